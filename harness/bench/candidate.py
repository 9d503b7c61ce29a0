"""Candidate: where a pull-request check's time goes. ``harness run -k SEL --candidate ENGINE=SPEC``
against ``harness run -k SEL`` on the same cells, one after the other in one bench run (docs/bench.md,
"candidate"; README, "Testing an engine build").

Each run is a ``harness run`` of its own (this checkout, a temporary results directory) with the
engine-child ledger on (harness.supervise.ledger), so that the figures are the ones a user's run
has: the wall time; per build, its cells' own time (``duration_s``) and vLLM's engine start within
it (``load.phases.engine_start``); the children per mode (a cell, a scored continuation, a timed
load of a gated tier's pair) with their seconds and the time they waited to start (a fork
server's imports); the fork servers each build started. The candidate's environment is built (or
found built) first: its build time is the one it took (harness.candidates.Candidate.built_s).
The ratios, not the seconds, are what carry from one machine to another.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from harness import candidates
from harness.loadtime import REPO_ROOT
from harness.supervise import LEDGER_ENV

# the pull-request check's target (issue 59): at most this many times the plain run's wall time
WALL_RATIO_TARGET = 2.2


def _records(results: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(results.glob("*.json"))]


def _cells(records: list[dict]) -> dict:
    """A build's cells: how many, their own time, vLLM's engine start within it."""
    return {"cells": len(records), "seconds": sum(r.get("duration_s") or 0 for r in records),
            "engine_start_s": sum(((r.get("load") or {}).get("phases") or {}).get("engine_start", 0) for r in records)}


def _ledger(path: Path, candidate_python: str | None) -> dict:
    """The ledger's children and fork servers, per build (``candidate``: started under its interpreter)."""
    out = {build: {"children": Counter(), "seconds": Counter(), "waited": 0.0, "fork_servers": 0}
           for build in ("base", "candidate")}
    if not path.exists():
        return out
    for entry in map(json.loads, path.read_text().splitlines()):
        build = out["candidate" if candidate_python and entry.get("python") == candidate_python else "base"]
        if entry["kind"] == "fork-server":
            build["fork_servers"] += 1
        else:
            build["children"][entry["mode"]] += 1
            build["seconds"][entry["mode"]] += entry["seconds"]
            build["waited"] += entry.get("waited", 0.0)
    return {name: {**b, "children": dict(b["children"]), "seconds": dict(b["seconds"])} for name, b in out.items()}


