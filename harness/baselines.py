"""Baselines: the stored result of a cell, as reviewable text (modelled on pytest-regressions).

One file per cell: ``baselines/<tier>/<cell id>.json``. Pretty JSON with a fixed key order and
one sequence position per line, so that ``git diff`` shows which positions moved. It holds the
scored token sequence and its logprobs (with top-k), the greedy tokens and their top-k, load-time
statistics, the fixture identity (or hub source) and provenance: engine, engine version,
environment, torch, platform, date, commit.

- ``read(root, tier, cell_id)`` returns the baseline or None.
- ``update(root, record)`` writes it; the CLI calls it only under ``--update-baselines``. It refuses
  a record whose verdict is failed, error or unsupported (a bug in today's engine never
  becomes tomorrow's baseline), writes atomically and returns what changed.
- ``handle(root, record)`` is the step after a verdict, through harness.store (the files of every
  baseline kind): a mismatch writes ``<cell id>.obtained.json`` beside the baseline in the same
  format, so ``diff baselines/cpu-tiny/X.json baselines/cpu-tiny/X.obtained.json`` shows it.
  Obtained files are git-ignored.
- Baselines recorded for one set of kernels live under ``<root>/kernels/<kernel set>/``, laid out
  as ``<root>`` is; which baseline judges a record is harness.resolver's choice.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar, Literal, NamedTuple, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from harness import cpu, files, store
from harness.records import (
    CpuInfo,
    FixtureRef,
    Greedy,
    LoadInfo,
    PromptRef,
    Record,
    Scored,
    SequenceResult,
    SourceRef,
    TopK,
    allocation_named,
)
from harness.files import atomic_write_text, is_version, render_json
from harness.store import Change, Outcome, git_commit, refusal_of
from harness.traces.fingerprint import Fingerprint
from harness.validation import one_line, strict_json

BASELINE_VERSION = 1
Doc = TypeVar("Doc", bound=BaseModel)
DEFAULT_ROOT = Path(__file__).resolve().parent.parent / "baselines"
KERNELS_FOLDER = "kernels"


class BaselineError(Exception):
    """A baseline file that cannot be read. ``str()`` is one line naming the file."""


class BaselineRefused(Exception):
    """update() was asked to store a record that must not become a baseline."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Provenance(_Strict):
    engine: str
    engine_version: str
    environment: str | None = None
    torch: str | None = None
    platform: str
    cpu: CpuInfo | None = None  # the kernels' CPU; None for baselines from before it was recorded
    date: str  # when the recorded run started (ISO 8601 UTC)
    commit: str | None = None  # git rev-parse HEAD of the harness checkout, when available


class ScoredRow(_Strict):
    """Position ``pos`` of the scored sequence: its token, the logprob of that token given the
    positions before it, and the top-k of that same distribution. Position 0 has neither."""

    pos: int
    token: int
    logprob: float | None = None
    topk: TopK | None = None


class GreedyRow(_Strict):
    step: int
    token: int
    topk: TopK


