"""Cross-engine localisation: two engines' full traces of the same sequences, module by module
(docs/design.md, "Localisation").

Per module and prompt: |Δ| per position is the largest element difference of that position's
output; the module differs where it exceeds the module's own noise (harness.traces.noise; 0 where
none was measured). Inputs likewise. Effective weights (``PromptTrace.weights``) differ beyond
``WEIGHT_RTOL`` of their size: the two engines project the same weight on the same vectors, and
only the order of a float32 sum over ``in_features`` products may differ.
"""
from __future__ import annotations

from harness import records as R
from harness.traces import PromptTrace, flips
from harness.traces.localise import WEIGHT_RTOL, Delta, PromptDeltas, localise
from harness.registry import ENGINES
from harness.traces.noise import ModuleNoise

def kernel_rtol(*engines: str) -> float:
    return max(ENGINES[e].kernel_rtol if e in ENGINES else 0.0 for e in engines)


def position_delta(a, b, noise: float, rtol: float = 0.0) -> Delta:
    """|Δ| of two [positions, features] tensors: the largest element difference, and the first
    position where it exceeds the noise (at least ``rtol`` of ``a``'s largest |value|); a shape
    mismatch differs without bound."""
    if a.shape != b.shape:
        return Delta(float("inf"), noise, None)
    noise = max(noise, rtol * float(a.abs().max())) if a.numel() else noise
    per_position = (a - b).abs().nan_to_num(nan=float("inf")).amax(dim=1) if a.numel() else a.new_zeros(1)
    beyond = (per_position > noise).nonzero()
    return Delta(float(per_position.max()), noise, int(beyond[0, 0]) if len(beyond) else None,
                 scale=float(a.abs().max()) if a.numel() else 0.0)


def weights_differ(a, b) -> bool:
    if a.shape != b.shape:
        return True
    return float((a - b).abs().max()) > WEIGHT_RTOL * max(float(a.abs().max()), float(b.abs().max()))


def prompt_deltas(mine: PromptTrace, theirs: PromptTrace, noise: ModuleNoise | None = None,
                  rtol: float = 0.0) -> PromptDeltas:
    """The per-module differences of one prompt, in ``mine``'s execution order, over the modules
    both traces recorded; ``rtol``: the kernel floor (:func:`kernel_rtol`)."""
    noise = noise or ModuleNoise()
    order = [n for n in mine.order if n in theirs.outputs and n in mine.outputs]
    return PromptDeltas(
        prompt=mine.prompt,
        order=order,
        outputs={n: position_delta(mine.outputs[n], theirs.outputs[n], noise.outputs.get(n, 0.0), rtol) for n in order},
        inputs={n: position_delta(mine.inputs[n], theirs.inputs[n], noise.inputs.get(n, 0.0), rtol)
                for n in order if n in mine.inputs and n in theirs.inputs},
        weights={n: weights_differ(w, theirs.weights[n]) for n, w in mine.weights.items() if n in theirs.weights},
        quantizers=mine.quantizers | theirs.quantizers,
    )


def cross_engine(mine: list[PromptTrace], theirs: list[PromptTrace], against: str,
                 noise: ModuleNoise | None = None, note: str = "", rtol: float = 0.0) -> R.Localisation:
    """The localisation of ``mine`` against ``theirs`` (the other engine's traces, same prompts);
    ``rtol``: the kernel floor of the two engines (:func:`kernel_rtol`)."""
    by_prompt = {t.prompt: t for t in theirs}
    deltas = [prompt_deltas(t, by_prompt[t.prompt], noise, rtol) for t in mine if t.prompt in by_prompt]
    if rtol:
        note += f"; noise at least {rtol:g} of each module's largest output (kernels other than torch's)"
    if (noise is None or noise.measured_by is None) and not rtol:
        note += "; no per-module noise measured: any difference counts"
    flip = None if rtol else flips.explain_across(mine, theirs, noise, deltas, against)
    return localise(deltas, against, note).model_copy(update={"rounding_flip": flip})
