"""The scored sequence: which tokens every engine of a (model, scheme) scores.

All engines of a group score the same tokens, decided per prompt in this order:

1. the stored baseline's scored tokens, read from the group's reference baseline first, then from
   the other engines' baselines in matrix order (baselines are written from one run, so they agree);
   a baseline whose scored tokens no longer begin with the prompt's tokens is not used (the engine
   child checks that);
2. otherwise prompt + the reference engine's greedy continuation on the cell's fixture (its
   ``max_tokens`` tokens, no EOS stop), computed ONCE per results directory under a file lock and
   cached in ``sequences/``: by the reference cell itself when it is selected (its own greedy
   continuation is the continuation), else by a continuation-only reference child. With one
   torch thread the reference is deterministic on a machine, so cells run separately (pytest -n 2,
   one Buildkite step per cell) compute the same continuation;
3. for a source the reference cannot load (hub checkpoints on GPU tiers without a baseline yet),
   each engine's own greedy continuation (cross-engine checks then report the differing sequences).
"""
from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from filelock import FileLock

from harness import baselines as B

Tokens = dict[str, list[int]]  # prompt id -> scored tokens
OWN = "each engine's own greedy continuation"
COMPUTED = "reference greedy continuation (this run)"


def from_baselines(baselines_root: Path, cells: Sequence) -> tuple[Tokens, str]:
    """Prompt id -> scored tokens from the stored baselines of ``cells`` (every engine of the group
    in the matrix, reference first), and which baselines gave them."""
    seqs: Tokens = {}
    sources = []
    for c in cells:
        try:
            b = B.read(baselines_root, c.tier, c.id)
        except B.BaselineError:
            continue
        if b is None:
            continue
        added = False
        for s in b.record_sequences():
            if s.prompt.id not in seqs:
                seqs[s.prompt.id] = list(s.scored.tokens)
                added = True
        if added:
            sources.append(c.id)
    return seqs, ("baseline " + ", ".join(sources)) if sources else ""


class ScoredSequences:
    """The scored sequences of each group, decided once per process (and, through ``sequences/``
    under a file lock, once per results directory).

    ``matrix_cells``: group key -> every engine's cell of the group in the matrix, reference first
    (for rule 1). ``compute(cells, path)`` runs the reference so that it writes prompt id -> tokens
    to ``path`` (rule 2): the runner's reference cell or a continuation-only child."""

    def __init__(self, baselines_root: Path, matrix_cells: dict[str, list], path_for: Callable[[str], Path],
                 compute: Callable[[list, Path], None]):
        self.baselines_root = Path(baselines_root)
        self.matrix_cells = matrix_cells
        self.path_for = path_for
        self.compute = compute
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[Tokens | None, str]] = {}

    def get(self, key: str, cells: list) -> tuple[Tokens | None, str]:
        """The sequences the group's engines score (None: each its own), and where they came from.
        ``cells``: the group's selected cells."""
        with self._lock:
            if key in self._cache:
                return self._cache[key]
        seqs, source = from_baselines(self.baselines_root, self.matrix_cells.get(key, []))
        if not seqs:
            computed = self._computed(cells, self.path_for(key))
            if computed:
                seqs, source = computed, COMPUTED
        result = (seqs, source) if seqs else (None, OWN)
        with self._lock:
            self._cache[key] = result
        return result

    def _computed(self, cells: list, path: Path) -> Tokens | None:
        if path.exists():
            return json.loads(path.read_text())
        with FileLock(str(path) + ".lock"):
            if path.exists():
                return json.loads(path.read_text())
            if any(c.engine == "reference" for c in cells) or cells[0].source_kind == "fixture":
                self.compute(cells, path)
            if path.exists():
                return json.loads(path.read_text())
        return None
