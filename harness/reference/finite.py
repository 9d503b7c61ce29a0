"""Non-finite unquantized weights, found when first used rather than scanned at load.

A NaN or an infinity in a linear's weight reaches every output of that row for every input (NaN
times anything is NaN, an infinity times zero is NaN), so a linear whose output is finite on a
finite input has a finite weight. The loader therefore hooks each unquantized linear: the first
call looks at the output (a few thousand values), and only when that is not finite at the weight
itself, which is named in a one-line CheckpointError. The hook then removes itself. This costs
nothing where a scan of every weight at load costs one pass over the whole checkpoint (on a
2.3 GB float32 model, a third of the load; docs/design.md, "Fast loading"). Quantized weights
are checked where they are decoded (their scales); their codes cannot hold a NaN the decoders do
not refuse.
"""
from __future__ import annotations

import torch
from torch import nn

from harness.errors import CheckpointError
from harness.quant import all_finite

WHAT = "NaN or infinite values in an unquantized weight"


def check_on_first_use(module: nn.Module, weight_key: str) -> None:
    """Hook ``module`` (a linear holding an unquantized weight stored as ``weight_key``)."""
    handle = None

    def hook(mod: nn.Module, args, output: torch.Tensor) -> None:
        if not bool(torch.isfinite(output).all()) and not all_finite(mod.weight):
            raise CheckpointError(weight_key, f"{WHAT} (found when the module was first called)")
        handle.remove()  # a finite output, or a non-finite input through a finite weight

    handle = module.register_forward_hook(hook)
