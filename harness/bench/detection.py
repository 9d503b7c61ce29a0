"""Detection: does the load-time gate catch a slower loader, and only then? (issue 13, target 3)

The load-time set is models.yaml's ``cpu-load`` tier. A *cell-run* is what an engine child of
``harness run`` does for one cell's load: a fresh process (forked from a parent that imported the
libraries, as the runner's fork server does) runs the engine's own ``load`` (import warm-up, the
calibration workload, the timed loads; harness.bench.calibration). A *run* is one cell-run of every
cell; it flags when any cell's calibrated ratio against its baseline exceeds the threshold. The
issue's rates are per run: a slower loader is caught when its run flags, and a clean run of the
whole set must not; the per-cell-run rates are reported beside them.

1. Choice: ``choice_runs`` clean runs with ``max(REPEATS)`` loads each. Run 0 is the baseline (as
   ``--update-baselines`` records one run). For every candidate rule (the first k loads, their
   min or median), the spread of the per-run log of load/calibration (pooled over cells; a robust
   standard deviation, the MAD's) gives the threshold at which a clean run flags with probability
   ``TARGET_FALSE_ALARM`` (a normal model over the run's cells, the baseline's own error
   included: the ratio of two runs has sqrt(2) times the spread), and never below the largest
   clean choice ratio. The rule kept is the one with the lowest threshold (fewest loads on a tie).
2. Held out: new runs with the rule's k loads, interleaved: clean runs (every cell) and runs
   slowed by 10%, 20% and 50% (``HARNESS_TEST_HOOK=slow=F``, harness.bench.slowdown: the
   reference loader's own reading repeated; reference cells only: transformers' loader has no
   such hook; a slowed run is the reference cells slowed). Reported: the fraction of slowed runs
   flagged and of slowed cell-runs, the slowdown actually injected (the median calibrated ratio
   of the slowed cell-runs), the fraction of clean runs with a false alarm and of clean
   cell-runs, and the false-alarm rate per run the normal model predicts from the held-out spread
   (the statistical argument when the clean runs are fewer than 1 / rate). Every cell-run's
   samples are kept (``raw``), so that another rule can be judged on the same measurements.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

REPEATS = (1, 3, 5, 9)
STATISTICS = ("min", "median")
SLOWDOWNS = (0.1, 0.2, 0.5)
TARGET_FALSE_ALARM = 0.002  # per run (the issue asks < 1%; the margin absorbs the model's error)
MAD_TO_SD = 1.4826


@dataclass(frozen=True)
class CellRun:
    """One cell's timed loads in one child: every load's seconds and the calibration."""

    cell: str
    samples: tuple[float, ...]
    calibration: float
    slow: float = 0.0

    def value(self, k: int, statistic: str) -> float:
        """load/calibration under a rule (the first ``k`` loads, their ``statistic``)."""
        from harness.bench.calibration import load_statistic

        return load_statistic(list(self.samples[:k]), statistic) / self.calibration


@dataclass(frozen=True)
class Rule:
    repeats: int
    statistic: str
    threshold: float
    spread: float  # the robust sd of log(load/calibration) of one cell-run

    def describe(self) -> str:
        return (f"{self.statistic} of {self.repeats} load(s) per cell over the calibration; flag when the "
                f"calibrated ratio > {self.threshold:.3f} (run-to-run spread {100 * self.spread:.1f}%)")


@dataclass
class Detection:
    rule: Rule
    candidates: list[Rule]
    rates: dict[str, float | None]  # slowdown_10/20/50 (runs flagged), false_alarm (runs)
    cell_rates: dict[str, float | None]  # slowdown_10/20/50: the slowed cell-runs flagged
    injected: dict[str, float | None]  # slowdown_10/20/50: the slowdown measured
    clean_runs: int
    clean_cell_runs: int
    clean_cell_false_alarms: int
    slowed_runs: dict[str, int]
    slowed_cell_runs: dict[str, int]
    predicted_false_alarm: float
    seconds: float
    raw: dict = field(default_factory=dict)  # {"choice", "clean": [runs], "slowed": {fraction: [runs]}}


# ------------------------------------------------------------------------------ the statistics


def _robust_sd(values: Sequence[float]) -> float:
    med = statistics.median(values)
    return MAD_TO_SD * statistics.median(abs(v - med) for v in values)


def _spread(runs: Sequence[Sequence[CellRun]], k: int, stat: str) -> float:
    """Robust sd of log(value) around each cell's median, pooled over cells."""
    by_cell: dict[str, list[float]] = {}
    for run in runs:
        for cr in run:
            by_cell.setdefault(cr.cell, []).append(math.log(cr.value(k, stat)))
    deviations = [v - statistics.median(vs) for vs in by_cell.values() for v in vs]
    return max(_robust_sd(deviations), 1e-6)


