"""Module traces recorded inside vLLM (harness.traces.vllm, ``VllmEngine.trace``), against the
reference's traces of the same sequences, float32 (where vLLM matches the reference to ~1e-6 per
module): on llama unquantized, hooks fire for every projection of every layer, names, shapes and
order are transformers', every module agrees; and a loading fault inside vLLM (the test-only
``HARNESS_VLLM_MUTATION=merged-shards-swapped``) is localised by harness.traces' rule to the
modules it breaks: gate_proj/up_proj on llama, the cross-attention k_proj/v_proj on whisper (issue
14's "swapped k/v in cross-attention"), each pair swapped, so either of the two is the right name.

Three vLLM engine starts (~30 s each here), each in its own interpreter: the mutation patches
vLLM's classes for the life of the process. The conversion of a recording into transformers'
shape is also tested alone, without vLLM.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness import matrix
from harness.engines import base
from harness.engines.reference import ReferenceEngine
from harness.engines.vllm import MUTATION_ENV
from harness.traces import diff
from harness.traces import vllm as vllm_traces_module

# vLLM is not imported here: the engine children import it
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

ROOT = Path(__file__).resolve().parent.parent
CELL = "llama.unquantized.vllm"
# Each module's noise against vLLM: this much of its largest reference output (input), 10x the
# float32 level of vLLM's kernels (<= 2e-6 on every module here; docs/README-vllm.md, "Module traces").
REL_TOL = diff.KERNEL_RTOL["vllm"]
# The reference's modules that vLLM has no counterpart for (harness.traces.vllm's docstring).
NOT_IN_VLLM = {"", "model", "model.rotary_emb"} | {f"model.layers.{i}.mlp.act_fn" for i in range(12)}
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")

CHILD = """
import json, sys, torch
from harness import matrix
from harness.engines import base
from harness.engines.vllm import VllmEngine
cell = next(c for c in matrix.load().cells(tier="cpu-tiny") if c.id == sys.argv[1])
ckpt = base.resolve_checkpoint(cell)
engine = VllmEngine(cell)
engine.load(ckpt)
prompts = base.prompts_for(cell, ckpt)
sequences = json.loads(sys.argv[2])
torch.save(engine.trace(prompts, [sequences[p.id] for p in prompts]), sys.argv[3])
"""


def vllm_traces(tmp: Path, cell: str, sequences: dict[str, list[int]], mutation: str | None) -> list:
    out = tmp / f"traces-{cell}-{mutation or 'control'}.pt"
    env = {k: v for k, v in os.environ.items() if k != MUTATION_ENV}
    if mutation:
        env[MUTATION_ENV] = mutation
    proc = subprocess.run([sys.executable, "-c", CHILD, cell, json.dumps(sequences), str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


def reference_traces(cell_id: str) -> tuple[dict[str, list[int]], list]:
    """The reference's traces of prompt + its own greedy continuation, and those sequences."""
    cell = next(c for c in matrix.load().cells(tier="cpu-tiny") if c.id == cell_id.replace(".vllm", ".reference"))
    ckpt = base.resolve_checkpoint(cell)
    engine = ReferenceEngine(cell)
    engine.load(ckpt)
    prompts = base.prompts_for(cell, ckpt)
    greedy = engine.greedy(prompts, cell.max_tokens, 1)
    sequences = {p.id: p.tokens + g.tokens for p, g in zip(prompts, greedy)}
    traces = engine.trace(prompts, [sequences[p.id] for p in prompts])
    engine.close()
    return sequences, traces


@pytest.fixture(scope="module")
def reference():
    return reference_traces(CELL)


@pytest.fixture(scope="module")
def control(reference, tmp_path_factory):
    return vllm_traces(tmp_path_factory.mktemp("vllm-traces"), CELL, reference[0], None)


def relative_delta(ours, theirs) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max().clamp_min(1e-30))


