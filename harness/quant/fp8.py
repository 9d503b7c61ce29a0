"""FP8 (float8_e4m3fn) weights with float32 scales, decoded in plain torch.

On-disk layout per weight `W` of module `M` (compressed-tensors `float-quantized` and the plain
`quant_method: fp8` layout share it):

    M.weight          F8_E4M3 [out, in]
    M.weight_scale    F32 (or BF16/F16)  per tensor: () or (1,);  per channel: (out, 1) or (out,)
    M.input_scale     F32  () or (1,)    static activation schemes only
    M.weight_zero_point                  compressed-tensors drops it for symmetric schemes; if
                                         present it must be all zero

The effective weight is `float32(q) * float32(scale)`: what vLLM computes with (it keeps scales in
float32). compressed-tensors' own `dequantize` multiplies in the scale's dtype, so for a bf16
scale it rounds the product to bf16; for float32 scales the two agree exactly.

Not handled (a `CheckpointError` says so): block-wise FP8 (`weight_scale_inv`, DeepSeek /
transformers FineGrainedFP8), group scales, e5m2 and e4m3fnuz weights on disk.

The KV cache: attention module `A` carries `A.k_scale` and `A.v_scale` (compressed-tensors
`kv_cache_scheme`), or the legacy `A.kv_scale` meaning both; see `kv_scales`.

Rounding: quantizing here is `clamp(x / scale, -448, 448).to(float8_e4m3fn)`, round to nearest
even, saturating; the division (not a multiply by 1/scale) is what compressed-tensors and vLLM's
static quant kernels do.
"""
from __future__ import annotations

import functools

import torch

from harness.errors import CheckpointError
from harness.quant import Decoded, Fp8Parts, native
from harness.quant.source import TensorSource

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448.0
_FLOAT8_DTYPES = tuple(d for d in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
                                   torch.float8_e5m2fnuz) if d is not None)
_SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _module(weight: str) -> str:
    return weight.rsplit(".", 1)[0] if "." in weight else ""


def _sibling(weight: str, leaf: str) -> str:
    m = _module(weight)
    return f"{m}.{leaf}" if m else leaf


def owns(src: TensorSource, weight: str) -> bool:
    """True when `weight` is stored as a float8 tensor."""
    return weight in src.keys and src.dtype(weight) in _FLOAT8_DTYPES


def _read_scale(src: TensorSource, name: str) -> torch.Tensor:
    t = src.get(name)
    if t.dtype not in _SCALE_DTYPES:
        raise CheckpointError(name, f"scale must be float32/float16/bfloat16, got {t.dtype}")
    t = t.float()
    if not torch.isfinite(t).all():
        raise CheckpointError(name, "NaN or infinite scale")
    if (t <= 0).any():
        raise CheckpointError(name, "zero or negative scale")
    return t


def decode(src: TensorSource, weight: str) -> Decoded:
    if weight not in src.keys:
        raise CheckpointError(weight, "missing tensor")
    q = src.get(weight)
    if q.dtype != FP8:
        raise CheckpointError(weight, f"FP8 weights must be float8_e4m3fn, got {q.dtype}")
    if q.dim() != 2:
        raise CheckpointError(weight, f"expected a 2-D [out, in] weight, got shape {tuple(q.shape)}")
    out, _ = q.shape

    scale_name = f"{weight}_scale"
    if scale_name not in src.keys:
        if f"{weight}_scale_inv" in src.keys:
            raise CheckpointError(f"{weight}_scale_inv", "block-wise FP8 (weight_scale_inv) is not supported")
        raise CheckpointError(scale_name, "missing tensor (weight_scale)")
    scale = _read_scale(src, scale_name)
    if scale.numel() == 1:
        strategy, scale = "tensor", scale.reshape(())
    elif scale.dim() == 1 or (scale.dim() == 2 and scale.shape[1] == 1):
        if scale.shape[0] != out:
            raise CheckpointError(scale_name, f"per-channel scale shape {tuple(scale.shape)} does not match weight shape {tuple(q.shape)}")
        strategy, scale = "channel", scale.reshape(out, 1)
    else:
        raise CheckpointError(scale_name, f"scale shape {tuple(scale.shape)} for weight {tuple(q.shape)}: "
                                          "only per-tensor and per-channel FP8 are supported")

    zp_name = f"{weight}_zero_point"
    if zp_name in src.keys and (src.get(zp_name).float() != 0).any():
        raise CheckpointError(zp_name, "non-zero FP8 zero point (asymmetric FP8) is not supported")

    input_scale = None
    is_name = _sibling(weight, "input_scale")
    if is_name in src.keys:
        input_scale = _read_scale(src, is_name)
        if input_scale.numel() != 1:
            raise CheckpointError(is_name, f"input_scale must be one value, got shape {tuple(input_scale.shape)}")
        input_scale = input_scale.reshape(())

    parts = Fp8Parts(qweight=q, scale=scale, input_scale=input_scale)
    return Decoded(
        label=f"fp8-{strategy}",
        weight=parts,
        fp8=parts,
        settings={"strategy": strategy, "static_input": input_scale is not None},
    )


