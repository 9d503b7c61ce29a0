"""The noise child: ``python -m harness.noise_child JOB OUT``, started by harness.measure_noise under
the kernels it measures. The job's ``role`` says what it does:

- ``record`` (a run on other kernels): score the sequences and save the quantizer calls' scaled
  activations;
- ``analyse`` (run A): score them again, compare with each other run's, place each prompt's fragile onset and
  its bound after the onset from ``SIMULATED_RUNS`` simulated flips, and write the Noise
  (harness.noise, whose docstring gives the method);
- ``trace``: record the module traces of the sequences with FP8 rounding of activations turned off
  (harness.traces.noise).
"""
from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import torch

from harness import cpu, scoring, traces
from harness.engines import base
from harness.engines.reference import ReferenceEngine
from harness.matrix import Cell
from harness.noise import NOISE_FACTOR, SIMULATED_RUNS, Noise, NoiseError, Onset, PromptNoise
from harness.quant import fp8
from harness.quant.fp8 import FP8, FP8_MAX, nearest_boundary, rounding_boundaries
from harness.reference.linear import without_activation_rounding
from harness.traces.record import torch_module

# Quantizer calls whose activations every decoder position depends on: encoders, vision towers,
# projectors, and the key/value side of cross-attention (its k/v projections and its KV cache).
_SEEN_BY_ALL_POSITIONS = re.compile(
    r"(^|\.)(encoder|vision_model|visual|vision_tower|multi_modal_projector|audio_tower)(\.|$)"
    r"|(^|\.)(encoder_attn|cross_attn)(\.(k_proj|v_proj|kv_proj))?$"
)


def distance_to_boundary(scaled, boundaries):
    return nearest_boundary(scaled, boundaries)[0]


def flip_across(rows, noise, boundaries, chosen):
    """``rows`` with each chosen activation that lies within its ``noise`` of a rounding boundary
    moved just across that boundary, so that it rounds to the other FP8 neighbour: a flip another
    CPU's kernels can make."""
    distance, boundary = nearest_boundary(rows, boundaries)
    flip = chosen & (distance <= noise)
    here = rows.to(FP8).double()  # where the activation rounds to now; the other neighbour is across
    b32 = boundary.float()
    ulp = (torch.nextafter(b32, torch.full_like(b32, float("inf"))) - b32).double()
    across = boundary + torch.sign(boundary - here) * torch.maximum(distance, ulp)
    return torch.where(flip, across, rows.double()).to(rows.dtype)


class _Recorder:
    """Sees every scaled activation of one forward pass (through ``fp8.scaled_observer``), names it
    by the module whose forward made the call, and optionally adds simulated kernel noise."""

    def __init__(self, model, decoder_len: int, noises: list | None = None, seed: int = 0):
        self.decoder_len = decoder_len
        self.noises = noises  # per call, [positions, features]: flip what lies within it of a boundary
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)
        self.boundaries = rounding_boundaries() if noises is not None else None
        self.calls: list[tuple[str, bool, Any]] = []  # (quantizer, positional, scaled [positions, features])
        self._stack: list[str] = []
        self._counts: dict[str, int] = {}
        self._handles = []
        for name, module in model.named_modules():
            self._handles.append(module.register_forward_pre_hook(lambda _m, _a, name=name: self._enter(name)))
            self._handles.append(module.register_forward_hook(lambda *_: self._leave()))

    def _enter(self, name: str) -> None:
        self._stack.append(name)

    def _leave(self) -> None:
        self._stack.pop()

    def __call__(self, scaled):
        module = self._stack[-1] if self._stack else ""
        n = self._counts.get(module, 0)
        self._counts[module] = n + 1
        positional = (scaled.dim() >= 3 and scaled.shape[-2] == self.decoder_len
                      and not _SEEN_BY_ALL_POSITIONS.search(module))
        rows = _rows(scaled.detach())
        if self.noises is not None:
            # Run 0 flips every fragile activation; the others each one with probability 1/2.
            chosen = (torch.rand(rows.shape, generator=self.generator) < 0.5) if self.seed else torch.ones_like(rows, dtype=torch.bool)
            rows = flip_across(rows, self.noises[len(self.calls)], self.boundaries, chosen)
            scaled = _unrows(rows, scaled)
        self.calls.append((f"{module}#{n}", positional, rows.clone()))
        return scaled

    def close(self):
        for h in self._handles:
            h.remove()


