"""Engine child processes: start, wait under a timeout, end, and turn what they left into a record.

Every engine runs a cell in a child process (harness.engines.worker), in its own process group
with its own log. By default the child is forked from a fork server that has already imported
torch, transformers and the harness (``multiprocessing``'s "forkserver", started once per process
that runs cells: ``harness run``, each pytest-xdist worker): ~1 s per cell instead of the imports'
several seconds, records bit-identical to a fresh interpreter's. ``HARNESS_ISOLATION=spawn``
starts ``python -m harness.engines.worker`` instead; engines that need a fresh interpreter (vLLM)
and environments that set variables always get one.

A timeout (SIGTERM, then SIGKILL to the process group), a crash (a signal, an exit without a
record) or an unreadable record becomes an ``error`` record carrying the end of the child's log
(:func:`child_record`). :class:`Supervisor` ends every running child on an interrupt.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from harness import records as R

REPO_ROOT = Path(__file__).resolve().parent.parent
LOG_TAIL_CHARS = 4000
KILL_GRACE_S = 3.0
THREADS_ENV = "HARNESS_TORCH_THREADS"
ISOLATION_ENV = "HARNESS_ISOLATION"  # "fork" (default): children forked from a preloaded fork server; "spawn"
# Test-only (never set it outside tests): "SIGNAME@STAGE" makes this process send itself SIGNAME
# when it reaches STAGE, one of STAGES: how the fault suite interrupts a run at each stage.
SIGNAL_HOOK_ENV = "HARNESS_TEST_SIGNAL"
STAGES = ("fork-server-start", "cell-running", "report-writing")
SPAWN_ENGINES = frozenset({"vllm"})  # engines that always get a fresh interpreter


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
            os.kill(os.getpid(), getattr(signal, sig))


@contextlib.contextmanager
def _signals_held():
    """SIGINT and SIGTERM held back while the body runs (main thread only): a child is started and
    registered, or not started at all, so an interrupt can always end it (docs/design.md, "Bad
    input and faults"). A signal that arrives meanwhile is noted and sent again when the body ends.
    (A signal mask would not do: multiprocessing unblocks both while it starts its resource
    tracker.)"""
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


def _stop_fork_server() -> None:
    """End the fork server this process started (it may still be importing its preload)."""
    if _FORK_CONTEXT is None:
        return
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


_FORK_LOCK = threading.Lock()
_FORK_CONTEXT = None


def _fork_context():
    """multiprocessing's "forkserver", preloaded with torch, transformers and the harness
    (harness.engines._forkserver_preload). A forked child is as isolated as a spawned one: its own
    address space and process group, its own log; nothing it does reaches the next cell."""
    global _FORK_CONTEXT
    with _FORK_LOCK:
        if _FORK_CONTEXT is None:
            import multiprocessing

            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(["harness.engines._forkserver_preload"])
            _FORK_CONTEXT = ctx
        return _FORK_CONTEXT


def uses_fork_server(engine: str, environment_env: dict[str, str]) -> bool:
    """Fork the child from the preloaded fork server, unless HARNESS_ISOLATION=spawn, the engine
    needs a fresh interpreter (vLLM), or the environment sets variables that libraries read at
    import time."""
    mode = os.environ.get(ISOLATION_ENV, "fork")
    if mode not in ("fork", "spawn"):
        raise ValueError(f"{ISOLATION_ENV}={mode!r}: expected 'fork' or 'spawn'")
    return mode == "fork" and sys.platform == "linux" and engine not in SPAWN_ENGINES and not environment_env


def child_env(environment_env: dict[str, str], threads: int) -> dict[str, str]:
    """The child's environment: ours, the matrix environment's variables, one torch thread count.
    ``HARNESS_DEVICE`` comes only from the matrix environment (models.yaml's ``cuda-check``), never
    from the caller's shell, so no other environment's cells run, or get baselines, on a GPU."""
    env = dict(os.environ)
    env.pop("HARNESS_DEVICE", None)
    env.update(environment_env)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


class Child:
    """An engine child: forked from the fork server, or spawned as ``python -m harness.engines.worker``.
    Either way it leads its own process group, which kill() ends whole."""

    def __init__(self, proc, fork: bool):
        self.proc = proc
        self.fork = fork

    @classmethod
    def start(cls, job_path: Path, log: Path, env: dict[str, str], fork: bool) -> Child:
        if fork:
            from harness.engines import worker

            proc = _fork_context().Process(target=worker.forked_main, args=(str(job_path), str(log), env, os.getpid()),
                                           name=f"harness-{job_path.stem}")
            stage("fork-server-start")
            proc.start()
            return cls(proc, True)
        with open(log, "w") as logf:
            proc = subprocess.Popen([sys.executable, "-m", "harness.engines.worker", str(job_path)],
                                    stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                    env=env, cwd=str(REPO_ROOT), start_new_session=True)
        return cls(proc, False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait(self, timeout: float | None) -> int | None:
        """The exit status (negative: killed by that signal), or None when ``timeout`` passed."""
        if self.fork:
            self.proc.join(timeout)
            return self.proc.exitcode
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """SIGTERM to the child's process group, SIGKILL after a grace period."""
        for sig, grace in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.pid, sig)
            except (ProcessLookupError, PermissionError):
                if self.fork and self.proc.exitcode is None:
                    self.proc.kill()  # not yet its own group leader
            if self.wait(grace) is not None:
                return


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

    def run(self, job: dict, job_path: Path, log: Path, env: dict[str, str], *, fork: bool, timeout: float) -> Exit:
        """Write the job, start its child and wait for it under ``timeout``."""
        R.atomic_write_text(job_path, json.dumps(job) + "\n")
        log.parent.mkdir(parents=True, exist_ok=True)
        started = R.utc_now()
        t0 = time.perf_counter()
        with self._lock:
            if self._stopping:
                raise KeyboardInterrupt("the run was interrupted")
            with _signals_held():
                child = Child.start(job_path, log, env, fork=fork)
                self._children.add(child)
        try:
            stage("cell-running")
            code = child.wait(timeout)
        except BaseException:
            child.kill()
            raise
        finally:
            with self._lock:
                self._children.discard(child)
        if code is None:
            child.kill()
        return Exit(code, started, time.perf_counter() - t0)

    def kill_all(self) -> None:
        with self._lock:
            self._stopping = True
            children = list(self._children)
        for child in children:
            child.kill()
        _stop_fork_server()


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
