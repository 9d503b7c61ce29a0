"""The plain-torch quantizers (harness.quant.quantize) against the libraries that define them, bit for
bit, and their memory: no full-size temporary, whatever the size of the weight."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.quant import quantize as Q

bnbf = pytest.importorskip("bitsandbytes.functional")


def _weight(out, inp, seed, zero_rows=0, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * scale
    w[:zero_rows] = 0
    return w


def bnb_oracle(w, quant_type, blocksize):
    """bitsandbytes' quantize_4bit, then its dequantization. Its CPU dequantize C kernel is right only
    when every row holds whole blocks; otherwise its flat-block reference implementation is the oracle
    (see tests/test_quant_bnb.py), called unwrapped to skip its torch.compile."""
    packed, state = bnbf.quantize_4bit(w, blocksize=blocksize, quant_type=quant_type)
    if w.shape[-1] % blocksize == 0:
        return bnbf.dequantize_4bit(packed, state).float()
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute

    compute = getattr(_dequantize_4bit_compute, "__wrapped__", _dequantize_4bit_compute)
    code = bnbf.get_4bit_type(quant_type, device="cpu")
    return compute(packed.reshape(-1), state.absmax, code, blocksize, state.shape, state.dtype).float()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(quant_type=st.sampled_from(["nf4", "fp4"]), blocksize=st.sampled_from([32, 64, 128, 256, 4096]),
       out=st.integers(1, 40), inp=st.integers(1, 140), zero_rows=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_bnb_4bit_equals_bitsandbytes(quant_type, blocksize, out, inp, zero_rows, seed):
    w = _weight(out, inp, seed, zero_rows)
    d = Q.bnb_4bit(w, quant_type, blocksize)
    assert d.label == f"bnb-{quant_type}"
    assert d.settings == {"quant_type": quant_type, "blocksize": blocksize, "double_quant": False}
    assert torch.equal(d.weight, bnb_oracle(w, quant_type, blocksize))


def test_bnb_4bit_ties_go_down_as_in_bitsandbytes():
    """Values exactly on a midpoint of the NF4 table take the lower code, as torch.bucketize does."""
    from harness.quant import bnb

    code = bnb.code_table("nf4")
    mids = (code[:-1] + code[1:]) / 2
    w = torch.cat([mids, torch.tensor([1.0])]).reshape(1, -1)  # absmax 1: scaled values are the midpoints
    assert torch.equal(Q.bnb_4bit(w, "nf4", 32).weight, bnb_oracle(w, "nf4", 32))


@settings(max_examples=30, deadline=None)
@given(granularity=st.sampled_from(["per-row", "per-tensor"]), out=st.integers(1, 40), inp=st.integers(2, 90),
       zero_rows=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_torchao_int8_equals_int8tensor(granularity, out, inp, zero_rows, seed):
    """(in_features >= 2: torchao 0.18 itself fails to reshape its scale for a one-column weight.)"""
    from torchao.quantization import PerRow, PerTensor
    from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor

    w = _weight(out, inp, seed, zero_rows)
    t = Int8Tensor.from_hp(w, PerRow() if granularity == "per-row" else PerTensor())
    d = Q.torchao_int8(w, granularity)
    assert d.label == "torchao-int8"
    assert torch.equal(d.weight, t.dequantize().float())


@settings(max_examples=30, deadline=None)
@given(strategy=st.sampled_from(["tensor", "channel"]), out=st.integers(1, 40), inp=st.integers(1, 90),
       zero_rows=st.integers(0, 2), scale=st.sampled_from([1e-4, 0.05, 30.0]), seed=st.integers(0, 2**16))
def test_fp8_equals_compressed_tensors(strategy, out, inp, zero_rows, scale, seed):
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    w = _weight(out, inp, seed, zero_rows, scale)
    args = QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=False)
    if strategy == "tensor":
        lo, hi = w.min().reshape(1), w.max().reshape(1)
    else:
        lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    s, zp = calculate_qparams(lo, hi, args)
    d = Q.fp8_weight(w, strategy)
    assert d.label == f"fp8-{strategy}"
    assert torch.equal(d.fp8.scale.reshape(-1), s.reshape(-1).float())
    assert torch.equal(d.weight, fake_quantize(w, s, zp, args).float())
    assert torch.equal(d.weight, d.fp8.qweight.float() * d.fp8.scale)


def test_fp8_per_tensor_scale_is_vllms():
    """vLLM's online fp8 (`scaled_fp8_quant(w, scale=None)`): scale = max|w| / 448."""
    w = _weight(64, 48, 3)
    assert float(Q.fp8_scale(w, "tensor")) == float(w.abs().max() / 448.0)


def test_all_zero_weight():
    w = torch.zeros(4, 64)
    assert torch.equal(Q.bnb_4bit(w).weight, w)
    assert torch.equal(Q.torchao_int8(w).weight, w)
    assert torch.equal(Q.fp8_weight(w, "tensor").weight, w)


@pytest.mark.parametrize("fn", [
    lambda w: Q.bnb_4bit(w, "fp4", 64),
    lambda w: Q.torchao_int8(w, "per-row"),
    lambda w: Q.torchao_int8(w, "per-tensor"),
    lambda w: Q.fp8_weight(w, "tensor"),
    lambda w: Q.fp8_weight(w, "channel"),
], ids=["bnb", "int8-row", "int8-tensor", "fp8-tensor", "fp8-channel"])
def test_chunking_does_not_change_the_result(fn, monkeypatch):
    w = _weight(37, 70, 5)  # 2590 values: chunks of 128 leave ragged row and block tails
    whole = fn(w).weight
    monkeypatch.setattr(Q, "CHUNK", 128)
    assert torch.equal(fn(w).weight, whole)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_weights_quantize_as_float32(dtype):
    w = _weight(33, 70, 9).to(dtype)
    for fn in (lambda x: Q.bnb_4bit(x, "nf4", 64), Q.torchao_int8, lambda x: Q.torchao_int8(x, "per-tensor"),
               lambda x: Q.fp8_weight(x, "tensor"), lambda x: Q.fp8_weight(x, "channel")):
        assert torch.equal(fn(w).weight, fn(w.float()).weight)


def _allocations(fn) -> list[int]:
    """Bytes of every CPU allocation an op made while `fn` ran (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return [e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0]


@pytest.mark.parametrize("fn,kept", [
    (lambda w: Q.bnb_4bit(w, "nf4", 64), [4]),
    (lambda w: Q.torchao_int8(w, "per-row"), [4]),
    (lambda w: Q.fp8_weight(w, "tensor"), [1, 4]),
    (lambda w: Q.fp8_weight(w, "channel"), [1, 4]),
], ids=["bnb", "int8", "fp8-tensor", "fp8-channel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_full_size_temporaries(fn, kept, dtype, monkeypatch):
    """Quantizing a 1024 x 1024 weight allocates full size only for what the model keeps: the float32
    effective weight (4 bytes a value) and, for FP8, the float8 codes (1 byte). Every temporary is
    bounded by CHUNK values (at most 8 bytes each), here far below one byte per weight value."""
    monkeypatch.setattr(Q, "CHUNK", 1 << 15)
    w = _weight(1024, 1024, 0).to(dtype)  # bfloat16: widened chunk by chunk, never as a whole
    n = w.numel()
    allocations = _allocations(lambda: fn(w))
    assert allocations, "the profiler recorded no allocation"
    big = sorted(a for a in allocations if a >= n)
    assert big == sorted(k * n for k in kept)
    assert max(a for a in allocations if a < n) <= 8 * Q.CHUNK
