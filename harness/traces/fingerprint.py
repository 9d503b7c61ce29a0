"""The trace fingerprint a baseline stores (docs/design.md, "Localisation"): a compact, reviewable
summary of the cell's module trace, so that a regressed cell names the first module that moved
without the old engine at hand.

Per module, in execution order, one row (one line of the baseline file):

- ``out``: per prompt, ``PROJECTIONS`` projections of the module's output [positions, features]
  on fixed random unit matrices (seeded by the shape alone: the same on every machine), rounded
  to ``DIGITS`` significant digits;
- ``noise``: [element noise, projection noise], ``NOISE_FACTOR`` x |A - B| of the two reference
  runs of harness.traces.noise (the element noise serves the cross-engine comparison);
- ``weight``: projections of the effective weight (``PromptTrace.weights`` on fixed unit vectors),
  for leaves whose weight the engine reads, else null;
- ``input`` / ``input_noise``: the same for a leaf's input where no recorded module made it (an
  attention's output projection, an MLP's down projection): what tells "attention" or the
  module's own code from the module itself.

A fresh projection moved where |fresh - stored| exceeds the projection noise plus half a unit in
the stored value's last digit (the rounding). The fingerprint holds no positions. A leaf's input
with no row of its own is an earlier module's output: where that module agrees, so does the input.
"""
from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, model_serializer

from harness.traces import PromptTrace
from harness.traces.localise import WEIGHT_RTOL, Delta, PromptDeltas
from harness.traces.noise import NOISE_FACTOR, ModuleNoise

PROJECTIONS = 4
DIGITS = 4


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModuleRow(_Strict):
    module: str
    noise: list[float]  # [element, projection]
    out: list[list[float]]  # per prompt (Fingerprint.prompts), PROJECTIONS values
    weight: list[float] | None = None
    input: list[list[float]] | None = None
    input_noise: list[float] | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler):
        """Absent fields are left out of the row (one line per module, kept short)."""
        return {k: v for k, v in handler(self).items() if v is not None}


class Fingerprint(_Strict):
    engine: str  # the engine whose trace this is
    fused: bool  # whether it executed fused projections
    projections: int = PROJECTIONS
    digits: int = DIGITS
    noise_measured_by: str | None = None  # "reference" / "reference-unfused"; None: not measured (zero)
    kernels: list[str] = []
    noise_factor: float = NOISE_FACTOR
    prompts: list[str]
    quantizers: list[str] = []  # leaves that quantize their input activations
    modules: list[ModuleRow]

    def noise(self) -> ModuleNoise:
        """The element noise per module, for a cross-engine comparison of full traces."""
        return ModuleNoise(outputs={r.module: r.noise[0] for r in self.modules},
                           inputs={r.module: r.input_noise[0] for r in self.modules if r.input_noise},
                           measured_by=self.noise_measured_by, kernels=list(self.kernels))


