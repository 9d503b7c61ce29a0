"""The reference loader's report and its loading discipline, on the fixtures."""
import json
import subprocess
import sys

import pytest
import torch

from harness import fixtures, reference
from harness.quant.source import TensorSource
from harness.reference import loader


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


def test_cli_load_json():
    path = fixtures.build("whisper-torchao-int8wo")
    run = subprocess.run([sys.executable, "-m", "harness.cli", "load", str(path), "--json"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout)["modules"]["model.decoder.layers.0.encoder_attn.q_proj"] == "torchao-int8"
