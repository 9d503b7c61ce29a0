"""Each module's own noise (docs/design.md, "Localisation"): the reference traces the same
sequences in fresh interpreters (harness.measure_noise.measure_modules), executed as the cell's engine
executes (fused or not): A under this machine's kernels, and one trace under each other kernel set
(harness.measure_noise.other_kernels: a lowered ``ATEN_CPU_CAPABILITY``, MKL's and oneDNN's AVX2
paths, and both at AVX2). A lowered torch capability alone leaves the BLAS kernels as they were,
and an AVX2-only CPU moved modules beyond a noise measured that way (issue 26). A module's noise is
``NOISE_FACTOR`` x the largest difference between A and another trace, of its output (and of its
input), measured with FP8 rounding of activations turned off
(harness.reference.linear.without_activation_rounding): a flip in another trace would move every
module after it by far more than the kernels' noise, which is what the noise is for telling a flip
from (harness.traces.flips).

This module is the data and the arithmetic; harness.noise_child records the traces.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

# A module's noise: this many times the largest difference between A and another trace (another
# CPU deviates from the exact value about as much as these do, possibly the other way).
NOISE_FACTOR = 2.0

if TYPE_CHECKING:
    from harness.traces import PromptTrace


@dataclass
class ModuleNoise:
    outputs: dict[str, float] = field(default_factory=dict)
    inputs: dict[str, float] = field(default_factory=dict)
    measured_by: str | None = None  # "reference" or "reference-unfused"; None: not measured
    kernels: list[str] = field(default_factory=list)  # [A's capability, then each other trace's kernels]


@dataclass
class Measured:
    noise: ModuleNoise
    a: list[PromptTrace]  # the traces under this machine's kernels (activations not rounded)
    others: list[list[PromptTrace]]  # one per set of harness.measure_noise.other_kernels


def noise_between(a: list[PromptTrace], others: list[list[PromptTrace]], measured_by: str,
                  kernels: list[str]) -> ModuleNoise:
    """NOISE_FACTOR x the largest difference, per module, between ``a`` and any of ``others``."""
    noise = ModuleNoise(measured_by=measured_by, kernels=kernels)
    for ta, tb in ((ta, tb) for b in others for ta, tb in zip(a, b)):
        for store, xa, xb in ((noise.outputs, ta.outputs, tb.outputs), (noise.inputs, ta.inputs, tb.inputs)):
            for name, x in xa.items():
                y = xb.get(name)
                if y is not None and y.shape == x.shape:
                    d = NOISE_FACTOR * float((x - y).abs().max()) if x.numel() else 0.0
                    store[name] = max(store.get(name, 0.0), d)
    return noise
