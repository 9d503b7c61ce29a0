"""Portability: do the cpu-load baselines hold here, under every kernel condition this machine can
set? (issue 31, target 2)

For the native condition and each of harness.cpu.KERNEL_CONDITIONS, a fresh interpreter with the
condition's environment (a lowered torch capability only takes effect before torch is imported)
times ``runs`` clean runs of the gate. A *cell-run* is what the runner's gate does for one cell:
the cell's load in a fresh child (harness.bench.detection.cell_run), its calibrated ratio against
the cell's stored baseline under ``--baselines``, the one the runner would judge this CPU's load
against (harness.resolver.load_baseline_here) (harness.loadcheck.load_ratio) over the cell's bound from models.yaml,
timed again in up to ``loadtime.CONFIRMATIONS`` fresh children while over it
(``loadtime.retimed``), and when over in every child, looked at again ``loadtime.LATER_LOOK_S``
after it began, as the runner's gate does (here after the condition's other runs; ``harness bench
--later-look`` shortens it for a quick check, which target 5 does not count). As the runner
reports it, the fastest child counts: over the bound the cell-run is a false alarm
(``regressed``), under 1/bound it reads ``improved``. A *run* is one
cell-run of every cell; it is a false alarm when any of its cells is.

The cells of one engine run in an interpreter of their own with that engine's imports preloaded,
as the runner's fork server has them (vLLM's imports would change the other engines' process). A
cell whose load fails under a condition is reported with its error once and not timed again there;
a cell without a stored baseline is reported so, and not timed.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from harness import resolver
from harness import cpu, loadtime
from harness import records as R
from harness.bench import detection
from harness.loadcheck import load_ratio

NATIVE = "native"
# The interpreter of one condition and engine (not ``-m``: harness.bench imports this module first).
# Its stderr is the bench's progress, so the libraries' own messages go to their log (harness.liblog).
CHILD = ("import sys; from harness import liblog; liblog.route(); from harness.bench.portability import main; "
         "sys.exit(main(sys.argv[1:]))")


def conditions() -> dict[str, dict[str, str]]:
    return {NATIVE: {}, **cpu.KERNEL_CONDITIONS}


def _ratio(cr: detection.CellRun, baseline: R.LoadInfo) -> float:
    return load_ratio(cr.load_info(), baseline)[0]


def time_runs(cells, paths: dict, baseline_loads: dict[str, R.LoadInfo], runs: int,
              echo: Callable[[str], None], later_look_s: float = loadtime.LATER_LOOK_S) -> dict:
    """In this interpreter (already under its condition, its engine's imports preloaded): ``runs``
    gated clean runs of ``cells``, one engine's; per cell the ratio of each child of each run, or its
    error. A cell-run over the bound in every child gets the gate's later look once the runs are
    done, ``later_look_s`` after it began (its children join that run's; ``later``: the runs looked
    at again)."""
    out = {c.id: {"runs": [], "error": None, "later": []} for c in cells}
    pending = []  # (when the later look is due, cell, run)
    t0 = time.perf_counter()
    for i in range(runs):
        for c in cells:
            if out[c.id]["error"] is not None:
                continue
            began = time.monotonic()
            try:
                children = _gate(c, paths, baseline_loads)
            except RuntimeError as e:
                out[c.id]["error"] = f"cannot load: {e}"
                echo(f"  portability: {c.id}: {e}")
                continue
            out[c.id]["runs"].append(children)
            if all(r > c.bounds.load_time for r in children):
                pending.append((began + later_look_s, c, i))
        echo(f"  portability: run {i + 1}/{runs} ({time.perf_counter() - t0:.0f} s)")
    for due, c, i in pending:
        wait = max(0.0, due - time.monotonic())
        echo(f"  portability: {c.id} over its bound in every child of run {i + 1}; its later look in {wait:.0f} s")
        time.sleep(wait)
        try:
            out[c.id]["runs"][i] += _gate(c, paths, baseline_loads)
        except RuntimeError as e:
            echo(f"  portability: {c.id}: its later look failed: {e}")
        out[c.id]["later"].append(i)
    return out


def _gate(c, paths: dict, baseline_loads: dict[str, R.LoadInfo]) -> list[float]:
    """One look of the gate at cell ``c``: a fresh child, and while over the bound up to
    ``loadtime.CONFIRMATIONS`` more; each child's calibrated ratio to the baseline."""
    child = lambda: _ratio(detection.cell_run(c, paths[c.id], loadtime.LOAD_REPEATS), baseline_loads[c.id])  # noqa: E731
    return loadtime.retimed(child(), child, lambda ratio: ratio > c.bounds.load_time)


def summarize(cells, by_cell: dict[str, dict], runs: int) -> dict:
    """Per cell: each run's reported ratio (its fastest child), regressed and improved counts, the
    later looks taken; per condition: the runs with a false alarm among those every cell finished."""
    bounds = {c.id: c.bounds.load_time for c in cells}
    summary = {"cells": {}, "runs": runs}
    for cell_id, got in by_cell.items():
        reported = [min(children) for children in got["runs"]]
        summary["cells"][cell_id] = {
            "reported": reported, "children": got["runs"], "error": got["error"], "bound": bounds[cell_id],
            "regressed": sum(r > bounds[cell_id] for r in reported), "later_looks": len(got.get("later", [])),
            "improved": sum(r < 1 / bounds[cell_id] for r in reported)}
    timed = [v for v in summary["cells"].values() if v["error"] is None]
    complete = min((len(v["reported"]) for v in timed), default=0)
    summary["complete_runs"] = complete
    summary["false_alarm_runs"] = sum(any(v["reported"][i] > v["bound"] for v in timed) for i in range(complete))
    summary["improved_runs"] = sum(any(v["reported"][i] < 1 / v["bound"] for v in timed) for i in range(complete))
    return summary


def measure(cells, paths: dict, *, matrix_path: str, baselines_root: str | Path, runs: int,
            only: list[str] | None = None, echo: Callable[[str], None] = print,
            later_look_s: float = loadtime.LATER_LOOK_S) -> dict:
    """Every condition (or ``only`` those), each engine's cells in a fresh interpreter under it. A
    cell without a load-time baseline under ``baselines_root`` is reported so and not timed; the
    cells whose baseline was timed under other memory allocation than these runs are named
    (``other_allocation``: their false alarms may be the allocation's, harness.loadtime.ALLOCATION_ENV)."""
    here = cpu.describe()
    stored = {c.id: b.load for c in cells if (b := resolver.load_baseline_here(baselines_root, c.tier, c.id, here)) and b.load}
    missing = [c.id for c in cells if c.id not in stored]
    allocation = loadtime.allocation_env()
    other_allocation = sorted(cell for cell, load in stored.items() if load.allocation != allocation)
    if len(missing) == len(cells):
        raise ValueError(f"{baselines_root}: no load-time baseline for {', '.join(missing)}; write them with "
                         "`harness run --tier cpu-load --update-baselines`")
    if missing:
        echo(f"  portability: not timed, no load-time baseline in {baselines_root}: {', '.join(missing)}")
    unbased = {cell: {"runs": [], "error": f"no load-time baseline in {baselines_root}", "later": []} for cell in missing}
    cells, all_cells = [c for c in cells if c.id not in missing], cells
    out = {}
    for name, overlay in conditions().items():
        if only and name not in only:
            continue
        by_cell: dict[str, dict] = {}
        for engine in sorted({c.engine for c in cells}):
            ids = [c.id for c in cells if c.engine == engine]
            echo(f"  portability: {name}, {engine}: {len(ids)} cell(s), {runs} run(s)")
            p = subprocess.run([sys.executable, "-c", CHILD, "--matrix", matrix_path,
                                "--baselines", str(baselines_root), "--runs", str(runs),
                                "--later-look", str(later_look_s), *ids],
                               env=cpu.condition_env(overlay), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               text=True)
            if p.returncode != 0:
                raise RuntimeError(f"portability under {name} ({engine}) exited {p.returncode}")
            by_cell.update(json.loads(p.stdout.strip().splitlines()[-1]))
        out[name] = {"environment": overlay, "later_look_s": later_look_s, "allocation": allocation,
                     "other_allocation": other_allocation, **summarize(all_cells, {**by_cell, **unbased}, runs)}
    return out


def main(argv: list[str] | None = None) -> int:
    # lazy: yaml and pydantic, +300 ms (scripts/import-graph --costs)
    from harness import matrix

    p = argparse.ArgumentParser(prog="harness.bench.portability")
    p.add_argument("--matrix", required=True)
    p.add_argument("--baselines", required=True)
    p.add_argument("--runs", type=int, required=True)
    p.add_argument("--later-look", type=float, default=loadtime.LATER_LOOK_S)
    p.add_argument("cells", nargs="+")
    args = p.parse_args(argv)
    m = matrix.load(args.matrix)
    cells = [c for c in m.cells(tier="cpu-load") if c.id in set(args.cells)]
    paths = {c.id: (m._dir / c.path).resolve() for c in cells}
    # torch first: its capability is part of the kernels the loads run on, and so of the baseline
    # the runner would judge them against (harness.resolver.load_baseline_here)
    detection.preload(cells, paths)
    here = cpu.describe()
    loads = {c.id: resolver.load_baseline_here(args.baselines, c.tier, c.id, here).load for c in cells}
    echo = lambda line: print(line, file=sys.stderr, flush=True)  # stdout is the parent's JSON
    print(json.dumps(time_runs(cells, paths, loads, args.runs, echo, later_look_s=args.later_look)))
    return 0
