"""Quantizers in plain torch: what each library does to a float weight, for online quantization.

Each function takes one float weight `[out, in]` and returns the `Decoded` that the format's
decoder would return for the checkpoint the library would have written: the label, the effective
(dequantized) float32 weight, the FP8 parts where there are any, and the settings that decide
fusion. The numerics are the libraries' own, op for op (the expressions are written the same way,
because `x * (1 / s)` and `x / s` round differently); `tests/test_online_quantize.py` checks every
function bit for bit against the library.

- `bnb_4bit`: bitsandbytes 0.50 `quantize_4bit` (its pure-torch kernel, which is what runs on CPU)
  followed by `dequantize_4bit`. Blocks run over the flattened weight, so a block may straddle
  rows; the last block may be short.
- `torchao_int8`: torchao 0.18 `Int8Tensor.from_hp` (`choose_qparams_affine` symmetric,
  `quantize_affine`) followed by `Int8Tensor.dequantize()`, per row or per tensor.
- `fp8`: compressed-tensors 0.17 `calculate_qparams` on a min/max observer, then its
  `fake_quantize` (`clamp(x / scale, -448, 448)` cast to float8_e4m3fn, times scale); per tensor
  that is also vLLM's online `scaled_fp8_quant(weight, scale=None)` (scale = amax / 448).

Memory: every function reads the weight (an mmap view, as the loader hands it over) and writes the
effective weight (and, for FP8, the float8 codes) into the only full-size tensors it allocates. The
temporaries of the arithmetic are bounded by `CHUNK` elements whatever the size of the weight, and a
float16 / bfloat16 weight is widened to float32 chunk by chunk, so quantizing online never holds a
second full-size copy (docs/design.md, "Fast loading"). Widening is exact: the result is that of
quantizing the float32 weight, which is what transformers quantizes after loading in float32.
"""
from __future__ import annotations

import torch

from harness.quant import Decoded, Fp8Parts, bnb, fp8

CHUNK = 1 << 20  # elements per slice of arithmetic temporaries (4 MiB of float32)


def _flat(weight: torch.Tensor) -> torch.Tensor:
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D [out, in] weight, got shape {tuple(weight.shape)}")
    return weight.contiguous().reshape(-1)


def _f32(t: torch.Tensor) -> torch.Tensor:
    """float32 values of a (chunk of a) float16/bfloat16/float32 weight: exact, so a half-precision
    checkpoint is quantized as transformers does after loading it in float32, chunk by chunk."""
    return t if t.dtype == torch.float32 else t.float()


