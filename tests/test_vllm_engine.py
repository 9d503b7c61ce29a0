"""The vLLM engine's own logic, without starting an engine: the module diff and its exactness
rule, error annotation, top-k extraction, the dtype rule, the capability probe, the core lock
and vLLM's timing log lines. (The engine itself runs in the matrix suite and in
tests/test_vllm_mutations.py.)"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from harness.engines import vllm as V
from harness.engines import vllm_conformance as C
from harness.engines import vllm_worker as W

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------- module diff


class FakeRef:
    """What compare_modules needs of harness.reference.load(...): report.modules and the model."""

    def __init__(self, modules: dict[str, tuple[str, torch.Tensor, torch.Tensor | None]]):
        self.report = SimpleNamespace(modules={n: label for n, (label, _, _) in modules.items()})
        self._m = {n: SimpleNamespace(weight=w, bias=b) for n, (_, w, b) in modules.items()}
        self.model = SimpleNamespace(get_submodule=lambda n: self._m[n])


def shard(name, label, weight, bias=None, note=""):
    return {"shard": name, "index": 0, "label": label, "weight": weight, "bias": bias, "note": note,
            "dtype": None if weight is None else str(weight.dtype).replace("torch.", "")}


def read(**modules):
    return {"modules": {k.replace("__", "."): v for k, v in modules.items()}, "packed": {}}


def vmod(name, qm, *shards):
    return {"module": name, "class": "X", "quant_method": qm, "scheme": None, "shards": list(shards), "note": ""}


@pytest.fixture
def llama_layer():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(8, 4, generator=g) for _ in range(3))
    o = torch.randn(4, 8, generator=g)
    ref = FakeRef({
        "model.layers.0.self_attn.q_proj": ("bnb-nf4", q, None),
        "model.layers.0.self_attn.k_proj": ("bnb-nf4", k, None),
        "model.layers.0.self_attn.v_proj": ("bnb-nf4", v, None),
        "model.layers.0.self_attn.o_proj": ("unquantized", o, None),
    })
    return ref, q, k, v, o


def test_identical_modules_give_no_diff(llama_layer):
    ref, q, k, v, o = llama_layer
    r = read(**{"model__layers__0__self_attn__qkv_proj": vmod("qkv", "BitsAndBytesLinearMethod",
                                                              shard("q_proj", "bnb-nf4", q.clone()),
                                                              shard("k_proj", "bnb-nf4", k.clone()),
                                                              shard("v_proj", "bnb-nf4", v.clone())),
                "model__layers__0__self_attn__o_proj": vmod("o", "UnquantizedLinearMethod",
                                                            shard("o_proj", "unquantized", o.clone()))})
    diff, lines, n = C.compare_modules(ref, r, "LlamaForCausalLM")
    assert diff is None and lines == [] and n == 4


def test_first_differing_module_is_named_label_before_weight(llama_layer):
    ref, q, k, v, o = llama_layer
    k2 = k.clone()
    k2[1, 2] += 1e-6
    r = read(**{"model__layers__0__self_attn__qkv_proj": vmod("qkv", "BitsAndBytesLinearMethod",
                                                              shard("q_proj", "bnb-nf4", q.clone()),
                                                              shard("k_proj", "bnb-nf4", k2),
                                                              shard("v_proj", "bnb-missing", None, note="no quant state")),
                "model__layers__0__self_attn__o_proj": vmod("o", "BitsAndBytesLinearMethod",
                                                            shard("o_proj", "bnb-nf4", o.clone()))})
    diff, lines, _ = C.compare_modules(ref, r, "LlamaForCausalLM")
    assert diff.first_differing_module == "model.layers.0.self_attn.k_proj"
    assert "1 of 32 weight elements differ" in diff.detail and "[1, 2]" in diff.detail
    assert "qkv_proj[k_proj]" in diff.detail
    assert "(and 2 more differing modules: model.layers.0.self_attn.v_proj, model.layers.0.self_attn.o_proj)" in diff.detail
    assert lines[1].startswith("model.layers.0.self_attn.v_proj: label bnb-missing in vLLM")
    assert "no quant state" in lines[1]
    assert lines[2].startswith("model.layers.0.self_attn.o_proj: label bnb-nf4 in vLLM") and "unquantized in the reference" in lines[2]


def test_exactness_rule_casts_unquantized_reference_to_the_engine_dtype():
    w = torch.randn(6, 4, dtype=torch.float64).float()
    ref = FakeRef({"lm_head": ("unquantized", w, None)})
    ok = read(lm_head=vmod("lm_head", "UnquantizedEmbeddingMethod", shard("lm_head", "unquantized", w.to(torch.bfloat16))))
    assert C.compare_modules(ref, ok, "LlamaForCausalLM")[0] is None
    # a bfloat16 copy of anything else (here: a quantized label) is compared in float32, exactly
    ref_q = FakeRef({"lm_head": ("torchao-int8", w, None)})
    bad = read(lm_head=vmod("lm_head", "TorchAOLinearMethod", shard("lm_head", "torchao-int8", w.to(torch.bfloat16))))
    assert C.compare_modules(ref_q, bad, "LlamaForCausalLM")[0] is not None


def test_vocabulary_padding_rows_of_an_lm_head_are_ignored():
    w = torch.randn(6, 4)
    ref = FakeRef({"lm_head": ("unquantized", w, None)})
    padded = torch.cat([w, torch.zeros(2, 4)])
    r = read(lm_head=vmod("lm_head", "UnquantizedEmbeddingMethod", shard("lm_head", "unquantized", padded)))
    assert C.compare_modules(ref, r, "LlamaForCausalLM")[0] is None


def test_bias_missing_equals_zeros_and_a_wrong_bias_is_named():
    w = torch.randn(4, 4)
    b = torch.randn(4)
    ref = FakeRef({"model.encoder.layers.0.self_attn.k_proj": ("unquantized", w, None),
                   "model.encoder.layers.0.self_attn.v_proj": ("unquantized", w, b)})
    r = read(**{"model__encoder__layers__0__self_attn__qkv_proj": vmod(
        "qkv", "UnquantizedLinearMethod",
        shard("k_proj", "unquantized", w.clone(), bias=torch.zeros(4)),
        shard("v_proj", "unquantized", w.clone(), bias=b + 1))})
    diff, lines, _ = C.compare_modules(ref, r, "WhisperForConditionalGeneration")
    assert len(lines) == 1 and diff.first_differing_module == "model.encoder.layers.0.self_attn.v_proj"
    assert diff.detail.startswith("bias: 4 of 4 bias elements differ")


def test_shape_mismatch_and_missing_module():
    w = torch.randn(4, 8)
    ref = FakeRef({"model.layers.0.mlp.down_proj": ("fp8-channel", w, None),
                   "model.layers.0.mlp.gate_proj": ("fp8-channel", w, None)})
    r = read(**{"model__layers__0__mlp__down_proj": vmod("down", "CompressedTensorsLinearMethod",
                                                          shard("down_proj", "fp8-channel", w.t().contiguous()))})
    diff, lines, _ = C.compare_modules(ref, r, "LlamaForCausalLM")
    assert "shape (8, 4) in vLLM, (4, 8) in the reference" in lines[0]
    assert lines[1] == "model.layers.0.mlp.gate_proj: vLLM has no module model.layers.0.mlp.gate_up_proj"


def test_nan_equals_nan_but_not_a_number():
    w = torch.tensor([[float("nan"), 1.0]])
    assert C._weight_detail(w.clone(), w.clone()) is None
    assert C._weight_detail(torch.tensor([[float("nan"), 2.0]]), w) is not None


# ------------------------------------------------------------------------- engine helpers


def test_annotate_names_the_frame_and_the_parameter_being_loaded():
    ns: dict = {}
    code = textwrap.dedent("""
        def _load_param(weight_qualname):
            assert 1 == 2
    """)
    exec(compile(code, "/x/site-packages/vllm/model_executor/models/utils.py", "exec"), ns)
    try:
        ns["_load_param"]("lm_head.weight")
    except AssertionError as e:
        text = V.annotate(e, "building the LLM")
    assert text.startswith("AssertionError (at vllm/model_executor/models/utils.py:3 in _load_param")
    assert text.endswith("while loading lm_head.weight [during building the LLM]")


def test_topk_keeps_rank_order_and_drops_the_extra_scored_token():
    lp = lambda v, r: SimpleNamespace(logprob=v, rank=r)  # noqa: E731
    d = {7: lp(-0.1, 1), 3: lp(-2.0, 3), 9: lp(-1.0, 2), 42: lp(-9.0, 88)}
    assert V._topk(d, 3) == [(7, -0.1), (9, -1.0), (3, -2.0)]
    assert V._topk(d, 2) == [(7, -0.1), (9, -1.0)]
    assert V._topk(None, 2) == []


def _ckpt(name):
    from harness.engines.base import Checkpoint
    from harness import fixtures

    return Checkpoint(fixtures.build(name))


def test_format_predicates_on_the_fixtures():
    assert V._per_tensor_fp8(_ckpt("llama-fp8-static-kv").quantization_config)
    assert not V._per_tensor_fp8(_ckpt("llama-fp8-dynamic").quantization_config)
    assert V._per_tensor_fp8({"quant_method": "fp8", "activation_scheme": "static"})
    assert not V._per_tensor_fp8({"quant_method": "fp8", "weight_block_size": [128, 128]})
    assert V._block_fp8({"quant_method": "fp8", "weight_block_size": [128, 128]})


def _cell(model="llama", scheme="unquantized"):
    from harness import matrix

    m = matrix.load(matrix.DEFAULT_PATH)
    return next(c for c in m.cells(tier="cpu-tiny") if c.id == f"{model}.{scheme}.vllm")


def test_dtype_rule(monkeypatch):
    e = V.VllmEngine(_cell())
    monkeypatch.delenv(V.DTYPE_ENV, raising=False)
    assert e.choose_dtype(_ckpt("llama-unquantized")) == "float32"
    assert e.choose_dtype(_ckpt("llama-fp8-dynamic")) == "float32"
    assert e.choose_dtype(_ckpt("llama-bnb-nf4")) == "bfloat16"
    monkeypatch.setenv(V.DTYPE_ENV, "float16")
    assert e.choose_dtype(_ckpt("llama-bnb-nf4")) == "float16"


def test_a_torchao_load_is_calibrated_by_torchao_quantizing():
    """vLLM's torchao load is mostly torchao quantizing full-size weights (docs/findings.md)."""
    from harness import loadtime

    from harness import matrix

    cpu = V.VllmEngine(_cell("llama", "torchao-int8wo"))
    assert cpu.calibration_workload(_ckpt("llama-torchao-int8wo")) == loadtime.TORCHAO_QUANTIZE
    for name in ("llama-unquantized", "llama-bnb-nf4", "llama-fp8-dynamic"):
        assert cpu.calibration_workload(_ckpt(name)) == loadtime.CALIBRATION_WORKLOAD
    # on a GPU vLLM quantizes on the GPU: the default workload
    gpu_cell = next(c for c in matrix.load(matrix.DEFAULT_PATH).cells()
                    if c.engine == "vllm" and (c.hardware.gpus or 0) > 0)
    assert V.VllmEngine(gpu_cell).calibration_workload(_ckpt("llama-torchao-int8wo")) == loadtime.CALIBRATION_WORKLOAD


