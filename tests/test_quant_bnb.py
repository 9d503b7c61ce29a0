"""bitsandbytes 4-bit: the plain-torch decoder against bitsandbytes' own dequantize_4bit."""
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

bnbf = pytest.importorskip("bitsandbytes.functional")

from harness.errors import CheckpointError  # noqa: E402
from harness.quant import LOOKUP_CHUNK, bnb, formats  # noqa: E402
from harness.quant.source import TensorSource  # noqa: E402

W = "model.layers.0.self_attn.k_proj.weight"


def quantized_state_dict(weight: torch.Tensor, quant_type="nf4", blocksize=64, double=False, name=W):
    """The tensors Linear4bit._save_to_state_dict writes (what transformers saves)."""
    packed, state = bnbf.quantize_4bit(weight, blocksize=blocksize, compress_statistics=double, quant_type=quant_type)
    sd = {name: packed}
    for k, v in state.as_dict(packed=True).items():
        sd[f"{name}.{k}"] = v
    return sd, packed, state


def oracle(packed, state) -> torch.Tensor:
    """bitsandbytes' own dequantization.

    Its CPU C kernel (what `dequantize_4bit` runs here) is used when every row holds whole blocks,
    as in real models. When blocks straddle rows (in_features % blocksize != 0) that kernel
    disagrees with bitsandbytes' own quantizer and with its flat-block reference implementation
    (bitsandbytes 0.50.2, AVX2), so the reference implementation is the oracle there; it is called
    unwrapped to skip its torch.compile.
    """
    if state.shape[-1] % state.blocksize == 0:
        return bnbf.dequantize_4bit(packed, state).float()
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute

    absmax = state.absmax
    if state.nested:
        absmax = bnbf.dequantize_blockwise(state.absmax, state.state2) + state.offset
    compute = getattr(_dequantize_4bit_compute, "__wrapped__", _dequantize_4bit_compute)
    code = bnbf.get_4bit_type(state.quant_type, device="cpu")
    return compute(packed.reshape(-1), absmax, code, state.blocksize, state.shape, state.dtype).float()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    quant_type=st.sampled_from(["nf4", "fp4"]),
    double=st.booleans(),
    blocksize=st.sampled_from([32, 64, 128, 256, 4096]),
    out=st.integers(1, 40),
    inp=st.integers(1, 70),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_decode_matches_bitsandbytes(quant_type, double, blocksize, out, inp, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(out, inp, generator=g) * 0.1).to(dtype)
    sd, packed, state = quantized_state_dict(w, quant_type, blocksize, double)
    d = formats.decode_weight(TensorSource.from_tensors(sd), W)
    assert d.label == f"bnb-{quant_type}"
    assert d.weight.dtype == torch.float32 and d.weight.shape == (out, inp)
    assert d.settings == {"quant_type": quant_type, "blocksize": blocksize, "double_quant": double}
    assert torch.equal(d.weight, oracle(packed, state))


