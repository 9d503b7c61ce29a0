"""Reading an untrusted file: one boundary for every file the harness reads from a checkpoint, a
matrix or a baseline (docs/design.md, "Bad input and faults").

``read_bytes(path)`` opens without blocking (``O_NONBLOCK``: a FIFO named ``config.json`` or
``model.safetensors`` never hangs the open), refuses anything that is not a regular file (a
directory, a FIFO, a socket, a device) and anything larger than ``limit`` bytes, and reads the
rest. ``read_text`` also refuses bytes that are not UTF-8, naming the offset. ``check_regular``
is the same check for files that another library opens itself (safetensors' mmap, torch.load).

Every refusal is an :class:`Unreadable` whose ``reason`` is one line (``missing``, ``is a FIFO,
not a regular file``, ``is not UTF-8 (byte 0xff at offset 3)``...); callers turn it into their own
one-line error (``CheckpointError``, ``MatrixError``, ``BaselineError``) with the path in front.

Writing has its check before the work too: :func:`write_problem` takes every path a command will
write (:class:`Written`) and says, in one line, the first that cannot be written.
"""
from __future__ import annotations

import errno
import os
import stat
import tempfile
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

# JSON and YAML files the harness reads are small; a config.json or a baseline of more than this
# is not one.
TEXT_LIMIT = 64 << 20

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


class Unreadable(Exception):
    """A file that cannot be read as what it should be. ``reason`` is one line, without the path."""

    def __init__(self, path: str | os.PathLike, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = str(path)
        self.reason = reason


def _kind(mode: int) -> str:
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def _os_reason(e: OSError) -> str:
    if e.errno == errno.ENOENT:
        return "missing"
    return f"cannot read: {e.strerror or e}"


def check_regular(path: str | os.PathLike) -> int:
    """The size of ``path`` when it is a regular file (symlinks followed); Unreadable otherwise.
    Never opens the file, so a FIFO cannot block it."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise Unreadable(path, _os_reason(e)) from None
    if not stat.S_ISREG(st.st_mode):
        raise Unreadable(path, f"is {_kind(st.st_mode)}, not a regular file")
    return st.st_size


@contextmanager
def _regular(path: str | os.PathLike):
    """An fd of a regular file, opened without blocking; (fd, stat)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if e.errno == errno.EISDIR:
            raise Unreadable(path, "is a directory, not a regular file") from None
        raise Unreadable(path, _os_reason(e)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Unreadable(path, f"is {_kind(st.st_mode)}, not a regular file")
        os.set_blocking(fd, True)
        yield fd, st
    except OSError as e:
        raise Unreadable(path, _os_reason(e)) from None
    finally:
        os.close(fd)


def read_bytes(path: str | os.PathLike, limit: int = TEXT_LIMIT) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes."""
    with _regular(path) as (fd, st):
        if st.st_size > limit:
            raise Unreadable(path, f"is {st.st_size} bytes, more than the {limit} this file may have")
        chunks, total = [], 0
        while chunk := os.read(fd, 1 << 20):
            total += len(chunk)
            if total > limit:  # it grew while being read
                raise Unreadable(path, f"is more than the {limit} bytes this file may have")
            chunks.append(chunk)
        return b"".join(chunks)


def read_range(path: str | os.PathLike, offset: int, count: int) -> bytes:
    """Up to ``count`` bytes at ``offset`` of a regular file (fewer at its end)."""
    with _regular(path) as (fd, _):
        return os.pread(fd, count, offset)


def decode_utf8(path: str | os.PathLike, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Unreadable(path, f"is not UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})") from None


def read_text(path: str | os.PathLike, limit: int = TEXT_LIMIT) -> str:
    """The UTF-8 text of a regular file of at most ``limit`` bytes."""
    return decode_utf8(path, read_bytes(path, limit))


def writable_dir_problem(path: str | os.PathLike) -> str | None:
    """Why files cannot be written under directory ``path``, or None when they can; decided
    before anything is written (docs/design.md, "Bad input and faults"). The nearest existing
    ancestor must be a directory in which a file can really be created (a probe file is created
    and removed there; permission bits alone do not tell, e.g. for root or a read-only mount)."""
    p = Path(os.path.abspath(path))
    probe = p
    while not os.path.lexists(probe) and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        return "is not a directory" if probe == p else f"cannot be created: {probe} is not a directory"
    try:
        fd, name = tempfile.mkstemp(dir=probe, prefix=".harness-write-probe-")
    except OSError as e:
        what = e.strerror or str(e)
        return f"is not writable: {what}" if probe == p else f"cannot be created in {probe}: {what}"
    os.close(fd)
    os.unlink(name)
    return None


@dataclass(frozen=True)
class Written:
    """A path a command will write: a directory that must accept new files, or (``file``) a file
    written atomically (a temporary file beside it renamed over it) or removed. ``option`` names
    where the path comes from, for the error line (``--results``, ``$HARNESS_FIXTURE_CACHE``...)."""

    path: Path
    option: str
    file: bool = False


def _replace_problem(path: Path) -> str | None:
    """Why a rename cannot put a file at ``path``, or unlink remove one, beyond what its directory
    allows: a directory is in the way, or an immutable or append-only file (EPERM on opening it for
    writing, which does not change it). EACCES is no problem: mode bits alone do not stop a rename."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot be replaced: {e.strerror or e}"
    if stat.S_ISDIR(st.st_mode):
        return "is a directory, which a file cannot replace"
    if not stat.S_ISREG(st.st_mode):
        return None  # a link, a FIFO...: the rename replaces the entry itself
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)))
    except OSError as e:
        if e.errno == errno.EPERM:
            return "cannot be replaced: it is immutable or append-only"
    return None


def write_problem(paths: Iterable[Written]) -> str | None:
    """The first of ``paths`` that cannot be written, as one line ``<path>: <what> (<option>)``,
    or None. A file's directory is checked as a directory first; each directory is probed once."""
    probed: dict[str, str | None] = {}

    def directory(p: Path) -> str | None:
        key = os.path.abspath(p)
        if key not in probed:
            probed[key] = writable_dir_problem(p)
        return probed[key]

    for w in paths:
        given = Path(w.path)
        checks: list[tuple[Path, Callable[[Path], str | None]]] = (
            [(given.parent, directory), (given, _replace_problem)] if w.file else [(given, directory)])
        for where, check in checks:
            problem = check(where)
            if problem:
                return f"{where}: {problem} ({w.option})"
    return None