class BaselineSequence(_Strict):
    prompt: PromptRef
    prompt_tokens: list[int]
    scored: list[ScoredRow]
    greedy: list[GreedyRow]

    @model_validator(mode="after")
    def _rows(self) -> BaselineSequence:
        if not self.scored:
            raise ValueError(f"sequence {self.prompt.id}: scored needs at least one row")
        for i, row in enumerate(self.scored):
            if row.pos != i:
                raise ValueError(f"sequence {self.prompt.id}: scored row {i} has pos {row.pos}")
            if (i == 0) != (row.logprob is None) or (i == 0) != (row.topk is None):
                raise ValueError(f"sequence {self.prompt.id}: scored row {i}: only position 0 has no logprob/topk")
        for i, row in enumerate(self.greedy):
            if row.step != i:
                raise ValueError(f"sequence {self.prompt.id}: greedy row {i} has step {row.step}")
        return self

    @classmethod
    def from_sequence(cls, s: SequenceResult) -> BaselineSequence:
        scored = [ScoredRow(pos=0, token=s.scored.tokens[0])]
        scored += [
            ScoredRow(pos=i + 1, token=t, logprob=lp, topk=tk)
            for i, (t, lp, tk) in enumerate(zip(s.scored.tokens[1:], s.scored.logprobs, s.scored.topk))
        ]
        greedy = [GreedyRow(step=i, token=t, topk=tk) for i, (t, tk) in enumerate(zip(s.greedy.tokens, s.greedy.topk))]
        return cls(prompt=s.prompt, prompt_tokens=s.prompt_tokens, scored=scored, greedy=greedy)

    def to_sequence(self) -> SequenceResult:
        return SequenceResult(
            prompt=self.prompt,
            prompt_tokens=self.prompt_tokens,
            scored=Scored(
                tokens=[r.token for r in self.scored],
                logprobs=[r.logprob for r in self.scored[1:]],
                topk=[r.topk for r in self.scored[1:]],
            ),
            greedy=Greedy(tokens=[r.token for r in self.greedy], topk=[r.topk for r in self.greedy]),
        )


class Baseline(_Strict):
    folder: ClassVar[str] = ""
    schema_version: Literal[1] = BASELINE_VERSION
    cell: str
    tier: str
    provenance: Provenance
    fixture: FixtureRef | None = None
    source: SourceRef | None = None
    load: LoadInfo | None = None
    sequences: list[BaselineSequence]
    fingerprint: Fingerprint | None = None  # the module trace's fingerprint (harness.traces.fingerprint)
    loaded_state: dict[str, str] | None = None  # module -> digest of what was loaded (harness.loaded_state)

    def record_sequences(self) -> list[SequenceResult]:
        """The sequences in the result record's shape, for compare."""
        return [s.to_sequence() for s in self.sequences]

    @classmethod
    def from_record(cls, record: Record, commit: str | None = None) -> Baseline:
        if record.status != "ok":
            raise ValueError(f"{record.cell}: a record with status {record.status} has no results to store")
        info = record.engine_info
        return cls(
            cell=record.cell,
            tier=record.tier,
            provenance=Provenance(
                engine=info.name,
                engine_version=info.version,
                environment=info.environment,
                torch=info.torch,
                platform=info.platform,
                cpu=info.cpu,
                date=record.started_at,
                commit=commit,
            ),
            fixture=record.fixture,
            source=record.source,
            load=record.load,
            sequences=[BaselineSequence.from_sequence(s) for s in record.sequences],
            loaded_state=record.loaded_state,
        )

    def to_text(self) -> str:
        data = self.model_dump()
        for key in ("fingerprint", "loaded_state"):  # files without one stay as they were before it
            if data[key] is None:
                del data[key]
        return render_json(data)


# ------------------------------------------------------------------------------- file access


def path_for(root: str | Path, tier: str, cell_id: str) -> Path:
    return store.path_for(Baseline, root, tier, cell_id)


def other_kernels(record: Record, baseline: Baseline) -> bool:
    """Whether the record ran on other kernels than the baseline (another CPU, another torch
    capability, a kernel-restricting variable: harness.cpu.same_kernels)."""
    return not cpu.same_kernels(cpu_of_record(record), cpu_of(baseline))


def kernel_set_of(baseline) -> str:
    """The name of the kernels a baseline (logprob or accuracy) was recorded on (harness.cpu.kernel_set)."""
    mine = cpu_of(baseline)
    return cpu.kernel_set(mine) if mine else "an unknown CPU"


def read(root: str | Path, tier: str, cell_id: str) -> Baseline | None:
    """The stored baseline of a cell, or None when there is none. A file that cannot be read, is
    not a baseline, or is the baseline of another cell or tier raises BaselineError (the runner
    makes it an ``error`` for that cell alone)."""
    path = path_for(root, tier, cell_id)
    if not os.path.lexists(path):
        return None
    try:
        text = files.read_text(path)
    except files.Unreadable as e:
        raise BaselineError(f"{path}: {e.reason}") from None
    baseline = parse(text, str(path))
    for key, want in (("cell", cell_id), ("tier", tier)):
        if getattr(baseline, key) != want:
            raise BaselineError(f"{path}: {key}: {getattr(baseline, key)!r} is not this file's {key} {want!r} "
                                "(a baseline copied from another cell?)")
    return baseline


