"""FP8: the plain-torch decoder against compressed-tensors, plus requantization, fnuz and KV scales."""
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

ct_forward = pytest.importorskip("compressed_tensors.quantization.lifecycle.forward")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.utils.helpers import calculate_qparams, compute_dynamic_scales_and_zp  # noqa: E402

from harness.errors import CheckpointError  # noqa: E402
from harness.quant import Decoded, Fp8Parts, formats  # noqa: E402
from harness.quant import fp8 as F8  # noqa: E402
from harness.quant.source import TensorSource  # noqa: E402

M = "model.layers.0.self_attn.k_proj"
W = f"{M}.weight"


def ct_args(strategy):
    return QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=False)


def ct_quantize(w: torch.Tensor, strategy: str):
    """Weight, scale as compressed-tensors computes and compresses them (minmax, symmetric)."""
    args = ct_args(strategy)
    if strategy == "tensor":
        mn, mx = w.amin(), w.amax()
    else:
        mn, mx = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    scale, zp = calculate_qparams(mn, mx, args)
    q = ct_forward.quantize(w, scale, zp, args, dtype=torch.float8_e4m3fn)
    return q, scale, zp, args


@settings(max_examples=30, deadline=None)
@given(strategy=st.sampled_from(["tensor", "channel"]), out=st.integers(1, 24), inp=st.integers(1, 40),
       static=st.booleans(), seed=st.integers(0, 2**16))
