"""Matrix: the whole default ``harness run`` (cpu-tiny, default options) before and after (target 4).

Each side runs in a temporary git worktree of its commit (``--before REF``, and HEAD), with this
checkout's interpreter and virtual environment (``PYTHONPATH`` at the worktree, so the worktree's
harness is the one imported) and this checkout's fixture cache (``HARNESS_FIXTURE_CACHE``; a
fixture whose sources differ has another key and is built, and that build is part of the time,
as it would be for a user). The two run back to back in one bench run; ``before_s``/``after_s`` are
their wall times. Uncommitted changes are not part of either side.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from harness.loadtime import REPO_ROOT

DEFAULT_BEFORE = "7d46f3c"  # the code before issue 13's work
SLOWEST = 10


@dataclass
class Side:
    ref: str
    commit: str
    seconds: float
    exit_code: int
    slowest: list[tuple[str, float]] = field(default_factory=list)  # (cell, duration_s), slowest first


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO_ROOT), *args], check=True, capture_output=True, text=True).stdout.strip()


def _slowest(results: Path) -> list[tuple[str, float]]:
    cells = []
    for f in results.glob("*.json"):
        try:
            data = json.loads(f.read_text())
            cells.append((data["cell"], float(data["duration_s"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(cells, key=lambda c: -c[1])[:SLOWEST]


def run_side(ref: str, echo: Callable[[str], None] = print, select: str | None = None, timeout_s: float = 3600) -> Side:
    """``harness run`` with default options at ``ref``, in a temporary worktree (``select``: a
    ``-k`` expression, for a reduced check of the part; the figures are then not the target's)."""
    commit = _git("rev-parse", "--verify", f"{ref}^{{commit}}")
    tmp = Path(tempfile.mkdtemp(prefix="harness-bench-matrix-"))
    tree = tmp / "tree"
    _git("worktree", "add", "--detach", str(tree), commit)
    try:
        env = {**os.environ, "PYTHONPATH": str(tree),
               "HARNESS_FIXTURE_CACHE": os.environ.get("HARNESS_FIXTURE_CACHE") or str(REPO_ROOT / ".cache" / "fixtures")}
        results = tmp / "results"
        echo(f"  matrix: harness run at {ref} ({commit[:10]}) ...")
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "harness.cli", "run", "--results", str(results), *(["-k", select] if select else [])]
        done = subprocess.run(cmd, cwd=tree,
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout_s, check=False)
        seconds = time.perf_counter() - t0
        echo(f"  matrix: harness run at {ref}: {seconds:.0f} s (exit {done.returncode})")
        return Side(ref, commit, seconds, done.returncode, _slowest(results))
    finally:
        subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True, check=False)
        shutil.rmtree(tmp, ignore_errors=True)


def measure(before: str = DEFAULT_BEFORE, echo: Callable[[str], None] = print,
            select: str | None = None) -> tuple[Side, Side]:
    """(before, after): the two sides, back to back."""
    return run_side(before, echo, select), run_side("HEAD", echo, select)