def cpu_of_record(record: Record) -> dict | None:
    return record.engine_info.cpu.model_dump() if record.engine_info.cpu else None


def cpu_of(baseline: Baseline) -> dict | None:
    return baseline.provenance.cpu.model_dump() if baseline.provenance.cpu else None


def parse(text: str, source: str = "<baseline>") -> Baseline:
    """A baseline read from a file: every field validated by its JSON type
    (harness.validation.strict_json); a problem is one BaselineError line naming the field."""
    return parse_document(Baseline, text, source, BASELINE_VERSION, "baseline")


def parse_document(kind: type[Doc], text: str, source: str, version: int, what: str) -> Doc:
    """A versioned baseline document of ``kind`` (``what`` names the kind in messages)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise BaselineError(f"{source}: not JSON: {e.msg} at line {e.lineno}") from None
    found = data.get("schema_version") if isinstance(data, dict) else None
    if not is_version(found, version):
        raise BaselineError(f"{source}: {what} schema_version {found!r} is not supported (this harness reads {version})")
    try:
        return strict_json(kind, text)
    except ValidationError as e:
        raise BaselineError(f"{source}: {one_line(e)}") from None


# ------------------------------------------------------------------------------------ update


def _fmt(x: float) -> str:
    return f"{x:.3g}"


# A difference old -> new: its line for the change's messages, or None for one that gets no line of
# its own (the top-k lists: describe_changes sums those up in one line after all others).
Difference = str | None


class ChangeRule(NamedTuple):
    """One kind of difference between a cell's old and new baseline. Only a ``material`` one makes
    the new baseline worth writing (update())."""

    name: str
    material: bool
    differences: Callable[[Baseline, Baseline], list[Difference]]


class PromptRule(NamedTuple):
    """One kind of difference between the old and new results of one prompt (all material)."""

    name: str
    differences: Callable[[BaselineSequence, BaselineSequence], list[Difference]]


def _first_difference(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _provenance_changes(old: Baseline, new: Baseline) -> list[Difference]:
    labels = (("engine_version", "engine version"), ("platform", "platform"), ("torch", "torch"),
              ("environment", "environment"))
    pairs = [(label, getattr(old.provenance, key), getattr(new.provenance, key)) for key, label in labels]
    return [f"provenance: {label} {a} -> {b}" for label, a, b in pairs if a != b]


def _fixture_change(old: Baseline, new: Baseline) -> list[Difference]:
    if (old.fixture and old.fixture.identity) == (new.fixture and new.fixture.identity):
        return []
    return [f"fixture identity {old.fixture.identity if old.fixture else None} -> {new.fixture.identity if new.fixture else None}"]


def _source_change(old: Baseline, new: Baseline) -> list[Difference]:
    return [f"source {old.source} -> {new.source}"] if old.source != new.source else []


def _prompt_set_changes(old: Baseline, new: Baseline) -> list[Difference]:
    old_ids, new_ids = {s.prompt.id for s in old.sequences}, {s.prompt.id for s in new.sequences}
    return ([f"prompt {pid}: removed" for pid in sorted(old_ids - new_ids)]
            + [f"prompt {pid}: added" for pid in sorted(new_ids - old_ids)])


def _prompt_tokens_change(a: BaselineSequence, b: BaselineSequence) -> list[Difference]:
    return ["prompt tokens changed"] if a.prompt_tokens != b.prompt_tokens else []


def _scored_tokens_change(a: BaselineSequence, b: BaselineSequence) -> list[Difference]:
    at, bt = [r.token for r in a.scored], [r.token for r in b.scored]
    return [f"scored tokens changed at position {_first_difference(at, bt)}"] if at != bt else []


def _logprobs_change(a: BaselineSequence, b: BaselineSequence) -> list[Difference]:
    # Equal logprobs (-inf for an image placeholder included) are no change; NaN never compares small.
    deltas = [
        (0.0 if ra.logprob == rb.logprob else abs(ra.logprob - rb.logprob), ra.pos)
        for ra, rb in zip(a.scored[1:], b.scored[1:])
        if ra.token == rb.token and ra.logprob is not None and rb.logprob is not None
    ]
    deltas = [(d if not math.isnan(d) else math.inf, p) for d, p in deltas]
    worst, pos = max(deltas) if deltas else (0.0, None)
    return [f"max |Δlogprob| vs old {_fmt(worst)} at position {pos}"] if worst > 0 else []


def _scored_topk_change(a: BaselineSequence, b: BaselineSequence) -> list[Difference]:
    return [None] if any(ra.topk != rb.topk for ra, rb in zip(a.scored, b.scored)) else []


def _greedy_change(a: BaselineSequence, b: BaselineSequence) -> list[Difference]:
    ag, bg = [r.token for r in a.greedy], [r.token for r in b.greedy]
    if ag == bg:
        return [None] if [r.topk for r in a.greedy] != [r.topk for r in b.greedy] else []
    step = _first_difference(ag, bg)
    x = ag[step] if step < len(ag) else "(end)"
    y = bg[step] if step < len(bg) else "(end)"
    return [f"greedy tokens changed at step {step}: {x} -> {y}"]


PROMPT_RULES: tuple[PromptRule, ...] = (
    PromptRule("prompt tokens", _prompt_tokens_change),
    PromptRule("scored tokens", _scored_tokens_change),
    PromptRule("logprobs", _logprobs_change),
    PromptRule("scored top-k", _scored_topk_change),
    PromptRule("greedy", _greedy_change),
)


def _prompt_changes(old: Baseline, new: Baseline) -> list[Difference]:
    """PROMPT_RULES on every prompt both baselines hold, in the new one's order."""
    old_seqs = {s.prompt.id: s for s in old.sequences}
    new_seqs = {s.prompt.id: s for s in new.sequences}
    shared = [(pid, old_seqs[pid], b) for pid, b in new_seqs.items() if pid in old_seqs]
    return [None if d is None else f"prompt {pid}: {d}"
            for pid, a, b in shared for rule in PROMPT_RULES for d in rule.differences(a, b)]


