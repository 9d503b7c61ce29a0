"""The fork server: a process that has imported an engine's libraries once and forks one engine
child per cell, so a cell pays for its own work and not for the imports (vLLM's alone take 7-9 s).

``python -P -m harness.engines.forkserver PRELOAD LISTEN_FD`` is started by harness.supervise, one
per (preload module, environment of the children), with exactly the environment its children get.
It imports PRELOAD (harness.engines._forkserver_preload, or ._vllm_preload for vLLM), then accepts
one connection per child on the listening Unix socket it inherits as LISTEN_FD, and ends when its
stdin, a pipe from the process that started it, closes: that process has gone.

One connection per child: the client sends one JSON line ``{"job": PATH, "log": PATH, "cwd": DIR,
"main": MODULE, "env": VARS}`` (DIR: the client's working directory, the child's, in which relative paths
resolve; MODULE: what the child runs, ``harness.engines.worker`` or the module-noise child
``harness.noise_child``, whose ``main([JOB])`` it calls; VARS: variables added to the child's
environment, those read only after the fork, harness.supervise.AFTER_FORK_ENV); the child
answers ``pid N`` once it leads its own session and its log is open, the server ``exit CODE`` when the child has ended
(CODE as Popen's ``returncode``: negative for a signal).

A child is what ``python -P -m MODULE JOB`` would be (docs/design.md, "Data
flow"): the same environment (the server's and VARS), the same imports in the same
order, no Python thread and no torch op before the fork (so no thread pool to lose), its own
session, stdout and stderr to the cell's log, stdin from /dev/null, SIGKILL when the server ends,
and a normal interpreter exit (atexit handlers run).

CUDA does not survive a fork. Where the preload initialised it (bitsandbytes does on import, on a
machine with a GPU, to choose its library), each forked child executes that command instead of
returning into the preloaded interpreter: the same protocol, pid, session and log, at the cost of
the imports.
"""
from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import selectors
import signal
import socket
import sys

REQUEST_TIMEOUT_S = 10.0


def _reap(children: dict[int, socket.socket]) -> None:
    """Tell the client of every child that has ended how it ended."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:  # the client has gone
                pass
            conn.close()


def _read_request(conn: socket.socket) -> dict | None:
    conn.settimeout(REQUEST_TIMEOUT_S)
    data = b""
    try:
        while not data.endswith(b"\n"):
            chunk = conn.recv(65536)
            if not chunk:
                return None
            data += chunk
        return json.loads(data)
    except (OSError, ValueError):
        return None
    finally:
        conn.settimeout(None)


def serve(listener: socket.socket, alive: int) -> tuple[socket.socket, dict]:
    """Fork a child per request until ``alive`` reads end-of-file (then exit). Returns only in a
    child: its connection and request, with nothing of the server's left open."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    children: dict[int, socket.socket] = {}
    sel = selectors.DefaultSelector()
    for obj in (listener, alive, wake_r):
        sel.register(obj, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select():
            if key.fileobj == alive:
                os._exit(0)  # the children end with this process (worker.die_with_parent)
            if key.fileobj == wake_r:
                os.read(wake_r, 4096)
                _reap(children)
                continue
            conn, _ = listener.accept()
            request = _read_request(conn)
            if request is None:
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                sel.close()
                listener.close()
                for fd in (wake_r, wake_w, alive):
                    os.close(fd)
                for other in children.values():
                    other.close()
                return conn, request
            children[pid] = conn


def become_child(conn: socket.socket, request: dict, server: int) -> list[str]:
    """In a child forked by the server (pid ``server``): its own session (told to the client),
    stdio as a spawned child's, and the child module's command line. Returns its arguments."""
    # lazy: pydantic, yaml, +230 ms (scripts/import-graph --costs)
    from harness.engines import worker

    worker.die_with_parent()
    if os.getppid() != server:  # the server ended before the child could ask to die with it
        os._exit(1)
    os.setsid()
    # The last exit handler of a worker that raises (one that returns ends with os._exit): the
    # interpreter's final collection then frees the server's frozen objects as a fresh process's
    # would (left frozen, triton's bindings print "leaked" warnings).
    atexit.register(gc.unfreeze)
    os.chdir(request["cwd"])
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    # the pid last: a client that has it can count on the log (an interrupted cell's is read)
    conn.sendall(f"pid {os.getpid()}\n".encode())
    conn.close()
    sys.argv = [importlib.import_module(request["main"]).__file__, request["job"]]
    return sys.argv[1:]


def cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


def main() -> int:
    preload, listen_fd = sys.argv[1], int(sys.argv[2])
    listener = socket.socket(fileno=listen_fd)
    importlib.import_module(preload)
    fresh_children = cuda_initialised()
    # The imports leave ~600k objects the collector tracks. Unfrozen, a child's first full
    # collection walks them all and writes to their pages (copy-on-write): ~350 ms, landing in
    # whichever step of the child crosses the collector's threshold (a timed load, on a gated tier).
    gc.freeze()
    server = os.getpid()
    conn, request = serve(listener, sys.stdin.fileno())
    args = become_child(conn, request, server)
    if fresh_children:
        os.execv(sys.executable, [sys.executable, "-P", "-m", request["main"], *args])
    return importlib.import_module(request["main"]).main(args)


if __name__ == "__main__":
    sys.exit(main())
