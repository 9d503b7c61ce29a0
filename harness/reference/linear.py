"""Linear modules of the reference model.

A linear holds its weight as loaded: an unquantized float32 weight as a parameter (a view of the
memory-mapped checkpoint where the file allows), a quantized one in its stored form
(`harness.quant.StoredWeight`), dequantized on every call and never cached, as an engine's kernel
does. `weight` is the effective float32 value either way. What quantization does to the numbers is
modelled where it happens: in the dequantized weight, in the requantization of fused FP8 shards,
and in the fake quantization of FP8 input activations.
"""
import dataclasses
import threading

import torch
from torch import nn
from torch.nn import functional as F

from harness.quant import StoredWeight, effective, fp8


class InputQuant:
    """FP8 activation quantization as compressed-tensors applies it before a quantized linear."""

    def __init__(self, static_scale: torch.Tensor | None):
        self.static_scale = static_scale

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.static_scale is not None:
            return fp8.fake_quant(x, self.static_scale.to(x.device))
        return fp8.quantize_dynamic_per_token(x)

    def __repr__(self) -> str:
        return "static" if self.static_scale is not None else "dynamic-per-token"

    def loaded_state(self) -> dict:
        return {"kind": repr(self), "scale": self.static_scale}


def without_activation_rounding(model) -> None:
    """Turn off FP8 rounding of activations in ``model`` (input quantization and the KV cache's
    fake quantization), keeping the weights as loaded: what measures the kernels' own noise per
    module without the rounding flips the kernels cause (harness.traces.noise)."""
    for module in model.modules():
        if getattr(module, "input_quant", None) is not None:
            module.input_quant = None
        for name in ("k_scale", "v_scale"):
            module._buffers.pop(name, None)


def _held(weight: "torch.Tensor | StoredWeight") -> dict:
    """A weight's loaded state (harness.loaded_state): its effective float32 value and, for a
    stored one, the stored tensors and their form, so that both a decoding and a reading fault show."""
    if isinstance(weight, torch.Tensor):
        return {"effective": weight}
    fields = {f.name: getattr(weight, f.name) for f in dataclasses.fields(weight)}
    return {"effective": weight.dequantize(), "stored": type(weight).__name__, **fields}


def _linear_state(module, weights: dict) -> dict:
    quant = module.input_quant.loaded_state() if module.input_quant is not None else None
    return {"label": module.label, "bias": module.bias, "input_quant": quant, **weights}


# A stored weight of more elements than this is dequantized a block of rows of about this many
# elements at a time, each into the same buffer, and multiplied at once; a smaller one is
# dequantized whole into that buffer (splitting a matmul by rows may change the last bit of its
# result, and every tiny fixture's weights are below the block). Memory stays at the stored form
# plus one block: no call allocates a dequantized temporary of its own. 2 MiB of float32: at 4 MiB
# the block was an eighth of S bnb-nf4's 33 MB checkpoint and held its peak on target 1c's limit
# (issue 13), and blocks of half that size multiply no slower (BLAS takes 256-row blocks of a
# 2048-wide weight at full speed; 128-row ones are slower).
ROW_BLOCK = 1 << 19
_buffers = threading.local()  # device -> the float32 buffer weights are dequantized into


