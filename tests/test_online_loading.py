"""Online quantization in the reference loader: configs, skip dialects, the load report, bad input,
and no full-size throwaway module. Numerics: tests/test_online_quantize.py; against the libraries'
own online quantization: suites/conformance/test_online.py."""
import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from harness import fixtures, reference
from harness.errors import CheckpointError
from harness.quant import quantize as Q
from harness.quant.source import TensorSource
from harness.reference import online

INT8 = online.PRESETS["online-torchao-int8wo"]["quant_type"]["default"]


@pytest.fixture(scope="module")
def llama():
    return fixtures.build("llama-unquantized")


@pytest.fixture(scope="module")
def whisper():
    return fixtures.build("whisper-unquantized")


def _fqn(table: dict) -> dict:
    return {"quant_method": "torchao", "modules_to_not_convert": None, "include_input_output_embeddings": False,
            "quant_type": {"default": {"_type": "FqnToConfig", "_version": 1,
                                       "_data": {"fqn_to_config": table, "module_fqn_to_config": table}}}}


def _labels(loaded, label):
    return {n for n, v in loaded.report.modules.items() if v == label}


@pytest.mark.parametrize("preset,label", [("online-bnb-nf4", "bnb-nf4"), ("online-torchao-int8wo", "torchao-int8"),
                                          ("online-fp8", "fp8-tensor")])
def test_presets_quantize_every_linear_but_the_output(llama, preset, label):
    loaded = reference.load(llama, quantization=preset)
    assert _labels(loaded, "unquantized") == {"lm_head"}
    assert len(_labels(loaded, label)) == len(loaded.report.modules) - 1
    assert "quantize" in loaded.report.timings
    assert loaded.report.notes[0].startswith("online quantization:")
    assert all(g.fused for g in loaded.report.groups)


def test_config_forms(llama, tmp_path):
    """A dict, a JSON file, a JSON string, a whole config.json, or a preset name."""
    config = online.PRESETS["online-bnb-nf4"]
    file = tmp_path / "q.json"
    file.write_text(json.dumps({"quantization_config": config}))
    for spec in (config, str(file), json.dumps(config), "online-bnb-nf4"):
        assert online.read_config(spec) == config


def test_online_weights_equal_the_quantizer(llama):
    loaded = reference.load(llama, fuse=False, quantization="online-torchao-int8wo")
    src = TensorSource.open(llama)
    w = src.get("model.layers.4.mlp.down_proj.weight")
    assert torch.equal(loaded.model.get_submodule("model.layers.4.mlp.down_proj").weight, Q.torchao_int8(w).weight)


def test_fqn_to_config_skips(llama):
    table = {"_default": INT8, "model.layers.1.self_attn.q_proj": None, r"re:model\.layers\.3\.mlp\..*": None}
    loaded = reference.load(llama, quantization=_fqn(table))
    skipped = _labels(loaded, "unquantized")
    assert skipped == {"lm_head", "model.layers.1.self_attn.q_proj", "model.layers.3.mlp.gate_proj",
                       "model.layers.3.mlp.up_proj", "model.layers.3.mlp.down_proj"}
    unfused = {(g.parent, g.kind) for g in loaded.report.groups if not g.fused}
    assert unfused == {("model.layers.1.self_attn", "qkv")}
    assert any("model.layers.1.self_attn.q_proj left unquantized" in n and "is None" in n for n in loaded.report.notes)


def test_transformers_dialect_prefix_overreach_is_reported(llama):
    """transformers' re.match reading of 'model.layers.1' also skips layers.10 and .11; the load
    report says so (the same disagreement machinery as for pre-quantized checkpoints)."""
    config = {**online.PRESETS["online-bnb-nf4"], "llm_int8_skip_modules": ["model.layers.1", "lm_head"]}
    loaded = reference.load(llama, quantization=config)
    skipped = _labels(loaded, "unquantized")
    assert {n.split(".")[2] for n in skipped if n.startswith("model.layers.")} == {"1", "10", "11"}
    overreach = {d.module for d in loaded.report.disagreements if d.source.endswith("overreach")}
    assert any(m.startswith("model.layers.10.") for m in overreach)
    assert not any(m.startswith("model.layers.1.") for m in overreach)


def test_vllm_fp8_ignored_layers(llama):
    """vLLM's fp8 dialect: exact names, fused shards expanded; a fused name skips all its shards;
    a partial fused group, which vLLM refuses, loads unfused and is reported."""
    cfg = {**online.PRESETS["online-fp8"], "ignored_layers": ["model.layers.0.self_attn.qkv_proj",
                                                              "model.layers.2.mlp.gate_proj"]}
    loaded = reference.load(llama, quantization=cfg)
    skipped = _labels(loaded, "unquantized")
    assert {f"model.layers.0.self_attn.{p}_proj" for p in "qkv"} <= skipped
    assert "model.layers.2.mlp.gate_proj" in skipped and "model.layers.2.mlp.up_proj" not in skipped
    assert [d.source for d in loaded.report.disagreements if d.module == "model.layers.2.mlp.gate_proj"] \
        == ["vllm-fp8:partial-fused-group"]
    groups = {(g.parent, g.kind): g.fused for g in loaded.report.groups}
    assert groups[("model.layers.2.mlp", "gate-up")] is False
    assert groups[("model.layers.0.self_attn", "qkv")] is True  # all three unquantized: they fuse


