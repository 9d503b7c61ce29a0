"""TensorSource (safetensors, legacy .bin, refusal of unsafe pickles) and the format dispatch."""
import json
import os
import pickle

import pytest
import torch
from safetensors.torch import save_file

from harness.errors import CheckpointError
from harness.quant import formats
from harness.quant.source import TensorSource


def _two_shards(tmp_path):
    a = {"x.weight": torch.randn(3, 4), "x.bias": torch.randn(3)}
    b = {"y.weight": torch.randn(2, 2).to(torch.float8_e4m3fn), "y.weight_scale": torch.tensor([0.5]),
         "z.weight": torch.zeros(5, 1, dtype=torch.uint8)}
    save_file(a, tmp_path / "model-00001-of-00002.safetensors", metadata={"format": "pt", "from": "a"})
    save_file(b, tmp_path / "model-00002-of-00002.safetensors", metadata={"format": "pt", "other": "b"})
    index = {"metadata": {}, "weight_map": {**{k: "model-00001-of-00002.safetensors" for k in a},
                                            **{k: "model-00002-of-00002.safetensors" for k in b}}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    return a, b


def test_sharded_safetensors(tmp_path):
    a, b = _two_shards(tmp_path)
    with TensorSource.open(tmp_path) as src:
        assert src.keys == frozenset(a) | frozenset(b)
        assert src.metadata == {"format": "pt", "from": "a", "other": "b"}
        assert src.dtype("y.weight") == torch.float8_e4m3fn and src.shape("y.weight") == (2, 2)
        assert src.dtype("z.weight") == torch.uint8 and src.shape("z.weight") == (5, 1)
        assert src.dtype("x.bias") == torch.float32 and src.shape("x.bias") == (3,)
        assert src.file_of("x.weight").endswith("model-00001-of-00002.safetensors")
        assert src.file_of("y.weight").endswith("model-00002-of-00002.safetensors")
        assert torch.equal(src.get("x.weight"), a["x.weight"])
        assert "x.weight" in src and "nope" not in src
        with pytest.raises(CheckpointError) as e:
            src.get("nope.weight")
        assert e.value.where == "nope.weight" and e.value.what == "missing tensor"
        with pytest.raises(CheckpointError):
            src.shape("nope.weight")


def test_index_names_a_missing_shard(tmp_path):
    _two_shards(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError) as e:
        TensorSource.open(tmp_path)
    assert e.value.where.endswith("model-00002-of-00002.safetensors") and "missing" in e.value.what


def test_tensor_in_two_files(tmp_path):
    save_file({"w": torch.zeros(1)}, tmp_path / "a.safetensors")
    save_file({"w": torch.zeros(1)}, tmp_path / "b.safetensors")
    with pytest.raises(CheckpointError) as e:
        TensorSource.open(tmp_path)
    assert e.value.where == "w"


@pytest.mark.parametrize("cut", [-10, 20, 5, 0])
def test_truncated_safetensors(tmp_path, cut):
    save_file({"w": torch.randn(16, 16)}, tmp_path / "model.safetensors")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:cut] if cut else b"")
    with pytest.raises(CheckpointError) as e:
        TensorSource.open(tmp_path)
    assert e.value.where == str(tmp_path / "model.safetensors")


def test_garbage_safetensors(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    with pytest.raises(CheckpointError) as e:
        TensorSource.open(tmp_path)
    assert e.value.where == str(tmp_path / "model.safetensors")


def test_empty_or_missing_directory(tmp_path):
    with pytest.raises(CheckpointError):
        TensorSource.open(tmp_path)
    with pytest.raises(CheckpointError):
        TensorSource.open(tmp_path / "absent")


def test_plain_bin(tmp_path):
    sd = {"a.weight": torch.randn(3, 3), "b.weight": torch.nn.Parameter(torch.randn(2))}
    torch.save(sd, tmp_path / "pytorch_model.bin")
    (tmp_path / "training_args.bin").write_bytes(b"not read")
    src = TensorSource.open(tmp_path)
    assert src.keys == {"a.weight", "b.weight"}
    assert type(src.get("b.weight")) is torch.Tensor
    assert torch.equal(src.get("a.weight"), sd["a.weight"])
    assert src.shape("a.weight") == (3, 3) and src.dtype("a.weight") == torch.float32


def test_reading_a_bin_leaves_the_process_allow_list_as_it_was(tmp_path):
    """torchao registers its tensor classes for weights_only loads on import, and vLLM's .bin loader
    relies on it; a .bin read by the reference or the fixture identity in the same process must not
    take them away (it did: vLLM then refused torchao.quantization.Int8Tensor, docs/findings.md)."""
    import torchao.quantization as tq

    from harness.fixtures.identity import load_bin

    torch.save({"a.weight": torch.randn(2, 2)}, tmp_path / "pytorch_model.bin")
    before = set(torch.serialization.get_safe_globals())
    assert tq.Int8Tensor in before
    TensorSource.open(tmp_path).get("a.weight")
    load_bin(tmp_path / "pytorch_model.bin")
    assert set(torch.serialization.get_safe_globals()) == before


def test_safetensors_preferred_over_bin(tmp_path):
    save_file({"a.weight": torch.ones(1)}, tmp_path / "model.safetensors")
    (tmp_path / "pytorch_model.bin").write_bytes(b"garbage never read")
    assert TensorSource.open(tmp_path).keys == {"a.weight"}


def test_bin_that_is_not_a_state_dict(tmp_path):
    torch.save([torch.ones(1)], tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError):
        TensorSource.open(tmp_path)
    torch.save({"a": 3}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError):
        TensorSource.open(tmp_path)


# ------------------------------------------------------------------------------------------------
# unsafe pickles are refused and never run

MARKER_ENV = "HARNESS_TEST_PICKLE_MARKER"


def side_effect():  # what a custom class's pickle would run
    with open(os.environ[MARKER_ENV], "w") as f:
        f.write("ran")
    return torch.zeros(1)


class Evil:
    def __init__(self, how):
        self.how = how

    def __reduce__(self):
        if self.how == "os.system":
            return (os.system, (f"touch {os.environ[MARKER_ENV]}",))
        return (side_effect, ())


@pytest.mark.parametrize("how", ["os.system", "custom"])
@pytest.mark.parametrize("fmt", ["zip", "raw-pickle"])
def test_unsafe_pickle_is_refused_and_not_run(tmp_path, monkeypatch, how, fmt):
    marker = tmp_path / "marker"
    monkeypatch.setenv(MARKER_ENV, str(marker))
    payload = {"w": torch.ones(2), "evil": Evil(how)}
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    if fmt == "zip":
        torch.save(payload, ckpt / "pytorch_model.bin")
    else:
        (ckpt / "pytorch_model.bin").write_bytes(pickle.dumps(payload, protocol=2))
    assert not marker.exists()
    with pytest.raises(CheckpointError) as e:
        TensorSource.open(ckpt)
    assert e.value.where == str(ckpt / "pytorch_model.bin")
    assert e.value.what.startswith("refused to unpickle")
    assert not marker.exists(), "the pickle ran code"


# ------------------------------------------------------------------------------------------------
# formats: config and dispatch


@pytest.mark.parametrize("config,expect", [
    ({}, None),
    ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}}, "bitsandbytes"),
    ({"quantization_config": {"load_in_4bit": True}}, "bitsandbytes"),
    ({"quantization_config": {"quant_method": "compressed-tensors"}}, "compressed-tensors"),
    ({"compression_config": {"quant_method": "compressed-tensors"}}, "compressed-tensors"),
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}, "fp8"),
    ({"quantization_config": {"quant_method": "torchao", "quant_type": {}}}, "torchao"),
])
def test_quant_method(config, expect):
    assert formats.quant_method(config) == expect