def project(x: torch.Tensor, weight: "torch.Tensor | StoredWeight", bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, effective weight, bias), with a large stored weight taken a block of rows at a time."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    rows, cols = weight.shape
    if rows * cols <= ROW_BLOCK:
        return F.linear(x, weight.dequantize(_buffer(rows, cols, x.device)), bias)
    step = max(1, ROW_BLOCK // cols // weight.row_alignment) * weight.row_alignment
    out = x.new_empty(*x.shape[:-1], rows)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        w = weight.rows(start, stop).dequantize(_buffer(stop - start, cols, x.device))
        out[..., start:stop] = F.linear(x, w, None if bias is None else bias[start:stop])
    return out


def _buffer(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """A [rows, cols] float32 view of this thread's buffer on `device`, grown when too small."""
    held = getattr(_buffers, "by_device", None)
    if held is None:
        held = _buffers.by_device = {}
    if device not in held or held[device].numel() < rows * cols:
        held[device] = torch.empty(rows * cols, dtype=torch.float32, device=device)
    return held[device][:rows * cols].view(rows, cols)


def _moved(weight, fn):
    """A held weight after `nn.Module._apply`'s `fn` (a device move)."""
    return fn(weight) if isinstance(weight, torch.Tensor) else weight.map(fn)


class ReferenceLinear(nn.Module):
    """`weight`: a float32 tensor (registered as the parameter `weight`) or a `StoredWeight`
    (kept as `stored`; reading `weight` dequantizes it)."""

    def __init__(self, weight: "torch.Tensor | StoredWeight", bias: torch.Tensor | None, label: str,
                 input_quant: InputQuant | None = None):
        super().__init__()
        self.stored = None if isinstance(weight, torch.Tensor) else weight
        if self.stored is None:
            self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.label = label
        self.input_quant = input_quant
        self.out_features, self.in_features = weight.shape

    def __getattr__(self, name: str):
        if name == "weight" and self.__dict__.get("stored") is not None:
            return self.stored.dequantize()
        return super().__getattr__(name)

    def _apply(self, fn, recurse=True):
        if self.stored is not None:
            self.stored = self.stored.map(fn)
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_quant is not None:
            x = self.input_quant(x)
        return project(x, self.weight if self.stored is None else self.stored, self.bias)

    def loaded_state(self) -> dict:
        return _linear_state(self, {"weight": _held(self.stored if self.stored is not None else self.weight)})

    def extra_repr(self) -> str:
        held = "" if self.stored is None else ", dequantized per call"
        return f"{self.in_features}->{self.out_features}, {self.label}, input={self.input_quant}{held}"


class FusedLinear(nn.Module):
    """Shards that execute as one projection (one FP8 input scale; per-tensor FP8 shards also
    share one requantized weight scale).

    `parts`: one weight per shard, each a float32 tensor or a `StoredWeight`, kept as they are: the
    fused weight is never materialised at load; calling the fused projection joins the shards'
    effective weights into one matmul. A single [sum(sizes), in] tensor and `sizes` also work.
    """

    def __init__(self, parts, bias: torch.Tensor | None, label: str, input_quant: InputQuant | None,
                 sizes: list[int] | None = None):
        super().__init__()
        self.parts = list(parts.split(sizes)) if isinstance(parts, torch.Tensor) else list(parts)
        self.sizes = [p.shape[0] for p in self.parts]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.label = label
        self.input_quant = input_quant
        self.out_features, self.in_features = sum(self.sizes), self.parts[0].shape[1]

    @property
    def weight(self) -> torch.Tensor:
        return torch.cat([effective(p) for p in self.parts])

    def shard(self, index: int) -> "ShardLinear":
        start = sum(self.sizes[:index])
        return ShardLinear(self, index, start, start + self.sizes[index])

    def _apply(self, fn, recurse=True):
        self.parts = [_moved(p, fn) for p in self.parts]
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_quant is not None:
            x = self.input_quant(x)
        return F.linear(x, self.weight, self.bias)

    def loaded_state(self) -> dict:
        return _linear_state(self, {"sizes": self.sizes, "parts": [_held(p) for p in self.parts]})

    def extra_repr(self) -> str:
        return f"{self.in_features}->{self.out_features}, {self.label}, input={self.input_quant}, shards {self.sizes}"


class ShardLinear(nn.Module):
    """One checkpoint module's rows of a fused projection, called where the model calls that module.

    Its weight is its own shard's (rows start:stop of the fused weight), dequantized on each call.
    """

    def __init__(self, fused: FusedLinear, index: int, start: int, stop: int):
        super().__init__()
        # A plain attribute, not a submodule: the fused weights are owned by the parent module.
        object.__setattr__(self, "fused", fused)
        self.index, self.start, self.stop = index, start, stop
        self.label = fused.label
        self.out_features, self.in_features = stop - start, fused.in_features

    @property
    def weight(self) -> torch.Tensor:
        return effective(self.fused.parts[self.index])

    @property
    def bias(self) -> torch.Tensor | None:
        return None if self.fused.bias is None else self.fused.bias[self.start:self.stop]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused.input_quant is not None:
            x = self.fused.input_quant(x)
        return project(x, self.fused.parts[self.index], self.bias)

    def loaded_state(self) -> dict:
        """Its rows of the fused projection (the weights are the fused module's state)."""
        return {"label": self.label, "shard": [self.index, self.start, self.stop]}

    def extra_repr(self) -> str:
        return f"rows {self.start}:{self.stop} of fused {self.label}"
