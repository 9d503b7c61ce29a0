"""The CPU this process runs on: the one reader of /proc/cpuinfo.

Results on CPUs differ in their last bits between kernel sets (docs/design.md, "Portability across
CPUs"): torch picks AVX2, AVX512 or AMX kernels from the CPU's flags and from the
``ATEN_CPU_CAPABILITY`` variable, and bitsandbytes and vLLM pick theirs from the flags. ``describe()``
is what records and baselines carry, so a difference can be explained; ``same_kernels`` says
whether two descriptions select the same kernels.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import platform as _platform

# The flags that select different kernels in torch, bitsandbytes or vLLM.
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")
# Variables that restrict the instruction sets a library's kernels may use, on any CPU: MKL's and
# oneDNN's (torch's BLAS and its fused CPU ops), OpenBLAS's (numpy), numpy's own dispatch.
# ``MKL_ENABLE_INSTRUCTIONS=AVX2`` on an AVX-512 Xeon moves float32 results as an AVX2-only EPYC
# does (issue 26), so a run under one is on other kernels than a run without it.
KERNEL_ENV = ("MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA", "OPENBLAS_CORETYPE",
              "NPY_DISABLE_CPU_FEATURES")


@functools.lru_cache(maxsize=None)
def _cpuinfo() -> tuple[str, str, frozenset[str]]:
    """(vendor, model name, all flags) of the first processor in /proc/cpuinfo; empty where absent."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor is enough
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = fields.get("flags") or fields.get("Features") or ""
    return fields.get("vendor_id", ""), fields.get("model name", ""), frozenset(flags.split())


def flags() -> frozenset[str]:
    return _cpuinfo()[2]


def kernel_flags() -> list[str]:
    have = flags()
    return [f for f in KERNEL_FLAGS if f in have]


def torch_capability() -> str | None:
    """The kernel set torch dispatches to (``default``, ``avx2``, ``avx512``), which
    ``ATEN_CPU_CAPABILITY`` lowers; None where torch is not imported (nothing ran on it)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return None
    return torch.backends.cpu.get_cpu_capability().lower()


# The other kernels a machine can select for itself beside a lowered torch capability: MKL's and
# oneDNN's AVX2 code paths, which an AVX-512 Xeon takes as an AVX2-only EPYC does.
LIBRARIES_AVX2 = {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
# torch's and the libraries' AVX2 kernels together, the nearest an AVX-512 machine comes to an
# AVX2-only one (Qwen2.5-VL's dynamic FP8 moves under it as on an AVX2-only EPYC, and under neither
# of the others alone).
AVX2_MACHINE = {"ATEN_CPU_CAPABILITY": "avx2", **LIBRARIES_AVX2}
# The kernel conditions one machine (CI's among them) can set for itself, as environment overlays
# for a fresh interpreter: a lowered torch capability, the libraries' AVX2 paths, and both at AVX2.
KERNEL_CONDITIONS: dict[str, dict[str, str]] = {
    "aten-default": {"ATEN_CPU_CAPABILITY": "default"},
    "libraries-avx2": LIBRARIES_AVX2,
    "avx2-machine": AVX2_MACHINE,
}


def condition_env(overlay: dict[str, str] | None) -> dict[str, str]:
    """This process's environment under a kernel condition (None: the native one). Only the
    variables the conditions set are replaced: OPENBLAS_CORETYPE, where the machine sets it, stays."""
    chosen = {k for c in KERNEL_CONDITIONS.values() for k in c}
    return {**{k: v for k, v in os.environ.items() if k not in chosen}, **(overlay or {})}


def kernel_env() -> dict[str, str]:
    """The :data:`KERNEL_ENV` variables set in this process."""
    return {k: os.environ[k] for k in KERNEL_ENV if os.environ.get(k)}


def describe() -> dict:
    """``{"vendor", "model", "flags", "capability", "kernel_env"}`` for records and baselines."""
    vendor, model, _ = _cpuinfo()
    return {"vendor": vendor, "model": model, "flags": kernel_flags(), "capability": torch_capability(),
            "kernel_env": kernel_env()}


def _kernel_key(description: dict) -> dict:
    """What selects the kernels in a ``describe()`` result."""
    return {**{k: description.get(k) for k in ("vendor", "model", "flags", "capability")},
            "kernel_env": description.get("kernel_env") or {}}


def same_kernels(a: dict | None, b: dict | None) -> bool:
    """Whether two ``describe()`` results select the same kernels: same vendor, model, kernel flags,
    torch capability and kernel-restricting variables. Unknown (None) is never the same."""
    if not a or not b:
        return False
    return _kernel_key(a) == _kernel_key(b)


def same_cpu(a: dict | None, b: dict | None) -> bool:
    """Whether two ``describe()`` results are of one kind of CPU (vendor, model, kernel flags),
    under any kernel condition. Unknown (None) is never the same."""
    if not a or not b:
        return False
    return all(a.get(k) == b.get(k) for k in ("vendor", "model", "flags"))


def native_first(description: dict) -> tuple:
    """A sort key putting a CPU's own kernels before the conditions that lower them: no
    kernel-restricting variable, then the widest torch capability."""
    widths = ("avx512", "avx2", "default")
    capability = description.get("capability")
    return (len(description.get("kernel_env") or {}), widths.index(capability) if capability in widths else len(widths))


def kernel_set(description: dict) -> str:
    """A folder name for the kernels a ``describe()`` result selects, the same for two results
    exactly when :func:`same_kernels` holds: the model, the widest kernel flag and a digest of
    the rest, e.g. ``amd-epyc-avx2-1f3a9c0d``."""
    key = _kernel_key(description)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:8]
    model = re.sub(r"[^a-z0-9]+", "-", (key["model"] or "unknown-cpu").lower()).strip("-")[:40]
    widest = (key["flags"] or ["no-kernel-flags"])[-1].replace("_", "-")
    return f"{model}-{widest}-{digest}"


def platform() -> str:
    """``cpu-<arch>-<widest vector ISA>``, e.g. ``cpu-x86_64-avx512``."""
    arch = _platform.machine().lower() or "unknown"
    have = flags()
    isa = next((name for flag, name in (("amx_tile", "amx"), ("avx512f", "avx512"), ("avx2", "avx2"),
                                         ("sve", "sve"), ("asimd", "neon")) if flag in have), None)
    return f"cpu-{arch}-{isa}" if isa else f"cpu-{arch}"


def available_memory() -> int | None:
    """The memory this machine can still give (/proc/meminfo's MemAvailable), None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
