"""Which cells a change touches (``harness pipeline --since`` / ``--changed-files``): rules that map
this project's changed paths, and an engine's own source tree, to the cells they can affect
(docs/README-buildkite.md, "Change-based selection").
"""
from __future__ import annotations

import fnmatch
import subprocess
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import architectures
from harness.matrix import ENGINES, Cell, Matrix, MatrixError
from harness.registry import FORMATS, VLLM_QUANTIZATION

Selector = Callable[[Cell], bool]
ALL: Selector = lambda c: True  # noqa: E731
NONE: Selector = lambda c: False  # noqa: E731


def _family(*families: str) -> Selector:
    return lambda c: c.family in families


def _engine(*engines: str) -> Selector:
    return lambda c: c.engine in engines



# Where each architecture lives in an engine's source tree (harness.architectures).
ARCH_SOURCES: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm": {a.hf_class: a.vllm_sources for a in architectures.ARCHITECTURES},
    "transformers": {a.hf_class: a.transformers_sources for a in architectures.ARCHITECTURES},
}


def _arch_in(engine: str, name: str) -> Selector:
    archs = {a for a, names in ARCH_SOURCES[engine].items() if name in names}
    return lambda c: c.arch in archs


@dataclass(frozen=True)
class Rule:
    pattern: str  # fnmatch glob on the repo-relative path ('*' also matches '/')
    what: str  # shown in the selection note
    select: Selector = NONE
    per_path: Callable[[str], Selector] | None = None  # a selector that depends on the path itself

    def selector(self, path: str) -> Selector:
        return self.per_path(path) if self.per_path is not None else self.select


def _format_rules(engine: str | None = None) -> tuple[Rule, ...]:
    """Each format's files (harness.registry.FORMATS): its module here (engine None), or the paths
    of that engine's source tree that touch its cells only. They do not overlap."""
    return tuple(Rule(path, f"{spec.name} schemes", _family(spec.name)) for spec in FORMATS.values()
                 for path in ((spec.path,) if engine is None else spec.engine_sources.get(engine, ())))


# This project's files, first match wins. Unmatched files select every cell.
PROJECT_RULES: tuple[Rule, ...] = (
    *(Rule(p, "documentation and tests (no cell)", NONE) for p in
      ("*.md", "docs/*", "tests/*", "suites/*", "reports/*", ".gitignore", "LICENSE*")),
    *_format_rules(),
    *(r for e in ENGINES for r in (
        Rule(f"harness/engines/{e}.py", f"{e} cells", _engine(e)),
        Rule(f"harness/engines/{e}/*", f"{e} cells", _engine(e)),
        Rule(f"harness/engines/{e}_*", f"{e} cells", _engine(e)),
    )),
    # vLLM's module-level conformance diffs against the reference loader.
    Rule("harness/reference/*", "reference and vllm cells", _engine("reference", "vllm")),
    Rule("harness/fixtures/*", "fixture cells", lambda c: c.source_kind == "fixture"),
    # The pipeline and the report themselves: the cheap CPU tier exercises them end to end.
    Rule("harness/buildkite/*", "cpu-tiny cells (pipeline)", lambda c: c.tier == "cpu-tiny"),
    Rule("harness/changes.py", "cpu-tiny cells (pipeline)", lambda c: c.tier == "cpu-tiny"),
    Rule("harness/report/*", "cpu-tiny cells (report)", lambda c: c.tier == "cpu-tiny"),
    Rule(".buildkite/*", "cpu-tiny cells (pipeline)", lambda c: c.tier == "cpu-tiny"),
    Rule("baselines/*", "that cell's baseline", per_path=lambda path: (
        lambda c: Path(path).name == f"{c.id}.json" and Path(path).parent.name == c.tier)),
)

