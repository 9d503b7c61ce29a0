"""Telling an FP8 rounding flip between two engines from a bug (docs/design.md, "Cross-engine").

Two engines on the same machine sum in different orders, so a scaled activation that lies within
kernel noise of a rounding boundary may round to the neighbouring FP8 value in one of them, and
attention carries the change to every later position. Such a difference is explained when, on
every prompt whose trace differs from the other engine's full trace of the same sequences:

1. the first diverging module (harness.traces.localise) is a leaf that quantizes its input;
2. its input agrees with the baseline's within kernel noise;
3. some of its input's elements lie within that noise of a rounding boundary (they can flip); and
4. its output moved no more than flipping ``MAX_FLIPS`` of those elements by one FP8 step can move
   it: each flip of element j at position p moves that position's output by step x scale x |W[:, j]|
   (L2), each position's row held to its own fragile elements.

The noise is the group's measured module noise (harness.measure_noise) for the module that made
the input (or for the input itself where code between modules made it). Nothing here is a
prediction: it is what this run's own traces show against what the other engine computed on the
same kernels. Every module's effective weights in the two traces must agree (:func:`explain_across`).
Against a baseline nothing is explained away (harness.judging.rounding_flip).
"""
from __future__ import annotations

from dataclasses import dataclass

from harness import records as R
from harness.traces import PromptTrace
from harness.traces.localise import PromptDeltas, classify, first_diverging
from harness.traces.noise import ModuleNoise

MAX_FLIPS = 4


class Unexplained(Exception):
    """Why a difference is not a rounding flip; ``str()`` is one line."""


def explain_across(traces: list[PromptTrace], theirs: list[PromptTrace], noise: ModuleNoise | None,
                   prompts: list[PromptDeltas], other: str) -> R.RoundingFlip:
    """Whether rounding flips explain how ``traces`` differ from ``theirs``, ``other`` engine's full
    traces of the same sequences on the same kernels (``prompts``: harness.traces.diff.prompt_deltas).
    There the loaded state is compared by the effective weights the traces hold: every module's
    must agree."""
    if noise is None or noise.measured_by is None:
        return R.RoundingFlip(explained=False, detail="not a rounding flip: no per-module noise measured")

    def state(p: PromptDeltas) -> str | None:
        differ = [m for m, d in p.weights.items() if d]
        return f"{differ[0]}'s effective weights differ from {other}'s" if differ else None

    return _explain(traces, prompts, _Noise(noise.inputs, noise.outputs), {t.prompt: t for t in theirs}, state)


@dataclass
class _Noise:
    """Element noise per module: of its own input where stored, and of its output."""

    inputs: dict[str, float]
    outputs: dict[str, float]


def _explain(traces: list[PromptTrace], prompts: list[PromptDeltas], noise: _Noise,
             theirs: dict[str, PromptTrace], state) -> R.RoundingFlip:
    """``theirs``: the other engine's full traces by prompt. ``state(prompt deltas)``: why the
    loaded state is not shown equal there, or None."""
    by_prompt = {t.prompt: t for t in traces}
    at = []
    try:
        for p in prompts:
            if (why := state(p)) is not None:
                raise Unexplained(f"prompt {p.prompt}: {why}")
            m = first_diverging(p)
            if m is not None:
                at.append(_flip_at(p, m, by_prompt[p.prompt], theirs[p.prompt], noise))
        if not at:
            raise Unexplained("no module differs beyond its noise")
    except Unexplained as e:
        return R.RoundingFlip(explained=False, detail=f"not a rounding flip: {e}", at=at)
    worst = max(at, key=lambda a: a.steps)
    where = "; ".join(f"prompt {a.prompt} at {a.module}, {a.fragile} fragile input element(s), output moved "
                      f"{a.steps:.2g} FP8 step(s)" for a in at)
    return R.RoundingFlip(explained=True, at=at, detail=f"rounding flip at {worst.module}: {where} (at most {MAX_FLIPS})")