def test_probe_static_fp8_needs_a_kernel_vllm_cpu_lacks(monkeypatch):
    monkeypatch.delenv(V.MUTATION_ENV, raising=False)
    if torch.cuda.is_available() or W._op_has_arguments("static_scaled_fp8_quant"):
        pytest.skip("this vLLM has the static FP8 quantization kernel")
    # the probe's rule, not this CPU's: flags with the FP8 KV cache's kernel and no AMX
    monkeypatch.setattr(V.cpu, "flags", lambda: frozenset({"avx2", "avx512f"}))
    e = V.VllmEngine(_cell("llama", "fp8-static-kv"))
    reason = e.probe(_ckpt("llama-fp8-static-kv"))
    assert reason and "_C::static_scaled_fp8_quant() -> ()" in reason and "per-tensor FP8" in reason
    # the test-only stand-in lets the mutation tests reach vLLM's requantization (with the kernel
    # every x86 CPU runs; see the AMX probe below)
    monkeypatch.setenv(V.MUTATION_ENV, "static-fp8-standin")
    monkeypatch.setenv("VLLM_DISABLED_KERNELS", V.AMX_FP8_KERNEL)
    assert e.probe(_ckpt("llama-fp8-static-kv")) is None


def test_probe_an_fp8_kv_cache_needs_avx512_or_amx(monkeypatch):
    """On an AVX2-only CPU (an EPYC before Zen 4) vllm-cpu 0.32's CPU attention has no FP8 KV cache:
    the probe says so, and the tests that run such a cell skip with its reason (tests/kernels.py)."""
    monkeypatch.setenv(V.MUTATION_ENV, "static-fp8-standin")  # past the missing static op
    e = V.VllmEngine(_cell("whisper", "fp8-static-kv"))
    monkeypatch.setattr(V.cpu, "flags", lambda: frozenset({"avx2", "fma"}))
    reason = e.probe(_ckpt("whisper-fp8-static-kv"))
    assert reason and "FP8 KV cache on CPU needs x86 with AVX-512 or AMX" in reason
    monkeypatch.setattr(V.cpu, "flags", lambda: frozenset({"avx2", "avx512f"}))
    assert e.probe(_ckpt("whisper-fp8-static-kv")) is None


