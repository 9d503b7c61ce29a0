"""The files of every baseline kind, one mechanism for all (modelled on pytest-regressions'
``perform_regression_check``).

A kind of baseline (harness.baselines.Baseline for the logprobs, harness.accuracy.store's
AccuracyBaseline) knows itself: its subfolder of the tier's folder (``folder``), how it is made
from a record (``from_record``) and written as text (``to_text``). This module knows the files:
the baseline ``<root>/<tier>/[<folder>/]<cell id>.json``, the obtained result
``<cell id>.obtained.json`` beside it (git-ignored, for ``diff``), and what happens to each after
a verdict (:func:`handle`):

- without ``--update-baselines`` the baseline is never written; an ok record whose verdict is a
  mismatch (harness.verdicts.WRITES_OBTAINED) writes the obtained file, a pass removes a stale one.
- with it, a record :func:`refusal_of` refuses is not stored (a bug in today's engine never
  becomes tomorrow's baseline); any other is given to the kind, which says what changed, and a
  baseline written by :func:`save` removes the obtained file it answers.

Every file is written atomically (harness.files.atomic_write_text): a reader never sees half a
file. Runs side by side (docs/design.md, "Runs side by side") may update one baseline at once: each
update (read the old file, decide what changed, write) holds an exclusive lock on the baseline's
folder (:func:`locked`), so the later run sees the earlier one's file and says what it changed of
that, and the printed change names the run that wrote it (harness.runs.current_id).
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal, Protocol

from harness import runs, verdicts
from harness.files import atomic_write_text
from harness.records import Record


class Content(Protocol):
    """A kind of baseline, as this module needs it."""

    folder: ClassVar[str]  # the kind's subfolder of the tier's folder; "" for the tier's folder itself
    cell: str
    tier: str

    @classmethod
    def from_record(cls, record: Record, commit: str | None = None) -> Content: ...

    def to_text(self) -> str: ...


def path_for(kind: type[Content], root: str | Path, tier: str, cell_id: str) -> Path:
    return Path(root, tier, kind.folder, f"{cell_id}.json")


def obtained_path_for(kind: type[Content], root: str | Path, tier: str, cell_id: str) -> Path:
    return Path(root, tier, kind.folder, f"{cell_id}.obtained.json")


def git_commit(cwd: str | Path | None = None) -> str | None:
    """``git rev-parse HEAD`` of the checkout holding ``cwd`` (default: this package), or None."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=str(cwd or Path(__file__).resolve().parent),
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and commit else None


def refusal_of(record: Record, verdict: str | None = None) -> str | None:
    """Why ``record`` (judged ``verdict``, by default its own) must not become a baseline; None when it may."""
    verdict = verdict if verdict is not None else record.verdict
    if verdict is None:
        return f"{record.cell}: refusing to update the baseline of a record that was never compared (no verdict)"
    if verdict in verdicts.REFUSED_BASELINE:
        why = record.verdict_reason or (record.error.message if record.error else "")
        return (f"{record.cell}: refusing to update the baseline: verdict is {verdict}" + (f" ({why})" if why else "")
                + "; fix the cell (or record a known failure) first")
    if record.status != "ok":
        return f"{record.cell}: refusing to update the baseline: status is {record.status}, nothing to store"
    return None


@dataclass
class Change:
    """What regenerating did to one baseline file."""

    cell: str
    path: Path
    kind: Literal["new", "updated", "unchanged"]
    messages: list[str] = field(default_factory=list)
    run: str | None = None  # the run that wrote it (harness.runs); None outside a run

    @property
    def written(self) -> bool:
        return self.kind != "unchanged"

    def __str__(self) -> str:
        head = f"{self.path}: {self.kind}" + (f" by run {self.run}" if self.written and self.run else "")
        return "\n".join([head, *(f"  - {m}" for m in self.messages)])


@dataclass
class Outcome:
    """What handle() did after a verdict: a baseline change, an obtained file, or a refusal."""

    change: Change | None = None
    obtained: Path | None = None
    refused: str | None = None


def save(root: str | Path, content: Content, kind: Literal["new", "updated", "unchanged"],
         messages: list[str]) -> Change:
    """Write ``content`` as its cell's baseline, unless the kind found it ``unchanged``."""
    path = path_for(type(content), root, content.tier, content.cell)
    if kind != "unchanged":
        atomic_write_text(path, content.to_text())
        clear_obtained(type(content), root, content.tier, content.cell)
    return Change(content.cell, path, kind, messages, run=runs.current_id())


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the folder of the baseline ``path`` (created if missing) while the
    body reads and rewrites it: a lock on the folder, not a lock file beside the baseline, which
    would be one more file in the committed tree. Where the filesystem has no flock for a folder
    the body runs unlocked: the atomic write still leaves one whole file."""
    folder = Path(path).parent
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def write_obtained(kind: type[Content], root: str | Path, record: Record) -> Path:
    """Write the obtained result beside the baseline, in the baseline's format."""
    path = obtained_path_for(kind, root, record.tier, record.cell)
    atomic_write_text(path, kind.from_record(record, commit=git_commit()).to_text())
    return path


def clear_obtained(kind: type[Content], root: str | Path, tier: str, cell_id: str) -> None:
    obtained_path_for(kind, root, tier, cell_id).unlink(missing_ok=True)


def handle(kind: type[Content], root: str | Path, record: Record, *, update_baselines: bool,
           regenerate: Callable[[], Change], obtained_when_refused: bool = False) -> Outcome:
    """The step after a verdict for one kind: with ``update_baselines``, ``regenerate`` (which
    decides what changed and calls save()) unless the record is refused, a refusal writing the
    obtained file of an ok record when ``obtained_when_refused``; without, the obtained file."""
    if update_baselines:
        refusal = refusal_of(record)
        if refusal is None:
            with locked(path_for(kind, root, record.tier, record.cell)):
                return Outcome(change=regenerate())
        keep = obtained_when_refused and record.status == "ok"
        return Outcome(obtained=write_obtained(kind, root, record) if keep else None, refused=refusal)
    if record.status == "ok" and record.verdict in verdicts.WRITES_OBTAINED:
        return Outcome(obtained=write_obtained(kind, root, record))
    if record.verdict in verdicts.CLEARS_OBTAINED:
        clear_obtained(kind, root, record.tier, record.cell)
    return Outcome()