# ------------------------------------------------------------------------------------------------
# numerics


def _scaled(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    return torch.clamp(x / scale, -FP8_MAX, FP8_MAX)


@functools.cache
def _finite_values() -> torch.Tensor:
    """Every finite e4m3fn value, ascending, float64."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    return torch.unique(values[torch.isfinite(values)])


@functools.cache
def rounding_boundaries() -> torch.Tensor:
    """The e4m3fn rounding boundaries: the midpoints between adjacent finite values, float64."""
    values = _finite_values()
    return (values[1:] + values[:-1]) / 2


def nearest_boundary(scaled: torch.Tensor, boundaries: torch.Tensor | None = None):
    """(|x - b|, b) for the rounding boundary b nearest to each element of a scaled activation
    (x / scale), in float64."""
    boundaries = rounding_boundaries() if boundaries is None else boundaries
    u = scaled.double().clamp(-FP8_MAX, FP8_MAX)
    i = torch.searchsorted(boundaries, u)
    below = boundaries[(i - 1).clamp(min=0)]
    above = boundaries[i.clamp(max=len(boundaries) - 1)]
    nearer_below = (u - below).abs() <= (u - above).abs()
    boundary = torch.where(nearer_below, below, above)
    return (u - boundary).abs(), boundary


def step_at(boundary: torch.Tensor) -> torch.Tensor:
    """The distance between the two e4m3fn values on either side of each rounding boundary: what
    a value that crosses it moves by once rounded (in scaled units)."""
    values = _finite_values()
    i = torch.searchsorted(values, boundary.double()).clamp(1, len(values) - 1)
    return values[i] - values[i - 1]


def quantize(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """float8_e4m3fn codes of x / scale: round to nearest even, saturating at +-448."""
    return _scaled(x, scale).to(FP8)


def on_grid(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """`quantize(x, scale)` as values of x's dtype; for float32 on the CPU in C (torch's float8
    casts there are a scalar loop, most of an FP8 forward pass), bit-identical."""
    scaled = _scaled(x, scale)
    rounded = native.round_e4m3(scaled)
    return rounded if rounded is not None else scaled.to(FP8).to(x.dtype)


def fake_quant(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """Quantize to float8_e4m3fn with `scale`, then dequantize; same dtype as x.

    compressed-tensors' `fake_quantize` for a static per-tensor scale: x / scale, clamp, cast
    to fp8, back to x's dtype, times scale (the scale is taken in x's dtype).
    """
    if isinstance(scale, torch.Tensor):
        scale = scale.to(x.dtype)
    return on_grid(x, scale) * scale


def quantize_dynamic_per_token(x: torch.Tensor) -> torch.Tensor:
    """Fake-quantize activations with one dynamic FP8 scale per token (per row of the last dim).

    The formula is compressed-tensors' (`compute_dynamic_scales_and_zp` + `calculate_qparams`,
    symmetric FLOAT 8-bit, strategy TOKEN), in x's dtype:
        amax  = max(|min(row, 0)|, max(row, 0))
        scale = amax / 448;  a zero scale becomes finfo(x.dtype).eps
        y     = fp8(clamp(x / scale, -448, 448)) * scale
    compressed-tensors reduces over the dims after the first two, so for a 3-D [batch, seq,
    hidden] input it is per token; for a 2-D input its own code reduces over the whole tensor.
    This function is per row for any rank.
    """
    mn = torch.clamp(x.amin(dim=-1, keepdim=True), max=0)
    mx = torch.clamp(x.amax(dim=-1, keepdim=True), min=0)
    amax = torch.maximum(mn.abs(), mx.abs())
    scale = amax / (float(FP8_MAX - (-FP8_MAX)) / 2)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(x.dtype).eps, dtype=scale.dtype), scale)
    return on_grid(x, scale) * scale


def requantize_fused(shards: list[Decoded], dq_dtype: torch.dtype = torch.float32) -> list[Decoded]:
    """Give a group of FP8 shards that are about to be fused one common scale.

    Per-tensor scales: each shard is dequantized with its own scale (in `dq_dtype`) and
    quantized again with the group's max scale; the returned shards' weights are the new
    effective weights, their `fp8.scale` is the shared scale, and their `fp8.remap` maps each
    stored code to its requantized code (`fp8.codes()`), the stored bytes left as they are. Per-channel scales concatenate
    and are returned unchanged. A static `input_scale` becomes the group's max.

    vLLM's `requantize_with_max_scale` dequantizes in float16 (`dq_dtype=torch.float16` models
    it); the float32 default is the exact value.
    """
    if not shards:
        return []
    if any(s.fp8 is None for s in shards):
        raise ValueError("requantize_fused needs FP8 shards")
    per_channel = {s.fp8.per_channel for s in shards}
    if len(per_channel) != 1:
        raise ValueError("cannot fuse per-tensor with per-channel FP8 shards")
    statics = {s.fp8.input_scale is not None for s in shards}
    if len(statics) != 1:
        raise ValueError("cannot fuse static with dynamic input FP8 shards")
    input_scale = None
    if statics == {True}:
        input_scale = torch.stack([s.fp8.input_scale.reshape(()) for s in shards]).max()

    if per_channel == {True}:
        return [Decoded(s.label, parts, parts, dict(s.settings))
                for s in shards for parts in [Fp8Parts(s.fp8.qweight, s.fp8.scale, input_scale, s.fp8.remap)]]

    smax = torch.stack([s.fp8.scale.reshape(()) for s in shards]).max()
    return [Decoded(s.label, parts, parts, dict(s.settings))
            for s in shards for parts in [Fp8Parts(s.fp8.qweight, smax.clone(), input_scale,
                                                   _requantized_codes(s.fp8, smax, dq_dtype))]]


def _requantized_codes(parts: Fp8Parts, new_scale: torch.Tensor, dq_dtype: torch.dtype) -> torch.Tensor:
    """Fp8Parts.remap after requantizing to `new_scale`: quantize(code * scale, new_scale), the
    dequantization in `dq_dtype`, for each of the 256 stored codes. The result depends on the code
    alone, so no stored byte is read or rewritten."""
    codes = torch.arange(256, dtype=torch.int32, device=parts.qweight.device).to(torch.uint8)
    if parts.remap is not None:
        codes = parts.remap[codes.int()]
    dq = codes.view(parts.qweight.dtype).to(dq_dtype) * parts.scale.reshape(()).to(dq_dtype)
    return quantize(dq.float(), new_scale).view(torch.uint8)


def normalise_fnuz(qweight: torch.Tensor, scale: torch.Tensor,
                   input_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What ROCm does to an e4m3fn checkpoint (vLLM `normalize_e4m3fn_to_e4m3fnuz`).

    The same bits read as e4m3fnuz are worth half as much, so the scales are doubled; the bit
    pattern 0x80 (-0 in e4m3fn, NaN in e4m3fnuz) becomes 0. Dequantized values are unchanged.
    `qweight` may be float8_e4m3fn or its raw bits as uint8/int8. An e4m3fnuz tensor is taken as
    already normalised and returned as it is, with its scales unchanged.
    """
    if qweight.dtype == torch.float8_e4m3fnuz:
        return qweight, scale, input_scale
    if qweight.dtype == FP8:
        bits = qweight.view(torch.uint8)
    elif qweight.dtype in (torch.uint8, torch.int8):
        bits = qweight.view(torch.uint8)
    else:
        raise ValueError(f"normalise_fnuz takes float8_e4m3fn or its uint8/int8 bits, not {qweight.dtype}")
    bits = torch.where(bits == 0x80, torch.zeros_like(bits), bits)
    out = bits.view(torch.float8_e4m3fnuz)
    return out, scale * 2.0, (input_scale * 2.0 if input_scale is not None else None)