def _rows(scaled):
    """[positions, features]: the position axis of a scaled activation is its second last."""
    return scaled.movedim(-2, 0).reshape(scaled.shape[-2], -1) if scaled.dim() >= 2 else scaled.reshape(1, -1)


def _unrows(rows, like):
    if like.dim() < 2:
        return rows.reshape(like.shape)
    moved = like.movedim(-2, 0)
    return rows.reshape(moved.shape).movedim(0, -2)


def _score(engine, prompt, tokens: list[int], top_k: int, noises: list | None = None, seed: int = 0):
    recorder = _Recorder(engine.model, len(tokens), noises, seed)
    fp8.scaled_observer = recorder
    try:
        scored = scoring.teacher_forced(engine.model, engine._prompt(prompt), tokens, top_k)
    finally:
        fp8.scaled_observer = None
        recorder.close()
    return scored, recorder.calls


def _deltas(a, b) -> list[float]:
    """Per logprob index, the larger of |Δ| of the scored token and max |Δ| over the shared top-k."""
    out = []
    for la, lb, ka, kb in zip(a.logprobs, b.logprobs, a.topk, b.topk):
        d = 0.0 if la == lb else abs(la - lb)
        kb_map = dict(kb)
        d = max([d, *(abs(x - kb_map[t]) for t, x in ka if t in kb_map)])
        out.append(d if d == d else float("inf"))
    return out


def _first_flip(calls_a, calls_b) -> int:
    """Index of the first call whose FP8 codes differ between the runs (len(calls) when none)."""
    if len(calls_a) != len(calls_b):
        raise NoiseError(f"the runs made {len(calls_a)} and {len(calls_b)} quantizer calls")
    for i, ((la, _, ua), (lb, _, ub)) in enumerate(zip(calls_a, calls_b)):
        if la != lb or ua.shape != ub.shape:
            raise NoiseError(f"the runs made different quantizer calls at #{i}: {la} {tuple(ua.shape)} vs {lb} {tuple(ub.shape)}")
        qa = torch.clamp(ua, -FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)
        qb = torch.clamp(ub, -FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)
        if not torch.equal(qa, qb):
            return i
    return len(calls_a)


def _onset(calls, noises, boundaries) -> Onset | None:
    """The earliest position at which a scaled activation lies within its noise of a boundary."""
    best: Onset | None = None
    for (label, positional, rows), noise in zip(calls, noises):
        d = distance_to_boundary(rows, boundaries)
        fragile = d <= noise
        if not fragile.any():
            continue
        # A row is one position of a positional call; a fragile row of another call is seen by all.
        position = int(fragile.any(dim=1).nonzero()[0, 0]) if positional else 0
        if best is not None and position >= best.position:
            continue
        where = slice(position, position + 1) if positional else slice(None)
        candidates = torch.where(fragile[where], d[where], torch.full_like(d[where], float("inf"))).reshape(-1)
        i = int(candidates.argmin())
        best = Onset(position=position, quantizer=label, value=float(rows[where].reshape(-1)[i]),
                     distance=float(candidates[i]), noise=float(noise[where].reshape(-1)[i]))
    return best


def _three(x: float) -> float:
    return float(f"{x:.3g}")


def _three_up(x: float) -> float:
    """``x`` to three significant digits, rounded up: a stored bound never understates what was
    measured."""
    if x <= 0 or not math.isfinite(x):
        return x
    step = 10.0 ** (math.floor(math.log10(x)) - 2)
    up = float(f"{math.ceil(x / step) * step:.3g}")
    return up if up >= x else x


