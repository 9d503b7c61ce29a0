"""The C decoders and FP8 rounding (harness.quant.native) against the plain-torch path, bit for bit.

Each check runs on up to three builds: the machine's own (`-march=native`: AVX-512 loops where the
CPU has them), an AVX2 one (`-march=haswell`, where the CPU has AVX2) and a portable one
(`-march=x86-64`: the scalar loops only), so that every code path is compared with torch on a CPU
with AVX-512, whatever runs the tests elsewhere.
"""
import platform
import shutil
import warnings

import pytest
import torch

from harness import cpu
from harness.quant import bnb, dequantize_fp8, fp8, native, torchao

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")

# build -> (its -march, the vector width its loops take)
MARCH = {"avx2": ("haswell", 8), "portable": ("x86-64", 1)}
BUILDS = ["native"] + (["avx2"] if "avx2" in cpu.flags() else []) + (["portable"] if platform.machine() == "x86_64" else [])


@pytest.fixture(params=BUILDS)
def c_library(request, monkeypatch, tmp_path_factory):
    """harness.quant.native with one build's library (built into a per-session cache)."""
    if request.param in MARCH:
        monkeypatch.setattr(native, "FLAGS", tuple(f"-march={MARCH[request.param][0]}" if f == "-march=native" else f
                                                   for f in native.FLAGS))
    monkeypatch.setenv("HARNESS_NATIVE_CACHE", str(tmp_path_factory.getbasetemp() / "native"))
    native.library.cache_clear()
    assert native.library() is not None
    yield request.param
    native.library.cache_clear()


@pytest.fixture
def torch_only(monkeypatch):
    """A context in which the C library is absent: the plain-torch path runs."""
    def run(fn, *args, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(native, "library", lambda: None)
            return fn(*args, **kwargs)
    return run


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def every_e4m3_code(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows * cols,), dtype=torch.uint8, generator=g)
    codes[:256] = torch.arange(256, dtype=torch.int32).to(torch.uint8)[:rows * cols]
    return codes.view(rows, cols).view(torch.float8_e4m3fn)


def test_each_build_runs_its_own_vector_loops(c_library):
    """A build whose vector loops were compiled out would pass every comparison on its scalar loops."""
    have = cpu.flags()
    own = 16 if "avx512f" in have else 8 if "avx2" in have else 1
    width = MARCH[c_library][1] if c_library in MARCH else own
    assert native.library().harness_vector_width() == width
    assert native.describe() == {16: "C, AVX-512 (16 values at a time)", 8: "C, AVX2 (8 values at a time)",
                                 1: "C, scalar"}[width]