# ------------------------------------------------------------------------------------------------
# KV cache scales


def _kv_scale(src: TensorSource, name: str) -> torch.Tensor:
    t = _read_scale(src, name)
    if t.numel() != 1:
        raise CheckpointError(name, f"KV-cache scale must be one value (vLLM takes one per tensor), got shape {tuple(t.shape)}")
    return t.reshape(())


def kv_scales(src: TensorSource, attention_prefix: str) -> tuple[torch.Tensor | None, torch.Tensor | None, list[str]]:
    """(k_scale, v_scale, notes) of one attention module, float32 scalars or None.

    Looks for `<prefix>.k_scale` / `<prefix>.v_scale` (compressed-tensors), then ModelOpt's
    `<prefix>.k_proj.k_scale` / `<prefix>.v_proj.v_scale`, then the legacy `<prefix>.kv_scale`
    (both). With only one of k and v, that one serves both and a note says so (vLLM takes the max
    of the two, a missing one counting as -1, which is the same thing). With none: (None, None,
    []); vLLM then uses 1.0.
    """
    p = attention_prefix.rstrip(".")
    notes: list[str] = []

    def find(*leaves):
        for leaf in leaves:
            if f"{p}.{leaf}" in src.keys:
                return f"{p}.{leaf}"
        return None

    k_name = find("k_scale", "k_proj.k_scale")
    v_name = find("v_scale", "v_proj.v_scale")
    kv_name = find("kv_scale")
    for name in (k_name, v_name):
        if name is not None and name.rsplit(".", 2)[-2] in ("k_proj", "v_proj"):
            notes.append(f"{name}: ModelOpt spelling of the KV-cache scale")
    k = _kv_scale(src, k_name) if k_name else None
    v = _kv_scale(src, v_name) if v_name else None
    if kv_name is not None:
        kv = _kv_scale(src, kv_name)
        if k is None and v is None:
            notes.append(f"{kv_name}: legacy kv_scale, used for both k and v")
            return kv, kv.clone(), notes
        notes.append(f"{kv_name}: legacy kv_scale ignored, k_scale/v_scale present")
    if k is not None and v is None:
        notes.append(f"{p}: v_scale missing, using k_scale for v")
        v = k.clone()
    elif v is not None and k is None:
        notes.append(f"{p}: k_scale missing, using v_scale for k")
        k = v.clone()
    return k, v, notes
