"""torchao int4 group-wise checkpoints (IntxWeightOnlyConfig, group 32): the faults a loader or a
producer of the seed's format makes, each caught with the module named.

| fault | planted as | caught by |
|---|---|---|
| the skip list ignored: the vision tower quantized | Qwen2.5-VL skip-vision's config over int4wo's weights | the reference's config-vs-disk disagreement |
| the None entries of ModuleFqnToConfig ignored | llama fqn-none's config over int4wo's weights | the reference's config-vs-disk disagreement |
| the None entries ignored by the engine | vLLM mutation ``torchao-ignore-skip`` | tests/test_vllm_mutations.py: an error naming layers.0 o_proj |
| a skip entry matched as a prefix (substring) | the skip-prefix fixture itself, as transformers wrote it | the reference's overreach disagreement; vLLM's dot-bounded reading fails at layers.10 (models.yaml's known failure) |
| a group's scale taken from its neighbour | ``fault=scale-groups-shifted`` on the reference | the loaded state against the baseline, and transformers in the same run |
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from harness import cli, fixtures, reference
from harness import records as R
from matrix_overlay import without_accuracy


def _tampered(tmp_path: Path, config_of: str, weights_of: str) -> Path:
    """A checkpoint whose producer ignored its own config: ``config_of``'s files with
    ``weights_of``'s weights (which quantize what the config leaves alone)."""
    out = Path(shutil.copytree(fixtures.build(config_of), tmp_path / config_of))
    shutil.copy(fixtures.build(weights_of) / "model.safetensors", out / "model.safetensors")
    return out


def _disagreements(path: Path) -> dict[str, list]:
    found: dict[str, list] = {}
    for d in reference.load(path).report.disagreements:
        found.setdefault(d.source, []).append(d)
    return found


def test_a_vision_tower_quantized_against_the_skip_list_is_named_by_the_loader(tmp_path):
    path = _tampered(tmp_path, "qwen2_5_vl-torchao-int4wo-skip-vision", "qwen2_5_vl-torchao-int4wo")
    [first, *_] = _disagreements(path)["config-vs-disk"]
    assert first.module == "model.visual.blocks.0.attn.qkv", first
    assert "should_convert_module('model.visual.blocks.0.attn.qkv.weight') is False, but the disk holds torchao-int4" \
        in first.detail
    # the checkpoint as transformers wrote it: no such disagreement
    assert "config-vs-disk" not in _disagreements(fixtures.build("qwen2_5_vl-torchao-int4wo-skip-vision"))


def test_none_entries_the_producer_ignored_are_named_by_the_loader(tmp_path):
    path = _tampered(tmp_path, "llama-torchao-int4wo-fqn-none", "llama-torchao-int4wo")
    named = {d.module: d.detail for d in _disagreements(path)["config-vs-disk"]}
    assert set(named) == {"model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"}
    assert "FqnToConfig module entry 'model.layers.0.self_attn.o_proj' is None, but the disk holds torchao-int4" \
        in named["model.layers.0.self_attn.o_proj"]
    assert "config-vs-disk" not in _disagreements(fixtures.build("llama-torchao-int4wo-fqn-none"))


def test_a_prefix_entry_that_over_matches_is_named_with_the_layers_it_reaches():
    """'model.layers.1' as transformers' matcher reads it also keeps layers.10 and .11 in float32:
    the loader names the over-reach; the stored state decides what it loads."""
    path = fixtures.build("llama-torchao-int4wo-skip-prefix")
    over = _disagreements(path)["transformers-torchao:overreach"]
    assert {d.module.split(".")[2] for d in over} == {"10", "11"}
    assert "entry 'model.layers.1': skips model.layers.10.self_attn.q_proj, which 'model.layers.1' does not name" \
        in over[0].detail
    modules = reference.load(path).report.modules
    assert modules["model.layers.10.mlp.down_proj"] == "unquantized" and modules["model.layers.2.mlp.down_proj"] == "torchao-int4"


@pytest.mark.slow("a harness run of llama.torchao-int4wo's reference and transformers cells under a fault")
def test_a_groups_scale_taken_from_its_neighbour_is_caught_naming_the_module(tmp_path, monkeypatch, capsys):
    scale = "model.layers.2.mlp.down_proj._weight_scale"
    monkeypatch.setenv("HARNESS_TEST_HOOK", f"fault=scale-groups-shifted:{scale}@llama.torchao-int4wo.reference")
    results, matrix = tmp_path / "results", without_accuracy(tmp_path / "models.yaml")
    assert cli.main(["run", "--matrix", str(matrix), "-k", "llama.torchao-int4wo. and not mllama",
                     "--engine", "reference,transformers", "--results", str(results)]) == 1
    capsys.readouterr()
    ref = R.load(results / "llama.torchao-int4wo.reference.json")
    assert ref.verdict in ("failed", "regressed"), ref.verdict_reason
    state = next(c for c in ref.checks if c.kind == "loaded-state")
    assert not state.ok and "loaded state differs from the baseline's at model.layers.2.mlp.down_proj: " \
        "of 136 modules, 1 differ" in state.detail
    assert any(c.kind == "teacher-forced" and c.against == "transformers" and not c.ok for c in ref.checks)
    assert R.load(results / "llama.torchao-int4wo.transformers.json").verdict != "pass"  # it disagrees too