def _z(per_run: float, cells: int) -> float:
    """The normal quantile at which each of ``cells`` independent cells stays under per run."""
    per_cell = 1 - (1 - per_run) ** (1 / max(1, cells))
    return statistics.NormalDist().inv_cdf(1 - per_cell)


def ratios(baseline: Sequence[CellRun], runs: Sequence[CellRun], k: int, stat: str) -> list[float]:
    """The calibrated ratio of each cell-run of ``runs`` against its cell's baseline."""
    base = {cr.cell: cr.value(k, stat) for cr in baseline}
    return [cr.value(k, stat) / base[cr.cell] for cr in runs]


def choose(choice: Sequence[Sequence[CellRun]]) -> tuple[Rule, list[Rule]]:
    """The rule (and every candidate) from clean choice runs; run 0 is the baseline."""
    if len(choice) < 3:
        raise ValueError(f"choosing a rule needs >= 3 clean choice runs, got {len(choice)}")
    cells = len(choice[0])
    most = min(len(cr.samples) for run in choice for cr in run)
    candidates = []
    for k in (r for r in REPEATS if r <= most):
        for stat in STATISTICS if k > 1 else ("min",):
            sd = _spread(choice, k, stat)
            modelled = math.exp(_z(TARGET_FALSE_ALARM, cells) * math.sqrt(2) * sd)
            observed = max(r for run in choice[1:] for r in ratios(choice[0], run, k, stat))
            candidates.append(Rule(k, stat, max(modelled, observed), sd))
    best = min(candidates, key=lambda r: (round(r.threshold, 3), r.repeats))
    return best, candidates


def predicted_false_alarm(rule: Rule, clean: Sequence[Sequence[CellRun]], baseline: Sequence[CellRun]) -> float:
    """The per-run false-alarm rate of the normal model fitted to held-out clean ratios."""
    logs = [math.log(r) for run in clean for r in ratios(baseline, run, rule.repeats, rule.statistic)]
    mu, sd = statistics.fmean(logs), max(_robust_sd(logs), 1e-6)
    per_cell = 1 - statistics.NormalDist(mu, sd).cdf(math.log(rule.threshold))
    return 1 - (1 - per_cell) ** len(baseline)


def evaluate(rule: Rule, baseline: Sequence[CellRun], clean: Sequence[Sequence[CellRun]],
             slowed: dict[float, list[list[CellRun]]]) -> dict:
    """Rates of the rule on held-out runs (see the module docstring)."""
    def flags(runs):
        return [[r > rule.threshold for r in ratios(baseline, run, rule.repeats, rule.statistic)] for run in runs]

    clean_flags = flags(clean)
    out = {"false_alarm": _share(any(f) for f in clean_flags), "clean_cell_runs": sum(map(len, clean_flags)),
           "clean_cell_false_alarms": sum(map(sum, clean_flags)),
           "rates": {}, "cell_rates": {}, "injected": {}, "slowed_runs": {}, "slowed_cell_runs": {}}
    for fraction, runs in sorted(slowed.items()):
        key = slowdown_key(fraction)
        slowed_flags = flags(runs)
        rs = [r for run in runs for r in ratios(baseline, run, rule.repeats, rule.statistic)]
        out["rates"][key] = _share(any(f) for f in slowed_flags)
        out["cell_rates"][key] = _share(f for fs in slowed_flags for f in fs)
        out["injected"][key] = statistics.median(rs) - 1 if rs else None
        out["slowed_runs"][key], out["slowed_cell_runs"][key] = len(runs), len(rs)
    return out


def _share(flags) -> float | None:
    """The fraction of true values (None when there are none)."""
    flags = list(flags)
    return sum(flags) / len(flags) if flags else None


def slowdown_key(fraction: float) -> str:
    return f"slowdown_{round(100 * fraction)}"