def load_reference(job: dict):
    """A noise child's reference engine, loaded fused or not as ``job`` says, and the cell's
    prompts by id."""
    torch.set_num_threads(1)
    cell = Cell.model_validate(job["cell"])
    engine = ReferenceEngine(cell, {"fuse": job["fuse"]})
    checkpoint = base.resolve_checkpoint(cell)
    engine.load(checkpoint)
    return engine, {p.id: p for p in base.prompts_for(cell, checkpoint)}


def run(job: dict, out: Path) -> None:
    engine, prompts = load_reference(job)
    cell = engine.cell
    sequences: dict[str, list[int]] = job["sequences"]
    runs = {pid: _score(engine, prompts[pid], tokens, cell.top_k) for pid, tokens in sequences.items()}
    if job["role"] == "record":
        torch.save({"capability": cpu.torch_capability(), "runs": runs}, out)
        return

    others = [(o["kernels"], torch.load(o["path"], weights_only=False)["runs"]) for o in job["others"]]
    boundaries = rounding_boundaries()
    quantizes = any(calls for _, calls in runs.values())
    clean_max = 0.0
    prompts_out = {}
    for pid, (scored, calls) in runs.items():
        # The noise of each scaled activation: NOISE_FACTOR x its largest deviation in any other run.
        # After a run's first flip its deviations are no longer noise but the flip's effect, which
        # makes every later activation fragile: the onset is then at the flip at the latest.
        noises, measured = None, [0.0] * len(scored.logprobs)
        for _, other in others:
            other_scored, other_calls = other[pid]
            deviations = [(a[2].double() - b[2].double()).abs() for a, b in zip(calls, other_calls)]
            first = _first_flip(calls, other_calls)
            clean_max = max([clean_max, *(float(d.max()) for d in deviations[: first + 1])])
            noises = deviations if noises is None else [torch.maximum(n, d) for n, d in zip(noises, deviations)]
            measured = [max(m, d) for m, d in zip(measured, _deltas(scored, other_scored))]
        noises = [NOISE_FACTOR * n for n in noises or []]
        onset = _onset(calls, noises, boundaries)
        bound = None
        if onset is not None:
            ensemble = [measured]
            for k in range(SIMULATED_RUNS):
                simulated, _ = _score(engine, prompts[pid], sequences[pid], cell.top_k, noises, seed=k)
                ensemble.append(_deltas(scored, simulated))
            bound = _three_up(max(max(d[onset.position:], default=0.0) for d in ensemble))
        prompts_out[pid] = PromptNoise(onset=onset, bound_after_onset=bound, logprob_noise=[_three(x) for x in measured])
    labels = [label for label, _ in others]
    note = None
    if quantizes and clean_max == 0.0:
        note = (f"kernels {', '.join(labels)} gave bit-identical activations: kernel noise not measured here, "
                "so no fragile onset is placed and the family bound applies everywhere")
    noise = Noise(measured_by="reference" if job["fuse"] else "reference-unfused",
                  kernels=[cpu.torch_capability() or "?", *labels],
                  activation_noise=_three(clean_max) if quantizes else None,
                  simulated_runs=SIMULATED_RUNS if any(p.onset for p in prompts_out.values()) else 0,
                  note=note, prompts=prompts_out)
    out.write_text(noise.model_dump_json())


def run_trace(job: dict, out: Path) -> None:
    engine, prompts = load_reference(job)
    without_activation_rounding(torch_module(engine.model))
    ids = [pid for pid in prompts if pid in job["sequences"]]
    traces.save(out, engine.trace([prompts[pid] for pid in ids], [job["sequences"][pid] for pid in ids]))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m harness.noise_child JOB OUT", file=sys.stderr)
        return 2
    job = json.loads(Path(args[0]).read_text())
    try:
        (run_trace if job["role"] == "trace" else run)(job, Path(args[1]))
    except NoiseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
