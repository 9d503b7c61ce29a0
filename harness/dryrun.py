"""``harness run --dry-run``: everything a real run would need, checked, and what would run where,
without loading a model, building a fixture or reaching the network.

For each selected cell: what this machine would do with it (run it; ``unsupported`` with the
probe's reason; ``error`` for a misconfigured cell, harness.probes), the Buildkite queue it goes
to (harness.buildkite.agents.queue_for), its environment (the image, or a virtualenv; its pip arguments
and variables validated as the pipeline generator validates them), its checkpoint (a fixture,
already in the fixture cache or built on first use; a hub id at its revision, in the local hub
cache or not; a local directory) and its baseline (present, with the engine version and platform
it was recorded with, stale against the environment's pinned version, missing, or unreadable).

Exit status: 0 when a real run could start every cell it selected (unsupported cells included);
1 when a cell is misconfigured, an environment is invalid or a baseline is unreadable; 2 (from
the CLI) for a usage or models.yaml error.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from harness import probes
from harness.buildkite import agents
from harness import baselines as B
from harness.matrix import UNPINNED, Cell, Matrix, MatrixError


def _environment(m: Matrix, name: str) -> tuple[str, str | None]:
    """(what the environment is, its problem or None)."""

    env = m.environments[name]
    try:
        agents.check_environment(name, env)
        agents.pip_commands(name, env)
    except MatrixError as e:
        return name, str(e)
    return (f"{name} (image {env.image})" if env.image else f"{name} (virtualenv)"), None


def _queue(cell: Cell) -> tuple[str, str | None]:
    try:
        return agents.queue_for(cell).name, None
    except MatrixError as e:
        return "none", str(e)


def _checkpoint(cell: Cell, matrix_dir: Path) -> str:
    if cell.source_kind == "fixture":
        # lazy: numpy, regex, +100 ms (scripts/import-graph --costs)
        from harness.fixtures import cache

        state = "cached" if cache.fixture_dir(cell.fixture_name).is_dir() else "built on first use"
        return f"fixture {cell.fixture_name} ({state})"
    if cell.source_kind == "path":
        p = Path(cell.path)
        return f"path {p if p.is_absolute() else matrix_dir / p}"
    rev = cell.hub.revision
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(cell.hub.id, "config.json", revision=None if rev == UNPINNED else rev)
        state = "in the local hub cache" if isinstance(hit, str) else "not in the local hub cache; prefetch fetches it"
    except Exception as e:  # an unreadable cache is worth a word, not a failure
        state = f"hub cache unreadable: {e}"
    return f"hub {cell.hub.id}@{rev if rev == UNPINNED else rev[:12]} ({state})"


def _baseline(root: Path, cell: Cell) -> tuple[str, str | None]:
    if cell.base is not None:  # harness.configurations: judged against its plain cell
        return f"none needed: judged against {cell.base}, which the run adds (one rank, eager)", None
    try:
        b = B.read(root, cell.tier, cell.id)
    except B.BaselineError as e:
        return "unreadable", str(e)
    if b is None:
        return "missing", None
    p = b.provenance
    text = f"present ({p.engine} {p.engine_version} on {p.platform}, {p.date[:10]})"
    if p.engine_version != cell.engine_version:
        text += f"; stale: the environment pins {cell.engine_version}"
    return text, None


def report(m: Matrix, cells: Sequence[Cell], *, matrix_path: str | Path, baselines_root: str | Path,
           tier: str, echo=print) -> int:
    matrix_dir = Path(matrix_path).resolve().parent
    root = Path(baselines_root)
    groups = {f"{c.model}.{c.scheme}" for c in cells}
    echo(f"harness run --dry-run: {len(cells)} cell(s) in {len(groups)} group(s), tier {tier}; "
         f"this machine: {probes.describe_machine()}; nothing is loaded or fetched")
    counts = {"run": 0, "unsupported": 0, "error": 0}
    missing = present = 0
    failed = False
    envs: dict[str, tuple[str, str | None]] = {}
    for c in cells:
        d = probes.preflight(c, matrix_dir)
        if c.environment not in envs:
            envs[c.environment] = _environment(m, c.environment)
        env_text, env_problem = envs[c.environment]
        queue, queue_problem = _queue(c)
        base, base_problem = _baseline(root, c)
        state = d.status or "run"
        problems = [p for p in (env_problem, queue_problem, base_problem) if p]
        if problems and state != "error":
            state = "error"
        counts[state] += 1
        failed |= state == "error"
        missing += base == "missing"
        present += base.startswith("present")
        echo(f"{c.id}")
        echo(f"    here: {'would run' if state == 'run' else state}"
             + (f": {d.reason}" if d.reason else ""))
        for p in problems:
            echo(f"    error: {p}")
        echo(f"    buildkite queue: {queue}; environment: {env_text}")
        echo(f"    checkpoint: {_checkpoint(c, matrix_dir)}")
        echo(f"    baseline: {base}" + ("" if c.base else f" ({B.path_for(root, c.tier, c.id)})"))
    echo("")
    echo(f"would run here: {counts['run']}; unsupported here: {counts['unsupported']}; "
         f"misconfigured (error): {counts['error']}")
    echo(f"baselines: {present} present, {missing} missing"
         + (" (a real run reports them missing-baseline, which fails it, unless --update-baselines)" if missing else ""))
    return 1 if failed else 0
