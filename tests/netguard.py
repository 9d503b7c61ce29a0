"""A network guard for tests: a ``sitecustomize`` that makes every process started with it refuse,
and log, any attempt to reach another machine (IPv4/IPv6 connect, name resolution).

``install(directory, log)`` writes the sitecustomize into ``directory`` and returns the
environment variables that activate it: ``PYTHONPATH`` with ``directory`` first, and the log file
the guarded processes append one line per attempt to. Engine children inherit both (the runner
prepends the repo to PYTHONPATH and keeps the rest). Unix sockets (the fork server's) and
loopback connections stay allowed, so a test may still talk to a stand-in server on 127.0.0.1;
set ``NETGUARD_LOOPBACK=0`` to refuse those too.

This is not the hub's offline switch: nothing here tells a library that it is offline; a library
that tries the network anyway is caught and the attempt is logged.
"""
from __future__ import annotations

import os
from pathlib import Path

SITECUSTOMIZE = r'''
import os, socket, traceback

_LOG = os.environ.get("NETGUARD_LOG")
_LOOPBACK = os.environ.get("NETGUARD_LOOPBACK", "1") == "1"
_LOCAL = ("127.", "::1", "localhost")


def _record(what):
    if _LOG:
        with open(_LOG, "a") as f:
            f.write(f"{os.getpid()} {what} :: {traceback.format_stack(limit=6)[0].strip().splitlines()[0]}\n")
    raise OSError(f"network access blocked by the test's guard: {what}")


def _is_local(host):
    return _LOOPBACK and isinstance(host, str) and (host.startswith(_LOCAL) or host == "")


_connect = socket.socket.connect
_connect_ex = socket.socket.connect_ex


def connect(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6) and not _is_local(address[0]):
        _record(f"connect {address!r}")
    return _connect(self, address)


def connect_ex(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6) and not _is_local(address[0]):
        _record(f"connect_ex {address!r}")
    return _connect_ex(self, address)


_getaddrinfo = socket.getaddrinfo


def getaddrinfo(host, *args, **kwargs):
    h = host.decode() if isinstance(host, bytes) else host
    if h is not None and not _is_local(h):
        _record(f"getaddrinfo {h!r}")
    return _getaddrinfo(host, *args, **kwargs)


def gethostbyname(host):
    if not _is_local(host):
        _record(f"gethostbyname {host!r}")
    return "127.0.0.1"


socket.socket.connect = connect
socket.socket.connect_ex = connect_ex
socket.getaddrinfo = getaddrinfo
socket.gethostbyname = gethostbyname
'''


def install(directory: Path, log: Path, loopback: bool = True) -> dict[str, str]:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log.touch()
    path = os.pathsep.join([str(directory), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {"PYTHONPATH": path, "NETGUARD_LOG": str(log), "NETGUARD_LOOPBACK": "1" if loopback else "0"}