@pytest.mark.parametrize("config", [{"quantization_config": {"quant_method": "awq"}},
                                    {"quantization_config": {"bits": 4}},
                                    {"quantization_config": "fp8"}])
def test_quant_method_unknown(config):
    with pytest.raises(CheckpointError) as e:
        formats.quant_method(config)
    assert e.value.where == "config.json"
    if "awq" in json.dumps(config):
        assert e.value.what == ("quantization_config.quant_method: unknown quant_method 'awq' "
                                "(known: bitsandbytes, compressed-tensors, fp8, torchao)")


def test_decode_weight_dispatch_and_disk_is_truth():
    src = TensorSource.from_tensors({
        "plain.weight": torch.randn(2, 3, dtype=torch.bfloat16),
        "f8.weight": torch.ones(2, 3).to(torch.float8_e4m3fn), "f8.weight_scale": torch.tensor([2.0]),
        "int.weight": torch.ones(2, 3, dtype=torch.int8),
        "i8.weight": torch.ones(2, 3, dtype=torch.int8), "i8.weight_scale": torch.ones(2, 1),
        "gptq.qweight": torch.zeros(1, dtype=torch.int32),
        "nan.weight": torch.tensor([[float("nan")]]),
    })
    d = formats.decode_weight(src, "plain.weight")
    assert d.label == "unquantized" and d.weight.dtype == torch.float32
    assert formats.owner(src, "plain.weight") is None
    assert formats.owner(src, "f8.weight") == "fp8"
    assert torch.equal(formats.decode_weight(src, "f8.weight").weight, torch.full((2, 3), 2.0))
    # Not scanned at decode: the reference names it when its module is first called (test_reference).
    assert formats.decode_weight(src, "nan.weight").weight.isnan().all()
    for name, word in (("int.weight", "neither"), ("i8.weight", "integer"), ("gptq.weight", "GPTQ"),
                       ("absent.weight", "missing")):
        with pytest.raises(CheckpointError) as e:
            formats.decode_weight(src, name)
        assert e.value.where == name and word in e.value.what, (name, e.value.what)


def _ct(inputs=None, kv=None):
    return {"quant_method": "compressed-tensors", "kv_cache_scheme": kv,
            "config_groups": {"g": {"targets": ["Linear"], "input_activations": inputs}}}


_TORCHAO_FLOAT8 = {"_type": "Float8DynamicActivationFloat8WeightConfig", "_data": {"granularity": [{"_type": "PerTensor"}]}}


@pytest.mark.parametrize("qc, spans", [
    (None, False),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, False),
    (_ct(), False),
    (_ct({"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}), False),
    (_ct({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}), False),
    (_ct({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": True}), True),
    (_ct(kv={"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}), False),
    (_ct(kv={"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": True}), True),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, False),
    ({"quant_method": "torchao", "quant_type": {"default": _TORCHAO_FLOAT8}}, True),
    ({"quant_method": "torchao", "quant_type": {"default": json.loads(json.dumps(_TORCHAO_FLOAT8).replace("PerTensor", "PerRow"))}}, False),
    ({"quant_method": "torchao", "quant_type": {"default": {"_type": "Int8WeightOnlyConfig", "_data": {}}}}, False),
])
def test_an_activation_scale_spans_tokens_only_where_it_is_dynamic_and_not_per_token(qc, spans):
    """What decides whether an in-process engine may batch the accuracy tasks' sequences (harness.scoring)."""
    from harness.quant import schema

    assert schema.scales_span_tokens(qc) is spans
