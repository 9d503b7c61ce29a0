"""The process environment vLLM runs with in an engine child (harness.engines.vllm's docstring
says why): the variables set before vLLM is imported, and the CPU core its OpenMP threads bind to,
held by a lock file per core for the child's life."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from pathlib import Path

_core_locks: list = []  # the open lock files of the cores this process bound (held until exit)


def bind_core(ranks: int = 1) -> str:
    """Choose the cores this engine's OpenMP threads bind to, one per tensor-parallel rank (see
    harness.engines.vllm's docstring), and set ``VLLM_CPU_OMP_THREADS_BIND`` (``0``, or ``0|1``
    for two ranks), unless the environment already set it. Returns the binding."""
    preset = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    if preset:
        return preset
    import fcntl

    try:
        cores = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = list(range(os.cpu_count() or 1))
    chosen: list[int] = []
    lock_dir = Path(os.environ.get("HARNESS_LOCK_DIR") or tempfile.gettempdir())
    for core in cores:
        if len(chosen) == ranks:
            break
        f = open(lock_dir / f"harness-vllm-cpu{core}.lock", "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            continue
        _core_locks.append(f)
        chosen.append(core)
    # with every core taken, share the first ones (the probes refuse more ranks than cores)
    chosen += [c for c in cores if c not in chosen][:ranks - len(chosen)]
    binding = "|".join(str(c) for c in chosen)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = binding
    return binding


def cache_root() -> str:
    """vLLM's cache directory for the vLLM installation this interpreter imports: its model-info
    cache holds one file per architecture, named by the class and not the release, so two builds
    sharing it (a candidate beside the pinned one) overwrite each other's entry, and every engine
    start then inspects the model again in a fresh interpreter (``python -m
    vllm.model_executor.models.registry``, ~10 s of imports)."""
    spec = importlib.util.find_spec("vllm")  # found, not imported
    where = spec.origin if spec is not None and spec.origin else "absent"
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vllm"
    return str(root / "installations" / hashlib.sha256(where.encode()).hexdigest()[:16])


def set_environment() -> None:
    """The variables vLLM runs with here, set before vLLM is imported (a fresh child's probe sets
    them, the vLLM fork server before its preload): vLLM reads some at import, e.g.
    ``VLLM_LOGGING_LEVEL`` configures its logger. ``VLLM_CPU_OMP_THREADS_BIND`` is not among them:
    vLLM reads it when the engine starts (:func:`bind_core`)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CACHE_ROOT", cache_root())
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
