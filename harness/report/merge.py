"""Reading result directories: one record per cell, merged across directories.

A result directory holds ``<cell id>.json`` (a result record) and ``logs/<cell id>.log`` (the
engine's log), as ``harness run --results DIR`` writes them and the Buildkite report step
downloads them; only its top-level ``*.json`` files are records.

Several directories are several result sets (runs): for each cell the latest record (by
``started_at``) is the one the report shows, and every record of the cell makes its trend.
``expected`` cells without any record are *missing* (their step never produced one: a crash, a
lost agent, a cancelled job). Unreadable files are *problems*, listed, never silently dropped.

A candidate build's records (``harness run --candidate``: ``candidate/<cell id>.json``, logs in
``candidate/logs/``, harness.layout.Layout.candidate) are ``candidates``, the latest per cell, apart
from the base build's: they share the base's cell ids, so mixed in they would stand in for the base
record, its trend and its missing check. A record tells which build it is (``Record.candidate``),
wherever it lies.

With the matrix at hand, ``cross_check`` adds the cross-engine comparisons that no single
``harness run`` made: engines of one model x scheme that ran in different runs into the same
result set (on Buildkite: engines in different environments, hence different steps) are compared
within the cell's bounds by the runner's own rule (``compare.cross_engine``: an engine with a
known failure is no witness; engines that differ in fusing shards are compared only in a run that
holds both), and the record with the new checks is judged by the runner's one judgement
(``judging.decide``, from the evidence the record carries). Records of one result set may come from different agents, so
two engines are compared only where their records share a kernel set (``share_kernels``): on other
kernels an FP8-quantized activation or a bfloat16 sum may round differently and move the logprobs
past the family bound with no bug (docs/design.md, "Portability across CPUs"). A comparison left
out for that reason is said in the record's verdict reason and in the merge's notes.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from harness import compare, cpu, files, judging
from harness.layout import Layout
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
    candidates: dict[str, Entry] = field(default_factory=dict)  # cell id -> a candidate build's latest record

    @property
    def missing(self) -> list[str]:
        return [c for c in self.expected if c not in self.current]

    def records(self) -> list[Record]:
        return [e.record for e in self.current.values()]

    def candidate_records(self) -> list[Record]:
        return [e.record for e in self.candidates.values()]


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


def _read(path: Path, problems: list[Problem]) -> Record | None:
    """The record in ``path``; None for another JSON file (a summary, a manifest) or an unreadable
    one, which becomes a problem."""
    try:
        text = files.read_text(path)
        data = json.loads(text)
    except files.Unreadable as e:
        problems.append(Problem(path, f"not a readable JSON file: {e.reason}"))
        return None
    except json.JSONDecodeError as e:
        problems.append(Problem(path, f"not a readable JSON file: {e}"))
        return None
    if not isinstance(data, dict) or "schema_version" not in data:
        return None
    try:
        return Record.from_json(text, str(path))
    except RecordError as e:
        problems.append(Problem(path, str(e)))
        return None


def _latest(entries: list[Entry], sets: list[str]) -> Entry:
    """The latest of one cell's entries; sorts them oldest first."""
    entries.sort(key=lambda e: (e.started, sets.index(e.source)))
    return entries[-1]


def load_results(dirs: Sequence[str | Path], expected: Iterable[str] = ()) -> Merged:
    sets = [str(d) for d in dirs]
    history: dict[str, list[Entry]] = {}
    candidates: dict[str, list[Entry]] = {}
    problems: list[Problem] = []
    for d in dirs:
        root = Path(d)
        if not root.exists():
            problems.append(Problem(root, "no such result directory"))
            continue
        build_dir = Layout(root).candidate().root
        for path in _record_files(root):
            record = _read(path, problems)
            if record is None:
                continue
            # a candidate's record outside candidate/ must not pass for the base build's: its log too is the candidate's
            logs = path.parent if record.candidate is None else build_dir
            into = history if record.candidate is None else candidates
            into.setdefault(record.cell, []).append(Entry(record, path, str(d), _log_for(logs, record.cell)))
        for path in _record_files(build_dir) if build_dir.is_dir() else ():
            record = _read(path, problems)
            if record is not None and record.candidate is None:
                problems.append(Problem(path, "a record of the base build (no candidate spec) among the candidate's"))
            elif record is not None:
                candidates.setdefault(record.cell, []).append(Entry(record, path, str(d), _log_for(build_dir, record.cell)))
    return Merged(sets=sets, current={c: _latest(es, sets) for c, es in history.items()}, history=history,
                  problems=problems, expected=list(expected),
                  candidates={c: _latest(es, sets) for c, es in candidates.items()})


MERGED = " (cross-engine, compared when the results were merged)"


def _groups(merged: Merged, source: str) -> list[list[Entry]]:
    """The entries of one result set, grouped by (model, scheme); a configuration cell's record
    (harness.configurations) is no engine of its group: its run judged it against its plain cell."""
    groups: dict[tuple[str, str], list[Entry]] = {}
    for entries in merged.history.values():
        for e in entries:
            if e.source == source and e.record.configuration is None:
                groups.setdefault((e.record.model, e.record.scheme), []).append(e)
    return [g for g in groups.values() if len(g) > 1]


def cross_check(merged: Merged, matrix: Matrix) -> None:
    """Compare the engines of each model x scheme within each result set (see the module doc), by
    the runner's rule and its one judgement (compare.cross_engine, judging.decide), between records
    that share a kernel set (share_kernels). Records gain the missing cross-engine checks; their
    verdict changes only when one fails; a comparison left out for the kernels is said."""
    cells = {c.id: c for c in matrix.cells()}
    for source in merged.sets:
        for group in _groups(merged, source):
            known = [k for e in group if e.record.cell in cells for k in cells[e.record.cell].known_failures]
            for entry in group:
                cell = cells.get(entry.record.cell)
                if cell is not None:
                    _cross_check(entry, [o.record for o in group if o is not entry], cell, known, merged)


