"""Telling an FP8 rounding flip from a bug (docs/design.md, "Portability across CPUs").

On other kernels a scaled activation that lies within kernel noise of a rounding boundary may round
to the neighbouring FP8 value, and attention carries the change to every later position. Such a
difference is explained when, on every prompt whose trace differs from the baseline's fingerprint:

1. the first diverging module (harness.traces.localise) is a leaf that quantizes its input;
2. its input agrees with the baseline's within kernel noise;
3. some of its input's elements lie within that noise of a rounding boundary (they can flip); and
4. its output moved no more than flipping ``MAX_FLIPS`` of those elements by one FP8 step can move
   it: each flip of element j at position p moves the output by step x scale x |W[:, j]|, and a
   projection on the fingerprint's unit matrix by at most that times the matrix row's norm.

The noise is the element noise the fingerprint stores for the module that made the input (or for
the input itself where code between modules made it). Nothing here is a prediction: it is what this
run's own trace shows against what the baseline stored. Whether the loaded state is exact, the
other half of the rule, is the comparison's (harness.compare.rounding_flip).
"""
from __future__ import annotations

from harness import records as R
from harness.traces import PromptTrace
from harness.traces.fingerprint import Fingerprint, unit_matrices
from harness.traces.localise import PromptDeltas, classify, first_diverging

MAX_FLIPS = 4


class Unexplained(Exception):
    """Why a difference is not a rounding flip; ``str()`` is one line."""


def explain(fp: Fingerprint, traces: list[PromptTrace], prompts: list[PromptDeltas]) -> R.RoundingFlip:
    """Whether rounding flips explain how ``traces`` moved from ``fp`` (``prompts``: the per-module
    deltas of fingerprint.deltas)."""
    by_prompt = {t.prompt: t for t in traces}
    rows = {r.module: r for r in fp.modules}
    at = []
    try:
        for p in prompts:
            m = first_diverging(p)
            if m is not None:
                at.append(_flip_at(p, m, by_prompt[p.prompt], rows))
        if not at:
            raise Unexplained("no module differs from the fingerprint beyond its noise")
    except Unexplained as e:
        return R.RoundingFlip(explained=False, detail=f"not a rounding flip: {e}", at=at)
    worst = max(at, key=lambda a: a.steps)
    where = "; ".join(f"prompt {a.prompt} at {a.module}, {a.fragile} fragile input element(s), output moved "
                      f"{a.steps:.2g} FP8 step(s)" for a in at)
    return R.RoundingFlip(explained=True, at=at, detail=f"rounding flip at {worst.module}: {where} (at most {MAX_FLIPS})")


def _flip_at(p: PromptDeltas, m: str, trace: PromptTrace, rows: dict) -> R.FlipAt:
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
    noise = _input_noise(m, trace, rows)
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
    out_shape = tuple(trace.outputs[m].shape)
    row_norm = unit_matrices(out_shape).norm(dim=2).amax(dim=0)  # [positions]: largest over projections
    per_flip = fp8.step_at(boundary) * scale * norms.double()[None, :] * row_norm[:, None]
    moves = per_flip[fragile]
    bound = float(moves.topk(min(MAX_FLIPS, count)).values.sum())
    moved = p.outputs[m]
    if not moved.delta <= bound + moved.noise:
        raise Unexplained(f"prompt {p.prompt}: {m}'s output moved {moved.delta:.3g}, more than {MAX_FLIPS} one-step "
                          f"flips of its {count} fragile input element(s) can ({bound:.3g})")
    return R.FlipAt(prompt=p.prompt, module=m, fragile=count, moved=moved.delta, bound=bound,
                    steps=moved.delta / float(moves.max()))


def _input_noise(m: str, trace: PromptTrace, rows: dict) -> float:
    """The stored element noise of ``m``'s input: its own where code between modules made it, else
    that of the module whose output it is."""
    import torch

    row = rows.get(m)
    if row is not None and row.input_noise:
        return row.input_noise[0]
    x = trace.inputs[m]
    for name in trace.order[: trace.order.index(m)]:
        y = trace.outputs.get(name)
        if y is not None and y.shape == x.shape and torch.equal(x, y) and name in rows:
            return rows[name].noise[0]
    return 0.0
