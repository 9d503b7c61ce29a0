"""A candidate build beside the base build (``harness run --candidate ENGINE=SPEC``): what every
output says of the pair.

Each cell of the candidate's engine has two records in a run: the pinned ("base") build's and the
candidate's, judged against the base's (harness.judging.judge_against_base). ``headline`` sums up
each candidate build in one line (``harness run``'s summary, the HTML report, the annotation);
``cost`` says what the check cost; ``pairs`` gives the cells side by side; ``label`` names a candidate record with both builds
(JUnit's test case).
"""
from __future__ import annotations

from collections.abc import Iterable

from harness.records import Record
from harness.report.merge import Entry, Merged
from harness.report.states import state_of
from harness.verdicts import fails_run

NEW = "new in the candidate"  # how judge_against_base starts the reason of a known failure the base does not match


def _n(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word if n == 1 else plural or word + 's'}"


def _version(rec: Record | None) -> str:
    return (rec.engine_info.version if rec is not None else None) or "?"


def _base_versions(base: Iterable[Record], cells: set[str]) -> str:
    """The base build's version(s) for these cells, "?" when no base record of them is at hand."""
    return "/".join(sorted({_version(r) for r in base if r.cell in cells})) or "?"


def headline(base: Iterable[Record], candidates: Iterable[Record]) -> str | None:
    """One line per candidate build: how many of its cells changed (a verdict that fails the run,
    against the base), were fixed, or show a known failure new in the candidate. None without
    candidate records."""
    builds: dict[tuple[str, str, str], list[Record]] = {}
    for r in candidates:
        builds.setdefault((r.engine, _version(r), r.candidate or "?"), []).append(r)
    if not builds:
        return None
    base = list(base)
    lines = []
    for (engine, version, spec), recs in builds.items():
        changed = sum(1 for r in recs if fails_run(state_of(r)))
        fixed = sum(1 for r in recs if state_of(r) == "fixed")
        new = sum(1 for r in recs if (r.verdict_reason or "").startswith(NEW))
        line = (f"candidate {engine} {version} ({spec}) vs base {_base_versions(base, {r.cell for r in recs})}: "
                f"{_n(changed, 'cell')} changed, {fixed} fixed")
        lines.append(line + (f", {_n(new, 'new known failure')}" if new else ""))
    return "\n".join(lines)


def cost(base: Iterable[Record], candidates: Iterable[Record], builds: Iterable[tuple[str, float | None, bool]],
         wall: float) -> str | None:
    """What the candidate check cost, in one line (``harness run``'s summary; a Buildkite step
    appends it to its label): the run's wall time, the cells' own time of the base and the
    candidate on the same cells, and each build's environment (``builds``: its label, its build
    seconds or None for the user's own environment, whether it was built before this run). None
    without candidate records."""
    candidates = list(candidates)
    if not candidates:
        return None
    cells = {r.cell for r in candidates}
    own_base = sum(r.duration_s or 0 for r in base if r.cell in cells)
    own = sum(r.duration_s or 0 for r in candidates)
    envs = [f"{name}: {'its own environment' if s is None else f'environment built in {s:.0f} s'}"
            f"{' before this run' if reused else ''}" for name, s, reused in builds]
    return (f"candidate cost: wall {wall:.0f} s; cells' own time: base {own_base:.0f} s, candidate {own:.0f} s"
            + "".join(f"; {e}" for e in envs))


def label(candidate: Record, base: Record | None) -> str:
    """The candidate record named with both builds: ``candidate vllm 0.31.0 vs base 0.32.0``."""
    return f"candidate {candidate.engine} {_version(candidate)} vs base {_version(base)}"


def pairs(merged: Merged, matrix=None) -> list[tuple[str, Entry | None, Entry]]:
    """(cell id, the base build's entry or None, the candidate's) for every candidate record, in
    the matrix's cell order (without it, or for cells it does not know, by id)."""
    order = [c.id for c in matrix.cells()] if matrix is not None else []
    ids = [c for c in order if c in merged.candidates] + sorted(set(merged.candidates) - set(order))
    return [(c, merged.current.get(c), merged.candidates[c]) for c in ids]