# Paths in an engine's own source tree (a vLLM or transformers checkout), first match wins.
# Unmatched files select every cell of that engine.
ENGINE_RULES: dict[str, tuple[Rule, ...]] = {
    "vllm": (
        *(Rule(p, "not loading code (no cell)", NONE) for p in
          ("*.md", "docs/*", "tests/*", "examples/*", "benchmarks/*", ".github/*", ".buildkite/*")),
        Rule("vllm/model_executor/models/utils.py", "all vllm cells", ALL),
        Rule("vllm/model_executor/models/interfaces*.py", "all vllm cells", ALL),
        Rule("vllm/model_executor/models/registry.py", "all vllm cells", ALL),
        Rule("vllm/model_executor/models/vision.py", "all vllm cells", ALL),
        Rule("vllm/model_executor/models/*.py", "cells of that architecture",
             per_path=lambda path: _arch_in("vllm", Path(path).stem)),
        *_format_rules("vllm"),
        Rule(f"{VLLM_QUANTIZATION}/__init__.py", "all vllm cells", ALL),
        Rule(f"{VLLM_QUANTIZATION}/base_config.py", "all vllm cells", ALL),
        Rule(f"{VLLM_QUANTIZATION}/utils/*", "all vllm cells", ALL),
        Rule(f"{VLLM_QUANTIZATION}/*", "other quantization methods (no cell)", NONE),
        Rule("csrc/cpu/*", "vllm cells on CPU", lambda c: (c.hardware.gpus or 0) == 0),
        Rule("csrc/*", "vllm cells on GPU", lambda c: (c.hardware.gpus or 0) > 0),
    ),
    "transformers": (
        *(Rule(p, "not loading code (no cell)", NONE) for p in
          ("*.md", "docs/*", "tests/*", "examples/*", "benchmark*", ".github/*", "utils/*")),
        Rule("src/transformers/models/*", "cells of that architecture",
             per_path=lambda path: _arch_in("transformers", Path(path).parts[3] if len(Path(path).parts) > 4 else "")),
        *_format_rules("transformers"),
        Rule("src/transformers/quantizers/quantizer_*.py", "other quantization methods (no cell)", NONE),
        Rule("src/transformers/integrations/*", "other integrations (no cell)", NONE),
    ),
}


def _apply(rules: Sequence[Rule], path: str, default: tuple[str, Selector]) -> tuple[str, Selector]:
    for rule in rules:
        if fnmatch.fnmatchcase(path, rule.pattern):
            return rule.what, rule.selector(path)
    return default


def _cell_fingerprint(cell: Cell, matrix: Matrix) -> Any:
    return (cell.model_dump(mode="json"), matrix.environments[cell.environment].model_dump(mode="json"))


def select_changed(matrix: Matrix, cells: Sequence[Cell], changed: Iterable[str], *,
                   engine_changed: dict[str, Iterable[str]] | None = None,
                   old_matrix: Matrix | None = None, matrix_rel: str = "models.yaml") -> tuple[list[Cell], list[str]]:
    """The cells a change touches, and one note per changed file saying what it selected.

    ``changed``: this project's changed paths (repo-relative). ``engine_changed``: per engine, the
    changed paths of that engine's own source tree. A change to the matrix file selects the cells
    whose resolved settings (or environment) differ from ``old_matrix``'s; every cell when the old
    matrix is not known."""
    chosen: set[str] = set()
    notes: list[str] = []

    def take(sel: Selector, pool: Iterable[Cell]) -> int:
        hit = [c.id for c in pool if sel(c)]
        chosen.update(hit)
        return len(hit)

    for path in changed:
        path = path.strip()
        if not path:
            continue
        if path == matrix_rel:
            if old_matrix is None:
                n = take(ALL, cells)
                notes.append(f"{path}: the previous matrix is not known, so every cell ({n})")
            else:
                old = {c.id: _cell_fingerprint(c, old_matrix) for c in old_matrix.cells()}
                n = take(lambda c: old.get(c.id) != _cell_fingerprint(c, matrix), cells)
                notes.append(f"{path}: {n} new or changed cell(s)")
            continue
        what, sel = _apply(PROJECT_RULES, path, ("harness code", ALL))
        notes.append(f"{path}: {what}: {take(sel, cells)} cell(s)")
    for engine, paths in (engine_changed or {}).items():
        if engine not in ENGINE_RULES:
            raise MatrixError(f"--engine-changed-files: no source rules for engine {engine!r} (known: {', '.join(ENGINE_RULES)})")
        pool = [c for c in cells if c.engine == engine]
        for path in paths:
            path = path.strip()
            if not path:
                continue
            what, sel = _apply(ENGINE_RULES[engine], path, (f"{engine} source", ALL))
            notes.append(f"{engine}:{path}: {what}: {take(sel, pool)} cell(s)")
    return [c for c in cells if c.id in chosen], notes


def git_changed_files(since: str, cwd: str | Path | None = None) -> list[str]:
    """Paths changed between ``since`` and HEAD (the merge base, as a pull request sees it)."""
    out = subprocess.run(["git", "diff", "--name-only", f"{since}...HEAD", "--"], cwd=cwd,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise MatrixError(f"--since {since}: git diff failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
    return [line for line in out.stdout.splitlines() if line.strip()]


def git_show(ref: str, path: str, cwd: str | Path | None = None) -> str | None:
    out = subprocess.run(["git", "show", f"{ref}:{path}"], cwd=cwd, capture_output=True, text=True)
    return out.stdout if out.returncode == 0 else None
