"""torchao Int8/Float8 weight-only: the plain-torch decoder against the subclasses' dequantize()."""
import json

import pytest
import torch

torchao_q = pytest.importorskip("torchao.quantization")
from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict  # noqa: E402
from torchao.quantization import (Float8WeightOnlyConfig, Int8WeightOnlyConfig, IntxWeightOnlyConfig, PerGroup,  # noqa: E402
                                  PerTensor, quantize_)

from harness.errors import CheckpointError  # noqa: E402
from harness.quant import formats  # noqa: E402
from harness.quant import torchao as TA  # noqa: E402
from harness.quant.source import TensorSource  # noqa: E402


def quantized_linears(config, dtype=torch.float32, shapes=((32, 64), (48, 64)), seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(i, o, dtype=dtype) for o, i in shapes])
    quantize_(model, config)
    return model


CONFIGS = {
    "int8-row": (Int8WeightOnlyConfig(), "torchao-int8", "per-row"),
    "int8-group": (Int8WeightOnlyConfig(granularity=PerGroup(16)), "torchao-int8", "block-1x16"),
    "float8-row": (Float8WeightOnlyConfig(), "torchao-float8", "per-row"),
    "int4-group": (IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(16)), "torchao-int4", "block-1x16"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("key", sorted(CONFIGS))
def test_flattened_layout_matches_dequantize(key, dtype):
    """The flattening transformers uses (torchao.prototype.safetensors), decoded here."""
    config, label, gran = CONFIGS[key]
    model = quantized_linears(config, dtype)
    sd = model.state_dict()
    tensors, metadata = flatten_tensor_state_dict(sd)
    src = TensorSource.from_tensors(tensors, metadata)
    for name in ("0.weight", "1.weight"):
        assert TA.owns(src, name)
        d = formats.decode_weight(src, name)
        assert d.label == label and d.settings["granularity"] == gran
        assert torch.equal(d.weight, sd[name].dequantize().float()), name
    assert formats.decode_weight(src, "0.bias").label == "unquantized"


def test_per_tensor_float8():
    try:
        model = quantized_linears(Float8WeightOnlyConfig(granularity=PerTensor()))
    except Exception as e:  # pragma: no cover - depends on the torchao build
        pytest.skip(f"Float8 per-tensor weight-only not available: {e}")
    tensors, metadata = flatten_tensor_state_dict(model.state_dict())
    src = TensorSource.from_tensors(tensors, metadata)
    d = formats.decode_weight(src, "0.weight")
    assert d.settings["granularity"] == "per-tensor"
    assert torch.equal(d.weight, model.state_dict()["0.weight"].dequantize().float())


def test_asymmetric_int8_zero_point():
    model = quantized_linears(Int8WeightOnlyConfig())
    w = model[0].weight
    tensors, metadata = flatten_tensor_state_dict(model.state_dict())
    zp = torch.randint(-5, 5, tensors["0._weight_zero_point"].shape, dtype=torch.int8)
    tensors["0._weight_zero_point"] = zp
    d = formats.decode_weight(TensorSource.from_tensors(tensors, metadata), "0.weight")
    assert d.settings["asymmetric"]
    assert torch.equal(d.weight, (w.qdata.float() - zp.float()) * w.scale)


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM, TorchAoConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    torch.manual_seed(0)
    base = tmp_path_factory.mktemp("base")
    LlamaForCausalLM(cfg).save_pretrained(base)
    out = {}
    for name, qc in (("int8", Int8WeightOnlyConfig()), ("float8", Float8WeightOnlyConfig())):
        model = LlamaForCausalLM.from_pretrained(base, quantization_config=TorchAoConfig(qc), device_map="cpu",
                                                 dtype=torch.bfloat16)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        out[name] = (path, model.state_dict())
    return out


@pytest.mark.parametrize("name,label", [("int8", "torchao-int8"), ("float8", "torchao-float8")])
def test_transformers_saved_checkpoint(saved_models, name, label):
    path, sd = saved_models[name]
    src = TensorSource.open(path)
    assert formats.quant_method(json.loads((path / "config.json").read_text())) == "torchao"
    q = "model.layers.0.self_attn.q_proj"
    assert {f"{q}._weight_qdata", f"{q}._weight_scale"} <= src.keys and f"{q}.weight" not in src.keys
    meta = json.loads(src.metadata[f"{q}.weight"])
    assert meta["_type"] == {"int8": "Int8Tensor", "float8": "Float8Tensor"}[name]
    quantized = [n for n, t in sd.items() if type(t) is not torch.Tensor]
    assert len(quantized) == 7
    for n in quantized:
        d = formats.decode_weight(src, n)
        assert d.label == label
        assert torch.equal(d.weight, sd[n].dequantize().float()), n
    assert formats.decode_weight(src, "lm_head.weight").label == "unquantized"


def test_legacy_bin(tmp_path):
    """A torch.save'd state dict of subclasses reads as the flattened layout."""
    model = quantized_linears(Int8WeightOnlyConfig(), shapes=((32, 64),))
    f8 = quantized_linears(Float8WeightOnlyConfig(), shapes=((16, 32),), seed=1)
    sd = {**model.state_dict(), **{f"f.{k}": v for k, v in f8.state_dict().items()}}
    torch.save(sd, tmp_path / "pytorch_model.bin")
    src = TensorSource.open(tmp_path)
    assert {"0._weight_qdata", "0._weight_scale", "f.0._weight_qdata", "0.bias"} <= src.keys
    assert src.file_of("0._weight_qdata").endswith("pytorch_model.bin")
    for name, label in (("0.weight", "torchao-int8"), ("f.0.weight", "torchao-float8")):
        d = formats.decode_weight(src, name)
        assert d.label == label
        assert torch.equal(d.weight, sd[name].dequantize().float())
    assert torch.equal(formats.decode_weight(src, "0.bias").weight, sd["0.bias"])


# ------------------------------------------------------------------------------------------------
# bad input

N = "0.weight"


def _parts():
    model = quantized_linears(Int8WeightOnlyConfig(), shapes=((8, 16),))
    tensors, metadata = flatten_tensor_state_dict(model.state_dict())
    return tensors, metadata


def _error(tensors, metadata, name=N) -> CheckpointError:
    with pytest.raises(CheckpointError) as e:
        formats.decode_weight(TensorSource.from_tensors(tensors, metadata), name)
    return e.value


def _edit_meta(metadata, fn):
    m = json.loads(metadata[N])
    fn(m)
    metadata[N] = json.dumps(m)


def test_missing_metadata():
    tensors, metadata = _parts()
    del metadata[N]
    err = _error(tensors, metadata)
    assert err.where == N and "metadata" in err.what


def test_unreadable_metadata():
    tensors, metadata = _parts()
    metadata[N] = "{nope"
    assert _error(tensors, metadata).where == N


def test_unsupported_subclass():
    tensors, metadata = _parts()
    _edit_meta(metadata, lambda m: m.update(_type="Int4Tensor"))
    err = _error(tensors, metadata)
    assert err.where == N and "Int4Tensor" in err.what


def test_activation_quantization_refused():
    tensors, metadata = _parts()
    _edit_meta(metadata, lambda m: m["_data"].update(act_quant_kwargs={"_type": "QuantizeTensorToInt8Kwargs"}))
    assert "act_quant" in _error(tensors, metadata).what


@pytest.mark.parametrize("part", ["qdata", "scale"])
def test_missing_parts(part):
    tensors, metadata = _parts()
    if part == "qdata":
        del tensors[f"0._weight_{part}"]
        # without qdata nothing claims the weight: it is simply missing
        assert _error(tensors, metadata).where == N
    else:
        del tensors[f"0._weight_{part}"]
        err = _error(tensors, metadata)
        assert err.where == f"0._weight_{part}" and "missing" in err.what


@pytest.mark.parametrize("bad", [float("nan"), 0.0, -1.0])
def test_bad_scale_values(bad):
    tensors, metadata = _parts()
    tensors["0._weight_scale"] = tensors["0._weight_scale"].clone()
    tensors["0._weight_scale"][1] = bad
    assert _error(tensors, metadata).where == "0._weight_scale"


def test_scale_shape_mismatch():
    tensors, metadata = _parts()
    tensors["0._weight_scale"] = tensors["0._weight_scale"][:-1]
    assert _error(tensors, metadata).where == "0._weight_scale"


def test_block_size_not_tiling():
    tensors, metadata = _parts()
    _edit_meta(metadata, lambda m: m["_data"].update(block_size=[1, 5]))
    assert _error(tensors, metadata).where == N


def test_qdata_wrong_dtype():
    tensors, metadata = _parts()
    tensors["0._weight_qdata"] = tensors["0._weight_qdata"].float()
    err = _error(tensors, metadata)
    assert err.where == "0._weight_qdata" and "int8" in err.what


def test_zero_point_shape_mismatch():
    tensors, metadata = _parts()
    tensors["0._weight_zero_point"] = tensors["0._weight_zero_point"][:2]
    assert _error(tensors, metadata).where == "0._weight_zero_point"


@pytest.mark.parametrize("key", sorted(CONFIGS))
def test_rows_dequantize_like_the_whole(key):
    """A block of rows of a stored weight (what a large linear's forward dequantizes at a time)
    equals those rows of the subclass's dequantize(), bit for bit."""
    model = quantized_linears(CONFIGS[key][0], shapes=((37, 64),))
    tensors, metadata = flatten_tensor_state_dict(model.state_dict())
    stored = formats.decode_weight(TensorSource.from_tensors(tensors, metadata), "0.weight").stored
    expect = model.state_dict()["0.weight"].dequantize().float()
    assert torch.equal(stored.dequantize(), expect)
    for start in range(0, 37, 5):
        assert torch.equal(stored.rows(start, min(37, start + 5)).dequantize(), expect[start:start + 5])


def test_per_tensor_scale_held_per_row():
    """A per-tensor scale is held as the rows' scales, so rows can be taken; values unchanged."""
    q = torch.randint(-128, 128, (6, 8), dtype=torch.int8)
    stored = TA.StoredTorchao.per_row(q, torch.tensor([[0.5]]), None, (6, 8), torch.float32)
    assert stored.block == (1, 8) and stored.scale.shape == (6, 1)
    assert torch.equal(stored.dequantize(), q.float() * 0.5)
    assert torch.equal(stored.rows(2, 5).dequantize(), q[2:5].float() * 0.5)


def _int4_parts():
    model = quantized_linears(IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(16)), shapes=((8, 32),))
    return flatten_tensor_state_dict(model.state_dict())