# ------------------------------------------------------------------------------- the measuring


def _in_child(fn: Callable[[], dict]) -> dict:
    """``fn()`` in a forked child (its output silenced); its JSON-able result."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(r)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        try:
            data, code = json.dumps(fn()), 0
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            data, code = json.dumps({"error": f"{type(e).__name__}: {e}"}), 1
        with os.fdopen(w, "w") as f:
            f.write(data)
        os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        data = f.read()
    os.waitpid(pid, 0)
    result = json.loads(data or '{"error": "the child wrote nothing"}')
    if "error" in result:
        raise RuntimeError(f"load-time cell-run failed: {result['error']}")
    return result


def cell_run(cell, path, repeats: int, slow: float = 0.0) -> CellRun:
    """One cell-run: the engine's own load in a fresh (forked) process, ``repeats`` loads."""

    def child() -> dict:
        from harness.bench import calibration
        from harness.engines import base, worker

        calibration.LOAD_REPEATS = repeats
        if slow:
            os.environ[worker.HOOK_ENV] = f"slow={slow}"
            worker.apply_hooks(cell.id)
        engine = base.engine_class(cell.engine)(cell)
        info = engine.load(base.resolve_checkpoint(cell, str(path)))
        engine.close()
        return {"samples": info.samples or [info.seconds], "calibration": info.phases["calibration"]}

    out = _in_child(child)
    return CellRun(cell.id, tuple(out["samples"]), out["calibration"], slow)


def preload(cells, paths: dict) -> None:
    """Import in this (parent) process what the children would import, as the fork server does."""
    import torch

    from harness.bench import calibration
    from harness.engines import base, reference, transformers  # noqa: F401

    torch.set_num_threads(1)
    calibration.calibration_file()
    for cell in cells:
        transformers.warm_imports(base.Checkpoint(paths[cell.id]))


def measure(cells, paths: dict, *, choice_runs: int, held_out_runs: int, slowed_runs: int,
            echo: Callable[[str], None] = print) -> Detection:
    """Choose the rule on clean runs, then evaluate it on held-out runs (module docstring)."""
    t0 = time.perf_counter()
    preload(cells, paths)
    most = max(REPEATS)
    choice = []
    for i in range(choice_runs):
        choice.append([cell_run(c, paths[c.id], most) for c in cells])
        echo(f"  detection: choice run {i + 1}/{choice_runs} ({time.perf_counter() - t0:.0f} s)")
    rule, candidates = choose(choice)
    echo(f"  detection: rule: {rule.describe()}")
    slow_cells = [c for c in cells if c.engine == "reference"]
    clean, slowed = [], {f: [] for f in SLOWDOWNS}
    for i in range(max(held_out_runs, slowed_runs)):
        if i < held_out_runs:
            clean.append([cell_run(c, paths[c.id], rule.repeats) for c in cells])
        if i < slowed_runs:
            for f in SLOWDOWNS:
                slowed[f].append([cell_run(c, paths[c.id], rule.repeats, slow=f) for c in slow_cells])
        echo(f"  detection: held-out run {i + 1}/{max(held_out_runs, slowed_runs)} ({time.perf_counter() - t0:.0f} s)")
    baseline = [CellRun(cr.cell, cr.samples[:rule.repeats], cr.calibration) for cr in choice[0]]
    ev = evaluate(rule, baseline, clean, slowed)
    return Detection(rule=rule, candidates=candidates, rates={**ev["rates"], "false_alarm": ev["false_alarm"]},
                     cell_rates=ev["cell_rates"], injected=ev["injected"], clean_runs=len(clean),
                     clean_cell_runs=ev["clean_cell_runs"], clean_cell_false_alarms=ev["clean_cell_false_alarms"],
                     slowed_runs=ev["slowed_runs"], slowed_cell_runs=ev["slowed_cell_runs"],
                     predicted_false_alarm=predicted_false_alarm(rule, clean, baseline) if clean else float("nan"),
                     seconds=time.perf_counter() - t0,
                     raw={"choice": _plain(choice), "clean": _plain(clean),
                          "slowed": {str(f): _plain(runs) for f, runs in slowed.items()}})


def _plain(runs: Sequence[Sequence[CellRun]]) -> list[list[dict]]:
    return [[vars(cr) for cr in run] for run in runs]