def test_probe_per_tensor_fp8_on_amx_needs_the_w8a8_kernel_for_float32(monkeypatch):
    """vllm-cpu 0.32's AMX kernel for per-tensor FP8 fails on float32 activations."""
    monkeypatch.setenv(V.MUTATION_ENV, "static-fp8-standin")  # past the missing static op
    monkeypatch.delenv("VLLM_DISABLED_KERNELS", raising=False)
    monkeypatch.delenv(V.DTYPE_ENV, raising=False)
    e = V.VllmEngine(_cell("llama", "fp8-static-kv"))
    monkeypatch.setattr(V.cpu, "flags", lambda: frozenset({"avx2", "avx512f", "amx_tile"}))
    reason = e.probe(_ckpt("llama-fp8-static-kv"))
    assert reason and "fp8_scaled_mm_cpu rejects float32 activations" in reason and V.AMX_FP8_KERNEL in reason
    monkeypatch.setattr(V.cpu, "flags", lambda: frozenset({"avx2", "avx512f"}))
    assert e.probe(_ckpt("llama-fp8-static-kv")) is None
    monkeypatch.setenv(V.DTYPE_ENV, "bfloat16")
    monkeypatch.setattr(V.cpu, "flags", lambda: frozenset({"avx2", "avx512f", "amx_tile"}))
    assert e.probe(_ckpt("llama-fp8-static-kv")) is None


