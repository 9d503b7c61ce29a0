"""The candidate build's load-time gate, pair by pair (issue 31; ``harness run --candidate`` on a
gated tier, harness.loadtime.paired): how often does a candidate the same as the pinned build read
over its bound, and how often is a slower one caught? No baseline is stored or read, so the answer
does not depend on the machine kind a baseline was recorded on.

A *pair-run* of a cell is what the runner's gate does for a candidate cell (harness.gate): the
two builds' loads in rounds of ``loadtime.CANDIDATE_PAIRS`` balanced pairs of fresh children
(harness.bench.detection.cell_run, ``loadtime.paired``), the candidate's median over the base's,
uncalibrated, against the cell's bound from models.yaml, a round outside it confirmed by another. The candidate differs from the base only by the
test-only slowdown hook (what a stand-in build's environment sets: tests/test_runner.py) or by a
test-only vLLM mutation (harness.bench.detection.MUTATIONS). A *run* is one pair-run of every cell
the change applies to; it is flagged when any of them is. Clean runs give the false alarms, runs
with the candidate slowed by each slowdown (and with each mutation) the detection.

Fewer than 100 clean runs cannot show a false-alarm rate under 1% by count, so each cell's clean
first rounds' log ratios are also fitted with a normal model (median, robust spread). A run is
flagged when any cell's first round is over its bound and its confirming round is too; how far the
two rounds depend on each other a few clean runs cannot tell (a spell of the host can span both),
so the model gives the run's rate between two ends: every first round over confirmed (an upper
bound, which the target is judged by) and the two rounds independent draws (a lower bound).
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

from harness import loadtime
from harness.bench import detection, noise_model

CLEAN = "clean"


def pair_run(cell, path, *, slow: float = 0.0, mutation: str | None = None) -> dict:
    """One pair-run of ``cell``: {ratio (the candidate's median child over the base's in the
    deciding round, as the gate compares them), first_ratio (the same in the first round),
    flagged, rounds}."""
    timed = loadtime.paired(lambda: detection.cell_run(cell, path, 1, slow=slow, mutation=mutation).load_info(),
                            lambda: detection.cell_run(cell, path, 1).load_info(), cell.bounds.load_time)
    mine, theirs = timed  # cell_run raises where a child fails
    ratio = mine.seconds / theirs.seconds
    rounds = loadtime.round_ratios(mine, theirs)
    return {"ratio": ratio, "first_ratio": rounds[0], "flagged": ratio > cell.bounds.load_time, "rounds": len(rounds)}


def changes(cells, slowdowns: Sequence[float]) -> list[tuple[str, dict, list]]:
    """(key, what the candidate changes, the cells it applies to): clean, each slowdown, each mutation."""
    out = [(CLEAN, {}, list(cells))]
    out += [(detection.slowdown_key(f), {"slow": f}, list(cells)) for f in slowdowns]
    for name, applies in detection.MUTATIONS.items():
        subjects = [c for c in cells if applies(c)]
        if subjects:
            out.append((name, {"mutation": name}, subjects))
    return out


def over_chance(ratios: Sequence[float], bound: float) -> float | None:
    """The normal model's chance that a pair-run's ratio is over ``bound``."""
    if len(ratios) < 3:
        return None
    logs = [math.log(r) for r in ratios]
    sd = noise_model.robust_sd(logs)
    if sd <= 0:
        return 0.0 if statistics.median(logs) <= math.log(bound) else 1.0
    return 1 - statistics.NormalDist(statistics.median(logs), sd).cdf(math.log(bound))


def predicted_false_alarm(clean_cells: dict) -> dict | None:
    """{"most", "least"}: the normal model's chance per run that a cell is flagged (module
    docstring), from each clean cell's first rounds; None with too few runs."""
    chances = [over_chance(v["first_ratios"], v["bound"]) for v in clean_cells.values()]
    if not chances or None in chances:
        return None
    return {"most": 1 - math.prod(1 - p for p in chances), "least": 1 - math.prod(1 - p * p for p in chances)}


def measure(cells, paths: dict, *, clean_runs: int, slowed_runs: int, slowdowns: Sequence[float],
            echo: Callable[[str], None] = print) -> dict:
    """{key: {runs, flagged_runs, cells: {cell: {bound, ratios, first_ratios, flagged, second_rounds}}},
    "predicted_false_alarm": predicted_false_alarm(...)}: the clean runs and the changed ones (module
    docstring)."""
    detection.preload(cells, paths)
    out: dict = {}
    for key, change, subjects in changes(cells, slowdowns):
        runs = clean_runs if key == CLEAN else slowed_runs
        by_cell = {c.id: {"bound": c.bounds.load_time, "ratios": [], "first_ratios": [], "flagged": 0, "second_rounds": 0}
                   for c in subjects}
        flagged_runs = 0
        for n in range(runs):
            flags = []
            for c in subjects:
                try:
                    r = pair_run(c, paths[c.id], **change)
                except RuntimeError as e:
                    raise RuntimeError(f"{c.id}: {e}") from None
                v = by_cell[c.id]
                v["ratios"].append(r["ratio"])
                v["first_ratios"].append(r["first_ratio"])
                v["flagged"] += r["flagged"]
                v["second_rounds"] += r["rounds"] > 1
                flags.append(r["flagged"])
            flagged_runs += any(flags)
            echo(f"  pairs {key} {n + 1}/{runs}: " + ", ".join(f"{cid} {v['ratios'][-1]:.3f}" for cid, v in by_cell.items())
                 + (" FLAGGED" if any(flags) else ""))
        out[key] = {"runs": runs, "flagged_runs": flagged_runs, "cells": by_cell}
    out["predicted_false_alarm"] = predicted_false_alarm(out[CLEAN]["cells"])
    return out