# ------------------------------------------------------------------------------- kernel sets

NO_CPU = "no CPU recorded"


def _accelerator(record: Record) -> str | None:
    """The record's platform when its results were computed off the CPU (``cuda-sm90``)."""
    platform = record.engine_info.platform
    return platform if platform and not platform.startswith("cpu") else None


def _cpu_of(record: Record) -> dict | None:
    info = record.engine_info.cpu
    return info.model_dump() if info is not None else None


def share_kernels(a: Record, b: Record) -> bool:
    """Whether two records' results were computed by the same kernels, so that the family bounds
    hold between them (docs/design.md, "Portability across CPUs").

    - Records computed on a GPU (platform ``cuda-sm90``): the same platform. Their host CPU selects
      none of the kernels that compute the logprobs, so two GPU agents of one compute capability
      share kernels whatever their hosts, and a GPU record never shares them with a CPU record.
    - Records computed on a CPU: harness.cpu.same_kernels of their CPUs (vendor, model, kernel
      flags, torch capability, kernel-restricting variables).
    - A CPU record that names no CPU (a harness older than the CPU provenance) is never known to
      share kernels, as cpu.same_kernels and a baseline of unknown CPU (harness.baselines.other_kernels)
      have it: comparing it could make ``failed`` of a mere kernel difference, and every record of
      today's harness names its CPU, so what is left out is said rather than guessed.
    """
    if _accelerator(a) or _accelerator(b):
        return _accelerator(a) == _accelerator(b)
    return cpu.same_kernels(_cpu_of(a), _cpu_of(b))


def kernels_of(record: Record) -> str | None:
    """A name for the kernels a record's results come from: its GPU platform, or its CPU's kernel
    set (harness.cpu.kernel_set, e.g. ``amd-epyc-avx2-ddc0264a``); None when unknown."""
    mine = _cpu_of(record)
    return _accelerator(record) or (cpu.kernel_set(mine) if mine else None)


def _not_compared(record: Record, other: Record) -> str:
    """Why ``record`` is not compared with ``other``: they do not share a kernel set."""
    mine, theirs = kernels_of(record) or NO_CPU, kernels_of(other) or NO_CPU
    return f"not compared with {other.engine}: recorded on other kernels ({theirs}) than this record ({mine})"


def _apart(rec: Record, others: list[Record], cell, known, have: set[str]) -> list[Record]:
    """The records of ``others`` on other kernels that the cross-engine rule would otherwise have
    compared ``rec`` with here (not those it never compares, nor those its own run compared it with)."""
    return [o for o in others if not share_kernels(rec, o)
            and any(c.name not in have for c in compare.cross_engine(rec, [o], cell.bounds, known_failures=known))]


def _say_not_compared(entry: Entry, apart: list[Record], merged: Merged) -> None:
    """The record's verdict reason and the merge's notes say which comparison was left out, once
    (a second merge of the same records says nothing twice)."""
    rec = entry.record
    said = [why for why in (_not_compared(rec, o) for o in apart) if why not in (rec.verdict_reason or "")]
    if not said:
        return
    reason = "; ".join(([rec.verdict_reason] if rec.verdict_reason else []) + said)
    entry.record = rec.model_copy(update={"verdict_reason": reason})
    merged.notes.extend(f"{rec.cell} ({entry.source}): {why}" for why in said)


# ------------------------------------------------------------------------------- one record


def _cross_check(entry: Entry, others: list[Record], cell, known, merged: Merged) -> None:
    rec = entry.record
    have = {c.name for c in rec.checks}
    # on other kernels the family bounds do not hold between two engines (share_kernels): such a
    # record is no witness here, and the reason says it was left out
    alike = [o for o in others if share_kernels(rec, o)]
    apart = _apart(rec, others, cell, known, have)
    # no unfused reference here: engines that differ in fusing shards are compared only by a run
    # holding both (and then the checks are in the records already)
    new = [c for c in compare.cross_engine(rec, alike, cell.bounds, known_failures=known) if c.name not in have]
    if new:
        _judge_new(entry, new, cell, merged)
    _say_not_compared(entry, apart, merged)


def _judge_new(entry: Entry, new: list, cell, merged: Merged) -> None:
    """The record with the new cross-engine checks, judged again by the one judgement
    (judging.decide) from the evidence it carries; a changed verdict is said in its reason and the
    merge's notes."""
    rec = entry.record
    with_new = rec.model_copy(update={"checks": [*rec.checks, *new]})
    if rec.evidence is None:  # a record judged by no harness of today: nothing to judge it from
        entry.record = with_new
        merged.notes.append(f"{rec.cell} ({entry.source}): not judged again with the merged checks: the record "
                            "carries no evidence (harness.evidence)")
        return
    j = judging.decide(with_new, cell.known_failures)
    if j.verdict == rec.verdict:
        entry.record = with_new
        return
    j.reason += MERGED
    entry.record = j.apply(with_new)
    failing_new = [c for c in new if not c.ok]
    why = (f"engines disagree ({', '.join(c.name for c in failing_new)})" if failing_new
           else f"the {', '.join(sorted({c.against for c in new}))} agrees")
    merged.notes.append(f"{rec.cell} ({entry.source}): {rec.verdict} -> {j.verdict}: {why}")
