"""Accuracy baselines: ``baselines/<tier>/accuracy/<cell id>.json`` (docs/design.md, "Accuracy").

One file per cell beside (not inside) its logprob baseline, so that accuracy results are added and
updated without touching the logprob baselines. Same provenance as a logprob baseline (engine,
version, platform, CPU, date, commit), the fixture or source, and per task: lm-eval's task name,
metric and filter, value, stderr, sample count, the task's hash, few-shot count, limit and the
per-sample values. Its files go through the one mechanism of every baseline kind (harness.store):
written only under ``--update-baselines``, with the same refusals as every baseline, and a
mismatch writes ``<cell id>.obtained.json`` beside it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, create_model

from harness import baselines as B
from harness import files, store
from harness.files import render_json
from harness.records import Accuracy, FixtureRef, Record, SourceRef

VERSION = 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# What a baseline keeps of a record's accuracy entry (records.Accuracy): the result and what it
# was measured on, not the wall time nor the gate (models.yaml's, which may change on purpose).
STORED = ("lm_eval_task", "metric", "filter", "value", "stderr", "samples", "task_hash", "num_fewshot", "limit", "items")
TaskBaseline = create_model("TaskBaseline", __base__=_Strict,
                            **{f: (Accuracy.model_fields[f].annotation, Accuracy.model_fields[f]) for f in STORED})


class AccuracyBaseline(_Strict):
    folder: ClassVar[str] = "accuracy"
    schema_version: Literal[1] = VERSION
    cell: str
    tier: str
    provenance: B.Provenance
    fixture: FixtureRef | None = None
    source: SourceRef | None = None
    tasks: dict[str, TaskBaseline]  # type: ignore[valid-type]

    @classmethod
    def from_record(cls, record: Record, commit: str | None = None) -> AccuracyBaseline:
        prov = B.Baseline.from_record(record, commit=commit).provenance
        tasks = {a.task: TaskBaseline(**a.model_dump(include=set(STORED))) for a in record.accuracy}
        return cls(cell=record.cell, tier=record.tier, provenance=prov, fixture=record.fixture, source=record.source,
                   tasks=tasks)

    def to_text(self) -> str:
        return render_json(self.model_dump())


def path_for(root: str | Path, tier: str, cell_id: str) -> Path:
    return store.path_for(AccuracyBaseline, root, tier, cell_id)


def read(root: str | Path, tier: str, cell_id: str) -> AccuracyBaseline | None:
    """The cell's accuracy baseline, or None. A corrupt file raises harness.baselines.BaselineError."""
    path = path_for(root, tier, cell_id)
    if not os.path.lexists(path):
        return None
    try:
        text = files.read_text(path)
    except files.Unreadable as e:
        raise B.BaselineError(f"{path}: {e.reason}") from None
    return B.parse_document(AccuracyBaseline, text, str(path), VERSION, "accuracy baseline")


def _material(old: AccuracyBaseline, new: AccuracyBaseline) -> list[str]:
    """What changed, old -> new, leaving out the date and the commit."""
    msgs = []
    op, np_ = old.provenance, new.provenance
    for key in ("engine_version", "platform", "torch", "environment"):
        if getattr(op, key) != getattr(np_, key):
            msgs.append(f"provenance: {key} {getattr(op, key)} -> {getattr(np_, key)}")
    if old.fixture != new.fixture or old.source != new.source:
        msgs.append("fixture or source changed")
    for task in sorted(set(old.tasks) | set(new.tasks)):
        a, b = old.tasks.get(task), new.tasks.get(task)
        if a is None or b is None:
            msgs.append(f"accuracy task {task}: {'added' if a is None else 'removed'}")
        elif a != b:
            what = f"{a.value} -> {b.value}" if a.value != b.value else "per-sample values, hash or settings changed"
            msgs.append(f"accuracy task {task}: {b.metric},{b.filter} {what}")
    return msgs


@dataclass
class Outcome:
    messages: list[str] = field(default_factory=list)
    written: bool = False


def _regenerate(root: str | Path, record: Record) -> store.Change:
    """The accuracy baseline written when it is new or changed."""
    try:
        old = read(root, record.tier, record.cell)
    except B.BaselineError as e:
        old, problem = None, str(e)
    else:
        problem = None
    new = AccuracyBaseline.from_record(record, commit=store.git_commit())
    changes = ["new accuracy baseline: " + ", ".join(f"{t} {v.metric} {v.value}" for t, v in new.tasks.items())] \
        if old is None else _material(old, new)
    if problem:
        changes.insert(0, f"old accuracy baseline unreadable, replaced: {problem}")
    return store.save(root, new, ("new" if old is None else "updated") if changes else "unchanged", changes)


def handle(root: str | Path, record: Record, *, update_baselines: bool = False) -> Outcome:
    """The step after a verdict, for a record with accuracy results (nothing otherwise), through
    harness.store.handle: with ``update_baselines``, write the accuracy baseline when it is new or
    changed (refusals as for any baseline); without, write the obtained file on a mismatch verdict
    and clear it on pass."""
    if not record.accuracy:
        return Outcome()
    done = store.handle(AccuracyBaseline, root, record, update_baselines=update_baselines,
                        regenerate=lambda: _regenerate(root, record))
    if done.refused:
        return Outcome([f"accuracy baseline refused: {done.refused}"])
    if done.change is not None and done.change.written:
        return Outcome([str(done.change)], written=True)
    return Outcome()