def _load_change(old: Baseline, new: Baseline) -> list[Difference]:
    if not (old.load and new.load and old.load.seconds != new.load.seconds):
        return []
    said = f"load {_fmt(old.load.seconds)} s -> {_fmt(new.load.seconds)} s"
    if old.load.allocation != new.load.allocation:  # which a calibration does not carry
        said += f", timed under {allocation_named(new.load.allocation)} ({allocation_named(old.load.allocation)} before)"
    return [said]


# In the order of the messages.
CHANGE_RULES: tuple[ChangeRule, ...] = (
    ChangeRule("provenance", True, _provenance_changes),
    ChangeRule("fixture identity", True, _fixture_change),
    ChangeRule("source", True, _source_change),
    ChangeRule("prompt set", True, _prompt_set_changes),
    ChangeRule("prompts", True, _prompt_changes),
    ChangeRule("load time", False, _load_change),
)


def describe_changes(old: Baseline | None, new: Baseline) -> tuple[list[str], bool]:
    """Human-readable differences old -> new (CHANGE_RULES), and whether any is material (anything
    but the date, the commit and load-time statistics)."""
    if old is None:
        n = sum(len(s.scored) for s in new.sequences)
        return [f"new baseline: {len(new.sequences)} sequence(s), {n} scored positions, "
                f"{new.provenance.engine} {new.provenance.engine_version} on {new.provenance.platform}"], True
    found = [(rule, d) for rule in CHANGE_RULES for d in rule.differences(old, new)]
    material = any(rule.material for rule, _ in found)
    msgs = [d for _, d in found if d is not None]
    if material and old.provenance.commit != new.provenance.commit:
        msgs.append(f"provenance: commit {old.provenance.commit} -> {new.provenance.commit}")
    if material and all(d is None for rule, d in found if rule.material):
        msgs.append("top-k logprobs changed")
    return msgs, material


