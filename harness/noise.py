"""Each cell's own numerical noise, measured when its baseline is written (docs/design.md,
"Portability across CPUs").

A float32 forward pass sums in an order that the CPU's kernels choose, so two CPUs give logprobs
that differ in their last bits. Where a scheme quantizes activations to FP8 (dynamic or static
input scales, the FP8 KV cache), such a difference can move one scaled activation across an FP8
rounding boundary; attention then carries the flip to every later position. So the measurement
has two parts, both made by the reference (the semantics every engine of the cell computes):

1. **Kernel noise.** The reference scores the baseline's sequences in fresh interpreters (a kernel
   variable only takes effect before torch is imported): under this machine's kernels (run A, the
   baseline's own) and once under each other kernel set this machine can select
   (harness.measure_noise.other_kernels: a lowered ``ATEN_CPU_CAPABILITY``, the libraries' AVX2
   paths, and torch's and the libraries' AVX2 kernels together, as an AVX2-only CPU runs them).
   ``logprob_noise`` is the largest |A - B| per position over those runs B; the noise of each
   scaled activation is ``NOISE_FACTOR`` x its own largest |A - B| (another CPU deviates from the
   exact value about as much as these do, possibly the other way). ``activation_noise`` reports
   the largest |A - B| over the quantizer calls whose inputs no flip has reached yet in that run
   B (up to its first call whose FP8 codes differ).
2. **Fragile onset.** Per prompt, the first position at which one of A's scaled activations lies
   within its noise of an FP8 rounding boundary. An activation of an encoder (audio, vision) or of
   a cross-attention key/value is seen by every decoder position, so it places the onset at 0.
   Where A and B really flipped, the deviations after the flip are large, so the onset is at that
   flip at the latest. The onset carries its evidence: the quantizer call, the activation, its
   distance to the boundary and the noise it was compared with.

Past the onset, the comparison applies ``bound_after_onset``: the largest |Δlogprob| (scored
token or shared top-k) at or after the onset, over the runs B and ``SIMULATED_RUNS`` runs of A in
which the fragile activations (within their noise of a boundary) are moved just across it before
rounding: all of them in the first run, each with probability 1/2 in the others (seeded). These
are the flips another CPU can make, made on purpose. A baseline from the same CPU and
kernel set is compared with the family bound everywhere; nothing is loosened there.

This module is the data: what a baseline stores (``Noise``) and the constants the measurement
shares. harness.measure_noise launches the measurement; harness.noise_child is the child that runs
A or B.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict

NOISE_FACTOR = 2.0
SIMULATED_RUNS = 8
# Lowered capabilities to measure against, in order of preference: the first one that differs
# from the record's own.
CAPABILITIES = ("default", "avx2")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Onset(_Strict):
    """The first fragile position of a prompt and the activation that makes it fragile."""

    position: int  # logprob index (scores token position + 1) from which the prompt is judged by the noise bound
    quantizer: str  # "<module>#<call within that module's forward>"
    value: float  # the scaled activation (x / scale) before rounding
    distance: float  # to the nearest FP8 rounding boundary
    noise: float  # NOISE_FACTOR x activation_noise, what the distance was compared with


class PromptNoise(_Strict):
    onset: Onset | None = None
    bound_after_onset: float | None = None
    logprob_noise: list[float]  # |A - B| per logprob index, max of the scored token and the shared top-k


class Noise(_Strict):
    measured_by: str = "reference"  # or "reference-unfused", as an engine that never fuses executes
    kernels: list[str]  # [A's capability, then each run B's kernels (harness.measure_noise.other_kernels)]
    activation_noise: float | None = None  # ν; None where the cell quantizes no activation
    noise_factor: float = NOISE_FACTOR
    simulated_runs: int = 0
    note: str | None = None
    prompts: dict[str, PromptNoise]

    def bounds_for(self, prompt_id: str) -> tuple[int | None, float | None]:
        """(onset index, bound past it) of one prompt; (None, None) when it has no fragile onset."""
        p = self.prompts.get(prompt_id)
        if p is None or p.onset is None:
            return None, None
        return p.onset.position, p.bound_after_onset


class NoiseError(Exception):
    """The noise of a cell could not be measured. ``str()`` is one line."""


def other_capability(own: str | None) -> str | None:
    return next((c for c in CAPABILITIES if c != own), None)