def test_decode_matches_compressed_tensors(strategy, out, inp, static, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * 0.05
    q, scale, zp, args = ct_quantize(w, strategy)
    sd = {W: q, f"{W}_scale": scale}
    if static:
        sd[f"{M}.input_scale"] = torch.tensor([0.02])
    d = formats.decode_weight(TensorSource.from_tensors(sd), W)
    expect = ct_forward.dequantize(q, scale, zp, args)
    assert torch.equal(d.weight, expect)
    label = "fp8-tensor" if strategy == "tensor" or out == 1 else "fp8-channel"
    assert d.label == label
    assert d.settings == {"strategy": label[4:], "static_input": static}
    assert d.fp8.qweight.dtype == torch.float8_e4m3fn and torch.equal(d.fp8.qweight.view(torch.uint8), q.view(torch.uint8))
    assert d.fp8.scale.shape == (() if label == "fp8-tensor" else (out, 1))
    assert (d.fp8.input_scale is not None) == static


def test_scalar_scale_and_bf16_scale():
    """The plain `quant_method: fp8` layout stores a scalar scale; bf16 scales decode in float32."""
    q = (torch.randn(8, 16) * 100).to(torch.float8_e4m3fn)
    for scale in (torch.tensor(0.01), torch.tensor(0.01, dtype=torch.bfloat16)):
        d = formats.decode_weight(TensorSource.from_tensors({W: q, f"{W}_scale": scale}), W)
        assert d.label == "fp8-tensor"
        assert torch.equal(d.weight, q.float() * scale.float())
        assert d.fp8.scale.dtype == torch.float32


@pytest.fixture(scope="module")
def ct_checkpoint(tmp_path_factory):
    """A real compressed-tensors float-quantized tiny Llama with a kv_cache_scheme, and its decompression."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    scheme = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
    qc = QuantizationConfig.model_validate({
        "config_groups": {
            "attn": {"targets": ["re:.*self_attn[.].*_proj$"], "weights": {**scheme, "strategy": "tensor"},
                     "input_activations": {**scheme, "strategy": "tensor"}},
            "mlp": {"targets": ["re:.*mlp[.].*_proj$"], "weights": {**scheme, "strategy": "channel"},
                    "input_activations": {**scheme, "strategy": "tensor"}},
        },
        "ignore": ["lm_head"], "format": "float-quantized",
        "kv_cache_scheme": {**scheme, "strategy": "tensor"},
    })
    apply_quantization_config(model, qc)
    with torch.no_grad():  # min-max calibration by hand
        for mod in model.modules():
            if hasattr(mod, "weight_scale"):
                args = mod.quantization_scheme.weights
                red = {} if args.strategy == "tensor" else {"dim": 1, "keepdim": True}
                s, _ = calculate_qparams(mod.weight.amin(**red), mod.weight.amax(**red), args)
                mod.weight_scale.copy_(s.reshape(mod.weight_scale.shape))
                mod.input_scale.fill_(0.01)
            if hasattr(mod, "k_scale"):
                mod.k_scale.fill_(0.02)
                mod.v_scale.fill_(0.03)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    out = tmp_path_factory.mktemp("ctfp8")
    model.save_pretrained(out)
    compressor.update_config(out)
    compressor.decompress_model(model)
    return out, {n: p.detach().float().clone() for n, p in model.state_dict().items()}


def test_compressed_tensors_checkpoint(ct_checkpoint):
    path, decompressed = ct_checkpoint
    src = TensorSource.open(path)
    config = json.loads((path / "config.json").read_text())
    assert formats.quant_method(config) == "compressed-tensors"
    assert src.shape(f"{M}.weight_scale") == (1,) and src.dtype(W) == torch.float8_e4m3fn
    assert src.shape("model.layers.0.mlp.up_proj.weight_scale") == (96, 1)
    seen = set()
    for name in decompressed:
        if not name.endswith("proj.weight"):
            continue
        d = formats.decode_weight(src, name)
        seen.add(d.label)
        assert torch.equal(d.weight, decompressed[name]), name
        assert d.settings["static_input"]
    assert seen == {"fp8-tensor", "fp8-channel"}
    assert formats.decode_weight(src, "lm_head.weight").label == "unquantized"
    k, v, notes = F8.kv_scales(src, "model.layers.0.self_attn")
    assert k.item() == pytest.approx(0.02) and v.item() == pytest.approx(0.03) and notes == []


# ------------------------------------------------------------------------------------------------
# requantization of fused shards


def _shard(seed, out, inp, scale, input_scale=None):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(out, inp, generator=g) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.tensor(scale)
    return Decoded("fp8-tensor", q.float() * s, Fp8Parts(q, s, None if input_scale is None else torch.tensor(input_scale)),
                   {"strategy": "tensor", "static_input": input_scale is not None})


def fp8_step(v: torch.Tensor) -> torch.Tensor:
    """The spacing of float8_e4m3fn around |v| (v in code units)."""
    e = torch.floor(torch.log2(v.abs().clamp(min=2.0 ** -6)))
    return torch.exp2(e - 3)


@settings(max_examples=25, deadline=None)
@given(scales=st.lists(st.floats(1e-4, 1.0), min_size=2, max_size=3), seed=st.integers(0, 1000))
def test_requantize_per_tensor_within_one_step(scales, seed):
    shards = [_shard(seed + i, 8, 16, s, input_scale=0.1 * (i + 1)) for i, s in enumerate(scales)]
    fused = F8.requantize_fused(shards)
    smax = torch.tensor(max(scales))
    for before, after in zip(shards, fused):
        assert after.fp8.scale.item() == smax.item()
        assert after.fp8.input_scale.item() == pytest.approx(0.1 * len(scales))
        assert after.fp8.codes().dtype == torch.float8_e4m3fn
        assert torch.equal(after.weight, after.fp8.codes().float() * smax)
        step = torch.maximum(fp8_step(after.fp8.codes().float()), fp8_step(before.weight / smax)) * smax
        assert ((after.weight - before.weight).abs() <= step).all()
    top = max(range(len(scales)), key=lambda i: scales[i])
    assert torch.equal(fused[top].weight, shards[top].weight)  # the max-scale shard is unchanged


@pytest.mark.parametrize("dq_dtype", [torch.float32, torch.float16])
def test_requantized_codes_are_each_element_requantized(dq_dtype):
    """The 256-entry code map gives every element what requantizing it on its own gives
    (quantize(q * scale, max scale), dequantized in dq_dtype), the stored bytes untouched."""
    shards = [_shard(7, 64, 300, 0.01), _shard(8, 32, 300, 0.03)]
    stored = [s.fp8.qweight.clone() for s in shards]
    fused = F8.requantize_fused(shards, dq_dtype)
    for before, after, kept in zip(shards, fused, stored):
        expect = F8.quantize((before.fp8.qweight.to(dq_dtype) * before.fp8.scale.to(dq_dtype)).float(), torch.tensor(0.03))
        assert torch.equal(after.fp8.codes().view(torch.uint8), expect.view(torch.uint8))
        assert torch.equal(after.fp8.qweight.view(torch.uint8), kept.view(torch.uint8))
        assert torch.equal(after.weight, expect.float() * 0.03)


@pytest.mark.parametrize("per_channel", [False, True])
def test_large_weight_dequantizes_like_the_cast_whole_and_by_rows(per_channel):
    """float32(q) * scale over several lookup chunks, whole and a block of rows at a time."""
    g = torch.Generator().manual_seed(4)
    q = (torch.randn(700, 300, generator=g) * 80).clamp(-448, 448).to(torch.float8_e4m3fn)
    q.view(torch.uint8)[3, :4] = torch.tensor([0x00, 0x80, 0x7F, 0xFF], dtype=torch.uint8)  # +-0, NaN
    scale = torch.rand(700, 1, generator=g) + 0.01 if per_channel else torch.tensor(0.02)
    parts = Fp8Parts(q, scale)
    expect = q.float() * scale

    def same(a, b):  # bit for bit, a NaN where the cast gives one
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())

    assert expect.isnan().sum() == 2 and same(parts.dequantize(), expect)
    for start in range(0, 700, 96):
        assert same(parts.rows(start, min(700, start + 96)).dequantize(), expect[start:start + 96])


def test_requantize_equal_scales_is_identity():
    shards = [_shard(1, 4, 8, 0.05), _shard(2, 4, 8, 0.05)]
    for a, b in zip(shards, F8.requantize_fused(shards)):
        assert torch.equal(a.weight, b.weight)
        assert torch.equal(a.fp8.codes().view(torch.uint8), b.fp8.codes().view(torch.uint8))


def test_requantize_per_channel_concatenates_unchanged():
    shards = []
    for i, n in enumerate((4, 6)):
        q = torch.randn(n, 8).to(torch.float8_e4m3fn)
        s = torch.rand(n, 1) + 0.1
        shards.append(Decoded("fp8-channel", q.float() * s, Fp8Parts(q, s, torch.tensor(0.5 + i)), {}))
    fused = F8.requantize_fused(shards)
    for a, b in zip(shards, fused):
        assert torch.equal(a.weight, b.weight) and torch.equal(a.fp8.scale, b.fp8.scale)
        assert b.fp8.input_scale.item() == 1.5


def test_requantize_refuses_mixed_groups():
    chan = Decoded("fp8-channel", torch.zeros(2, 2), Fp8Parts(torch.zeros(2, 2).to(torch.float8_e4m3fn), torch.ones(2, 1)))
    with pytest.raises(ValueError):
        F8.requantize_fused([_shard(0, 2, 2, 0.1), chan])
    with pytest.raises(ValueError):
        F8.requantize_fused([_shard(0, 2, 2, 0.1), _shard(1, 2, 2, 0.1, input_scale=0.2)])


def test_requantize_saturates():
    """A value that the max scale cannot hold saturates at +-448 instead of becoming NaN."""
    q = torch.tensor([[448.0, -448.0]]).to(torch.float8_e4m3fn)
    a = Decoded("fp8-tensor", q.float() * 2, Fp8Parts(q, torch.tensor(2.0)))
    b = Decoded("fp8-tensor", q.float(), Fp8Parts(q, torch.tensor(1.0)))
    fused = F8.requantize_fused([a, b])
    assert fused[1].fp8.codes().float().tolist() == [[224.0, -224.0]]
    assert torch.isfinite(fused[0].weight).all()


# ------------------------------------------------------------------------------------------------
# ROCm e4m3fnuz


def test_normalise_fnuz_keeps_every_value():
    bits = torch.arange(256, dtype=torch.uint8)
    fn = bits.view(torch.float8_e4m3fn)
    keep = ~torch.isnan(fn.float())
    scale = torch.tensor(0.37)
    for given_q in (fn, bits):
        q2, s2, i2 = F8.normalise_fnuz(given_q, scale, torch.tensor(0.5))
        assert q2.dtype == torch.float8_e4m3fnuz
        assert s2.item() == pytest.approx(0.74) and i2.item() == 1.0
        assert torch.equal((q2.float() * s2)[keep], (fn.float() * scale)[keep])
        assert q2.view(torch.uint8)[0x80].item() == 0  # -0 in e4m3fn, NaN in e4m3fnuz
        assert not torch.isnan(q2.float()[keep]).any()
    q3, s3, i3 = F8.normalise_fnuz(q2, s2)
    assert q3 is q2 and s3 is s2 and i3 is None


# ------------------------------------------------------------------------------------------------
# activations


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quant_matches_compressed_tensors(dtype):
    x = (torch.randn(3, 5, 16) * 4).to(dtype)
    x[0, 0, 0] = 1e4  # saturates
    scale = torch.tensor([0.01], dtype=dtype)
    expect = ct_forward.fake_quantize(x, scale, torch.zeros(1, dtype=dtype), ct_args("tensor"))
    assert torch.equal(F8.fake_quant(x, scale), expect)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dynamic_per_token_matches_compressed_tensors(dtype):
    x = (torch.randn(2, 7, 32) * 3).to(dtype)
    x[0, 3] = 0  # an all-zero token: eps scale
    x[1, 2] = x[1, 2].abs()  # an all-positive token
    args = QuantizationArgs(num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True)
    scale, zp = compute_dynamic_scales_and_zp(x, args, module=None)
    expect = ct_forward.fake_quantize(x, scale, zp, args)
    assert torch.equal(F8.quantize_dynamic_per_token(x), expect)


# ------------------------------------------------------------------------------------------------
# KV-cache scales

A = "model.layers.3.self_attn"


def _kv(**scales):
    return TensorSource.from_tensors({f"{A}.{k}": torch.tensor([v]) for k, v in scales.items()})


def test_kv_scales_both():
    k, v, notes = F8.kv_scales(_kv(k_scale=0.1, v_scale=0.2), A)
    assert (k.item(), v.item()) == pytest.approx((0.1, 0.2)) and notes == []
    assert k.shape == () and k.dtype == torch.float32


@pytest.mark.parametrize("present,missing", [("k_scale", "v_scale"), ("v_scale", "k_scale")])
def test_kv_scales_one_missing(present, missing):
    k, v, notes = F8.kv_scales(_kv(**{present: 0.3}), A)
    assert k.item() == pytest.approx(0.3) and v.item() == pytest.approx(0.3)
    assert len(notes) == 1 and missing in notes[0]


def test_kv_scales_legacy_kv_scale():
    k, v, notes = F8.kv_scales(_kv(kv_scale=0.4), A)
    assert k.item() == pytest.approx(0.4) and v.item() == pytest.approx(0.4)
    assert "legacy" in notes[0]
    k, v, notes = F8.kv_scales(_kv(kv_scale=0.4, k_scale=0.1, v_scale=0.2), A + ".")
    assert (k.item(), v.item()) == pytest.approx((0.1, 0.2)) and "ignored" in notes[0]


def test_kv_scales_modelopt_spelling():
    k, v, notes = F8.kv_scales(_kv(**{"k_proj.k_scale": 0.1, "v_proj.v_scale": 0.2}), A)
    assert (k.item(), v.item()) == pytest.approx((0.1, 0.2)) and len(notes) == 2


def test_kv_scales_none():
    assert F8.kv_scales(_kv(), A) == (None, None, [])


@pytest.mark.parametrize("bad", [float("nan"), 0.0, -1.0])
def test_kv_scales_bad_values(bad):
    with pytest.raises(CheckpointError) as e:
        F8.kv_scales(_kv(k_scale=bad, v_scale=0.1), A)
    assert e.value.where == f"{A}.k_scale"


def test_kv_scales_per_head_refused():
    src = TensorSource.from_tensors({f"{A}.k_scale": torch.ones(4, 1, 1), f"{A}.v_scale": torch.ones(1)})
    with pytest.raises(CheckpointError) as e:
        F8.kv_scales(src, A)
    assert e.value.where == f"{A}.k_scale"


# ------------------------------------------------------------------------------------------------
# bad input


def _good(out=4, inp=8):
    q = torch.randn(out, inp).to(torch.float8_e4m3fn)
    return {W: q, f"{W}_scale": torch.full((out, 1), 0.1), f"{M}.input_scale": torch.tensor([0.2])}


def _error(sd) -> CheckpointError:
    with pytest.raises(CheckpointError) as e:
        formats.decode_weight(TensorSource.from_tensors(sd), W)
    return e.value


def test_missing_weight_scale():
    sd = _good()
    del sd[f"{W}_scale"]
    err = _error(sd)
    assert err.where == f"{W}_scale" and "missing" in err.what


def test_block_fp8_refused():
    sd = _good()
    sd[f"{W}_scale_inv"] = sd.pop(f"{W}_scale")
    err = _error(sd)
    assert err.where == f"{W}_scale_inv" and "block" in err.what


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -0.5])
def test_bad_weight_scale_values(bad):
    sd = _good()
    sd[f"{W}_scale"][2, 0] = bad
    assert _error(sd).where == f"{W}_scale"


@pytest.mark.parametrize("bad", [float("nan"), 0.0, -0.5])
def test_bad_input_scale_values(bad):
    sd = _good()
    sd[f"{M}.input_scale"] = torch.tensor([bad])
    assert _error(sd).where == f"{M}.input_scale"


@pytest.mark.parametrize("shape", [(5, 1), (3,), (4, 2)])
def test_scale_shape_mismatch(shape):
    sd = _good()
    sd[f"{W}_scale"] = torch.full(shape, 0.1)
    assert _error(sd).where == f"{W}_scale"


def test_scale_wrong_dtype():
    sd = _good()
    sd[f"{W}_scale"] = torch.ones(4, 1, dtype=torch.int32)
    err = _error(sd)
    assert err.where == f"{W}_scale" and "int32" in err.what


def test_input_scale_not_scalar():
    sd = _good()
    sd[f"{M}.input_scale"] = torch.tensor([0.1, 0.2])
    assert _error(sd).where == f"{M}.input_scale"


def test_e5m2_weight_refused():
    sd = _good()
    sd[W] = sd[W].float().to(torch.float8_e5m2)
    err = _error(sd)
    assert err.where == W and "float8_e4m3fn" in err.what


def test_nonzero_zero_point_refused():
    sd = _good()
    sd[f"{W}_zero_point"] = torch.ones(4, 1).to(torch.float8_e4m3fn)
    assert _error(sd).where == f"{W}_zero_point"
    sd[f"{W}_zero_point"] = torch.zeros(4, 1).to(torch.float8_e4m3fn)
    assert formats.decode_weight(TensorSource.from_tensors(sd), W).label == "fp8-channel"


def test_fp8_through_safetensors(tmp_path):
    sd = _good()
    save_file(sd, tmp_path / "model.safetensors")
    src = TensorSource.open(tmp_path)
    assert src.dtype(W) == torch.float8_e4m3fn
    d = formats.decode_weight(src, W)
    assert torch.equal(d.weight, sd[W].float() * sd[f"{W}_scale"])