def _flip_at(p: PromptDeltas, m: str, trace: PromptTrace, other: PromptTrace, stored: _Noise) -> R.FlipAt:
    import torch

    # lazy: torch, numpy, +3.8 s (scripts/import-graph --costs)
    from harness.quant import fp8

    module, kind, why = classify(p, m)
    inp = p.inputs.get(m)
    if kind != "quantizer" or inp is None:
        raise Unexplained(f"prompt {p.prompt}: the first diverging module {module} is {kind} ({why}), not an "
                          "activation quantizer whose input agrees")
    x, norms = trace.inputs.get(m), trace.column_norms.get(m)
    if x is None or norms is None or m not in trace.input_scales:
        raise Unexplained(f"prompt {p.prompt}: {m}'s input quantization was not recorded")
    if x.shape[1] != norms.numel():  # traces flatten a 4-D input (Mllama's vision tiles) to tiles x the rest
        raise Unexplained(f"prompt {p.prompt}: {m}'s input is recorded as {x.shape[0]} rows of {x.shape[1]}, not of its "
                          f"{norms.numel()} input features, which the flip model does not cover")
    noise = _input_noise(m, trace, stored)
    if not noise > 0:
        raise Unexplained(f"prompt {p.prompt}: the element noise of {m}'s input is not measured")
    x = x.double()
    static = trace.input_scales[m]
    if static is not None:
        scale = torch.full((x.shape[0], 1), static, dtype=torch.float64)
        tolerance = noise / scale.expand_as(x)
    else:  # per token: amax / 448, and the amax itself may move by the noise
        amax = x.abs().amax(dim=1, keepdim=True)
        scale = torch.where(amax > 0, amax / fp8.FP8_MAX, torch.finfo(torch.float32).eps)
        tolerance = (noise + x.abs() * noise / amax.clamp(min=noise)) / scale
    distance, boundary = fp8.nearest_boundary(x / scale)
    fragile = distance <= tolerance
    count = int(fragile.sum())
    if count == 0:
        raise Unexplained(f"prompt {p.prompt}: no element of {m}'s input lies within kernel noise ({noise:.3g}) of "
                          "an FP8 rounding boundary, so none can flip")
    # a flip of element j at position p moves that position's output row by this much (L2)
    per_flip = fp8.step_at(boundary) * scale * norms.double()[None, :]
    moved, bound, largest = _on_full_outputs(p, m, trace, other, per_flip, fragile, stored.outputs.get(m, 0.0))
    return R.FlipAt(prompt=p.prompt, module=m, fragile=count, moved=moved, bound=bound, steps=moved / largest)


def _on_full_outputs(p: PromptDeltas, m: str, trace: PromptTrace, other: PromptTrace, per_flip, fragile,
                     noise: float) -> tuple[float, float, float]:
    """(moved, bound, largest single move) of ``m``'s output against the other engine's, position by
    position: a flip moves only its own position's row, by its move in L2 norm, so each row may move
    by the sum of its ``MAX_FLIPS`` largest fragile moves and the element noise over the row."""
    import torch

    mine, theirs = trace.outputs[m].double(), other.outputs[m].double()
    moved = (mine - theirs).norm(dim=1)  # [positions]
    moves = torch.where(fragile, per_flip, torch.zeros_like(per_flip))
    bound = moves.topk(min(MAX_FLIPS, moves.shape[1]), dim=1).values.sum(dim=1) + noise * mine.shape[1] ** 0.5
    over = (moved > bound).nonzero()
    if len(over):
        i = int(over[0, 0])
        raise Unexplained(f"prompt {p.prompt}: {m}'s output moved {float(moved[i]):.3g} at position {i}, more than "
                          f"{MAX_FLIPS} one-step flips of its fragile input elements there can ({float(bound[i]):.3g})")
    i = int(moved.argmax())
    return float(moved[i]), float(bound[i]), float(per_flip[fragile].max())


def _input_noise(m: str, trace: PromptTrace, stored: _Noise) -> float:
    """The stored element noise of ``m``'s input: its own where code between modules made it, else
    that of the module whose output it is."""
    import torch

    if stored.inputs.get(m):
        return stored.inputs[m]
    x = trace.inputs[m]
    for name in trace.order[: trace.order.index(m)]:
        y = trace.outputs.get(name)
        if y is not None and y.shape == x.shape and torch.equal(x, y) and name in stored.outputs:
            return stored.outputs[name]
    return 0.0
