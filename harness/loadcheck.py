"""The load-time check (docs/design.md, "Load time"): a record's load time over its baseline's,
calibrated where both timed the same calibration workload (harness.loadtime), gated on the tiers
that gate it, and what the calibration does not carry said where it differs.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from harness import cpu
from harness.baselines import other_kernels
from harness.checks import BASELINE
from harness.records import Check, LoadInfo, Record, allocation_named

if TYPE_CHECKING:
    from harness.baselines import Baseline


def _fmt(x: float) -> str:
    return f"{x:.3g}" if math.isfinite(x) else str(x)


def load_ratio(obtained: LoadInfo, baseline: LoadInfo) -> tuple[float, bool]:
    """(ratio, calibrated): the calibrated ratio (obtained load / its calibration) over (baseline
    load / its calibration) when both recorded the ``calibration`` phase of the same workload
    (``LoadInfo.calibration_workload``, harness.loadtime), else the plain ratio of the load times
    (docs/design.md, "Load time")."""
    ratio = obtained.seconds / baseline.seconds
    cal_obt, cal_base = obtained.phases.get("calibration"), baseline.phases.get("calibration")
    if cal_obt and cal_base and cal_obt > 0 and cal_base > 0 and not other_calibration_workload(obtained, baseline):
        return ratio / (cal_obt / cal_base), True
    return ratio, False


def other_calibration_workload(obtained: LoadInfo, baseline: LoadInfo) -> bool:
    """Whether the two calibrations timed different workloads (a record without the version timed
    the first)."""
    return (obtained.calibration_workload or 1) != (baseline.calibration_workload or 1)


def check_load_time(record: Record, baseline: Baseline, *, bound: float, gated: bool) -> Check | None:
    """Load-time ratio obtained / baseline, calibrated where both runs measured the calibration
    workload (:func:`load_ratio`). ``ok`` is False only when gated and the ratio exceeds
    ``bound``; data["improved"] marks a ratio below 1/bound."""
    if record.load is None or baseline.load is None or baseline.load.seconds <= 0:
        return None
    s_obt, s_base = record.load.seconds, baseline.load.seconds
    ratio, calibrated = load_ratio(record.load, baseline.load)
    regressed = ratio > bound
    improved = ratio < 1 / bound
    text = f"load {_fmt(s_obt)} s vs baseline {_fmt(s_base)} s: {'calibrated ' if calibrated else ''}ratio {_fmt(ratio)}, bound {_fmt(bound)}"
    if calibrated:
        text += (f" (calibration {_fmt(record.load.phases['calibration'])} s vs "
                 f"{_fmt(baseline.load.phases['calibration'])} s)")
    elif other_calibration_workload(record.load, baseline.load):
        text += (" (not calibrated: the baseline's calibration timed another workload; record the "
                 "baseline again with --update-baselines)")
    if not gated:
        text += " (measured, not gated on this tier)"
    elif regressed or improved:
        text = ("slower than bound: " if regressed else "faster than 1/bound: ") + text + _timed_otherwise(record, baseline)
    return Check(kind="load-time", against=BASELINE, ok=not (gated and regressed), detail=text,
                 data={"ratio": ratio if math.isfinite(ratio) else None, "calibrated": calibrated, "seconds": s_obt, "baseline_seconds": s_base,
                       "bound": bound, "gated": gated, "regressed": gated and regressed, "improved": gated and improved})


def _timed_otherwise(record: Record, baseline: Baseline) -> str:
    """A clause for each thing the calibration does not carry that differs between the two loads:
    the kernels (docs/design.md, "Load-time baselines per kind of CPU"), the memory allocation ("Memory allocation")."""
    said = ""
    if other_kernels(record, baseline) and baseline.provenance.cpu is not None:
        said += (f"; the baseline was recorded on other kernels ({cpu.kernel_set(baseline.provenance.cpu.model_dump())}): "
                 "harness run --update-kernel-baselines records these kernels' once, and --candidate times a "
                 "build against the pinned one here")
    mine, theirs = (allocation_named(info.allocation) for info in (record.load, baseline.load))
    if mine != theirs:
        said += (f"; the loads were timed under other memory allocation than the baseline's ({mine} here, "
                 f"{theirs} there), which a calibration does not carry")
    return said