def test_probe_needs_the_bnb_plugin_and_torchvision_for_qwen(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("vllm_bnb_plugin", "torchvision") else real(name, *a))
    e = V.VllmEngine(_cell("llama", "bnb-nf4"))
    assert "vllm-bnb-plugin is not installed" in e.probe(_ckpt("llama-bnb-nf4"))
    from harness.engines.base import Checkpoint

    class QwenCkpt(Checkpoint):
        config = {"architectures": ["Qwen2_5_VLForConditionalGeneration"]}

    reason = e.probe(QwenCkpt(Path(".")))
    assert "needs `torchvision`" in reason


def test_two_engine_children_bind_different_cores(tmp_path):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core only")
    script = textwrap.dedent("""
        import sys
        from harness.engines.vllm_environment import bind_core
        print(bind_core(), flush=True)
        sys.stdin.readline()
    """)
    env = dict(os.environ, HARNESS_LOCK_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    procs = [subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=env) for _ in range(2)]
    try:
        cores = [p.stdout.readline().strip() for p in procs]
    finally:
        for p in procs:
            p.communicate("\n", timeout=30)
    assert len(set(cores)) == 2, cores
    # a preset binding is respected
    env["VLLM_CPU_OMP_THREADS_BIND"] = "1"
    out = subprocess.run([sys.executable, "-c", script], input="\n", capture_output=True, text=True, env=env)
    assert out.stdout.strip() == "1"


