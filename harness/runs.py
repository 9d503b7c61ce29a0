"""Which run a results directory belongs to (docs/design.md, "Runs side by side").

A *run* is one ``harness run`` or ``harness bisect``, or one pytest session with all its xdist
workers. Several may start at once on one checkout (two terminals, a Buildkite agent running two
jobs, a script starting a run per engine); each must keep its records to itself. So a run owns the
results directory it writes, and claims it before any cell runs:

- a default directory (``results/<prefix><UTC stamp>``, harness.layout.default_results_dir) is
  created with ``mkdir``, which fails when the name exists: a second run in the same second takes
  ``<stamp>-2``, never the same directory;
- the claim is the mark ``.harness-run`` in the directory (JSON: the run's id, pid, host, start
  and command), put in place with ``os.link`` from a complete temporary file: a link never
  replaces an existing file, so of two runs claiming one directory exactly one mark appears,
  whole, and the other run is refused. A directory holding another run's mark, or files no run
  claimed, is refused too (:class:`Refused`, one line saying how to reuse it on purpose);
- every process of the run holds a shared ``flock`` on the mark for its life (the kernel drops it
  when the process ends, however it ends), so a refused run can say whether the owner still runs.

:func:`current_id` names the run this process belongs to; harness.store writes it into the line
a baseline change prints, so that of two runs updating one baseline each says which wrote it.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import socket
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from harness.errors import UsageError
from harness.files import writable_dir_problem
from harness.layout import default_results_dir

MARK = ".harness-run"

# the run this process belongs to, and the marks it holds its shared lock on (path -> descriptor)
_current: Run | None = None
_held: dict[Path, int] = {}


class Refused(UsageError):
    """A results directory this run may not write: one line, printed as ``error: <line>``."""


@dataclass(frozen=True)
class Run:
    id: str
    pid: int
    host: str
    started: str  # ISO 8601 UTC
    command: str

    @classmethod
    def new(cls, command: str) -> Run:
        """A new run of this process. The id is unique on its own (time, pid and a random part:
        two containers sharing a checkout may give their runs the same pid)."""
        now = datetime.now(timezone.utc)
        pid = os.getpid()
        return cls(f"{now:%Y%m%dT%H%M%SZ}-{pid}-{secrets.token_hex(2)}", pid, socket.gethostname(),
                   now.isoformat(timespec="seconds").replace("+00:00", "Z"), command)

    def describe(self) -> str:
        return f"run {self.id} ({self.command}, pid {self.pid} on {self.host}, started {self.started})"


def current_id() -> str | None:
    """The id of the run this process belongs to; None outside a run (a unit test, harness report)."""
    return _current.id if _current is not None else None


def create(run: Run, base: str | Path = "results", prefix: str = "") -> Path:
    """A new results directory of its own for ``run`` (under ``base``), claimed."""
    problem = writable_dir_problem(base)
    if problem:
        raise Refused(f"{base}: {problem} (--results)")
    path = default_results_dir(base, prefix)
    claim(path, run)
    return path


def claim(path: str | Path, run: Run) -> None:
    """Make ``path`` (created if missing) ``run``'s results directory, or raise Refused when it
    holds another run's mark or files no run claimed. Claiming a directory twice is a no-op."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise Refused(f"{path}: {writable_dir_problem(path) or e.strerror or e} (--results)") from None
    owner = owner_of(path)
    if owner is None:
        strangers = sorted(p.name for p in path.iterdir() if not p.name.startswith(MARK))
        if strangers:
            raise Refused(f"{path}: holds files that no run claimed ({', '.join(strangers[:3])}"
                          f"{', ...' if len(strangers) > 3 else ''}); give a new or empty --results directory, "
                          f"or leave --results out (to reuse this one on purpose, remove it first: rm -r {path})")
        owner = _put_mark(path, run)
    if owner.id != run.id:
        raise Refused(_taken(path, owner))
    _hold(path, run)


def join(path: str | Path, run_id: str) -> None:
    """This process (a pytest-xdist worker) is part of run ``run_id``, which claimed ``path``."""
    path = Path(path)
    owner = owner_of(path)
    if owner is None or owner.id != run_id:
        raise Refused(f"{path}: not claimed by this session's run {run_id}"
                      + (f" but by {owner.describe()}" if owner else "") + " (--results)")
    _hold(path, owner)


def owner_of(path: Path) -> Run | None:
    """The run whose mark is in ``path``; None when there is none."""
    try:
        data = json.loads((path / MARK).read_text(encoding="utf-8"))
        return Run(**data)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as e:  # not a mark this harness writes: nobody's to take over
        return Run("unknown", 0, "?", "?", f"an unreadable mark: {e}")


def alive(path: Path) -> bool:
    """Whether a process of the run that marked ``path`` still runs (holds its shared lock)."""
    try:
        fd = os.open(path / MARK, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError as e:
        return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)  # drops the probe's lock with it


def release(path: str | Path) -> None:
    """This process is done with ``path`` (a command run inside a test's process, which goes on)."""
    global _current
    fd = _held.pop(Path(path), None)
    if fd is not None:
        os.close(fd)
    if not _held:
        _current = None


def discard_if_unused(path: str | Path, run: Run) -> None:
    """Remove a directory that ``run`` created and wrote nothing into but its mark (a pytest
    session that ran no cell, a run refused after its default directory was made)."""
    path = Path(path)
    with contextlib.suppress(OSError):
        owner = owner_of(path)
        if owner is not None and owner.id == run.id and [p.name for p in path.iterdir()] == [MARK]:
            release(path)
            (path / MARK).unlink()
            path.rmdir()


def _put_mark(path: Path, run: Run) -> Run:
    """Link a complete mark of ``run`` into ``path``; the owner afterwards (another run's mark, if
    one was linked first)."""
    tmp = path / f"{MARK}.{run.pid}.{secrets.token_hex(4)}.tmp"
    tmp.write_text(json.dumps(asdict(run), indent=1) + "\n", encoding="utf-8")
    try:
        os.link(tmp, path / MARK)
    except FileExistsError:
        return owner_of(path) or run
    finally:
        tmp.unlink()
    return run


def _hold(path: Path, run: Run) -> None:
    """Hold the shared lock on ``path``'s mark for this process's life, and belong to ``run``."""
    global _current
    _current = run
    if path not in _held:
        fd = os.open(path / MARK, os.O_RDONLY | os.O_CLOEXEC)
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while another run's alive() probes it
        _held[path] = fd


def _taken(path: Path, owner: Run) -> str:
    if alive(path):
        return (f"{path}: {owner.describe()} is writing its results here; give another --results "
                "directory, or leave --results out for a new one")
    return (f"{path}: holds the results of {owner.describe()}; give another --results directory, or leave "
            f"--results out (to reuse this one on purpose, remove it first: rm -r {path})")
