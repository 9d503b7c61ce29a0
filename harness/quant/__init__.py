"""On-disk quantization formats: one module per format (the skip rules they share are harness/dialects/).

Each format module decodes its layout in plain torch. The libraries that produce the layouts are
used only as oracles in the tests.
"""
from dataclasses import dataclass, field

import torch

# The label of a linear module, as the reference's load report and the fixture manifests spell it.
LABELS = (
    "unquantized",
    "bnb-nf4",
    "bnb-fp4",
    "fp8-tensor",
    "fp8-channel",
    "torchao-int8",
    "torchao-float8",
)


@dataclass
class Fp8Parts:
    """What an FP8 weight is made of, kept so that fused shards can be requantized."""

    qweight: torch.Tensor  # float8_e4m3fn, [out, in]
    scale: torch.Tensor  # float32: shape () or (1,) per tensor, (out, 1) per channel
    input_scale: torch.Tensor | None = None  # float32 scalar, static schemes only

    @property
    def per_channel(self) -> bool:
        return self.scale.numel() > 1


@dataclass
class Decoded:
    """One linear weight as decoded from disk."""

    label: str
    weight: torch.Tensor  # float32 [out, in]: the effective (dequantized) weight
    fp8: Fp8Parts | None = None
    settings: dict = field(default_factory=dict)  # what must match for shards to fuse (quant_type, blocksize, ...)