def _unit(shape: tuple[int, ...], seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    r = torch.randn(PROJECTIONS, *shape, generator=g, dtype=torch.float64)
    return r / r.flatten(1).norm(dim=1).reshape(-1, *([1] * len(shape)))


def unit_matrices(shape: tuple[int, int]):
    """float64 [PROJECTIONS, positions, features]: the unit matrices a tensor of ``shape`` is
    projected on, seeded by the shape alone."""
    return _unit(shape, shape[0] * 1_000_003 + shape[1])


def project(x) -> list[float]:
    """PROJECTIONS projections of a [positions, features] tensor on unit random matrices seeded by its shape."""
    import torch

    if x.numel() == 0:
        return [0.0] * PROJECTIONS
    return [float(v) for v in torch.einsum("kpf,pf->k", unit_matrices(tuple(x.shape)), x.double())]


def project_weight(w) -> list[float]:
    """PROJECTIONS values of a weight's [out_features, WEIGHT_PROJECTIONS] projection."""
    import torch

    r = _unit((w.shape[0],), w.shape[0])  # [PROJECTIONS, out]
    return [float(v) for v in torch.einsum("ko,ok->k", r, w.double()[:, : PROJECTIONS])]


def rounded(values: list[float]) -> list[float]:
    return [float(f"{v:.{DIGITS}g}") if math.isfinite(v) else v for v in values]


def half_unit(v: float) -> float:
    """Half a unit in the last stored digit of ``v``: what rounding may have moved it."""
    if v == 0 or not math.isfinite(v):
        return 0.0
    return 0.5 * 10.0 ** (math.floor(math.log10(abs(v))) - DIGITS + 1)


def _made_between_modules(trace: PromptTrace) -> set[str]:
    """Leaves whose recorded input is no recorded output of the same trace (code made it)."""
    import torch

    seen: dict[tuple, list] = {}
    for x in trace.outputs.values():
        seen.setdefault(tuple(x.shape), []).append(x)
    return {n for n, x in trace.inputs.items()
            if not any(torch.equal(x, y) for y in seen.get(tuple(x.shape), ()))}


def make(traces: list[PromptTrace], engine: str, fused: bool, a: list[PromptTrace] | None = None,
         others: list[list[PromptTrace]] = (), noise: ModuleNoise | None = None) -> Fingerprint:
    """The fingerprint of ``traces`` (the cell's engine's), with the noise of the reference run
    ``a`` against the runs on ``others`` kernels (harness.measure_noise.measure_modules) where measured."""
    first = traces[0]
    with_input = _made_between_modules(first)
    rows = []
    for name in first.order:
        if name not in first.outputs:
            continue
        out = [project(t.outputs[name]) for t in traces]
        proj_noise = _projection_noise(name, "outputs", a, others)
        row = ModuleRow(module=name, noise=[_noise(noise, "outputs", name), proj_noise], out=[rounded(o) for o in out])
        if name in first.weights:
            row.weight = rounded(project_weight(first.weights[name]))
        if name in with_input and all(name in t.inputs for t in traces):
            row.input = [rounded(project(t.inputs[name])) for t in traces]
            row.input_noise = [_noise(noise, "inputs", name), _projection_noise(name, "inputs", a, others)]
        rows.append(row)
    return Fingerprint(engine=engine, fused=fused, noise_measured_by=noise.measured_by if noise else None,
                       kernels=noise.kernels if noise else [], prompts=[t.prompt for t in traces],
                       quantizers=[n for n in first.order if n in first.quantizers], modules=rows)


def _noise(noise: ModuleNoise | None, kind: str, name: str) -> float:
    return float(f"{getattr(noise, kind).get(name, 0.0):.3g}") if noise else 0.0


def _projection_noise(name: str, kind: str, a, others) -> float:
    if not a or not others:
        return 0.0
    worst = 0.0
    for ta, tb in ((ta, tb) for b in others for ta, tb in zip(a, b)):
        xa, xb = getattr(ta, kind).get(name), getattr(tb, kind).get(name)
        if xa is not None and xb is not None and xa.shape == xb.shape:
            worst = max([worst, *(abs(p - q) for p, q in zip(project(xa), project(xb)))])
    return float(f"{NOISE_FACTOR * worst:.3g}")


def _moved(stored: list[float], fresh: list[float], noise: float) -> Delta:
    d = max(abs(s - f) if math.isfinite(f) else math.inf for s, f in zip(stored, fresh))
    return Delta(d, noise + max(half_unit(s) for s in stored), scale=max(abs(s) for s in stored))


def deltas(fp: Fingerprint, traces: list[PromptTrace]) -> list[PromptDeltas]:
    """Per prompt, how far ``traces`` moved from the stored fingerprint, module by module."""
    by_prompt = {t.prompt: t for t in traces}
    out = []
    for i, pid in enumerate(fp.prompts):
        t = by_prompt.get(pid)
        if t is None:
            continue
        rows = [r for r in fp.modules if r.module in t.outputs]
        p = PromptDeltas(prompt=pid, order=[r.module for r in rows], outputs={}, quantizers=set(fp.quantizers))
        for r in rows:
            p.outputs[r.module] = _moved(r.out[i], project(t.outputs[r.module]), r.noise[1])
            if r.input is not None and r.module in t.inputs:
                p.inputs[r.module] = _moved(r.input[i], project(t.inputs[r.module]), r.input_noise[1])
            elif r.module in t.inputs:  # no row: the input is an earlier module's output, compared there
                p.inputs[r.module] = Delta(0.0, 0.0)
            if r.weight is not None and r.module in t.weights:
                fresh = project_weight(t.weights[r.module])
                tolerance = WEIGHT_RTOL * max(abs(v) for v in fresh) + max(half_unit(s) for s in r.weight)
                p.weights[r.module] = max(abs(s - f) for s, f in zip(r.weight, fresh)) > tolerance
        out.append(p)
    return out
