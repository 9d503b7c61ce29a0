"""Linear modules of the reference model.

Every weight is held as its effective (dequantized) float32 value. What quantization does to the
numbers is modelled where it happens: in the decoded weight, in the requantization of fused FP8
shards, and in the fake quantization of FP8 input activations.
"""
import torch
from torch import nn
from torch.nn import functional as F

from harness.quant import fp8


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


class ReferenceLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, label: str,
                 input_quant: InputQuant | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.label = label
        self.input_quant = input_quant
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_quant is not None:
            x = self.input_quant(x)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features}->{self.out_features}, {self.label}, input={self.input_quant}"


class FusedLinear(ReferenceLinear):
    """Shards that share one fused weight (one FP8 scale, one input scale)."""

    def __init__(self, weight, bias, label, input_quant, sizes: list[int]):
        super().__init__(weight, bias, label, input_quant)
        self.sizes = sizes

    def shard(self, index: int) -> "ShardLinear":
        start = sum(self.sizes[:index])
        return ShardLinear(self, start, start + self.sizes[index])


class ShardLinear(nn.Module):
    """One checkpoint module's rows of a fused weight, called where the model calls that module.

    Slicing the fused weight gives exactly the rows the fused matmul would produce.
    """

    def __init__(self, fused: FusedLinear, start: int, stop: int):
        super().__init__()
        # A plain attribute, not a submodule: the fused weights are owned by the parent module.
        object.__setattr__(self, "fused", fused)
        self.start, self.stop = start, stop
        self.label = fused.label
        self.out_features, self.in_features = stop - start, fused.in_features

    @property
    def weight(self) -> torch.Tensor:
        return self.fused.weight[self.start:self.stop]

    @property
    def bias(self) -> torch.Tensor | None:
        return None if self.fused.bias is None else self.fused.bias[self.start:self.stop]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused.input_quant is not None:
            x = self.fused.input_quant(x)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"rows {self.start}:{self.stop} of fused {self.label}"
