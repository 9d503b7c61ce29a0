"""Engine child processes: start, wait under a timeout, end, and turn what they left into a record.

Every engine runs a cell in a child process (harness.engines.worker), in its own process group
with its own log. By default the child is forked from a fork server (harness.engines.forkserver)
that has already imported the engine's libraries: torch, transformers and the harness for every
engine, vLLM too for vLLM. A server serves one (preload, environment) pair, so it has exactly the
environment its children get, a matrix environment's ``env:`` included; it is started when the run
starts (its imports overlap the first cells) or on the first cell that needs it, and ends with the
process that started it. A cell then costs its own work: ~1 s of start instead of the imports'
several seconds (vLLM's 7-9 s), with records bit-identical to a fresh interpreter's
(tests/test_vllm_server.py). Where the preload initialised CUDA (bitsandbytes' import does on a
GPU machine) the server executes each child afresh, as CUDA does not survive a fork
(harness.engines.forkserver). ``HARNESS_ISOLATION=spawn`` starts ``python -m harness.engines.worker``
instead.

A timeout (SIGTERM, then SIGKILL to the process group), a crash (a signal, an exit without a
record) or an unreadable record becomes an ``error`` record carrying the end of the child's log
(:func:`child_record`). :class:`Supervisor` ends every running child on an interrupt, and the fork
servers with them.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from harness import files
from harness import records as R
from harness.registry import DEFAULT_PRELOAD, ENGINES

REPO_ROOT = Path(__file__).resolve().parent.parent
LOG_TAIL_CHARS = 4000
KILL_GRACE_S = 3.0
THREADS_ENV = "HARNESS_TORCH_THREADS"
ISOLATION_ENV = "HARNESS_ISOLATION"  # "fork" (default): children forked from a preloaded fork server; "spawn"
# Test-only (never set it outside tests): "SIGNAME@STAGE" makes this process send itself SIGNAME
# when it reaches STAGE, one of STAGES: how the fault suite interrupts a run at each stage; with
# SIGNAL_STAMP_ENV naming a file, the hook first writes there when it sent it (time.time()), which
# the fault suite measures the answer against.
SIGNAL_HOOK_ENV = "HARNESS_TEST_SIGNAL"
# A file to which every engine child and fork server started appends one JSON line (what it ran and
# for how long, and the pytest test that started it): the test suite's count of what it spawns.
LEDGER_ENV = "HARNESS_CHILD_LEDGER"
SIGNAL_STAMP_ENV = "HARNESS_TEST_SIGNAL_STAMP"
STAGES = ("fork-server-start", "cell-running", "report-writing")
SERVER_REPLY_TIMEOUT_S = 600.0  # a fork server answers once its preload is imported
# A harness run needs one per engine environment, and its localisation one per set of kernels it
# measures module noise under (harness.measure_noise): ~0.5-1 GB each.
MAX_SERVERS = 6
# Variables a child reads only after the fork, never a preload: the test hooks and vLLM mutations
# (harness.engines.worker, harness.engines.vllm_mutations). They travel in the fork request instead
# of keying the server, so a test that plants a fault shares the fork servers of every other test.
AFTER_FORK_ENV = ("HARNESS_TEST_HOOK", "HARNESS_VLLM_MUTATION", "HARNESS_VLLM_MASK_LAYER")
WORKER = "harness.engines.worker"  # what a child runs unless told otherwise


def tail(path: Path, chars: int = LOG_TAIL_CHARS) -> str:
    """The end of a log file, from a line start, marked with … when cut."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - chars))
            data = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    if size > chars:
        data = "…" + data[data.find("\n") + 1:] if "\n" in data else "…" + data
    return data


def stage(name: str) -> None:
    """A stage of the run that SIGNAL_HOOK_ENV may name (test-only)."""
    spec = os.environ.get(SIGNAL_HOOK_ENV)
    if spec:
        sig, _, at = spec.partition("@")
        if at == name:
            if os.environ.get(SIGNAL_STAMP_ENV):
                Path(os.environ[SIGNAL_STAMP_ENV]).write_text(repr(time.time()))
            os.kill(os.getpid(), getattr(signal, sig))


