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
write (:class:`Written`) and says, in one line, the first that cannot be written. Every file the
harness writes is written whole or not at all (:func:`atomic_write_text`), and its records and
baselines in one JSON layout made for review in a diff (:func:`render_json`).
"""
from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


# ---- writing ------------------------------------------------------------------------------


def is_version(value: Any, version: int) -> bool:
    """Whether a file's ``schema_version`` is ``version``: the JSON integer (``true`` and ``1.0`` are not)."""
    return type(value) is int and value == version


def _has_dict(obj: Any) -> bool:
    if isinstance(obj, dict):
        return True
    if isinstance(obj, (list, tuple)):
        return any(_has_dict(x) for x in obj)
    return False


def _inline(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(", ", ": "))


def render_json(obj: Any, _level: int = 0) -> str:
    """Pretty JSON for review in a diff: keys in the order given (never re-sorted), mappings one
    key per line, a list of plain values on one line, and a list of flat mappings (rows, e.g. one
    sequence position each) one row per line. Floats are written in Python's shortest
    round-trip form, so a rewrite of unchanged numbers is byte-identical."""
    text = _render(obj, _level)
    return text + "\n" if _level == 0 else text


def _render(obj: Any, level: int) -> str:
    pad, inner = "  " * level, "  " * (level + 1)
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        items = [f"{inner}{json.dumps(str(k), ensure_ascii=False)}: {_render(v, level + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, (list, tuple)):
        if not _has_dict(obj):
            return _inline(obj)
        if all(isinstance(x, dict) and not any(_has_dict(v) for v in x.values()) for x in obj):
            return "[\n" + ",\n".join(inner + _inline(x) for x in obj) + "\n" + pad + "]"
        return "[\n" + ",\n".join(inner + _render(x, level + 1) for x in obj) + "\n" + pad + "]"
    return _inline(obj)


def _umask() -> int:
    """The process's umask, read without changing it (other threads may be creating files)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_text(path: Path, text: str) -> None:
    """Write to a temp file in the same directory, fsync, then os.replace over ``path``.
    On any failure the old file is left as it was and the temp file is removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; a written file gets the normal mode
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