def test_int4_codes_outside_their_range_are_refused():
    """One code per int8 byte: a byte outside -8..7 is not int4, whatever the metadata says."""
    tensors, metadata = _int4_parts()
    assert formats.decode_weight(TensorSource.from_tensors(tensors, metadata), N).label == "torchao-int4"
    tensors["0._weight_qdata"] = tensors["0._weight_qdata"].clone()
    tensors["0._weight_qdata"][0, 0] = 9
    err = _error(tensors, metadata, N)
    assert err.where == "0._weight_qdata" and "int4 codes must lie in [-8, 7], found [" in err.what


def test_int4_target_dtype_and_activation_quantization_are_read_by_type():
    tensors, metadata = _int4_parts()
    _edit_meta(metadata, lambda m: m["_data"].update(target_dtype={"_type": "torch.dtype", "_data": "int2"}))
    assert "target_dtype 'int2' is not supported (only int4)" in _error(tensors, metadata).what
    tensors, metadata = _int4_parts()
    _edit_meta(metadata, lambda m: m["_data"].update(activation_quantization="INT8_ASYM_PER_TOKEN"))
    assert "activation quantization" in _error(tensors, metadata).what


def test_a_group_that_does_not_tile_the_weight_is_refused_in_one_line():
    tensors, metadata = _int4_parts()
    _edit_meta(metadata, lambda m: m["_data"].update(block_size=[1, 12]))
    err = _error(tensors, metadata)
    assert err.where == N and "block_size [1, 12] does not tile the weight shape [8, 32]" in err.what


