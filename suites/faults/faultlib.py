"""What every fault case asserts, and the two ways to run the ``harness`` command.

A case ends in an exit status and its exact ``error:`` line, or in an ``error`` record for its own
cell. Either way there is no traceback, nothing is written outside the results directory and the
caches, and no process of the command is left behind (docs/design.md, "Bad input and faults").

- ``in_process(argv)``: ``harness.cli.main`` in this test process, sharing its imports (most
  cases: a subprocess is not the point there);
- ``subprocess_run(argv, ...)``: the installed command in a fresh interpreter, for what only a
  process shows: the terminal, signals, the fork server and engine children. Its environment
  carries a unique marker, so every process it started can be found afterwards in ``/proc``.

And for the fuzzing of JSON files (test_fuzz.py): ``EVERY_JSON_TYPE``, one value of each JSON type,
and ``every_field_every_type(doc)``, a document with each of its fields set to each of them.
"""
from __future__ import annotations

import contextlib
import copy
import io
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HARNESS = [sys.executable, "-m", "harness.cli"]
MARK_ENV = "HARNESS_FAULT_CASE"


def matrix(schemes=("unquantized",)) -> str:
    """A small models.yaml: the tiny Llama fixture on the reference engine, with these schemes."""
    rows = "".join(f"      {s}:\n" for s in schemes)
    return f"""\
version: 1
environments:
  core:
    engines: {{reference: "0.1.0", transformers: "5.19.0"}}
defaults:
  max_tokens: 4
  top_k: 3
  timeout_s: 300
  bounds:
    unquantized: {{logprob: 1.0e-4, topk: 1.0e-4, load_time: 1.5}}
    bnb: {{logprob: 2.0e-3, topk: 2.0e-3, load_time: 1.5}}
    fp8: {{logprob: 5.0e-2, topk: 5.0e-2, load_time: 1.5}}
    torchao: {{logprob: 1.0e-2, topk: 1.0e-2, load_time: 1.5}}
models:
  llama:
    arch: LlamaForCausalLM
    fixture: llama
    prompts: fixture
    tier: cpu-tiny
    engines: {{reference: core}}
    schemes:
{rows}"""


@dataclass
class Outcome:
    code: int
    out: str
    err: str
    marker: str | None = None
    wall: float = 0.0
    ended_at: float = 0.0  # time.time() when the command had exited


def in_process(argv: list) -> Outcome:
    """``harness ARGV`` in this process. An exception escaping main() fails the test with its
    traceback, which is what a case must never produce."""
    from harness import cli

    out, err = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main([str(a) for a in argv])
        except SystemExit as e:  # argparse
            code = e.code
    return Outcome(code, out.getvalue(), err.getvalue(), wall=time.perf_counter() - t0)


