"""Reading result directories: one record per cell, merged across directories.

A result directory holds ``<cell id>.json`` (a result record) and ``logs/<cell id>.log`` (the
engine's log), as ``harness run --results DIR`` writes them and the Buildkite report step
downloads them; only its top-level ``*.json`` files are records.

Several directories are several result sets (runs): for each cell the latest record (by
``started_at``) is the one the report shows, and every record of the cell makes its trend.
``expected`` cells without any record are *missing* (their step never produced one: a crash, a
lost agent, a cancelled job). Unreadable files are *problems*, listed, never silently dropped.

With the matrix at hand, ``cross_check`` adds the cross-engine comparisons that no single
``harness run`` made: engines of one model x scheme that ran in different runs into the same
result set (on Buildkite: engines in different environments, hence different steps) are compared
within the cell's bounds, with harness.runner's rules (an engine with a known failure is no
witness; engines that differ in fusing shards are compared only in a run that holds both). A
disagreement makes the verdict ``failed`` (``waived`` when a known failure matches every failing
check), as the verdict order of docs/design.md, "Verdicts", has it.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from harness import compare
from harness.engines.base import fuses_shards
from harness.records import Record, RecordError

if TYPE_CHECKING:
    from harness.matrix import Matrix


@dataclass
class Entry:
    record: Record
    path: Path  # the record file
    source: str  # the result set (directory) it came from
    log: Path | None = None  # the engine log beside it, when there is one

    @property
    def started(self) -> datetime:
        return datetime.fromisoformat(self.record.started_at.replace("Z", "+00:00"))


@dataclass
class Problem:
    path: Path
    message: str


@dataclass
class Merged:
    sets: list[str]
    current: dict[str, Entry]  # cell id -> the latest record
    history: dict[str, list[Entry]]  # cell id -> every record, oldest first
    problems: list[Problem] = field(default_factory=list)
    expected: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the merge itself did (cross-engine checks)

    @property
    def missing(self) -> list[str]:
        return [c for c in self.expected if c not in self.current]

    def records(self) -> list[Record]:
        return [e.record for e in self.current.values()]


def parse_expected(values: Iterable[str] | None) -> list[str]:
    """Expected cell ids from ``--expect`` values (each space- or comma-separated), in order."""
    out: list[str] = []
    for v in values or ():
        for item in v.replace(",", " ").split():
            if item not in out:
                out.append(item)
    return out


def _record_files(root: Path) -> list[Path]:
    """The records of a result directory: its top-level ``*.json`` files (``harness run`` keeps
    its unjudged and intermediate files in subdirectories: raw/, witness/, sequences/)."""
    if root.is_file():
        return [root]
    return sorted(p for p in root.glob("*.json")
                  if not p.name.startswith(".") and not p.name.endswith(".obtained.json") and p.is_file())


def _log_for(root: Path, cell: str) -> Path | None:
    for p in (root / "logs" / f"{cell}.log", root / f"{cell}.log"):
        if p.is_file():
            return p
    return None


def load_results(dirs: Sequence[str | Path], expected: Iterable[str] = ()) -> Merged:
    sets = [str(d) for d in dirs]
    history: dict[str, list[Entry]] = {}
    problems: list[Problem] = []
    for d in dirs:
        root = Path(d)
        if not root.exists():
            problems.append(Problem(root, "no such result directory"))
            continue
        for path in _record_files(root):
            try:
                data = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
                problems.append(Problem(path, f"not a readable JSON file: {e}"))
                continue
            if not isinstance(data, dict) or "schema_version" not in data:
                continue  # another JSON file (a summary, a manifest): not a record
            try:
                record = Record.from_dict(data, str(path))
            except RecordError as e:
                problems.append(Problem(path, str(e)))
                continue
            history.setdefault(record.cell, []).append(
                Entry(record, path, str(d), _log_for(path.parent, record.cell)))
    current: dict[str, Entry] = {}
    for cell, entries in history.items():
        entries.sort(key=lambda e: (e.started, sets.index(e.source)))
        current[cell] = entries[-1]
    return Merged(sets=sets, current=current, history=history, problems=problems, expected=list(expected))


def _is_cross(check_name: str) -> bool:
    against = check_name.split(":", 1)[1] if ":" in check_name else ""
    return against not in ("baseline", "")


def cross_check(merged: Merged, matrix: Matrix) -> None:
    """Compare the engines of each model x scheme within each result set (see the module doc).
    Records gain the missing cross-engine checks; their verdict changes only when one fails."""
    cells = {c.id: c for c in matrix.cells()}
    for source in merged.sets:
        groups: dict[tuple[str, str], list[Entry]] = {}
        for entries in merged.history.values():
            for e in entries:
                if e.source == source:
                    groups.setdefault((e.record.model, e.record.scheme), []).append(e)
        for group in groups.values():
            if len(group) < 2:
                continue
            for entry in group:
                rec = entry.record
                cell = cells.get(rec.cell)
                if cell is None or rec.status != "ok":
                    continue
                # as harness.runner compares: an engine with a known failure is no witness, and
                # engines that differ in fusing shards need the reference executed unfused, which
                # only a run holding both makes (then the checks are in the records already)
                others = [o.record for o in group if o is not entry
                          and fuses_shards(o.record.engine) == fuses_shards(rec.engine)
                          and not (o.record.cell in cells and compare.applicable(
                              cells[o.record.cell].known_failures, o.record.engine, o.record.engine_info.version))]
                have = {c.name for c in rec.checks}
                new = [c for c in compare.cross_engine(rec, others, cell.bounds) if c.name not in have]
                if not new:
                    continue
                checks = [*rec.checks, *new]
                failing_new = [c for c in new if not c.ok]
                if not failing_new or rec.verdict in (None, "error", "unsupported"):
                    entry.record = rec.model_copy(update={"checks": checks})
                    continue
                failing = [c for c in checks if not c.ok and _is_cross(c.name)]
                known = compare.applicable(cell.known_failures, rec.engine, rec.engine_info.version)
                k = compare._waiver(known, failing)
                if k is not None:
                    j = compare.Judgement("waived", f"known failure: {k.reason} ({failing[0].name}; cross-engine, "
                                          "compared when the results were merged)", checks, k)
                else:
                    j = compare.Judgement("failed", "; ".join(f"{c.name}: {c.detail}" for c in failing)
                                          + " (cross-engine, compared when the results were merged)", checks)
                before = rec.verdict
                entry.record = j.apply(rec)
                merged.notes.append(f"{rec.cell} ({source}): {before} -> {j.verdict}: engines disagree "
                                    f"({', '.join(c.name for c in failing_new)})")