def test_the_engines_probes_read_the_torchao_config_by_type():
    """Int4WeightOnlyConfig has no CPU kernel; IntxWeightOnlyConfig's int4 runs anywhere, though
    its JSON says int4 too."""
    from harness.quant import schema

    cuda_only = {"quant_method": "torchao", "quant_type": {"default": {"_type": "Int4WeightOnlyConfig", "_data": {}}}}
    anywhere = {"quant_method": "torchao", "quant_type": {"default": {"_type": "IntxWeightOnlyConfig", "_data": {
        "weight_dtype": {"_type": "torch.dtype", "_data": "int4"}, "granularity": {"_type": "PerGroup", "_data": {}}}}}}
    fqn = {"quant_method": "torchao", "quant_type": {"default": {"_type": "FqnToConfig", "_data": {"fqn_to_config": {
        "_default": {"_type": "Int4WeightOnlyConfig", "_data": {}}, "lm_head": None}}}}}
    assert "Int4WeightOnlyConfig has no CPU kernel" in schema.cpu_problem_of_torchao(cuda_only)
    assert "Int4WeightOnlyConfig has no CPU kernel" in schema.cpu_problem_of_torchao(fqn)
    assert schema.cpu_problem_of_torchao(anywhere) is None
    assert schema.torchao_config_types(anywhere) == {"IntxWeightOnlyConfig", "torch.dtype", "PerGroup"}