@contextlib.contextmanager
def _signals_held():
    """SIGINT and SIGTERM held back while the body runs (main thread only): a child is started and
    registered, or not started at all, so an interrupt can always end it (docs/design.md, "Bad
    input and faults"). The body takes milliseconds (a fork and exec, or a request sent to a fork
    server), never a wait for a fork server's imports. A signal that arrives meanwhile is noted and
    sent again when the body ends. (A signal mask would not do: the processes started meanwhile
    would inherit it.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    held = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in held}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if caught:
            os.kill(os.getpid(), caught[0])


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def ledger(kind: str, **fields) -> None:
    """One line in LEDGER_ENV's file, when it is set: appended whole (O_APPEND), so the processes of
    a test session can share the file."""
    path = os.environ.get(LEDGER_ENV)
    if path:
        line = json.dumps({"kind": kind, "test": os.environ.get("PYTEST_CURRENT_TEST"), **fields}) + "\n"
        with open(path, "a") as f:
            f.write(line)


def repeats(entries: list[dict]) -> list[dict]:
    """The ledger's children that ran a job another child had already run in the same environment:
    the engine time that sharing records between tests could still save."""
    seen, out = set(), []
    for entry in entries:
        if entry["kind"] == "child":
            work = (entry["work"], entry["environment"])
            if work in seen:
                out.append(entry)
            seen.add(work)
    return out


def preload_for(engine: str) -> str | None:
    """The preload module of the fork server that forks the engine's children, or None when they
    are spawned (``HARNESS_ISOLATION=spawn``, or not Linux)."""
    mode = os.environ.get(ISOLATION_ENV, "fork")
    if mode not in ("fork", "spawn"):
        raise ValueError(f"{ISOLATION_ENV}={mode!r}: expected 'fork' or 'spawn'")
    if mode == "spawn" or sys.platform != "linux":
        return None
    return ENGINES[engine].preload if engine in ENGINES else DEFAULT_PRELOAD


def child_env(environment_env: dict[str, str], threads: int) -> dict[str, str]:
    """The child's environment: ours, the matrix environment's variables, one torch thread count.
    ``HARNESS_DEVICE`` comes only from the matrix environment (models.yaml's ``cuda-check``), never
    from the caller's shell, so no other environment's cells run, or get baselines, on a GPU."""
    env = dict(os.environ)
    env.pop("HARNESS_DEVICE", None)
    # pytest names the running test phase here: it changes at every test, and a fork server serves
    # one environment, so under pytest each test would start its own (tens of seconds of imports)
    env.pop("PYTEST_CURRENT_TEST", None)
    env.update(environment_env)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


class Child:
    """An engine child. It leads its own process group, which kill() ends whole."""

    pid: int | None

    def wait(self, timeout: float | None) -> int | None:
        """The exit status (negative: killed by that signal), or None when ``timeout`` passed."""
        raise NotImplementedError

    def started(self) -> None:
        """Wait until the child has a pid (a spawned child has one at once)."""

    def kill(self) -> None:
        """SIGTERM to the child's process group, SIGKILL after a grace period."""
        for sig, grace in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 10.0)):
            if self.pid is not None:
                try:
                    os.killpg(self.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            if self.wait(grace) is not None:
                return


class Spawned(Child):
    """``python -P -m MAIN JOB`` in a new session, in our working directory (relative paths in the
    job mean what they mean here); ``-P``: the harness comes from PYTHONPATH (child_env), never from
    that directory."""

    def __init__(self, job_path: Path, log: Path, env: dict[str, str], python: str, main: str):
        with open(log, "w") as logf:
            self.proc = subprocess.Popen([python, "-P", "-m", main, str(job_path)],
                                         stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)
        self.pid = self.proc.pid

    def wait(self, timeout: float | None) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None


class Forked(Child):
    """A child forked by a fork server, which reports on the child's connection its pid (once it
    leads its own session) and then its exit status. It is registered with the Supervisor as soon
    as its request is sent, before the server has answered (a server still importing its preload
    answers seconds later), so an interrupt meanwhile is answered at once: the child is abandoned
    (kill()) and the server's stop ends whatever it forks."""

    def __init__(self, conn: socket.socket, server: ForkServer, log: Path):
        self.conn = conn
        self.server = server
        self.log = log
        self.pid = None
        self.code: int | None = None
        self._ended_by_server = False
        self._buffer = b""

    def _message(self, timeout: float | None) -> tuple[str, int] | None:
        """The next message (``pid N`` or ``exit CODE``), or None when ``timeout`` passed.
        The server gone without a word: its children were killed with it (worker.die_with_parent)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            try:
                self.conn.settimeout(left)
                chunk = self.conn.recv(4096)
            except TimeoutError:
                return None
            except OSError:  # closed by kill() from another thread
                chunk = b""
            if not chunk:
                return ("exit", -signal.SIGKILL)
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        what, _, value = line.decode().partition(" ")
        return what, int(value)

    def _read(self, timeout: float | None) -> bool:
        """Read and apply the next message; False when ``timeout`` passed first."""
        message = self._message(timeout)
        if message is None:
            return False
        if message[0] == "pid":
            self.pid = message[1]
        else:
            self._ended(message[1])
        return True

    def started(self) -> None:
        """Wait for the pid (interruptible: no signal is held meanwhile); a server that ended or
        never answered leaves the reason in the log, an abandoned child (kill()) nothing."""
        stage("fork-server-start")
        if self.pid is None and self.code is None and not self._read(SERVER_REPLY_TIMEOUT_S):
            self._ended(1)
        if self.pid is None and self._ended_by_server:
            with open(self.log, "a") as f:
                f.write("harness: the fork server ended or did not answer before this cell's child started\n")

    def _ended(self, code: int, by_server: bool = True) -> None:
        """Note how the child ended, once: kill() from another thread may race the waiting one."""
        with _SERVERS_LOCK:
            if self.code is not None:
                return
            self.code = code
            self._ended_by_server = by_server
            self.server.children -= 1
        with contextlib.suppress(OSError):
            self.conn.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked reading it
        self.conn.close()

    def wait(self, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.code is None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._read(left):
                return None
        return self.code

    def kill(self) -> None:
        """A child not forked yet is abandoned: there is nothing to signal, and waiting for it
        could take the server's whole import; the server's stop ends it if it is forked anyway."""
        if self.pid is None:
            self._ended(-signal.SIGKILL, by_server=False)
            return
        super().kill()


class ForkServer:
    """A harness.engines.forkserver process: it has the environment of the children it forks and
    ends when this process ends (its stdin is our pipe) or on stop()."""

    def __init__(self, preload: str, env: dict[str, str], python: str):
        self.children = 0  # running or being forked (under _SERVERS_LOCK)
        self.address = f"\0harness-forkserver-{os.getpid()}-{secrets.token_hex(8)}"  # abstract: no file
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(self.address)
            listener.listen(64)
            alive, self._alive = os.pipe()
            try:
                self.proc = subprocess.Popen(
                    [python, "-P", "-m", "harness.engines.forkserver", preload, str(listener.fileno())],
                    stdin=alive, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=str(REPO_ROOT),
                    start_new_session=True, pass_fds=(listener.fileno(),))
            finally:
                os.close(alive)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def fork(self, job_path: Path, log: Path, main: str, env: dict[str, str]) -> Forked:
        """Ask for a child running ``main`` with ``env`` added to the server's environment (the
        AFTER_FORK_ENV variables), counted in ``children`` by :func:`fork_server`, without waiting
        for the answer (Forked.started)."""
        conn = socket.socket(socket.AF_UNIX)
        child = Forked(conn, self, log)
        try:
            conn.connect(self.address)
            request = {"job": str(job_path), "log": str(log), "cwd": os.getcwd(), "main": main, "env": env}
            conn.sendall(json.dumps(request).encode() + b"\n")
        except OSError:
            pass  # started() then finds the connection closed
        return child

    def stop(self) -> None:
        self.proc.kill()
        if self._alive is not None:
            os.close(self._alive)
            self._alive = None
        self.proc.wait()


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


_SERVERS: dict[tuple[str, str, tuple[tuple[str, str], ...]], ForkServer] = {}
_SERVERS_LOCK = threading.Lock()


def fork_server(preload: str, env: dict[str, str], *, for_child: bool = False, python: str | None = None) -> ForkServer:
    """This process's fork server for the preload module, the children's environment and their
    interpreter (``python``: a candidate build's environment, harness.candidates; default ours), started
    now (in the background: its imports overlap whatever runs meanwhile) unless it is running;
    ``for_child``: counted as forking a child until that child has ended. A process whose
    environment keeps changing (tests) keeps at most MAX_SERVERS: the idle ones asked for least
    recently end, so its most used environment keeps its server."""
    python = python or sys.executable
    env = {k: v for k, v in env.items() if k not in AFTER_FORK_ENV}
    key = (preload, python, tuple(sorted(env.items())))
    with _SERVERS_LOCK:
        server = _SERVERS.pop(key, None)
        if server is not None and not server.alive():  # ended (killed from outside): replaced
            server.stop()
            server = None
        if server is None:
            idle = [k for k, s in _SERVERS.items() if s.children == 0]
            for old in idle[:max(0, len(_SERVERS) + 1 - MAX_SERVERS)]:
                _SERVERS.pop(old).stop()
            server = ForkServer(preload, env, python)
            ledger("fork-server", preload=preload, python=python, environment=_digest(repr(key)))
        _SERVERS[key] = server  # last: the order is of the latest use
        server.children += for_child
        return server


def stop_fork_servers() -> None:
    with _SERVERS_LOCK:
        servers = list(_SERVERS.values())
        _SERVERS.clear()
    for server in servers:
        server.stop()


def start_child(job_path: Path, log: Path, env: dict[str, str], preload: str | None, python: str | None = None,
                main: str = WORKER) -> Child:
    """Fork the child running ``main`` from the preload's fork server, or spawn it when ``preload``
    is None, under ``python`` (default ours); a forked child has its pid only after Child.started."""
    if preload is None:
        return Spawned(job_path, log, env, python or sys.executable, main)
    after_fork = {k: env[k] for k in AFTER_FORK_ENV if k in env}
    return fork_server(preload, env, for_child=True, python=python).fork(job_path, log, main, after_fork)


@dataclass
class Exit:
    """How a child ended: its exit status (None: it ran past the timeout and was killed)."""

    code: int | None
    started: str  # ISO 8601 UTC
    wall: float  # seconds


class Supervisor:
    """Runs engine children, one per call of :meth:`run`, from any number of threads; after
    :meth:`kill_all` (an interrupted run) it ends them all and starts no more."""

    def __init__(self):
        self._children: set[Child] = set()
        self._stopping = False
        self._lock = threading.Lock()

    def run(self, job: dict, job_path: Path, log: Path, env: dict[str, str], *, preload: str | None,
            timeout: float, python: str | None = None, main: str = WORKER) -> Exit:
        """Write the job, start its child running ``main`` (under ``python``, default ours) and wait
        for it under ``timeout``."""
        files.atomic_write_text(job_path, json.dumps(job) + "\n")
        log.parent.mkdir(parents=True, exist_ok=True)
        started = R.utc_now()
        t0 = time.perf_counter()
        with self._lock:
            if self._stopping:
                raise KeyboardInterrupt("the run was interrupted")
            with _signals_held():
                child = start_child(job_path, log, env, preload, python, main)
                self._children.add(child)
        try:
            child.started()
            waited = time.perf_counter() - t0  # for a forked child, a cold fork server's imports among it
            stage("cell-running")
            code = child.wait(timeout)
        except BaseException:
            child.kill()
            raise
        finally:
            with self._lock:
                self._children.discard(child)
        if self._stopping:  # kill_all() from another thread (-j): a killed child leaves no record
            raise KeyboardInterrupt("the run was interrupted")
        if code is None:
            child.kill()
        seconds = time.perf_counter() - t0
        cell = job.get("cell") or {}  # a cell's job; a test's own child may run several
        # environment and work: what tells a child computing what another of the session already did
        ledger("child", engine=cell.get("engine"), mode=job.get("mode", main), cell=cell.get("id"),
               seconds=round(seconds, 2), waited=round(waited, 2), forked=preload is not None,
               python=python or sys.executable, environment=_digest(repr(sorted(env.items()))),
               work=_digest(json.dumps([job.get(k) for k in ("mode", "cell", "sequences", "threads")], default=str)))
        return Exit(code, started, seconds)

    def kill_all(self) -> None:
        with self._lock:
            self._stopping = True
            children = list(self._children)
        for child in children:
            child.kill()
        stop_fork_servers()


def child_record(cell, exit: Exit, record_path: Path, info_path: Path, log: Path, *,
                 record_expected: bool = True) -> R.Record | None:
    """The record a child left at ``record_path`` (with its wall time and, on an engine error,
    the log tail), or an ``error`` record for a timeout, a crash or a missing or unreadable
    record. None when the child exited cleanly without a record it was not expected to write
    (a continuation-only child)."""
    if exit.code is None:
        error = ("Timeout", f"the {cell.engine} engine child did not finish within the cell's timeout_s "
                            f"({cell.timeout_s:g} s) and was killed")
    elif exit.code != 0:
        what = f"was killed by {_signal_name(exit.code)}" if exit.code < 0 else f"exited with status {exit.code}"
        error = ("EngineCrashed", f"the {cell.engine} engine child {what} without a record")
    elif not record_path.exists():
        if not record_expected:
            return None
        error = ("EngineCrashed", f"the {cell.engine} engine child exited without writing a record")
    else:
        try:
            rec = R.load(record_path)
        except R.RecordError as e:
            error = ("EngineCrashed", f"the {cell.engine} engine child wrote an unreadable record: {e}")
        else:
            update: dict = {"duration_s": exit.wall}
            if rec.error is not None:
                update["error"] = rec.error.model_copy(update={"log_tail": tail(log)})
            return rec.model_copy(update=update)
    info = R.EngineInfo(name=cell.engine, environment=cell.environment, platform=R.cpu_platform())
    try:
        info = R.EngineInfo.model_validate(json.loads(info_path.read_text()))
    except (OSError, ValueError):
        pass
    return R.Record.for_cell(cell, engine_info=info, status="error",
                             error=R.ErrorInfo(type=error[0], message=error[1], log_tail=tail(log)),
                             started_at=exit.started, duration_s=exit.wall)