@pytest.mark.parametrize("quant_type,double,blocksize,shape,dtype", [
    ("nf4", False, 64, (300, 512), torch.float32),  # several lookup chunks, rows of whole blocks
    ("fp4", True, 64, (257, 1100), torch.bfloat16),  # blocks straddle rows, a short last block
    ("nf4", True, 128, (129, 1027), torch.float16),  # an odd element count: the last byte half used
])
def test_large_weight_decodes_like_bitsandbytes_whole_and_by_rows(quant_type, double, blocksize, shape, dtype):
    """The chunked decode of a weight larger than one lookup chunk, whole and a block of rows at a
    time (Stored4bit.rows, what a large linear's forward uses), equals bitsandbytes bit for bit."""
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(*shape, generator=g) * 0.1).to(dtype)
    sd, packed, state = quantized_state_dict(w, quant_type, blocksize, double)
    expect = oracle(packed, state)
    stored = formats.decode_weight(TensorSource.from_tensors(sd), W).stored
    assert isinstance(stored, bnb.Stored4bit) and shape[0] * shape[1] > 2 * LOOKUP_CHUNK
    assert torch.equal(stored.dequantize(), expect)
    step = stored.row_alignment * max(1, 40 // stored.row_alignment)
    for start in range(0, shape[0], step):
        stop = min(shape[0], start + step)
        assert torch.equal(stored.rows(start, stop).dequantize(), expect[start:stop]), (start, stop)


def test_dequantize_into_an_output_the_table_cannot_view():
    """An `out` at an odd float offset (no int64 view of it) still receives the exact values."""
    torch.manual_seed(3)
    sd, packed, state = quantized_state_dict(torch.randn(8, 64))
    stored = formats.decode_weight(TensorSource.from_tensors(sd), W).stored
    buffer = torch.full((1 + 8 * 64,), 7.0)
    out = buffer[1:].view(8, 64)
    assert stored.dequantize(out) is out and torch.equal(out, oracle(packed, state)) and buffer[0] == 7.0


def test_safetensors_roundtrip_and_ownership(tmp_path):
    torch.manual_seed(0)
    sd = {}
    for i, (qt, dq) in enumerate([("nf4", False), ("nf4", True), ("fp4", False), ("fp4", True)]):
        part, packed, state = quantized_state_dict(torch.randn(48, 80), qt, 64, dq, name=f"m.l{i}.weight")
        sd.update(part)
        sd[f"m.l{i}.expect"] = oracle(packed, state)
    sd["m.plain.weight"] = torch.randn(4, 4)
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    src = TensorSource.open(tmp_path)
    assert src.dtype("m.l0.weight") == torch.uint8 and src.shape("m.l0.weight") == (48 * 80 // 2, 1)
    for i in range(4):
        assert bnb.owns(src, f"m.l{i}.weight")
        assert torch.equal(bnb.decode(src, f"m.l{i}.weight").weight, src.get(f"m.l{i}.expect"))
    assert not bnb.owns(src, "m.plain.weight")
    assert formats.decode_weight(src, "m.plain.weight").label == "unquantized"


def test_transformers_saved_checkpoint(tmp_path):
    """The layout transformers 5.x really writes: decode equals what its loaded Linear4bit holds."""
    pytest.importorskip("transformers")
    from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "base")
    qc = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                            bnb_4bit_compute_dtype=torch.float32)
    model = LlamaForCausalLM.from_pretrained(tmp_path / "base", quantization_config=qc, device_map="cpu",
                                             dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "q")
    src = TensorSource.open(tmp_path / "q")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert formats.quant_method(config) == "bitsandbytes"
    names = [n for n, m in model.named_modules() if type(m).__name__ == "Linear4bit"]
    assert names
    for n in names:
        p = model.get_submodule(n).weight
        d = formats.decode_weight(src, f"{n}.weight")
        assert d.settings == {"quant_type": "nf4", "blocksize": 64, "double_quant": True}
        assert torch.equal(d.weight, oracle(p.data, p.quant_state)), n  # down_proj: 96 % 64 != 0
    assert formats.decode_weight(src, "lm_head.weight").label == "unquantized"


def test_nibble_order_high_first():
    packed = torch.tensor([[0x1F], [0x80]], dtype=torch.uint8)
    assert bnb.unpack_nibbles(packed, 4).tolist() == [1, 15, 8, 0]
    assert bnb.unpack_nibbles(packed, 3).tolist() == [1, 15, 8]


def test_code_tables_match_bitsandbytes():
    for qt in ("nf4", "fp4"):
        assert torch.equal(bnb.code_table(qt), bnbf.get_4bit_type(qt, device="cpu"))


def test_quant_storage_other_than_uint8():
    """transformers' bnb_4bit_quant_storage stores the same bytes under another dtype."""
    torch.manual_seed(1)
    sd, packed, state = quantized_state_dict(torch.randn(16, 64))
    sd[W] = packed.reshape(-1).view(torch.bfloat16).reshape(-1, 1)
    d = formats.decode_weight(TensorSource.from_tensors(sd), W)
    assert torch.equal(d.weight, oracle(packed, state))


# ------------------------------------------------------------------------------------------------
# bad input: a CheckpointError that names the tensor


def _state(double=False, quant_type="nf4"):
    torch.manual_seed(2)
    sd, _, _ = quantized_state_dict(torch.randn(32, 64), quant_type, 64, double)
    return sd


def _qs_key(quant_type="nf4"):
    return f"{W}.quant_state.bitsandbytes__{quant_type}"


QS = f"<memory>: quant state of {W}"  # where a problem of the quant state's JSON is


def _set_json(sd, **changes):
    key = _qs_key()
    state = json.loads(bytes(sd[key].numpy()).decode())
    for k, v in changes.items():
        if v is None:
            state.pop(k, None)
        else:
            state[k] = v
    sd[key] = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)


def _error(sd) -> CheckpointError:
    with pytest.raises(CheckpointError) as e:
        formats.decode_weight(TensorSource.from_tensors(sd), W)
    return e.value


def test_missing_quant_state():
    sd = _state()
    del sd[_qs_key()]
    err = _error(sd)
    assert err.where.startswith(f"{W}.quant_state") and "missing" in err.what


@pytest.mark.parametrize("leaf", ["absmax", "quant_map"])
def test_missing_parts(leaf):
    sd = _state()
    del sd[f"{W}.{leaf}"]
    err = _error(sd)
    assert err.where == f"{W}.{leaf}" and "missing" in err.what