def test_each_vllm_installation_has_its_own_cache(monkeypatch, tmp_path):
    """vLLM's model-info cache names one file per architecture, whatever the release: a candidate
    build sharing the pinned build's cache would overwrite its entries, and each engine start of
    either would inspect the model again in a fresh interpreter."""
    import importlib.util
    from types import SimpleNamespace as Spec

    from harness.engines import vllm_environment

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    roots = {}
    for build in ("venv", "candidate"):
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, b=build: Spec(origin=f"/{b}/vllm/__init__.py"))
        roots[build] = vllm_environment.cache_root()
    assert roots["venv"] != roots["candidate"] and all(r.startswith(str(tmp_path / "vllm")) for r in roots.values())
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: Spec(origin="/venv/vllm/__init__.py"))
    assert vllm_environment.cache_root() == roots["venv"]  # the same installation, the same cache
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != "VLLM_CACHE_ROOT"})  # ours untouched
    vllm_environment.set_environment()
    assert os.environ["VLLM_CACHE_ROOT"] == roots["venv"]
    os.environ["VLLM_CACHE_ROOT"] = str(tmp_path / "mine")  # a user's own is kept
    vllm_environment.set_environment()
    assert os.environ["VLLM_CACHE_ROOT"] == str(tmp_path / "mine")


def test_log_capture_reads_vllms_timing_lines():
    cap = W.LogCapture()
    log = logging.getLogger("test.vllm.timing")
    log.addHandler(cap)
    log.setLevel(logging.INFO)
    try:
        log.info("Initializing model took %.6f seconds", 0.175738)
        log.info("Loading weights took %.2f seconds", 0.05)
        log.info("Model loading took %s GiB memory and %.6f seconds", "0.01", 1.25)
        log.info("init engine (profile, create kv cache, warmup model) took %.2f s", 0.54)
    finally:
        log.removeHandler(cap)
    assert cap.values == {"log_init_model": 0.175738, "log_weights": 0.05, "log_model_loading": 1.25,
                          "log_init_engine": 0.54}


def test_unknown_mutation_is_refused():
    from harness.engines import vllm_mutations

    with pytest.raises(ValueError, match="unknown mutation 'nope'; known: torchao-full-size-dummy, merged-shards-swapped"):
        vllm_mutations.apply(["nope"])


def test_known_failures_of_vllm_carry_evidence():
    """Every vLLM known failure in models.yaml says what it is and shows its evidence, and is bounded
    to the releases harness bisect saw it in (docs/findings.md), none of them past the pinned one."""
    from harness import matrix

    m = matrix.load(matrix.DEFAULT_PATH)
    bisected = ["0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0"]
    on_pinned = 0
    for c in m.cells(tier="cpu-tiny"):
        if c.engine != "vllm":
            continue
        for k in c.known_failures:
            on_pinned += k.applies_to("vllm", "0.32.0")
            assert k.engine == "vllm" and k.evidence and len(k.reason) > 80, c.id
            assert any(k.applies_to("vllm", v) for v in bisected) and not k.applies_to("vllm", "0.33.0"), (c.id, k.versions)
    assert on_pinned >= 10


@pytest.mark.slow("a fresh interpreter importing vLLM to time the llama model load")
def test_a_load_timed_alone_ends_the_engine_after_the_model_loading_span(tmp_path):
    """harness bench's load-time children: vLLM's model loading span is timed, and the LLM's
    construction ends there (no engine start, no module read)."""
    script = textwrap.dedent("""
        import json
        from harness import matrix
        from harness.engines import base, vllm, vllm_worker
        cell = next(c for c in matrix.load().cells(tier="cpu-tiny") if c.id == "llama.unquantized.vllm")
        engine = vllm.VllmEngine(cell)
        info = engine.load_timed_only(base.resolve_checkpoint(cell))
        print(json.dumps({"seconds": info.seconds, "llm": engine.llm is None, "phases": sorted(info.phases),
                          "stop": vllm_worker.STOP_AFTER_LOAD}))
    """)
    env = dict(os.environ, HARNESS_LOCK_DIR=str(tmp_path), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT,
                         stdin=subprocess.DEVNULL, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["seconds"] > 0 and got["llm"] is True and got["stop"] is False
    assert "engine_start" in got["phases"] and "log_init_engine" not in got["phases"]  # the engine never started