def localise(traces, ref):
    """harness.traces' localisation of vLLM's traces against the reference's, as the runner does it:
    no per-module noise of the reference's, vLLM's kernel floor (diff.KERNEL_RTOL)."""
    return diff.cross_engine(traces, ref, "reference", rtol=diff.kernel_rtol("vllm", "reference"))


@needs_vllm
def test_hooks_fire_for_every_projection_in_transformers_names_and_shapes(reference, control):
    sequences, ref = reference
    for r, v in zip(ref, control):
        assert v.prompt == r.prompt
        n = len(sequences[v.prompt])
        for i in range(12):
            for p in PROJECTIONS:
                name = f"model.layers.{i}.{p}"
                assert name in v.outputs and name in v.inputs, (v.prompt, name)
                assert v.outputs[name].shape == r.outputs[name].shape and v.outputs[name].shape[0] == n
        assert set(r.order) - set(v.order) == NOT_IN_VLLM
        assert set(v.order) <= set(r.order)
        assert [m for m in r.order if m in v.outputs] == v.order  # the same execution order
        assert v.outputs["lm_head"].shape == r.outputs["lm_head"].shape  # both LogitsProcessor calls placed
        assert not v.outputs["lm_head"].isnan().any()


@needs_vllm
def test_every_module_matches_the_reference_in_float32(reference, control):
    _, ref = reference
    assert localise(control, ref).module is None, localise(control, ref).detail
    for r, v in zip(ref, control):
        for name in v.inputs:
            assert relative_delta(v.inputs[name], r.inputs[name]) <= REL_TOL, (r.prompt, name)
        linears = {f"model.layers.{i}.{p}" for i in range(12) for p in PROJECTIONS} | {"lm_head"}
        assert set(v.weights) == linears and linears <= set(r.weights)
        for name, w in v.weights.items():
            assert torch.equal(w, r.weights[name]), name  # the same effective weights, bit for bit


@needs_vllm
def test_a_loading_fault_inside_vllm_is_localised_to_its_module(reference, control, tmp_path):
    _, ref = reference
    broken = vllm_traces(tmp_path, CELL, reference[0], "merged-shards-swapped")
    swapped = {"model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"}  # both are wrong: either is right
    found = localise(broken, ref)
    assert found.module in swapped and (found.kind, found.prompt) == ("weights", "p0"), found.detail  # equal inputs
    assert all(torch.equal(c.weights[m], r.weights[m]) for r, c in zip(ref, control) for m in swapped)


@needs_vllm
def test_swapped_cross_attention_kv_inside_vllm_is_localised_to_them(tmp_path):
    cell = "whisper.unquantized.vllm"
    sequences, ref = reference_traces(cell)
    broken = vllm_traces(tmp_path, cell, sequences, "merged-shards-swapped")
    swapped = {"model.decoder.layers.0.encoder_attn.k_proj", "model.decoder.layers.0.encoder_attn.v_proj"}
    for r, v in zip(ref, broken):
        for m in swapped:  # encoder positions, split from kv_proj
            assert v.outputs[m].shape == r.outputs[m].shape
    found = localise(broken, ref)
    assert found.module in swapped and (found.kind, found.prompt) == ("weights", "p0"), found.detail


# ------------------------------------------------------------------- the conversion, without vLLM

LAYER = "model.layers.0"
HF_NAMES = ["model", "model.embed_tokens", "model.layers", LAYER, f"{LAYER}.self_attn",
            *(f"{LAYER}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")), f"{LAYER}.mlp",
            *(f"{LAYER}.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj", "act_fn")), "model.norm", "lm_head"]