def _side(where: Path, select: str, tier: str, extra: list[str], candidate_python: str | None,
          echo: Callable[[str], None]) -> dict:
    """One ``harness run`` of the selection (``extra``: the candidate's option), timed whole."""
    where.mkdir(parents=True)
    results, ledger = where / "results", where / "ledger.jsonl"
    argv = [sys.executable, "-m", "harness.cli", "run", "-k", select, "--tier", tier, "--results", str(results), *extra]
    echo(f"bench: candidate: {' '.join(argv[3:])}")
    t0 = time.perf_counter()
    with open(where / "run.log", "w") as log:
        code = subprocess.run(argv, cwd=REPO_ROOT, env={**os.environ, LEDGER_ENV: str(ledger)}, stdout=log,
                              stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    summary = (results / "summary.txt").read_text() if (results / "summary.txt").exists() else ""
    echo(f"bench: candidate: {wall:.1f} s, exit {code}")
    return {"wall_s": wall, "exit": code, "summary": summary.strip(), "base": _cells(_records(results)),
            "candidate": _cells(_records(results / "candidate")), "ledger": _ledger(ledger, candidate_python)}


def measure(spec_text: str, select: str | None, tier: str, echo: Callable[[str], None]) -> dict:
    """The candidate's environment built or found, then the plain run and the candidate run of the
    selection (default: every cell of the candidate's engine)."""
    engine, spec = candidates.parse(spec_text)
    select = select or engine
    build = candidates.prepare(engine, spec, echo=echo)
    with tempfile.TemporaryDirectory(prefix="harness-bench-candidate-") as tmp:
        plain = _side(Path(tmp, "plain"), select, tier, [], None, echo)
        both = _side(Path(tmp, "candidate"), select, tier, ["--candidate", spec_text], build.python, echo)
    return {"spec": spec_text, "version": build.version, "select": select, "tier": tier,
            "build_s": build.built_s, "built_now": not build.reused,
            "plain": plain, "with_candidate": both, "wall_ratio": both["wall_s"] / plain["wall_s"]}


def met(fig: dict | None) -> bool | None:
    """The target: the candidate run at most WALL_RATIO_TARGET times the plain run's wall time;
    None when not measured."""
    return None if not fig else fig["wall_ratio"] <= WALL_RATIO_TARGET


def detail(fig: dict | None) -> str:
    if not fig:
        return "not measured"
    plain, both = fig["plain"], fig["with_candidate"]
    return (f"{both['wall_s']:.1f} s against {plain['wall_s']:.1f} s, {fig['wall_ratio']:.2f}x; the base's cells "
            f"{both['base']['seconds']:.0f} s beside the candidate's {both['candidate']['seconds']:.0f} s, "
            f"{plain['base']['seconds']:.0f} s alone")


def _children(ledger: dict) -> str:
    parts = [f"{mode} {n} ({ledger['seconds'][mode]:.0f} s)" for mode, n in sorted(ledger["children"].items())]
    return ", ".join(parts) or "-"


def lines(fig: dict | None) -> list[str]:
    """The section of BENCHMARKS.md."""
    if not fig:
        return ["not measured"]
    plain, both = fig["plain"], fig["with_candidate"]
    build = ("an existing environment" if fig["build_s"] is None else
             f"{fig['build_s']:.0f} s, {'built in this run' if fig['built_now'] else 'built before and reused'}")
    base_ratio = both["base"]["seconds"] / plain["base"]["seconds"] if plain["base"]["seconds"] else float("nan")
    rows = [
        ("wall time", f"{plain['wall_s']:.1f} s", f"{both['wall_s']:.1f} s ({fig['wall_ratio']:.2f} x)"),
        ("the base's cells: count, own time", f"{plain['base']['cells']}, {plain['base']['seconds']:.0f} s",
         f"{both['base']['cells']}, {both['base']['seconds']:.0f} s ({base_ratio:.2f} x)"),
        ("the candidate's cells: count, own time", "-",
         f"{both['candidate']['cells']}, {both['candidate']['seconds']:.0f} s"),
        ("vLLM engine start within them (base; candidate)", f"{plain['base']['engine_start_s']:.0f} s",
         f"{both['base']['engine_start_s']:.0f} s; {both['candidate']['engine_start_s']:.0f} s"),
        ("children by mode, base", _children(plain["ledger"]["base"]), _children(both["ledger"]["base"])),
        ("children by mode, candidate", "-", _children(both["ledger"]["candidate"])),
        ("waiting for a child to start (base; candidate)", f"{plain['ledger']['base']['waited']:.0f} s",
         f"{both['ledger']['base']['waited']:.0f} s; {both['ledger']['candidate']['waited']:.0f} s"),
        ("fork servers started (base; candidate)", f"{plain['ledger']['base']['fork_servers']}",
         f"{both['ledger']['base']['fork_servers']}; {both['ledger']['candidate']['fork_servers']}"),
    ]
    mark = "met" if met(fig) else "MISSED"
    return [f"`harness run -k {fig['select']} --tier {fig['tier']}` and the same with `--candidate {fig['spec']}` "
            f"({fig['spec'].partition('=')[0]} {fig['version'] or '?'}), one after the other; the candidate's environment: {build}. A `load` child is "
            "a timed load of a gated tier's load-time pair; waiting: from asking for a child to its start (a cold "
            "fork server's imports).", "",
            "| | plain | with the candidate |", "|---|---|---|"] + [f"| {a} | {b} | {c} |" for a, b, c in rows] + [
            "", f"Target 7: {mark} ({detail(fig)}); exit status {plain['exit']} and {both['exit']}.", "",
            "The candidate run's summary:", "", "```", both["summary"], "```"]