def _loaded_state_change(old: dict[str, str] | None, new: dict[str, str]) -> str:
    if old is None:
        return f"loaded state recorded ({len(new)} modules)"
    changed = [m for m in new if old.get(m) != new[m]] + [m for m in old if m not in new]
    return f"loaded state changed in {len(changed)} module(s), first {changed[0]}"


def update(root: str | Path, record: Record, verdict: str | None = None, *, commit: str | None = None,
           rewrite: bool = False) -> Change:
    """Store ``record`` as its cell's baseline and return what changed.

    ``verdict`` defaults to ``record.verdict``; a record that was never judged, or whose verdict
    is failed, error or unsupported, raises BaselineRefused. When nothing material changed (only
    the date, commit or load time) and not ``rewrite`` (the stored one moved beyond a bound, the
    load time's included, or is stale: the runner says), the file is left untouched and the change
    is ``unchanged``. Any obtained file is removed."""
    verdict = verdict if verdict is not None else record.verdict
    refusal = refusal_of(record, verdict)
    if refusal:
        raise BaselineRefused(refusal)
    try:
        old = read(root, record.tier, record.cell)
    except BaselineError as e:
        old = None
        unreadable = str(e)
    else:
        unreadable = None
    new = Baseline.from_record(record, commit=commit if commit is not None else git_commit())
    messages, material = describe_changes(old, new)
    if old is not None and old.fingerprint is not None:
        if old.sequences == new.sequences:
            new.fingerprint = old.fingerprint
        else:
            messages.append("trace fingerprint dropped: the results changed (harness run --update-fingerprints adds it again)")
    if old is not None and old.loaded_state != new.loaded_state and new.loaded_state is not None:
        messages.append(_loaded_state_change(old.loaded_state, new.loaded_state))
        material = True
    if unreadable:
        messages.insert(0, f"old baseline unreadable, replaced: {unreadable}")
        material = True
    if old is not None and not material and not rewrite:
        return store.save(root, new, "unchanged", messages)
    return store.save(root, new, "new" if old is None and not unreadable else "updated", messages)


def set_fingerprint(root: str | Path, tier: str, cell_id: str, fingerprint: Fingerprint) -> str:
    """Store ``fingerprint`` in the cell's existing baseline, nothing else of the file changed
    (``harness run --update-fingerprints``); returns what was done, one line."""
    return _set_measured(root, tier, cell_id, "fingerprint", fingerprint, "trace fingerprint",
                         f" ({len(fingerprint.modules)} modules)")


def _set_measured(root: str | Path, tier: str, cell_id: str, field: str, value, what: str, detail: str) -> str:
    path = path_for(root, tier, cell_id)
    with store.locked(path):  # read, change, write: another run's update between would be lost
        baseline = read(root, tier, cell_id)
        if baseline is None:
            return f"{path}: no baseline, no {what} written"
        if getattr(baseline, field) == value:
            return f"{path}: {what} unchanged"
        kind = "added" if getattr(baseline, field) is None else "refreshed"
        setattr(baseline, field, value)
        atomic_write_text(path, baseline.to_text())
    return f"{path}: {what} {kind}{detail}"


def handle(root: str | Path, record: Record, *, update_baselines: bool = False, rewrite: bool = False) -> Outcome:
    """The step after a verdict, for the CLI and the pytest plugin (harness.store.handle): with
    ``update_baselines``, update (a refusal is returned, not raised; ``rewrite`` as update's);
    otherwise write the obtained file when the record is ok and its verdict is a mismatch, and
    clear a stale obtained file on pass."""
    # a refused result is kept beside the baseline, so that what was refused can be diffed
    return store.handle(Baseline, root, record, update_baselines=update_baselines,
                        regenerate=lambda: update(root, record, rewrite=rewrite), obtained_when_refused=True)
