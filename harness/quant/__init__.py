"""On-disk quantization formats: one module per format (the skip rules they share are harness/dialects/).

Each format module decodes its layout in plain torch. The libraries that produce the layouts are
used only as oracles in the tests.

A quantized weight stays in its stored form (`StoredWeight`: the tensors as on disk, memory-mapped
where the file allows) and is dequantized each time it is used (docs/design.md, "Fast loading").
"""
import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from harness import registry
from harness.quant import native

# The label of a linear module, as the reference's load report and the fixture manifests spell it.
LABELS = ("unquantized", *(label for spec in registry.FORMATS.values() for label in spec.labels))


class StoredWeight:
    """A quantized weight as stored: `dequantize` gives its effective float32 [out, in] value.

    Subclasses are dataclasses (one per format, beside its decoder) whose tensor fields are the
    stored tensors and whose `shape` is the [out, in] shape of the effective weight.
    """

    shape: tuple[int, int]
    row_alignment = 1  # `rows` takes ranges whose bounds are multiples of this (or the last row)

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The effective float32 weight, written into `out` (a contiguous [out, in] float32
        tensor) when given; never cached, so that only the stored form stays in memory."""
        raise NotImplementedError

    def rows(self, start: int, stop: int) -> "StoredWeight":
        """Rows start:stop of the weight in their stored form (views, nothing copied)."""
        raise NotImplementedError

    def map(self, fn) -> "StoredWeight":
        """A copy whose tensor fields are `fn(tensor)` (what `nn.Module._apply` does to parameters:
        moving to a device)."""
        return dataclasses.replace(self, **{f.name: fn(v) for f in dataclasses.fields(self)
                                            if isinstance(v := getattr(self, f.name), torch.Tensor)})


def effective(weight: "torch.Tensor | StoredWeight") -> torch.Tensor:
    """The float32 value of a weight held as a tensor or in its stored form."""
    return weight if isinstance(weight, torch.Tensor) else weight.dequantize()


# Codes decoded at a time by `lookup_bytes`'s torch path: the int32 indices and the values of one
# chunk stay in cache. A power of two, so that a chunk holds whole bitsandbytes blocks.
LOOKUP_CHUNK = 1 << 16


def lookup_bytes(table: torch.Tensor, codes: torch.Tensor, out: torch.Tensor,
                 scales: torch.Tensor | None = None, group: int = 1) -> None:
    """out = table[codes] for flat uint8 `codes` and a flat float32 `out`: one value per code from
    a float32 table, or a pair per code from an int64 table of float32 pairs (two 4-bit codes per
    byte). With `scales`, the values of each `group` codes (a whole number of groups) are then
    multiplied by that group's scale, while they are in cache.

    `index_select`, a chunk of codes at a time through int32 indices (never an int64 temporary):
    the plain-torch decode, where harness.quant.native's does not apply."""
    width = table.element_size() // 4
    values = out.view(table.dtype)  # one element per code
    chunk = max(1, LOOKUP_CHUNK // group) * group
    index = torch.empty(min(chunk, codes.numel()), dtype=torch.int32, device=codes.device)
    for start in range(0, codes.numel(), chunk):
        stop = min(start + chunk, codes.numel())
        torch.index_select(table, 0, index[:stop - start].copy_(codes[start:stop]), out=values[start:stop])
        if scales is not None:
            out[start * width:stop * width].view(-1, group * width).mul_(scales[start // group:stop // group, None])


def dequantize_fp8(qweight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None,
                   remap: torch.Tensor | None = None) -> torch.Tensor:
    """The effective weight float32(q) * scale, written into `out` when given; with `remap`
    (Fp8Parts.remap), q is remap[stored code].

    In C on the CPU (harness.quant.native). Else float32(q) is looked up per byte in a 256-entry
    table (torch's own float8 -> float32 cast is several times slower on CPU); a per-tensor scale
    is multiplied into the table (the same product per value); per channel, each row is scaled
    while it is in cache.
    """
    rows, cols = qweight.shape
    if out is None:
        out = torch.empty((rows, cols), dtype=torch.float32, device=qweight.device)
    codes = qweight.contiguous().view(torch.uint8).reshape(-1)
    per_tensor = scale.numel() == 1
    scales = scale.reshape(-1).float().contiguous()
    if native.decode_e4m3(codes, remap, scales, codes.numel() if per_tensor else cols, out.view(-1)):
        return out
    table = _float_table(qweight.dtype, qweight.device)
    if remap is not None:
        table = table[remap.int()]
    if per_tensor:
        lookup_bytes(table * scale.reshape(()), codes, out.view(-1))
    else:
        lookup_bytes(table, codes, out.view(-1), scales, max(1, cols))
    return out


@functools.cache
def _float_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """float32 of each of the 256 values of a one-byte float dtype, exactly as its cast gives them."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float().to(device)


def all_finite(t: torch.Tensor) -> bool:
    """Whether a floating tensor holds no NaN and no infinity. Its sum is finite only then: one
    pass, the cheapest there is; a sum that overflows is looked at again (finite_bounds)."""
    return math.isfinite(float(t.sum())) or finite_bounds(t) is not None


def finite_bounds(t: torch.Tensor) -> tuple[float, float] | None:
    """(min, max) of a floating tensor, or None when it holds a NaN or an infinity: one pass and
    no full-size temporary (NaN propagates through min and max), where `isfinite` allocates a mask."""
    if t.numel() == 0:
        return 0.0, 0.0
    lo, hi = (float(v) for v in torch.aminmax(t))
    return (lo, hi) if math.isfinite(lo) and math.isfinite(hi) else None


@dataclass
class Fp8Parts(StoredWeight):
    """What an FP8 weight is made of: its stored form, kept so that fused shards can be requantized."""

    qweight: torch.Tensor  # float8_e4m3fn, [out, in], as stored
    scale: torch.Tensor  # float32: shape () or (1,) per tensor, (out, 1) per channel
    input_scale: torch.Tensor | None = None  # float32 scalar, static schemes only
    # uint8 [256]: once requantized (fp8.requantize_fused), the code each stored code stands for;
    # the stored bytes are never rewritten. None: the stored codes are the codes.
    remap: torch.Tensor | None = None

    @property
    def per_channel(self) -> bool:
        return self.scale.numel() > 1

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)

    def codes(self) -> torch.Tensor:
        """The weight's float8 codes (the stored ones through `remap`), materialised."""
        if self.remap is None:
            return self.qweight
        return self.remap[self.qweight.view(torch.uint8).int()].view(self.qweight.dtype)

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        return dequantize_fp8(self.qweight, self.scale, out, self.remap)

    def rows(self, start: int, stop: int) -> "Fp8Parts":
        scale = self.scale.reshape(-1, 1)[start:stop] if self.per_channel else self.scale
        return Fp8Parts(self.qweight[start:stop], scale, self.input_scale, self.remap)


@dataclass(init=False)
class Decoded:
    """One linear weight as decoded from disk.

    `stored` is what the model keeps: a float32 tensor (unquantized weights, and weights quantized
    online) or a `StoredWeight`. `weight` is the effective float32 value, dequantized on each read;
    assigning it replaces the stored form with that tensor.
    """

    label: str
    stored: "torch.Tensor | StoredWeight"
    fp8: Fp8Parts | None
    settings: dict  # what must match for shards to fuse (quant_type, blocksize, ...)

    def __init__(self, label: str, weight: "torch.Tensor | StoredWeight", fp8: Fp8Parts | None = None,
                 settings: dict | None = None):
        self.label, self.stored, self.fp8 = label, weight, fp8
        self.settings = {} if settings is None else settings

    @property
    def weight(self) -> torch.Tensor:
        return effective(self.stored)

    @weight.setter
    def weight(self, value: torch.Tensor) -> None:
        self.stored = value

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.stored.shape)