@pytest.mark.parametrize("leaf", ["nested_absmax", "nested_quant_map"])
def test_missing_nested_parts(leaf):
    sd = _state(double=True)
    del sd[f"{W}.{leaf}"]
    err = _error(sd)
    assert err.where == f"{W}.{leaf}" and "missing" in err.what


def test_missing_packed_weight():
    sd = _state()
    del sd[W]
    err = _error(sd)
    assert err.where == W and "missing" in err.what


def test_shape_mismatch_with_quant_state():
    sd = _state()
    _set_json(sd, shape=[32, 128])
    err = _error(sd)
    assert err.where == W and "bytes" in err.what


def test_absmax_count_mismatch():
    sd = _state()
    sd[f"{W}.absmax"] = sd[f"{W}.absmax"][:-1]
    assert _error(sd).where == f"{W}.absmax"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_bad_absmax_values(bad):
    sd = _state()
    a = sd[f"{W}.absmax"].clone()
    a[3] = bad
    sd[f"{W}.absmax"] = a
    assert _error(sd).where == f"{W}.absmax"


def test_zero_absmax_is_legal():
    """An all-zero block has absmax 0, and bitsandbytes stores it so."""
    w = torch.randn(4, 64)
    w[1] = 0
    sd, packed, state = quantized_state_dict(w)
    assert (sd[f"{W}.absmax"] == 0).any()
    assert torch.equal(formats.decode_weight(TensorSource.from_tensors(sd), W).weight, oracle(packed, state))


def test_nan_nested_absmax():
    sd = _state(double=True)
    sd[f"{W}.nested_absmax"] = torch.full_like(sd[f"{W}.nested_absmax"], float("nan"))
    assert _error(sd).where == f"{W}.nested_absmax"


def test_wrong_absmax_dtype():
    sd = _state()
    sd[f"{W}.absmax"] = sd[f"{W}.absmax"].half()
    err = _error(sd)
    assert err.where == f"{W}.absmax" and "float32" in err.what


def test_double_quant_absmax_must_be_uint8():
    sd = _state(double=True)
    sd[f"{W}.absmax"] = sd[f"{W}.absmax"].float()
    assert _error(sd).where == f"{W}.absmax"


def test_unreadable_json():
    sd = _state()
    sd[_qs_key()] = torch.tensor(list(b"{not json"), dtype=torch.uint8)
    err = _error(sd)
    assert err.where == QS and err.what.startswith("JSON unreadable: ")


def test_quant_state_wrong_dtype():
    sd = _state()
    sd[_qs_key()] = sd[_qs_key()].float()
    assert _error(sd).where == _qs_key()


@pytest.mark.parametrize("changes, what", [
    ({"blocksize": None}, "blocksize: required key is missing"),
    ({"blocksize": 48}, "blocksize: must be 32, 64, 128, 256, 512, 1024, 2048 or 4096 (got 48)"),
    ({"blocksize": "64"}, 'blocksize: must be 32, 64, 128, 256, 512, 1024, 2048 or 4096 (got "64")'),
    ({"dtype": "int8"}, "dtype: must be 'float32', 'float16' or 'bfloat16' (got \"int8\")"),
    ({"dtype": ["float32"]}, "dtype: must be 'float32', 'float16' or 'bfloat16' (got list)"),
    ({"quant_type": "fp4"}, "quant_type: 'fp4' under a __nf4 key"),
    ({"shape": [2048]}, "shape: List should have at least 2 items after validation, not 1 (got list)"),
    ({"shape": "x"}, 'shape: must be a list (got "x")'),
    ({"shape": [32, True]}, "shape[1]: must be an integer (got true)"),
    ({"nested_offset": "0.5"}, 'nested_offset: must be a number (got "0.5")'),
])
def test_bad_quant_state_fields(changes, what):
    sd = _state()
    _set_json(sd, **changes)
    err = _error(sd)
    assert (err.where, err.what) == (QS, what)


def test_nested_fields_missing_from_json():
    sd = _state(double=True)
    _set_json(sd, nested_offset=None)
    err = _error(sd)
    assert (err.where, err.what) == (QS, "nested_offset: double quant but the quant state has none")


def test_quant_map_disagreeing_with_the_table():
    sd = _state()
    sd[f"{W}.quant_map"] = bnb.code_table("fp4")
    err = _error(sd)
    assert err.where == f"{W}.quant_map"


def test_two_quant_states():
    sd = _state()
    sd[_qs_key("fp4")] = sd[_qs_key()]
    assert _error(sd).where == W
