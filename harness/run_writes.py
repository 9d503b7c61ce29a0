"""What a run may write (harness.files.Written), checked before anything runs (docs/decisions.md,
"Every path a run writes is checked before anything runs"): the results directory and each cell's
files in it; beside each baseline of a cell that runs its obtained file (written on a mismatch,
removed on a pass or by a new baseline, with or without --update-baselines), and the baseline
itself where --update-baselines or --update-fingerprints may replace it; the fixture and bench
caches where something they lack is built. The report's files are harness.report's.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from harness import baselines as B
from harness import loadtime, store
from harness.accuracy import store as accuracy_store
from harness.files import Written
from harness.fixtures import benchmark, cache
from harness.layout import Layout
from harness.matrix import Cell, Matrix


class Run(Protocol):
    """What this module reads of a run (harness.runner.Runner)."""

    matrix: Matrix
    cells: Sequence[Cell]
    groups: dict[str, list[Cell]]
    layout: Layout
    candidates: dict
    candidate_layout: Layout
    baselines_root: Path
    update_baselines: bool
    update_fingerprints: bool
    update_kernel_baselines: bool

    def candidate_cells(self) -> list[Cell]: ...

    def decided(self, cell: Cell): ...


def writes(run: Run) -> list[Written]:
    """Every path ``run`` may write (the module docstring)."""
    out = [Written(d, "--results") for d in run.layout.directories()]
    out += [Written(run.layout.summary(), "--results", file=True)]
    out += [Written(run.layout.sequences(key), "--results", file=True) for key in run.groups]
    for cell in run.cells:
        out += [Written(p, "--results", file=True) for p in run.layout.cell_files(cell.id)]
    if run.candidates:
        candidate = run.candidate_layout
        out += [Written(d, "--results") for d in candidate.directories()]
        out += [Written(p, "--results", file=True) for c in run.candidate_cells() for p in candidate.cell_files(c.id)]
    unbuilt = benchmark.unbuilt(run.matrix, run.cells)
    # a cell whose checkpoint is built after this check is not decided before it (it would be
    # decided a configuration error: no checkpoint yet)
    later = {cell.id for cell, *_ in unbuilt}
    running = [c for c in run.cells if c.id in later or run.decided(c) is None]
    beside_baselines = [w for c in running if c.configuration is None for w in _baseline_writes(run, c)]
    if beside_baselines:
        beside_baselines.insert(0, Written(run.baselines_root, "--baselines"))
        # the baselines of each set of kernels, and the obtained files beside them
        kernels = run.baselines_root / B.KERNELS_FOLDER
        if run.update_kernel_baselines or kernels.is_dir():
            beside_baselines.insert(1, Written(kernels, "--baselines"))
    return out + beside_baselines + _cache_writes(running, bool(unbuilt))


def _baseline_writes(run: Run, cell: Cell) -> list[Written]:
    kinds = [(B.Baseline, run.update_baselines or run.update_fingerprints)]
    if cell.accuracy:
        kinds.append((accuracy_store.AccuracyBaseline, run.update_baselines))
    out = []
    for kind, replaced in kinds:
        out.append(Written(store.obtained_path_for(kind, run.baselines_root, cell.tier, cell.id), "--baselines", True))
        baseline = store.path_for(kind, run.baselines_root, cell.tier, cell.id)
        # one that is not a regular file is its cell's error (unreadable), never replaced
        if replaced and (baseline.is_file() or not os.path.lexists(baseline)):
            out.append(Written(baseline, "--baselines", True))
    return out


def _cache_writes(running: list[Cell], checkpoints_to_build: bool) -> list[Written]:
    fixtures = {c.fixture_name for c in running if c.fixture_name}
    out = []
    if any(not cache.fixture_dir(name).is_dir() for name in fixtures):
        out.append(Written(cache.cache_root(), "$HARNESS_FIXTURE_CACHE or .cache/fixtures"))
    gated = any(c.gate_load_time for c in running)
    if checkpoints_to_build or (gated and not loadtime.calibration_path().is_file()):
        out.append(Written(cache.bench_cache_root(), "$HARNESS_BENCH_CACHE or .cache/bench"))
    return out
