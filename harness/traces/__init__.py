"""Module traces: the output of every module of one scored sequence, in execution order
(docs/design.md, "Localisation").

The shared shape every engine produces (``Engine.trace``): the reference and transformers record
it with forward hooks (harness.traces.record), vLLM through ``LLM.apply_model``
(harness.traces.vllm). Nothing here imports torch at module level: the report imports this package.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class PromptTrace:
    """The trace of one prompt's scored sequence.

    ``order``: module names in first-execution order, in transformers' in-memory spelling
    (``model.named_modules()`` of the HF model: ``model.layers.0.self_attn.q_proj``), fused modules
    already split into their checkpoint shards (q_proj/k_proj/v_proj, gate_proj/up_proj).
    ``outputs``: name -> float32 [positions, features] output of the module on the scored
    sequence (batch dimension dropped; the first tensor of a tuple output); for encoder modules
    the positions are the encoder's. ``inputs``: name -> float32 [positions, features] first
    positional input of linear-like modules, so that "equal inputs" can be decided (may be
    restricted to leaf modules). Optional, for telling weights, kernel and quantizer apart:
    ``weights``: name -> float32 [out_features, WEIGHT_PROJECTIONS] = W @ weight_probe(in_features),
    the effective (dequantized) weight of a linear-like leaf times fixed random vectors (leave
    out what the engine cannot read); ``quantizers``: the leaves that quantize their input
    activations (FP8 dynamic or static input scales). For those, what tells a rounding flip's size
    (harness.traces.flips): ``input_scales``: name -> the static input scale, or None for a dynamic
    per-token one; ``column_norms``: name -> float32 [in_features], the norm of each column of the
    effective weight (how far the output moves per unit of that input)."""

    prompt: str  # prompt id (p0, p1, ...)
    order: list[str] = field(default_factory=list)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    quantizers: set[str] = field(default_factory=set)
    input_scales: dict[str, float | None] = field(default_factory=dict)
    column_norms: dict[str, torch.Tensor] = field(default_factory=dict)


WEIGHT_PROJECTIONS = 4


def weight_probe(in_features: int) -> torch.Tensor:
    """The fixed random vectors a weight is projected on: float32 [in_features, WEIGHT_PROJECTIONS],
    the same on every engine and machine (seeded by the size alone)."""
    import torch

    g = torch.Generator().manual_seed(in_features)
    return torch.randn(in_features, WEIGHT_PROJECTIONS, generator=g, dtype=torch.float32)


def save(path, traces: list[PromptTrace]) -> None:
    """Write traces with torch.save (plain dicts, lists and tensors: loadable with weights_only)."""
    import torch

    torch.save([{"prompt": t.prompt, "order": t.order, "outputs": t.outputs, "inputs": t.inputs,
                 "weights": t.weights, "quantizers": sorted(t.quantizers), "input_scales": t.input_scales,
                 "column_norms": t.column_norms} for t in traces], path)


def load(path) -> list[PromptTrace]:
    import torch

    return [PromptTrace(prompt=d["prompt"], order=d["order"], outputs=d["outputs"], inputs=d["inputs"],
                        weights=d["weights"], quantizers=set(d["quantizers"]),
                        input_scales=d.get("input_scales", {}), column_norms=d.get("column_norms", {}))
            for d in torch.load(path, weights_only=True)]