# 33 columns leave a scalar tail after each row's 16- or 8-wide loops; 2048 has none.
@pytest.mark.parametrize("shape", [(24, 33), (16, 2048)])
@pytest.mark.parametrize("scheme", ["tensor", "channel", "remap"])
def test_fp8_weights_decode_in_c_as_in_torch(c_library, torch_only, shape, scheme):
    q = every_e4m3_code(*shape)
    scale = torch.rand(shape[0], 1) + 1e-3 if scheme == "channel" else torch.tensor(0.0173)
    remap = torch.randperm(256).to(torch.uint8) if scheme == "remap" else None
    got = dequantize_fp8(q, scale, remap=remap)
    want = torch_only(dequantize_fp8, q, scale, remap=remap)
    assert torch.equal(bits(got), bits(want))  # NaN codes included: compared as bits


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("blocksize,shape", [(32, (7, 40)), (64, (33, 64)), (4096, (3, 1500))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bnb_weights_decode_in_c_as_in_torch(c_library, torch_only, quant_type, blocksize, shape, dtype):
    n = shape[0] * shape[1]
    g = torch.Generator().manual_seed(blocksize)
    packed = torch.randint(0, 256, ((n + 1) // 2,), dtype=torch.uint8, generator=g)
    absmax = torch.rand(-(-n // blocksize), generator=g)
    absmax[0] = 0.0  # an all-zero block is legal
    got = bnb.dequantize(packed, absmax, quant_type, blocksize, shape, dtype)
    want = torch_only(bnb.dequantize, packed, absmax, quant_type, blocksize, shape, dtype)
    assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("block", [(1, 40), (1, 8)])
def test_torchao_weights_decode_in_c_as_in_torch(c_library, torch_only, block, dtype):
    q = every_e4m3_code(12, 40, seed=1).view(dtype)
    scale = torch.rand(12 // block[0], 40 // block[1]) + 1e-3
    got = torchao.dequantize(q, scale, None, block)
    want = torch_only(torchao.dequantize, q, scale, None, block)
    assert torch.equal(bits(got), bits(want))


def test_fp8_rounding_in_c_matches_torchs_cast_at_every_boundary(c_library):
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[~grid.isnan()].unique().double()
    midpoints = ((grid[1:] + grid[:-1]) / 2).float()  # exact in float32: the ties
    up, down = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    g = torch.Generator().manual_seed(0)
    x = torch.cat([
        midpoints, torch.nextafter(midpoints, up), torch.nextafter(midpoints, down),
        torch.tensor([0.0, -0.0, 448.0, -448.0, float("nan"), -float("nan"), 2.0 ** -6, 2.0 ** -10, 1e-40, -1e-45]),
        torch.randn(200_000, generator=g) * torch.logspace(-12, 2.6, 200_000),
    ]).clamp(-448, 448)
    got = native.round_e4m3(x)
    assert got is not None
    assert torch.equal(bits(got), bits(x.to(torch.float8_e4m3fn).float()))


def test_fp8_activation_quantization_is_the_same_in_c_and_in_torch(c_library, torch_only):
    x = torch.randn(3, 5, 48) * 7
    assert torch.equal(bits(fp8.quantize_dynamic_per_token(x)), bits(torch_only(fp8.quantize_dynamic_per_token, x)))
    scale = torch.tensor(0.05)
    assert torch.equal(bits(fp8.fake_quant(x, scale)), bits(torch_only(fp8.fake_quant, x, scale)))


def test_the_library_is_built_once_and_then_loaded_from_its_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HARNESS_NATIVE_CACHE", str(tmp_path))
    native.library.cache_clear()
    try:
        assert native.library() is not None
        built = list(tmp_path.glob("*.so"))
        assert len(built) == 1 and not list(tmp_path.glob("*.tmp"))
        stamp = built[0].stat().st_mtime_ns
        native.library.cache_clear()
        assert native.library() is not None
        assert built[0].stat().st_mtime_ns == stamp and list(tmp_path.glob("*.so")) == built
    finally:
        native.library.cache_clear()


UNAVAILABLE = "harness native decoders unavailable, decoding in plain torch: "


@pytest.mark.parametrize("setting,warned", [
    ({"CC": "no-such-compiler"}, [UNAVAILABLE + "no C compiler (no-such-compiler) on PATH"]),
    ({"CC": "false"}, [UNAVAILABLE + "false failed on native.c: no message"]),  # a compiler that fails
    ({"HARNESS_NATIVE": "0"}, []),
])
def test_without_the_library_the_decoders_run_in_torch(monkeypatch, tmp_path, setting, warned):
    monkeypatch.setenv("HARNESS_NATIVE_CACHE", str(tmp_path))
    for key, value in setting.items():
        monkeypatch.setenv(key, value)
    native.library.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert native.library() is None
        assert [str(w.message) for w in caught] == warned
        assert not list(tmp_path.iterdir())  # nothing half-built left behind
        q = every_e4m3_code(4, 64)
        want = q.float() * torch.tensor(0.5)
        assert torch.equal(bits(dequantize_fp8(q, torch.tensor(0.5))), bits(want))
        assert native.round_e4m3(torch.ones(3)) is None
    finally:
        native.library.cache_clear()
