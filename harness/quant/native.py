"""The byte decoders and the FP8 rounding in C, for CPU tensors: bit-identical to the plain-torch
path, at the memory's speed (docs/design.md, "Decode speed").

torch has no kernel for "a 16- or 256-entry table per byte": `index_select` with int32 indices
costs 0.6-1.2 ns per value on one thread, where writing the float32 output costs ~0.15 ns, and its
float8 casts run a scalar loop (~3.7 ns per value). `native.c` decodes at about the speed of the
write (with AVX-512 or AVX2; a scalar loop elsewhere). It is compiled on first use with the machine's C
compiler, for this CPU (`-march=native`), into a cache keyed by the source, the flags, the compiler
and the CPU; `-ffp-contract=off` keeps every multiply unfused, so that the values are the torch
path's on every CPU.

Where there is no compiler, or ``HARNESS_NATIVE=0``, `library()` is None and the callers take their
plain-torch path (one warning says why). The tests check both paths against each other.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from harness import cpu

SOURCE = Path(__file__).with_name("native.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared")


def cache_dir() -> Path:
    env = os.environ.get("HARNESS_NATIVE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "harness" / "native"


def _build_key(compiler: str) -> str:
    # not checked: a compiler that fails here fails the build, which says so
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    machine = cpu.describe()
    parts = [SOURCE.read_bytes(), " ".join(FLAGS).encode(), version.encode(), machine["vendor"].encode(),
             machine["model"].encode(), " ".join(sorted(cpu.flags())).encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _build() -> Path:
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise OSError(f"no C compiler ({compiler}) on PATH")
    target = cache_dir() / f"harness_native-{_build_key(compiler)}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name and renamed into place: processes that build at the same time
    # each load a whole library.
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise OSError(f"{compiler} failed on {SOURCE.name}: {last}")
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled library, built on first use; None (with one warning) where it cannot be."""
    if os.environ.get("HARNESS_NATIVE", "1") == "0":
        return None
    try:
        lib = ctypes.CDLL(str(_build()))
    except OSError as e:
        warnings.warn(f"harness native decoders unavailable, decoding in plain torch: {e}", RuntimeWarning,
                      stacklevel=2)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.harness_decode_e4m3.argtypes = [ptr, i64, ptr, ptr, i64, ptr]
    lib.harness_decode_int8.argtypes = [ptr, i64, ptr, i64, ptr]
    lib.harness_decode_nibbles.argtypes = [ptr, ptr, i64, ptr, i64, ptr]
    lib.harness_round_e4m3.argtypes = [ptr, i64, ptr]
    for fn in (lib.harness_decode_e4m3, lib.harness_decode_int8, lib.harness_decode_nibbles, lib.harness_round_e4m3):
        fn.restype = None
    lib.harness_vector_width.argtypes, lib.harness_vector_width.restype = [], ctypes.c_int
    return lib


def describe() -> str:
    """Which decoders run here, for reports: the C ones and their vector width, or plain torch."""
    lib = library()
    if lib is None:
        return "plain torch"
    width = lib.harness_vector_width()
    return {16: "C, AVX-512 (16 values at a time)", 8: "C, AVX2 (8 values at a time)"}.get(width, "C, scalar")


def _usable(*tensors: torch.Tensor | None) -> bool:
    return (all(t is None or (t.device.type == "cpu" and t.is_contiguous()) for t in tensors)
            and library() is not None)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def decode_e4m3(codes: torch.Tensor, remap: torch.Tensor | None, scales: torch.Tensor, group: int,
                out: torch.Tensor) -> bool:
    """out[i] = float32(e4m3 code i) * scales[i // group] for flat uint8 `codes` (through the uint8
    `remap` when given) into a flat float32 `out`; False, nothing written, where the C path does
    not apply (harness.quant.dequantize_fp8 then decodes in torch)."""
    if not _usable(codes, remap, scales, out):
        return False
    library().harness_decode_e4m3(codes.data_ptr(), codes.numel(), _ptr(remap), scales.data_ptr(), group,
                                  out.data_ptr())
    return True


def decode_int8(codes: torch.Tensor, scales: torch.Tensor, group: int, out: torch.Tensor) -> bool:
    """out[i] = float32(codes[i]) * scales[i // group] for flat int8 `codes` into a flat float32
    `out`; False, nothing written, where the C path does not apply."""
    if not _usable(codes, scales, out):
        return False
    library().harness_decode_int8(codes.data_ptr(), codes.numel(), scales.data_ptr(), group, out.data_ptr())
    return True


def decode_nibbles(code16: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group: int,
                   out: torch.Tensor) -> bool:
    """bitsandbytes 4-bit: out[2i], out[2i+1] = code16[high, low nibble of packed[i]] * scales[i //
    group] into a flat float32 `out`; False, nothing written, where the C path does not apply
    (harness.quant.bnb.dequantize then decodes in torch)."""
    if not _usable(code16, packed, scales, out):
        return False
    library().harness_decode_nibbles(code16.data_ptr(), packed.data_ptr(), packed.numel(), scales.data_ptr(), group,
                                     out.data_ptr())
    return True


def round_e4m3(x: torch.Tensor) -> torch.Tensor | None:
    """float32(float8_e4m3fn(x)) of a float32 tensor within +-448 (NaN kept), in C; None where the
    C path does not apply."""
    if x.dtype != torch.float32 or not _usable(x):
        return None
    out = torch.empty_like(x)
    library().harness_round_e4m3(x.data_ptr(), x.numel(), out.data_ptr())
    return out