def test_fused_per_tensor_fp8_shares_the_max_scale(llama):
    fused = reference.load(llama, quantization="online-fp8")
    src = TensorSource.open(llama)
    parent = "model.layers.5.self_attn"
    floats = [src.get(f"{parent}.{p}_proj.weight") for p in "qkv"]
    merged = Q.fp8_weight(torch.cat(floats), "tensor")
    assert torch.equal(fused.model.get_submodule(parent).qkv_proj.weight, merged.weight)


def test_compressed_tensors_per_channel_config(whisper):
    scheme = {"targets": ["Linear"],
              "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False},
              "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                                    "dynamic": True}}
    config = {"quant_method": "compressed-tensors", "config_groups": {"group_0": scheme},
              "ignore": ["proj_out", r"re:model\.encoder\..*"], "format": "float-quantized"}
    loaded = reference.load(whisper, quantization=config)
    assert all(n.startswith("model.encoder.") or n == "proj_out" for n in _labels(loaded, "unquantized"))
    assert all(n.startswith("model.decoder.") for n in _labels(loaded, "fp8-channel"))
    q = loaded.model.get_submodule("model.decoder.layers.0.self_attn.q_proj")
    assert repr(q.fused.input_quant if hasattr(q, "fused") else q.input_quant) == "dynamic-per-token"


def test_fqn_bias_quantization_is_noted(whisper):
    """transformers 5.19 applies an FqnToConfig _default to Linear biases too; the reference keeps
    them float and says so."""
    loaded = reference.load(whisper, quantization=_fqn({"_default": INT8}))
    assert any(n.startswith("model.decoder.layers.0.self_attn.q_proj.bias: ") for n in loaded.report.notes)
    quiet = reference.load(whisper, quantization=_fqn({"_default": INT8, r"re:.*\.bias": None}))
    assert not any(".bias: " in n for n in quiet.report.notes)


BAD = [
    ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "load_in_8bit"),
    ({**online.PRESETS["online-bnb-nf4"], "bnb_4bit_use_double_quant": True}, "bnb_4bit_use_double_quant"),
    ({**online.PRESETS["online-bnb-nf4"], "bnb_4bit_quant_type": "int4"}, "bnb_4bit_quant_type"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}, "weight_block_size"),
    ({"quant_method": "torchao", "quant_type": {"default": {"_type": "Int4WeightOnlyConfig", "_data": {}}}}, "quant_type"),
    ({"quant_method": "torchao", "quant_type": "int8_weight_only"}, "quant_type"),
    ({**online.PRESETS["online-torchao-int8wo"], "include_input_output_embeddings": True}, "include_input_output_embeddings"),
    (_fqn({"_default": {"_type": "Float8WeightOnlyConfig", "_data": {}}}), "fqn_to_config"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}}}}, "config_groups.g.weights"),
    ({"quant_method": "awq"}, "quant_method"),
    ("not-a-preset", "quantization"),
]


@pytest.mark.parametrize("config,where", BAD, ids=[w for _, w in BAD])
def test_unmodelled_configs_are_refused(llama, config, where):
    with pytest.raises(CheckpointError) as e:
        reference.load(llama, quantization=config)
    assert where in e.value.where


def test_prequantized_checkpoint_is_refused():
    with pytest.raises(CheckpointError, match="already quantized"):
        reference.load(fixtures.build("llama-bnb-nf4"), quantization="online-fp8")


@pytest.mark.slow("two `harness load --quantize` subprocesses on the llama fixture")
def test_cli(llama):
    run = [sys.executable, "-m", "harness.cli", "load", str(llama), "--quantize"]
    ok = subprocess.run(run + ["online-bnb-nf4"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "labels: bnb-nf4=84, unquantized=1" in ok.stdout and "quantize=" in ok.stdout
    bad = subprocess.run(run + ['{"quant_method": "fp8", "activation_scheme": "static"}'], capture_output=True, text=True)
    assert bad.returncode == 2
    assert [line for line in bad.stderr.splitlines() if line.startswith("error:")] == [
        "error: quantization.activation_scheme: 'static': online FP8 has no calibration data; only 'dynamic'"]


def test_no_full_size_module(llama, monkeypatch):
    """Loading with online quantization never builds an nn.Linear off the meta device (a library's
    module to quantize into would be one): every Linear the skeleton makes is on meta."""
    made = []
    init = nn.Linear.__init__

    def watch(self, in_features, out_features, *args, **kwargs):
        init(self, in_features, out_features, *args, **kwargs)
        if not self.weight.is_meta and self.weight.numel() > 1:
            made.append((in_features, out_features))

    monkeypatch.setattr(nn.Linear, "__init__", watch)
    for preset in online.PRESETS:
        loaded = reference.load(llama, quantization=preset)
        assert len(loaded.report.modules) == 85
    assert made == []
