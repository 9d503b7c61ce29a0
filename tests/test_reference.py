"""The reference loader's report and its loading discipline, on the fixtures."""
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.nn import functional as F

from harness import fixtures, reference
from harness.errors import CheckpointError
from harness.quant import Fp8Parts, bnb, formats, torchao
from harness.quant.source import TensorSource
from harness.reference import linear, loader


def _load(name, **kw):
    return reference.load(fixtures.build(name), **kw)


def test_skeleton_allocates_no_weights():
    path = fixtures.build("llama-unquantized")
    model = loader._skeleton(path, json.loads((path / "config.json").read_text()), TensorSource.open(path))
    assert all(p.is_meta for p in model.parameters())


def test_ambiguous_skip_reports_overreach_into_layers_10_and_11():
    report = _load("llama-bnb-nf4-skip-ambiguous").report
    overreach = {d.module.split(".")[2] for d in report.disagreements if d.source == "transformers:overreach"}
    assert overreach == {"10", "11"}
    assert report.modules["model.layers.11.mlp.up_proj"] == "unquantized"
    assert report.modules["model.layers.2.mlp.up_proj"] == "bnb-nf4"


def test_short_spelling_that_matches_nothing_is_reported():
    report = _load("llama-bnb-nf4-skip-short").report
    kinds = {d.source for d in report.disagreements}
    assert {"transformers:underreach", "transformers:unmatched"} <= kinds
    assert report.modules["model.layers.2.mlp.up_proj"] == "bnb-nf4"


def test_mixed_group_loads_unfused_with_reason():
    report = _load("llama-fp8-static-kv-skip-kproj").report
    group = next(g for g in report.groups if g.parent == "model.layers.0.self_attn")
    assert not group.fused and "k_proj=unquantized" in group.reason
    assert all(g.fused for g in report.groups if g is not group)


def test_kv_scales_found_on_every_attention_including_cross():
    report = _load("whisper-fp8-static-kv").report
    assert report.kv_fake_quant
    assert any(".encoder_attn" in name for name in report.kv_scales)
    assert len(report.kv_scales) == len(fixtures.manifest(fixtures.build("whisper-fp8-static-kv"))["kv_cache_modules"])


def test_report_json_round_trips_and_has_phase_timings():
    report = _load("llama-bnb-nf4").report
    data = json.loads(report.to_json())
    assert data["modules"] == report.modules
    assert {"skeleton", "read", "decode", "fuse", "assign", "total"} <= set(data["timings"])


def test_fuse_false_leaves_every_group_unfused():
    report = _load("llama-bnb-nf4", fuse=False).report
    assert report.groups and not any(g.fused for g in report.groups)


