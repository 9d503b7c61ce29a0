"""Accuracy checks: a task's value against its baseline and against other engines of the same run
(docs/design.md, "Accuracy"). Pure functions on records; no torch, no lm-eval.

Each check is of kind ``accuracy`` with its task (named ``accuracy/llama-choice:baseline``,
``accuracy/llama-choice:reference``): against ``baseline`` it decides ``regressed``, against an
engine ``failed``, as every check does. The gate is the one the
record carries (models.yaml's, resolved for the cell): see harness.accuracy.spec.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

from harness.records import Accuracy, Check, Record


def _fmt(x: float | None) -> str:
    return "none" if x is None else f"{x:.4g}"


def two_proportion_p(p1: float, n1: int, p2: float, n2: int) -> float:
    """Two-sided p-value of the pooled two-proportion z-test."""
    if n1 <= 0 or n2 <= 0:
        return 0.0
    pooled = (p1 * n1 + p2 * n2) / (n1 + n2)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n1 + 1 / n2))
    if se == 0:
        return 1.0 if p1 == p2 else 0.0
    return math.erfc(abs(p1 - p2) / se / math.sqrt(2))


def wilson_interval(p: float, n: int, alpha: float) -> tuple[float, float]:
    """The Wilson score interval of a proportion ``p`` observed on ``n`` samples, at confidence 1 - alpha."""
    if n <= 0:
        return 0.0, 1.0
    z = NormalDist().inv_cdf(1 - alpha / 2)
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, center - half), min(1.0, center + half)


def mcnemar_p(lost: int, gained: int) -> float:
    """Two-sided p-value of the exact McNemar test: of the samples that changed, how unlikely a
    split at least this uneven is when either direction is equally likely."""
    n = lost + gained
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(lost, gained) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def within_gate(gate: dict[str, Any], value: float | None, samples: int, expected: float | None,
                expected_samples: int, items: Sequence[float] | None = None,
                expected_items: Sequence[float] | None = None) -> tuple[bool, str, dict]:
    """Whether ``value`` (on ``samples``) is the same as ``expected`` (on ``expected_samples``) by
    ``gate``: (ok, what the rule found, data). ``items`` and ``expected_items``, the per-sample
    values of both, serve the paired rule (mcnemar)."""
    if value is None or expected is None:
        return False, "no value to compare", {}
    delta = value - expected
    if "abs" in gate:
        return abs(delta) <= gate["abs"], f"|Δ| {abs(delta):.4g} (bound {gate['abs']:g})", {"delta": delta}
    if "rel" in gate:
        bound = gate["rel"] * abs(expected)
        return abs(delta) <= bound, f"|Δ| {abs(delta):.4g} (bound {gate['rel']:g} x {expected:.4g} = {bound:.4g})", {"delta": delta}
    alpha = gate["alpha"]
    if gate.get("test") == "wilson":
        lo, hi = wilson_interval(expected, expected_samples, alpha)
        ok = lo <= value <= hi
        return ok, (f"{'inside' if ok else 'outside'} the Wilson interval [{lo:.4g}, {hi:.4g}] of {expected:.4g} "
                    f"at n={expected_samples}, alpha {alpha:g}"), {"delta": delta, "interval": [lo, hi]}
    moved = _items(items, expected_items)
    if gate.get("test") == "mcnemar" and moved is not None:
        p = mcnemar_p(moved["lost"], moved["gained"])
        return p >= alpha, (f"McNemar test p={p:.3g} on {moved['lost']} lost and {moved['gained']} gained of "
                            f"{moved['of']} samples ({'not ' if p >= alpha else ''}significant at alpha {alpha:g})"), \
            {"delta": delta, "p_value": p}
    p = two_proportion_p(value, samples, expected, expected_samples)
    fallback = " (no per-sample values on both sides for McNemar)" if gate.get("test") == "mcnemar" else ""
    return p >= alpha, (f"two-proportion test p={p:.3g} at n={samples}/{expected_samples} "
                        f"({'not ' if p >= alpha else ''}significant at alpha {alpha:g}){fallback}"), {"delta": delta, "p_value": p}


def _items(a: Sequence[float] | None, b: Sequence[float] | None) -> dict | None:
    """Which samples moved, when both runs kept per-sample values of the same samples."""
    if a is None or b is None or len(a) != len(b):
        return None
    moved = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    return {"differ": len(moved), "of": len(a), "first": moved[:20],
            "gained": sum(1 for i in moved if a[i] > b[i]), "lost": sum(1 for i in moved if a[i] < b[i])}


def compare(obtained: Accuracy, expected_value: float | None, expected_samples: int,
            expected_items: Sequence[float] | None, *, against: str) -> Check:
    """One accuracy check of ``obtained`` against a value (a baseline's or another engine's)."""
    ok, found, data = within_gate(obtained.gate, obtained.value, obtained.samples, expected_value, expected_samples,
                                  obtained.items, expected_items)
    moved = _items(obtained.items, expected_items)
    detail = (f"{obtained.metric},{obtained.filter} {_fmt(obtained.value)} vs {against} {_fmt(expected_value)}: {found}")
    if moved is not None and moved["differ"]:
        detail += f"; {moved['differ']} of {moved['of']} samples differ ({moved['lost']} lost, {moved['gained']} gained)"
    return Check(kind="accuracy", task=obtained.task, against=against, ok=ok, detail=detail if ok else "outside the gate: " + detail,
                 data={"task": obtained.task, "metric": obtained.metric, "filter": obtained.filter,
                       "value": obtained.value, "stderr": obtained.stderr, "samples": obtained.samples,
                       against: expected_value, "expected_samples": expected_samples, "gate": obtained.gate,
                       "items": moved, **data})


def cross_engine(record: Record, other: Record, *, against: str) -> list[Check]:
    """The accuracy checks of ``record`` against ``other``'s results of the same tasks (either may
    be the reference executed unfused, which compare.cross_engine substitutes for the reference
    when the engines differ in fusing shards: docs/design.md, "Fusion rule")."""
    theirs = {a.task: a for a in other.accuracy}
    checks = []
    for a in record.accuracy:
        b = theirs.get(a.task)
        if b is None:
            continue
        if a.task_hash != b.task_hash:
            checks.append(Check(kind="accuracy", task=a.task, against=against, ok=False,
                                detail=f"{against} evaluated another version of the task (hash {b.task_hash[:12]}, "
                                       f"this run {a.task_hash[:12]}): not comparable",
                                data={"task": a.task, "task_hash": a.task_hash, f"{against}_task_hash": b.task_hash}))
            continue
        checks.append(compare(a, b.value, b.samples, b.items, against=against))
    return checks


@dataclass
class AgainstBaseline:
    """The accuracy part of a cell's baseline comparison: the checks, the tasks with no stored
    value (missing-baseline) and why stored values do not fit (stale-baseline)."""

    checks: list[Check] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)


def against_baseline(record: Record, baseline) -> AgainstBaseline:
    """The record's accuracy results against its accuracy baseline (harness.accuracy.store; None
    when there is none). Key problems of the baseline as a whole (engine version, platform,
    fixture, source) are compare.baseline_key_problems'; here only the per-task ones."""
    out = AgainstBaseline()
    stored = baseline.tasks if baseline is not None else {}
    for a in record.accuracy:
        b = stored.get(a.task)
        if b is None:
            out.missing.append(a.task)
            continue
        out.checks.append(compare(a, b.value, b.samples, b.items, against="baseline"))
        if b.task_hash != a.task_hash:
            out.stale.append(f"accuracy task {a.task} changed since its baseline (task hash {b.task_hash[:12]}, "
                             f"this run {a.task_hash[:12]})")
        elif (b.metric, b.filter) != (a.metric, a.filter):
            out.stale.append(f"accuracy task {a.task}: baseline holds {b.metric},{b.filter}, this run {a.metric},{a.filter}")
    return out