def _row_chunks(rows: int, cols: int):
    step = max(1, CHUNK // max(cols, 1))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


# ------------------------------------------------------------------------------------------------
# bitsandbytes 4-bit


def _bnb_bounds(quant_type: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(code, midpoints, order) exactly as bitsandbytes' `_get_4bit_quantize_bounds` builds them."""
    code = bnb.code_table(quant_type)
    order = torch.argsort(code)
    midpoints = (code[order[:-1]] + code[order[1:]]) / 2
    return code, midpoints, order


def bnb_4bit(weight: torch.Tensor, quant_type: str = "nf4", blocksize: int = 64) -> Decoded:
    """bitsandbytes `quantize_4bit(weight, blocksize, quant_type)` then `dequantize_4bit`, float32.

    Per block of `blocksize` consecutive values of the flattened weight: absmax = max |x|;
    scaled = clamp(x * (1 / max(absmax, 1e-38)), -1, 1) (a short last block divides instead, and
    stores the clamped absmax); the code is `bucketize(scaled, midpoints)`, the nearest table
    value with ties to the lower one (fp4 maps the sorted index back through `argsort`); the
    effective value is `table[code] * absmax`. The weight is taken as float32 (the quant state's
    dtype when transformers loads in float32), so no rounding through another dtype follows.
    """
    if quant_type not in bnb.QUANT_TYPES:
        raise ValueError(f"quant_type must be one of {bnb.QUANT_TYPES}, got {quant_type!r}")
    if blocksize not in bnb.BLOCKSIZES:
        raise ValueError(f"blocksize {blocksize!r} is not one of {bnb.BLOCKSIZES}")
    flat = _flat(weight)
    n = flat.numel()
    code, bounds, order = _bnb_bounds(quant_type)
    out = torch.empty(n, dtype=torch.float32)
    rem = n % blocksize
    full = n - rem
    step = max(blocksize, (CHUNK // blocksize) * blocksize)
    for start in range(0, full, step):
        stop = min(full, start + step)
        blocks = _f32(flat[start:stop]).view(-1, blocksize)
        absmax = blocks.abs().amax(dim=-1)  # the values of bitsandbytes' .max(dim=-1)[0], faster
        scaled = torch.clamp(blocks * (1.0 / absmax.clamp(min=1e-38).view(-1, 1)), -1, 1).reshape(-1)
        out[start:stop] = _bnb_dequant(scaled, bounds, order, code, quant_type).view(-1, blocksize).mul_(absmax.view(-1, 1)).reshape(-1)
    if rem:
        tail = _f32(flat[full:])
        am = tail.abs().max().clamp(min=1e-38)
        scaled = torch.clamp(tail / am, -1, 1)
        out[full:] = _bnb_dequant(scaled, bounds, order, code, quant_type) * am
    return Decoded(
        label=f"bnb-{quant_type}",
        weight=out.view(weight.shape),
        settings={"quant_type": quant_type, "blocksize": blocksize, "double_quant": False},
    )


def _bnb_dequant(scaled, bounds, order, code, quant_type) -> torch.Tensor:
    q = torch.bucketize(scaled, bounds)  # bitsandbytes asks for int32; the indices are the same
    if quant_type != "nf4":
        q = order[q]
    return code[q]


# ------------------------------------------------------------------------------------------------
# torchao Int8Tensor


_INT8_MIN, _INT8_MAX = -128, 127


def torchao_int8(weight: torch.Tensor, granularity: str = "per-row") -> Decoded:
    """torchao `Int8Tensor.from_hp(weight, PerRow() | PerTensor())` then `.dequantize()`, float32.

    Symmetric int8 (`choose_qparams_affine`): amax = max(-min(min, 0), max(max, 0)) over the row
    (or the tensor); scale = max(amax / 127.5, eps_float32); zero point 0; q = clamp(round(x * (1 /
    scale)) + 0, -128, 127) (round half to even); effective = (q - 0) * scale.
    """
    if granularity not in ("per-row", "per-tensor"):
        raise ValueError(f"granularity must be 'per-row' or 'per-tensor', got {granularity!r}")
    w = weight
    rows, cols = w.shape
    if granularity == "per-row":
        lo, hi = _f32(w.amin(dim=1, keepdim=True)), _f32(w.amax(dim=1, keepdim=True))
    else:
        lo, hi = (_f32(t).reshape(1, 1) for t in torch.aminmax(w))
    min_neg = torch.min(lo, torch.zeros_like(lo))
    max_pos = torch.max(hi, torch.zeros_like(hi))
    amax = torch.max(-min_neg, max_pos)
    scale = torch.clamp(amax / (float(_INT8_MAX - _INT8_MIN) / 2), min=torch.finfo(torch.float32).eps)
    inv = 1.0 / scale
    zero = torch.zeros((), dtype=torch.int8)
    out = torch.empty((rows, cols), dtype=torch.float32)
    for start, stop in _row_chunks(rows, cols):
        r = slice(start, stop) if granularity == "per-row" else slice(None)
        q = torch.clamp(torch.round(_f32(w[start:stop]) * inv[r]) + zero, _INT8_MIN, _INT8_MAX).to(torch.int8)
        out[start:stop] = (q.to(torch.int32) - zero.to(torch.int32)).to(torch.float32) * scale[r]
    return Decoded(
        label="torchao-int8",
        weight=out,
        settings={"subclass": "Int8Tensor", "granularity": granularity, "asymmetric": False},
    )


# ------------------------------------------------------------------------------------------------
# FP8 (float8_e4m3fn), per tensor or per channel


def fp8_scale(weight: torch.Tensor, strategy: str) -> torch.Tensor:
    """The float32 weight scale compressed-tensors' `calculate_qparams` gives a min/max observer:
    max(|min(lo, 0)|, |max(hi, 0)|) / 448, a zero scale replaced by float32 eps. Shape () per
    tensor, (out, 1) per channel."""
    w = weight
    if strategy == "tensor":
        lo, hi = torch.aminmax(w)
    elif strategy == "channel":
        lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    else:
        raise ValueError(f"strategy must be 'tensor' or 'channel', got {strategy!r}")
    lo, hi = _f32(lo), _f32(hi)
    lo = torch.min(lo, torch.zeros_like(lo))
    hi = torch.max(hi, torch.zeros_like(hi))
    scale = torch.max(torch.abs(lo), torch.abs(hi)) / (float(fp8.FP8_MAX - (-fp8.FP8_MAX)) / 2)
    return torch.where(scale == 0, torch.tensor(torch.finfo(torch.float32).eps), scale)


def fp8_weight(weight: torch.Tensor, strategy: str, scale: torch.Tensor | None = None) -> Decoded:
    """FP8 weight quantization: q = fp8(clamp(x / scale, -448, 448)), effective = float32(q) * scale.

    `scale` defaults to `fp8_scale(weight, strategy)`. A per-tensor shard of a group that an
    engine fuses is given the group's scale (the max of the shards' scales, which is the scale of
    the fused weight: vLLM quantizes the merged weight once), so the fused weight is quantized
    from the float values once and never requantized.
    """
    if scale is None:
        scale = fp8_scale(weight, strategy)
    w = weight
    rows, cols = w.shape
    qweight = torch.empty((rows, cols), dtype=fp8.FP8)
    out = torch.empty((rows, cols), dtype=torch.float32)
    for start, stop in _row_chunks(rows, cols):
        s = scale[start:stop] if strategy == "channel" else scale
        q = fp8.quantize(_f32(w[start:stop]), s)
        qweight[start:stop] = q
        out[start:stop] = q.float() * s
    return Decoded(
        label=f"fp8-{strategy}",
        weight=out,
        fp8=Fp8Parts(qweight=qweight, scale=scale.reshape(()) if strategy == "tensor" else scale.reshape(rows, 1)),
        settings={"strategy": strategy, "static_input": False},
    )
