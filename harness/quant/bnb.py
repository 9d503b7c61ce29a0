"""bitsandbytes 4-bit (nf4 / fp4), pre-quantized, decoded in plain torch.

On-disk layout per weight `W` (what `Linear4bit._save_to_state_dict` writes through
`QuantState.as_dict(packed=True)`; transformers saves it as is):

    W                                       U8  [ceil(n/2), 1]  two 4-bit codes per byte, the
                                                                 first element in the high nibble
    W.absmax                                F32 [ceil(n/blocksize)]          (no double quant)
                                            U8  [ceil(n/blocksize)]          (double quant)
    W.quant_map                             F32 [16]   the 4-bit code table
    W.nested_absmax                         F32 [ceil(n_blocks/nested_blocksize)]  (double quant)
    W.nested_quant_map                      F32 [256]  bnb's 8-bit dynamic map    (double quant)
    W.quant_state.bitsandbytes__nf4|__fp4   U8  [len]  UTF-8 JSON: quant_type, blocksize, dtype,
                                                       shape, and with double quant
                                                       nested_blocksize, nested_dtype, nested_offset

Decoding, as bitsandbytes 0.50 does it (`dequantize_4bit` / `dequantize_blockwise`):
- the flat weight (n = prod(shape) values) is cut into blocks of `blocksize`; value i is
  `code[nibble_i] * absmax[i // blocksize]`, computed in float32;
- with double quant, absmax itself is `nested_quant_map[absmax_u8[j]] * nested_absmax[j //
  nested_blocksize] + nested_offset`, in float32;
- the result is cast to the quant state's `dtype` (the original weight dtype); this module returns
  it widened back to float32.
- bitsandbytes decodes 4-bit codes with its own built-in table for the quant type and ignores the
  stored `quant_map`. This module does the same, and refuses a checkpoint whose stored
  `quant_map` disagrees with that table: an engine would silently decode something other than
  what the file says.

An absmax of 0 is legal (an all-zero block); a negative or non-finite one is not.
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
from pydantic import Field, PrivateAttr, StrictInt

from harness.errors import CheckpointError
from harness.quant import Decoded, StoredWeight, finite_bounds, lookup_bytes, native, schema
from harness.quant.source import TensorSource
from harness.validation import short

QUANT_TYPES = ("nf4", "fp4")
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # what bitsandbytes' 4-bit dequantize accepts
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# bitsandbytes.functional.get_4bit_type, built the same way (list -> float32 tensor -> / max|.|)
_NF4 = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
]
_FP4 = [0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, -0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0]


def code_table(quant_type: str) -> torch.Tensor:
    """The 16 float32 values a 4-bit code stands for, exactly as bitsandbytes builds them."""
    data = {"nf4": _NF4, "fp4": _FP4}[quant_type]
    t = torch.tensor(data, dtype=torch.float32)
    return t.div_(t.abs().max())


@functools.cache
def _code_table(quant_type: str, device: torch.device) -> torch.Tensor:
    return code_table(quant_type).to(device)


@functools.cache
def _pair_table(quant_type: str, device: torch.device) -> torch.Tensor:
    """For each byte value, the float32 pair of codes it packs (high nibble first), held as one
    int64 per byte: one index_select then writes both values of a byte."""
    code = code_table(quant_type)
    pairs = torch.stack([code.repeat_interleave(16), code.repeat(16)], dim=1)  # [256, 2]
    return pairs.contiguous().view(torch.int64).reshape(256).to(device)


def unpack_nibbles(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The first n 4-bit codes of a packed buffer (high nibble first), as uint8."""
    flat = _bytes(packed)
    codes = torch.empty(flat.numel() * 2, dtype=torch.uint8, device=flat.device)
    codes[0::2] = flat >> 4
    codes[1::2] = flat & 0xF
    return codes[:n]


