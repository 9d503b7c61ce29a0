"""What third-party libraries say on their own goes to a log file, never to the user's terminal.

Importing torchao prints "Failed to load …_C_mxfp8…so" through its logger, torch logs two
``_pytree`` deprecation warnings, transformers and torch warn through ``warnings``: none of it is
about the user's command, and on the terminal it buries the one ``error:`` line a bad input gets
(docs/design.md, "Bad input and faults"). ``route()``, called once by the ``harness`` command
before anything else, sends all of it to ``log_path()``:

- the first import of each library in ``LIBRARIES`` runs with ``sys.stdout``/``sys.stderr`` and
  file descriptors 1 and 2 pointed at the log (a ``sys.meta_path`` finder wraps the library's
  loader), so output written while importing, and handlers a library creates then (torch's own
  stderr handler binds the stream it sees at that moment), land in the log;
- log records that reach the root logger, and Python warnings (``logging.captureWarnings``), are
  written to the log too.

The harness's own output (its ``error:`` line, progress, tables) is printed as before. Engine
children keep their own per-cell logs (harness.supervise).
"""
from __future__ import annotations

import contextlib
import fcntl
import importlib.abc
import logging
import os
import sys
import threading
from pathlib import Path

from harness.registry import ENGINES, methods

LOG_ENV = "HARNESS_LOG"  # a file to write the libraries' messages to (default: <repo>/.cache/logs/libraries.log)
# The libraries besides the engines' and the formats' own (harness.registry).
LIBRARIES = frozenset({"torch", "accelerate", "safetensors", "tokenizers", "huggingface_hub", "triton",
                       *(lib for spec in ENGINES.values() for lib in spec.libraries),
                       *(m.library for m in methods().values() if m.library)})
ROTATE_BYTES = 8 << 20  # beyond this the log is moved to <log>.1 when a command starts

_lock = threading.RLock()
_stream = None
_finder = None


def log_path() -> Path:
    env = os.environ.get(LOG_ENV)
    return Path(env) if env else Path(__file__).resolve().parent.parent / ".cache" / "logs" / "libraries.log"


def _rotate(path: Path) -> None:
    """Move a log past ROTATE_BYTES to ``<log>.1``, under a lock: commands starting side by side
    (docs/design.md, "Runs side by side") would otherwise each move it, the second moving the
    first one's fresh log over the old one. Every command appends (O_APPEND): their lines
    interleave whole, and one still writing to the moved file loses nothing."""
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists() and path.stat().st_size > ROTATE_BYTES:
            os.replace(path, path.with_name(path.name + ".1"))


def _open_log():
    """The log, opened once per process for appending (os.devnull when it cannot be written)."""
    global _stream
    if _stream is None:
        path = log_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.exists() and path.stat().st_size > ROTATE_BYTES:
                _rotate(path)
            _stream = open(path, "a", buffering=1, encoding="utf-8", errors="replace")
            _stream.write(f"== pid {os.getpid()}: {' '.join(sys.argv)}\n")
        except OSError:
            _stream = open(os.devnull, "w")
    return _stream


@contextlib.contextmanager
def _into_log():
    """Python's and the C level's stdout and stderr pointed at the log while the body runs."""
    log = _open_log()
    with _lock:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = []
        try:
            for fd in (1, 2):
                saved.append((fd, os.dup(fd)))
                os.dup2(log.fileno(), fd)
        except OSError:  # no such descriptors (an embedding host): Python's streams only
            pass
        streams = sys.stdout, sys.stderr
        sys.stdout = sys.stderr = log
        try:
            yield
        finally:
            sys.stdout, sys.stderr = streams
            log.flush()
            for fd, copy in saved:
                os.dup2(copy, fd)
                os.close(copy)


class _QuietLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        try:
            with _into_log():
                self.loader.exec_module(module)
        finally:  # the module keeps its own loader (importlib.resources, linecache)
            module.__loader__ = self.loader
            if module.__spec__ is not None:
                module.__spec__.loader = self.loader

    def __getattr__(self, name):
        return getattr(self.loader, name)


class _QuietFinder(importlib.abc.MetaPathFinder):
    """Finds a library's top-level package with the other finders and wraps its loader."""

    def find_spec(self, name, path=None, target=None):
        if name not in LIBRARIES or name in sys.modules:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _QuietLoader(spec.loader)
                return spec
        return None


class _LogHandler(logging.StreamHandler):
    """A handler that writes to the log (opened lazily)."""

    def __init__(self):
        super().__init__(_open_log())
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))


def route() -> None:
    """Send the libraries' messages to the log, from now on, in this process (idempotent)."""
    global _finder
    with _lock:
        if _finder is not None:
            return
        _finder = _QuietFinder()
        sys.meta_path.insert(0, _finder)
        root = logging.getLogger()
        if not any(isinstance(h, _LogHandler) for h in root.handlers):
            root.addHandler(_LogHandler())
        logging.captureWarnings(True)