@pytest.mark.slow("builds the Whisper torchao fixture and runs `harness load --json` in a subprocess")
def test_cli_load_json():
    path = fixtures.build("whisper-torchao-int8wo")
    run = subprocess.run([sys.executable, "-m", "harness.cli", "load", str(path), "--json"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout)["modules"]["model.decoder.layers.0.encoder_attn.q_proj"] == "torchao-int8"


# ------------------------------------------------------------------------------------------------
# loading like an engine: weights as stored, dequantized when used (docs/design.md, "Fast loading")


def _mapped_from(file: Path) -> list[tuple[int, int]]:
    """The address ranges this process maps from `file` (Linux /proc/self/maps)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(file):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((lo, hi))
    return ranges


def _inside(t: torch.Tensor, ranges) -> bool:
    return any(lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi for lo, hi in ranges)


needs_proc_maps = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps (Linux)")


def _half_precision_copy(name: str, tmp_path: Path) -> Path:
    """The fixture with every float32 tensor stored as float16."""
    path = fixtures.build(name)
    out = tmp_path / name
    shutil.copytree(path, out)
    tensors = load_file(path / "model.safetensors")
    save_file({k: v.half() if v.dtype == torch.float32 else v for k, v in tensors.items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    return out


@needs_proc_maps
def test_float32_weights_are_views_of_the_checkpoint_file_and_half_ones_are_widened(tmp_path):
    path = fixtures.build("llama-unquantized")
    loaded = reference.load(path)
    ranges = _mapped_from((path / "model.safetensors").resolve())
    weights = {n: loaded.model.get_submodule(n).weight for n in loaded.report.modules}
    weights["model.embed_tokens"] = loaded.model.model.embed_tokens.weight
    assert ranges and all(_inside(w, ranges) for w in weights.values()), [n for n, w in weights.items() if not _inside(w, ranges)]
    assert set(loaded.report.storage.values()) == {"mapped"}

    half = _half_precision_copy("llama-unquantized", tmp_path)
    widened = reference.load(half)
    assert set(widened.report.storage.values()) == {"in-memory"}
    w = widened.model.get_submodule("model.layers.0.mlp.up_proj").weight
    assert w.dtype == torch.float32 and not _inside(w, _mapped_from((half / "model.safetensors").resolve()))
    assert torch.equal(w, loaded.model.get_submodule("model.layers.0.mlp.up_proj").weight.half().float())


@needs_proc_maps
@pytest.mark.parametrize("name,kind,field", [("llama-bnb-nf4", bnb.Stored4bit, "packed"),
                                             ("llama-fp8-dynamic", Fp8Parts, "qweight"),
                                             ("llama-torchao-int8wo", torchao.StoredTorchao, "qdata")])
def test_quantized_weights_stay_stored_in_the_mapping_and_dequantize_when_called(name, kind, field):
    path = fixtures.build(name)
    loaded = reference.load(path, fuse=False)
    ranges = _mapped_from((path / "model.safetensors").resolve())
    module = loaded.model.get_submodule("model.layers.0.self_attn.o_proj")
    assert isinstance(module.stored, kind) and _inside(getattr(module.stored, field), ranges)
    assert "weight" not in dict(module.named_parameters())  # no float32 copy is held
    assert loaded.report.storage["model.layers.0.self_attn.o_proj"] == "stored"
    expect = formats.decode_weight(TensorSource.open(path), "model.layers.0.self_attn.o_proj.weight").weight
    assert torch.equal(module.weight, expect)
    x = torch.randn(2, 3, module.in_features)
    quantized_x = x if module.input_quant is None else module.input_quant(x)
    assert torch.equal(module(x), F.linear(quantized_x, expect, module.bias))


def test_fused_groups_copy_nothing_and_say_how_they_hold_their_shards():
    bnb_report = _load("llama-bnb-nf4").report
    assert bnb_report.groups and {g.layout for g in bnb_report.groups} == {"per-shard"}
    assert "nothing copied" in bnb_report.summary()
    fp8_loaded = _load("llama-fp8-static-kv")
    report = fp8_loaded.report
    assert {g.layout for g in report.groups} == {"requantized"}
    assert report.storage["model.layers.0.self_attn.k_proj"] == "requantized"
    assert report.storage["model.layers.0.self_attn.o_proj"] == "stored"
    k_proj = fp8_loaded.model.get_submodule("model.layers.0.self_attn.k_proj")
    parts = k_proj.fused.parts[k_proj.index]
    assert parts.remap is not None  # read through the code map, its bytes those on disk
    assert torch.equal(parts.qweight.view(torch.uint8),
                       TensorSource.open(fixtures.build("llama-fp8-static-kv")).get(
                           "model.layers.0.self_attn.k_proj.weight").view(torch.uint8))
    assert {g.layout for g in _load("llama-bnb-nf4", fuse=False).report.groups} == {""}


@pytest.mark.parametrize("name", ["llama-bnb-nf4", "llama-fp8-static-kv", "llama-torchao-int8wo"])
def test_a_large_stored_weight_is_multiplied_a_block_of_rows_at_a_time(name, monkeypatch):
    """With the row block below the fixture's weights, every quantized linear takes its weight in
    blocks; the output is F.linear of the whole weight (to rounding) and its bias rows are its own."""
    loaded = _load(name)
    x = torch.randn(1, 5, 128)
    monkeypatch.setattr(linear, "ROW_BLOCK", 1000)
    for shard in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj"):
        module = loaded.model.get_submodule(shard)
        bias = torch.arange(module.out_features, dtype=torch.float32)
        held = module.stored if isinstance(module, linear.ReferenceLinear) else module.fused.parts[module.index]
        assert not isinstance(held, torch.Tensor)
        got = linear.project(x, held, bias)
        assert torch.allclose(got, F.linear(x, module.weight, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("row_block", [1000, 1 << 19], ids=["in-blocks", "whole"])
def test_every_dequantization_of_a_call_writes_into_the_one_reused_buffer(row_block, monkeypatch):
    """Whole or a block of rows at a time, a stored weight is dequantized into the thread's one
    buffer, never into a temporary of its own (target 1c of issue 13: memory is the stored form
    plus one block), and the result is bit-identical to F.linear of the whole weight when whole."""
    loaded = _load("llama-bnb-nf4")
    module = loaded.model.get_submodule("model.layers.0.mlp.up_proj")
    held = module.stored if isinstance(module, linear.ReferenceLinear) else module.fused.parts[module.index]
    monkeypatch.setattr(linear, "ROW_BLOCK", row_block)
    x = torch.randn(1, 5, 128)
    linear.project(x, held, None)  # the buffer is grown to this weight's block
    buffer = linear._buffers.by_device[x.device]
    outs = []
    dequantize = type(held).dequantize

    def recording(self, out=None):
        outs.append(out)
        return dequantize(self, out)

    monkeypatch.setattr(type(held), "dequantize", recording)
    got = linear.project(x, held, None)
    assert outs and all(o is not None and o.data_ptr() == buffer.data_ptr() for o in outs)
    if row_block > math.prod(held.shape):
        assert torch.equal(got, F.linear(x, module.weight))


def test_a_decode_hook_that_replaces_the_weight_reaches_the_model():
    """The worker's break= hook assigns a halved weight to what a decode returns; the loaded model
    must compute with it (harness.engines.worker)."""
    path = fixtures.build("llama-bnb-nf4")
    src = TensorSource.open(path)
    decoded = bnb.decode(src, "model.layers.0.self_attn.o_proj.weight")
    whole = decoded.weight
    decoded.weight = whole * 0.5
    assert torch.equal(decoded.stored, whole * 0.5)
    module = linear.ReferenceLinear(decoded.stored, None, decoded.label)
    x = torch.randn(1, 2, module.in_features)
    assert torch.equal(module(x), F.linear(x, whole * 0.5))


def _with_weight_value(name: str, tensor: str, value: float, tmp_path: Path) -> Path:
    """The fixture with element [0, 0] of ``tensor`` set to ``value``."""
    path = fixtures.build(name)
    out = tmp_path / name
    shutil.copytree(path, out)
    tensors = load_file(path / "model.safetensors")
    tensors[tensor][0, 0] = value
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("fuse", [True, False])
def test_a_non_finite_unquantized_weight_is_named_when_its_module_is_first_called(bad, fuse, tmp_path):
    weight = "model.layers.1.self_attn.k_proj.weight"  # a fused shard when fuse=True
    loaded = reference.load(_with_weight_value("llama-unquantized", weight, bad, tmp_path), fuse=fuse)
    with pytest.raises(CheckpointError) as e:
        loaded.model(input_ids=torch.arange(1, 9).unsqueeze(0))
    assert e.value.where == weight and "NaN or infinite" in e.value.what


def test_the_first_use_check_leaves_once_an_output_is_finite_and_lets_a_non_finite_input_through():
    model = _load("llama-unquantized").model
    down = model.get_submodule("model.layers.0.mlp.down_proj")
    assert down._forward_hooks
    nan_input = torch.full((1, down.in_features), float("nan"))
    assert torch.isnan(down(nan_input)).all()  # its weight is finite: the NaN is the input's
    assert not down._forward_hooks
    model(input_ids=torch.arange(1, 9).unsqueeze(0))
    assert not any(m._forward_hooks for m in model.modules())