def subprocess_run(argv: list, *, cwd: Path, env: dict[str, str] | None = None, timeout: float = 300) -> Outcome:
    """``python -m harness.cli ARGV`` in ``cwd`` with a fresh marker in its environment."""
    marker = uuid.uuid4().hex
    full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), MARK_ENV: marker,
            "HARNESS_LOG": str(cwd / "cache" / "libraries.log"), **(env or {})}
    t0 = time.perf_counter()
    # A shell's background job starts with SIGINT ignored, and Python then installs no handler:
    # the child starts with the default disposition, as from an interactive shell or CI.
    proc = subprocess.run([*HARNESS, *map(str, argv)], cwd=cwd, env=full, capture_output=True, text=True,
                          timeout=timeout, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return Outcome(proc.returncode, proc.stdout, proc.stderr, marker, time.perf_counter() - t0, time.time())


@contextlib.contextmanager
def cpu_hog():
    """A process busy-looping on every core while the body runs: a loaded CI agent, on which a
    process that waits for something else's CPU time answers late."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def assert_one_error(o: Outcome, code: int, line: str) -> None:
    """Exit ``code``, and stderr is exactly the one line ``line`` (no traceback, no noise)."""
    assert "Traceback" not in o.out + o.err, o.err[-3000:]
    assert o.code == code, (o.code, o.err[-2000:], o.out[-2000:])
    assert o.err == line + "\n", f"expected exactly\n{line}\ngot\n{o.err}"


def assert_clean(o: Outcome, code: int = 0) -> None:
    assert "Traceback" not in o.out + o.err, o.err[-3000:]
    assert o.code == code, (o.code, o.err[-2000:], o.out[-2000:])
    assert o.err == "", o.err


def processes_with(marker: str) -> list[int]:
    """The pids of live processes whose environment holds the marker."""
    found = []
    needle = f"{MARK_ENV}={marker}".encode()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                if needle in f.read():
                    with open(f"/proc/{entry.name}/stat") as st:
                        if st.read().split(") ", 1)[1].startswith("Z"):
                            continue  # a zombie has ended
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def assert_no_process_left(o: Outcome, within: float = 30.0) -> None:
    """No process of the command is alive; a fork server may take a moment to see its runner gone."""
    deadline = time.monotonic() + within
    while (left := processes_with(o.marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes left behind: {left}"


class Tree:
    """What a directory tree holds (path -> size, mtime), to see what a command wrote."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.files = self.snapshot()

    def snapshot(self) -> dict[str, tuple[int, int]]:
        out = {}
        if not self.root.exists():
            return out
        for dirpath, dirnames, filenames in os.walk(self.root):
            for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
                p = os.path.join(dirpath, name)
                try:
                    st = os.lstat(p)
                except OSError:
                    continue
                out[os.path.relpath(p, self.root)] = (st.st_size, st.st_mtime_ns)
        return out

    def written(self) -> list[str]:
        """Paths created, changed or removed since the snapshot."""
        now = self.snapshot()
        return sorted(p for p in set(now) | set(self.files) if now.get(p) != self.files.get(p))


def assert_written_only_under(tree: Tree, *allowed: str) -> None:
    """Everything written below ``tree.root`` lies under one of the ``allowed`` relative paths."""
    stray = [p for p in tree.written() if not any(p == a or p.startswith(a.rstrip("/") + "/") for a in allowed)]
    assert not stray, f"written outside {allowed}: {stray[:20]}"


# ------------------------------------------------------------------------- JSON documents

# One value of every JSON type Python's json reads, with the awkward ones: huge and negative
# integers, NaN and the infinities (which json writes and reads), empty and nested containers.
EVERY_JSON_TYPE = [None, True, 0, -1, 2 ** 70, 1.5, float("nan"), float("-inf"), "", "x", [], [[1, "a"]], {},
                   {"k": {"k": []}}]


NAME_MAP = 8


def _layout(value):
    """A JSON value's layout: its type, and an object's keys with the types of their values."""
    if isinstance(value, dict):
        return tuple((k, type(v)) for k, v in value.items())
    return type(value)


def _representatives(items: list) -> list:
    """Of the (key, value) items of a list (or of a map of names), the first, and the last where
    its layout differs from the first's (scored row 0 has no logprob; the other rows do)."""
    if len(items) < 2 or _layout(items[0][1]) == _layout(items[-1][1]):
        return items[:1]
    return [items[0], items[-1]]


def field_paths(doc, prefix: tuple = ()) -> list[tuple]:
    """Every field of a JSON document: each key of an object, and of a list its representative
    elements (the others have their schema). An object of more than NAME_MAP keys whose values are
    all of one type maps names to one schema (an index's weight_map, a record's loaded_state): a
    list by another name, explored the same way."""
    out = []
    if isinstance(doc, dict):
        items = list(doc.items())
        if len(items) > NAME_MAP and len({type(v) for v in doc.values()}) == 1:
            items = _representatives(items)
    elif isinstance(doc, list):
        items = _representatives(list(enumerate(doc)))
    else:
        items = []
    for key, value in items:
        out.append(prefix + (key,))
        out += field_paths(value, prefix + (key,))
    return out


def _copy_along(doc, path: tuple):
    """A copy of ``doc`` in which the containers on ``path`` are new (the rest is shared); the copy
    and the parent of the last key."""
    new = parent = copy.copy(doc)
    for p in path[:-1]:
        parent[p] = copy.copy(parent[p])
        parent = parent[p]
    return new, parent


def replaced(doc, path: tuple, value):
    """A copy of ``doc`` with the field at ``path`` set to ``value``."""
    new, parent = _copy_along(doc, path)
    parent[path[-1]] = copy.deepcopy(value)
    return new


def deleted(doc, path: tuple):
    """A copy of ``doc`` without the key at ``path`` (an object's key; a list element is left)."""
    new, parent = _copy_along(doc, path)
    if isinstance(parent, dict):
        del parent[path[-1]]
    return new


def every_field_every_type(doc):
    """``doc`` with one field changed: each field (field_paths) set to each of EVERY_JSON_TYPE,
    and each key deleted. Yields (path, what was done, the changed document)."""
    for path in field_paths(doc):
        for value in EVERY_JSON_TYPE:
            yield path, value, replaced(doc, path, value)
        if isinstance(path[-1], str):
            yield path, "deleted", deleted(doc, path)