def recording(n: int = 5) -> dict:
    """What read_back returns for a one-layer Llama scored on ``n`` tokens (hidden 4, q 8, kv 4,
    MLP 6), with the LM head's two calls in the order vLLM makes them (the sampled token first)."""
    g = torch.Generator().manual_seed(0)
    out = {name: torch.randn(n, width, generator=g) for name, width in (
        ("", 4), ("model.embed_tokens", 4), (LAYER, 4), (f"{LAYER}.self_attn", 4),
        (f"{LAYER}.self_attn.qkv_proj", 16), (f"{LAYER}.self_attn.attn", 8), (f"{LAYER}.self_attn.o_proj", 4),
        (f"{LAYER}.mlp", 4), (f"{LAYER}.mlp.gate_up_proj", 12), (f"{LAYER}.mlp.act_fn", 6),
        (f"{LAYER}.mlp.down_proj", 4), ("model.norm", 4))}
    logits = torch.randn(n, 10, generator=g)
    hidden = out[""]
    return {"order": list(out), "outputs": out,
            "inputs": {f"{LAYER}.self_attn.qkv_proj": torch.randn(n, 4, generator=g)},
            "classes": {name: "SiluAndMul" if name.endswith("act_fn") else "Module" for name in out},
            "logits": [("lm_head", hidden[n - 1:].clone(), logits[n - 1:]), ("lm_head", hidden[:n - 1].clone(), logits[:n - 1])],
            "shards": {f"{LAYER}.self_attn.qkv_proj": (["q_proj", "k_proj", "v_proj"], [8, 4, 4]),
                       f"{LAYER}.self_attn.o_proj": (["o_proj"], [4]),
                       f"{LAYER}.mlp.gate_up_proj": (["gate_proj", "up_proj"], [6, 6]),
                       f"{LAYER}.mlp.down_proj": (["down_proj"], [4])},
            "silent": [], "uncalled": {"model": "its hooks never fire"}, "_logits": logits}


def test_a_recording_becomes_transformers_names_shards_and_positions():
    raw = recording()
    converted = vllm_traces_module.prompt_trace(raw, "p0", 5, vllm_traces_module.hf_names_of_vllm(HF_NAMES, "LlamaForCausalLM"))
    t, qkv, gate_up = converted.trace, raw["outputs"][f"{LAYER}.self_attn.qkv_proj"], raw["outputs"][f"{LAYER}.mlp.gate_up_proj"]
    assert t.order == ["model.embed_tokens", LAYER, f"{LAYER}.self_attn", f"{LAYER}.self_attn.q_proj",
                       f"{LAYER}.self_attn.k_proj", f"{LAYER}.self_attn.v_proj", f"{LAYER}.self_attn.o_proj",
                       f"{LAYER}.mlp", f"{LAYER}.mlp.gate_proj", f"{LAYER}.mlp.up_proj", f"{LAYER}.mlp.down_proj",
                       "model.norm", "lm_head"]
    assert torch.equal(t.outputs[f"{LAYER}.self_attn.q_proj"], qkv[:, :8])
    assert torch.equal(t.outputs[f"{LAYER}.self_attn.v_proj"], qkv[:, 12:])
    assert torch.equal(t.outputs[f"{LAYER}.mlp.up_proj"], gate_up[:, 6:])
    for shard in ("q_proj", "k_proj", "v_proj"):  # one input, the fused module's
        assert torch.equal(t.inputs[f"{LAYER}.self_attn.{shard}"], raw["inputs"][f"{LAYER}.self_attn.qkv_proj"])
    assert torch.equal(t.outputs["lm_head"], raw["_logits"])  # both calls, in position order
    assert torch.equal(t.inputs["lm_head"], raw["outputs"][""])
    assert set(converted.left_out) == {"model", f"{LAYER}.self_attn.attn", f"{LAYER}.mlp.act_fn"}


def test_a_recording_without_any_hook_fired_says_vllm_ran_a_compiled_graph():
    raw = recording()
    raw.update(order=[], outputs={}, inputs={}, logits=[], silent=list(raw["shards"]))
    with pytest.raises(RuntimeError, match="no module hook fired .* compiled graph"):
        vllm_traces_module.prompt_trace(raw, "p0", 5, {})


def test_a_sequence_not_scored_in_one_pass_over_every_position_is_refused():
    with pytest.raises(RuntimeError, match="in 1 forward passes over 5 positions; a trace needs one pass over all of them"):
        vllm_traces_module.prompt_trace(recording(5), "p0", 6, {})