def _bytes(packed: torch.Tensor) -> torch.Tensor:
    flat = packed.contiguous().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def scale_blocks_(values: torch.Tensor, absmax: torch.Tensor, blocksize: int) -> torch.Tensor:
    """values[i] *= absmax[i // blocksize], in place, for a flat float32 tensor (the last block
    may be short): a broadcast over [blocks, blocksize], never absmax expanded to full size."""
    full = values.numel() // blocksize * blocksize
    values[:full].view(-1, blocksize).mul_(absmax[:full // blocksize, None])
    if full < values.numel():
        values[full:].mul_(absmax[full // blocksize])
    return values


def dequantize_absmax(qabsmax: torch.Tensor, nested_absmax: torch.Tensor, nested_quant_map: torch.Tensor,
                      nested_blocksize: int, nested_offset: float) -> torch.Tensor:
    """Undo double quantization of the absmax values (bitsandbytes `dequantize_blockwise` + offset)."""
    vals = nested_quant_map.float()[qabsmax.reshape(-1).to(torch.int32)]
    scale_blocks_(vals, nested_absmax.float().reshape(-1), nested_blocksize)
    return vals.add_(torch.tensor(float(nested_offset), dtype=torch.float32))


def dequantize(packed: torch.Tensor, absmax: torch.Tensor, quant_type: str, blocksize: int,
               shape: tuple[int, ...], dtype: torch.dtype = torch.float32, *,
               nested: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize a packed 4-bit buffer to float32, as bitsandbytes does.

    `nested`, for double quant: {"absmax": nested_absmax, "quant_map": nested_quant_map,
    "blocksize": nested_blocksize, "offset": nested_offset}; `absmax` is then the uint8 codes.
    `dtype` is the quant state's dtype: bitsandbytes returns the weight in it, and so the
    float32 result here is rounded through it. `out`: a contiguous float32 tensor of `shape` to
    write into (else one is allocated).

    In C on the CPU (harness.quant.native). Else one lookup per byte into a 256-entry table of
    code pairs, written straight into the output, then, while it is in cache, the multiply by
    each block's absmax (`lookup_bytes`).
    """
    n = math.prod(shape)
    if nested is not None:
        absmax = dequantize_absmax(absmax, nested["absmax"], nested["quant_map"], int(nested["blocksize"]),
                                   float(nested["offset"]))
    absmax = absmax.float().reshape(-1)
    packed = _bytes(packed)
    result = torch.empty(shape, dtype=torch.float32, device=packed.device) if out is None else out
    if not result.is_contiguous() or result.storage_offset() % 2:  # no int64 view of it
        return result.copy_(dequantize(packed, absmax, quant_type, blocksize, shape, dtype))
    flat = result.view(-1)
    full = n // blocksize * blocksize  # whole blocks: whole bytes, since blocksizes are even
    codes, scales = packed[:full // 2], absmax[:full // blocksize].contiguous()
    if not native.decode_nibbles(_code_table(quant_type, packed.device), codes, scales, blocksize // 2, flat[:full]):
        lookup_bytes(_pair_table(quant_type, packed.device), codes, flat[:full], scales, blocksize // 2)
    if full < n:  # a last, short block
        tail = flat[full:]
        tail.copy_(_code_table(quant_type, tail.device)[unpack_nibbles(packed[full // 2:], n - full).int()])
        scale_blocks_(tail, absmax[full // blocksize:], blocksize)
    if dtype != torch.float32:
        flat.copy_(flat.to(dtype))
    return result


@dataclass
class Stored4bit(StoredWeight):
    """A bitsandbytes 4-bit weight as stored: the packed bytes (memory-mapped) and the float32
    absmax (decoded at load under double quant: it is checked there)."""

    packed: torch.Tensor  # uint8, two codes per byte
    absmax: torch.Tensor  # float32 [n_blocks]
    quant_type: str
    blocksize: int
    shape: tuple[int, int]
    dtype: torch.dtype  # the quant state's dtype, which the values are rounded through

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        return dequantize(self.packed, self.absmax, self.quant_type, self.blocksize, self.shape, self.dtype,
                          out=out)

    @property
    def row_alignment(self) -> int:
        """Rows that hold a whole number of blocks (blocks run over the flattened weight)."""
        return self.blocksize // math.gcd(self.shape[1], self.blocksize)

    def rows(self, start: int, stop: int) -> Stored4bit:
        cols = self.shape[1]
        first, last = start * cols, stop * cols  # first is a block boundary (row_alignment)
        return Stored4bit(self.packed[first // 2:(last + 1) // 2], self.absmax[first // self.blocksize:-(-last // self.blocksize)],
                          self.quant_type, self.blocksize, (stop - start, cols), self.dtype)


# ------------------------------------------------------------------------------------------------
# the checkpoint side


def _state_key(src: TensorSource, weight: str) -> str | None:
    found = [f"{weight}.quant_state.bitsandbytes__{qt}" for qt in QUANT_TYPES
             if f"{weight}.quant_state.bitsandbytes__{qt}" in src.keys]
    if len(found) > 1:
        raise CheckpointError(weight, f"two quant states: {found}")
    return found[0] if found else None


def owns(src: TensorSource, weight: str) -> bool:
    """True when the tensors for `weight` are bitsandbytes 4-bit: a packed quant state or an absmax."""
    if _state_key(src, weight) is not None:
        return True
    return f"{weight}.absmax" in src.keys or f"{weight}.nested_absmax" in src.keys


class QuantState(schema.Open):
    """The JSON quant state bitsandbytes stores beside a 4-bit weight (``QuantState.as_dict``)."""

    quant_type: Literal[QUANT_TYPES]  # type: ignore[valid-type]
    blocksize: Literal[BLOCKSIZES]  # type: ignore[valid-type]
    dtype: Literal[tuple(_DTYPES)]  # type: ignore[valid-type]
    shape: Annotated[list[Annotated[StrictInt, Field(gt=0)]], Field(min_length=2, max_length=2)]  # [out, in]
    nested_blocksize: Annotated[StrictInt, Field(gt=0)] | None = None
    nested_offset: Annotated[float, Field(strict=True, allow_inf_nan=False)] | None = None
    nested_dtype: Literal["float32"] | None = None  # what bitsandbytes writes
    _where: str = PrivateAttr("")  # "<file>: quant state of <weight>", for the problems found later


def read_quant_state(src: TensorSource, weight: str) -> QuantState:
    """The JSON quant state of `weight`, validated (QuantState). A problem names the file, the
    weight and the field: ``<file>: quant state of <weight>: dtype: must be ...``."""
    key = _state_key(src, weight)
    if key is None:
        raise CheckpointError(f"{weight}.quant_state.bitsandbytes__nf4", "missing tensor (bitsandbytes quant state)")
    raw = src.get(key)
    if raw.dtype != torch.uint8 or raw.dim() != 1:
        raise CheckpointError(key, f"quant state must be 1-D uint8 JSON bytes, got {raw.dtype} {tuple(raw.shape)}")
    where = f"{src.file_of(key)}: quant state of {weight}"
    try:
        data = json.loads(bytes(raw.numpy()).decode("utf-8"))
    except ValueError as e:  # not UTF-8, not JSON
        raise CheckpointError(where, f"JSON unreadable: {e}") from None
    if not isinstance(data, dict):
        raise schema.ConfigProblem(where, "", f"must be a JSON object (got {short(data)})")
    state = schema.validate(QuantState, data, where)
    suffix = key.rsplit("__", 1)[1]
    if state.quant_type != suffix:
        raise schema.ConfigProblem(where, "quant_type", f"{state.quant_type!r} under a __{suffix} key")
    state._where = where
    return state


def _get(src: TensorSource, name: str, what: str) -> torch.Tensor:
    if name not in src.keys:
        raise CheckpointError(name, f"missing tensor ({what})")
    return src.get(name)


def _check_scale(name: str, t: torch.Tensor) -> None:
    bounds = finite_bounds(t)
    if bounds is None:
        raise CheckpointError(name, "NaN or infinite values")
    if bounds[0] < 0:
        raise CheckpointError(name, "negative values")


def decode(src: TensorSource, weight: str) -> Decoded:
    state = read_quant_state(src, weight)
    qt, bs, shape = state.quant_type, state.blocksize, tuple(state.shape)
    dtype = _DTYPES[state.dtype]
    n = math.prod(shape)

    packed = _get(src, weight, "packed 4-bit weight")
    if packed.dtype != torch.uint8 and tuple(packed.shape) == shape:
        raise CheckpointError(weight, f"is a {packed.dtype} tensor of the full shape {list(shape)}, not packed 4-bit data")
    nbytes = packed.numel() * packed.dtype.itemsize
    if nbytes != (n + 1) // 2:
        raise CheckpointError(weight, f"packed weight holds {nbytes} bytes but quant state shape {list(shape)} needs {(n + 1) // 2}")

    quant_map = _get(src, f"{weight}.quant_map", "quant_map")
    if quant_map.dtype != torch.float32 or quant_map.numel() != 16:
        raise CheckpointError(f"{weight}.quant_map", f"expected 16 float32 values, got {quant_map.dtype} {tuple(quant_map.shape)}")
    if not torch.allclose(quant_map.reshape(-1), code_table(qt), rtol=0, atol=1e-6):
        raise CheckpointError(f"{weight}.quant_map",
                              f"differs from bitsandbytes' {qt} table, which bitsandbytes decodes with regardless")

    n_blocks = -(-n // bs)
    absmax = _get(src, f"{weight}.absmax", "absmax")
    if absmax.numel() != n_blocks:
        raise CheckpointError(f"{weight}.absmax", f"has {absmax.numel()} values; shape {list(shape)} in blocks of {bs} needs {n_blocks}")

    double = f"{weight}.nested_absmax" in src.keys or state.nested_offset is not None or absmax.dtype == torch.uint8
    if double:
        if absmax.dtype != torch.uint8:
            raise CheckpointError(f"{weight}.absmax", f"double-quant absmax must be uint8, got {absmax.dtype}")
        for field in ("nested_blocksize", "nested_offset"):
            if getattr(state, field) is None:
                raise schema.ConfigProblem(state._where, field, "double quant but the quant state has none")
        nbs, offset = state.nested_blocksize, state.nested_offset
        n_abs = _get(src, f"{weight}.nested_absmax", "nested_absmax")
        n_map = _get(src, f"{weight}.nested_quant_map", "nested_quant_map")
        if n_abs.dtype != torch.float32:
            raise CheckpointError(f"{weight}.nested_absmax", f"must be float32, got {n_abs.dtype}")
        if n_abs.numel() != -(-n_blocks // nbs):
            raise CheckpointError(f"{weight}.nested_absmax",
                                  f"has {n_abs.numel()} values; {n_blocks} absmax codes in blocks of {nbs} need {-(-n_blocks // nbs)}")
        _check_scale(f"{weight}.nested_absmax", n_abs)
        if n_map.dtype != torch.float32 or n_map.numel() != 256:
            raise CheckpointError(f"{weight}.nested_quant_map", f"expected 256 float32 values, got {n_map.dtype} {tuple(n_map.shape)}")
        if not torch.isfinite(n_map).all():
            raise CheckpointError(f"{weight}.nested_quant_map", "NaN or infinite values")
        absmax = dequantize_absmax(absmax, n_abs, n_map, nbs, offset)
        if finite_bounds(absmax) is None:
            raise CheckpointError(f"{weight}.absmax", "NaN or infinite after double-quant decoding")
    else:
        if absmax.dtype != torch.float32:
            raise CheckpointError(f"{weight}.absmax", f"must be float32 (or uint8 with double quant), got {absmax.dtype}")
        _check_scale(f"{weight}.absmax", absmax)

    return Decoded(
        label=f"bnb-{qt}",
        weight=Stored4bit(_bytes(packed), absmax.reshape(-1), qt, bs, shape, dtype),
        settings={"quant_type": qt, "blocksize": bs, "double_quant": double},
    )
