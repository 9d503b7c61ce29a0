"""The configurations users run (docs/design.md, "Configurations"): tensor-parallel ranks and
compiled execution as cells of their own, judged against the plain cell (one rank, eager) of the
same run.

The matrix part and the reassembly of the ranks' readings run in milliseconds. Every configuration
cell of models.yaml runs clean in `make test` (suites/matrix, ``--tier cpu-tiny,cpu-config``); the
end-to-end tests here run vLLM at two ranks and compiled (15-60 s a cell, by machine) under the
planted faults (harness.engines.vllm_mutations), each caught with the module (and the rank) named:

| fault           | cell                            | caught by                                              |
|-----------------|---------------------------------|--------------------------------------------------------|
| tp-q-offset     | llama.unquantized.vllm-tp2      | module diff: layers.0 q_proj, rank 1's rows             |
| tp-scale-shard  | llama.fp8-dynamic.vllm-tp2      | module diff: layers.0 q_proj, rank 1's rows             |
| compiled-only   | llama.unquantized.vllm-compiled | teacher-forced logprobs against the plain cell, localised |
|                 |                                 | to layers.0 o_proj by the compiled graph's own traces   |

Under each fault the plain cell of the same run is the control: one rank, eager, it is unaffected.
"""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

from harness import cli, configurations, probes
from harness import loaded_state as state
from harness import records as R
from harness.engines import vllm_ranks
from harness.engines.vllm import MUTATION_ENV
from harness.matrix import MatrixError, loads

ROOT = Path(__file__).resolve().parent.parent

MATRIX = """
version: 1
environments:
  core: {engines: {reference: "0", transformers: "5.19.0"}}
  vllm-cpu-0.32:
    engines: {vllm: "0.32.0"}
    env: {HF_HUB_OFFLINE: "1", VLLM_CPU_KVCACHE_SPACE: "1"}
defaults:
  max_tokens: 8
  top_k: 5
  timeout_s: 600
  bounds:
    unquantized: {logprob: 1.0e-4, topk: 1.0e-4, load_time: 1.5}
    fp8:         {logprob: 1.0e-2, topk: 1.0e-2, load_time: 1.5}
configurations:
  tp2: {engine: vllm, tensor_parallel: 2}
  compiled: {engine: vllm, compiled: true}
models:
  llama:
    arch: LlamaForCausalLM
    fixture: llama
    prompts: fixture
    tier: cpu-tiny
    engines: {vllm: vllm-cpu-0.32}
    configurations: {tp2: cpu-config}
    schemes:
      unquantized:
        configurations: {tp2: cpu-config, compiled: cpu-config}
      fp8-dynamic:
        known_failures:
          - {engine: vllm, configuration: tp2, versions: "<0", pattern: "never", reason: only the tp2 cell's}
  whisper:
    arch: WhisperForConditionalGeneration
    fixture: whisper
    prompts: fixture
    tier: cpu-tiny
    engines: {vllm: vllm-cpu-0.32}
    configurations: {tp2: cpu-config}
    schemes:
      unquantized:
"""


# ------------------------------------------------------------------------------------- the matrix


def test_a_configuration_is_a_cell_of_its_own_tier_judged_against_its_plain_cell():
    m = loads(MATRIX)
    cells = {c.id: c for c in m.cells(tier="cpu-config")}
    assert sorted(cells) == ["llama.fp8-dynamic.vllm-tp2", "llama.unquantized.vllm-compiled",
                             "llama.unquantized.vllm-tp2", "whisper.unquantized.vllm-tp2"]
    tp2 = cells["llama.fp8-dynamic.vllm-tp2"]
    assert (tp2.base, tp2.engine, tp2.tensor_parallel, tp2.compiled, tp2.tier) == (
        "llama.fp8-dynamic.vllm", "vllm", 2, False, "cpu-config")
    assert [k.reason for k in tp2.known_failures] == ["only the tp2 cell's"]
    assert not tp2.gate_load_time  # judged against the plain cell, never a load-time baseline
    compiled = cells["llama.unquantized.vllm-compiled"]
    assert (compiled.tensor_parallel, compiled.compiled) == (1, True)
    # ranks are not traced (the runner localises no two-rank cell; the vLLM engine refuses to trace one)
    assert "at 2 ranks are not recorded" in tp2.untraceable and compiled.untraceable is None
    # the scheme's own tier holds the plain cells only, the configuration's known failure not on them
    plain = {c.id: c for c in m.cells(tier="cpu-tiny")}
    assert "llama.fp8-dynamic.vllm" in plain and not any(c.configuration for c in plain.values())
    assert plain["llama.fp8-dynamic.vllm"].known_failures == ()


def test_a_selected_configuration_cell_brings_its_plain_cell():
    m = loads(MATRIX)
    chosen = [c for c in m.cells(tier="cpu-config") if c.id == "whisper.unquantized.vllm-tp2"]
    cells = configurations.with_bases(chosen, m.cells(tier=("cpu-tiny", "cpu-config")))
    assert [c.id for c in cells] == ["whisper.unquantized.vllm-tp2", "whisper.unquantized.vllm"]


@pytest.mark.parametrize("change, message", [
    (("{tp2: cpu-config, compiled: cpu-config}", "{tp4: cpu-config}"),
     "models.llama.schemes.unquantized.configurations.tp4: configuration 'tp4' is not defined under configurations "
     "(defined: tp2, compiled)"),
    (("tp2: {engine: vllm, tensor_parallel: 2}", "tp2: {engine: vllm}"),
     "configurations.tp2: one rank, eager is the plain cell every scheme has"),
    (("tp2: {engine: vllm, tensor_parallel: 2}", "tp2: {engine: transformers, tensor_parallel: 2}"),
     "configurations.tp2: engine 'transformers' does not run tensor_parallel"),
    (("{tp2: cpu-config, compiled: cpu-config}", "{tp2: gpu-tiny}"),
     "models.llama.schemes.unquantized.configurations.tp2: tier 'gpu-tiny' runs on GPUs, the scheme's tier 'cpu-tiny' on a CPU"),
    (("configuration: tp2, versions", "configuration: compiled, versions"),
     "models.llama.schemes.fp8-dynamic.known_failures[0].configuration: 'compiled' is not one of this scheme's "
     "configurations (defined: tp2)"),
])
def test_a_configuration_that_cannot_be_judged_is_one_line_naming_where(change, message):
    old, new = change
    assert old in MATRIX
    with pytest.raises(MatrixError) as e:
        loads(MATRIX.replace(old, new, 1))
    assert message in str(e.value)


def test_the_probe_refuses_more_ranks_than_cores_and_compiling_without_vector_kernels(monkeypatch):
    cells = {c.id: c for c in loads(MATRIX).cells(tier="cpu-config")}
    monkeypatch.setattr(probes.os, "sched_getaffinity", lambda pid: {0})
    assert probes.configuration_problem(cells["llama.unquantized.vllm-tp2"]) == (
        "2 tensor-parallel ranks on a CPU need a core each; this machine gives the harness 1")
    assert probes.configuration_problem(cells["llama.unquantized.vllm-compiled"]) is None
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    assert "ATEN_CPU_CAPABILITY=default" in probes.configuration_problem(cells["llama.unquantized.vllm-compiled"])


# ----------------------------------------------------------------------- the ranks put back together


def _linear(kind, names, sizes, weights, biases=None, scale=None, replicas=1):
    """One rank's loaded-state entries of a linear, as vllm_state.linear_state holds them."""
    shards = [{"shard": n, "label": "unquantized", "note": "", "dtype": "float32", "weight": w,
               "bias": None if biases is None else biases[i]} for i, (n, w) in enumerate(zip(names, weights))]
    entries = {"class": "L", "quant_method": "Q", "scheme": None, "note": "", "quantization": {},
               "layout": {"shards": names, "sizes": sizes}, "shards": shards, "weight_scale": scale, "input_scale": None}
    return {"parallel": kind, "vocab": None, "kv_replicas": replicas, "entries": entries}


def _split(t, parts, dim=0):
    return list(torch.chunk(t, parts, dim=dim))


def _digests(ranks: list[dict[str, dict]]) -> dict[str, str]:
    return vllm_ranks.gather_state([{"rank": r, "size": len(ranks), "modules": m} for r, m in enumerate(ranks)])


def test_ranks_are_put_back_together_as_one_rank_holds_them():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 8, generator=g) for n in (8, 4, 4))
    o = torch.randn(8, 8, generator=g)
    scale = torch.rand(16, 1, generator=g)
    emb = torch.nn.Parameter(torch.randn(12, 8, generator=g), requires_grad=False)
    norm = torch.nn.Parameter(torch.ones(8), requires_grad=False)
    one = {"qkv": _linear("column", ["q_proj", "k_proj", "v_proj"], [8, 4, 4], [q, k, v], scale=scale)["entries"],
           "o": _linear("row", ["o_proj"], [8], [o], biases=[torch.ones(8)])["entries"],
           "emb": {"weight": emb, "class": "VocabParallelEmbedding"},
           "norm": {"weight": norm, "class": "RMSNorm"}}
    qs, ks, vs = _split(q, 2), _split(k, 2), _split(v, 2)
    ranks = []
    for r in range(2):
        rank_scale = torch.cat([scale[0:8][r * 4:(r + 1) * 4], scale[8:12][r * 2:(r + 1) * 2], scale[12:16][r * 2:(r + 1) * 2]])
        vocab_rows = torch.cat([emb[r * 6:(r + 1) * 6], torch.zeros(2, 8)])  # 6 rows of the vocabulary, 2 of padding
        ranks.append({
            "qkv": _linear("column", ["q_proj", "k_proj", "v_proj"], [4, 2, 2], [qs[r], ks[r], vs[r]], scale=rank_scale),
            "o": _linear("row", ["o_proj"], [8], [_split(o, 2, dim=1)[r]], biases=[torch.ones(8)]),
            "emb": {"parallel": "vocab", "vocab": (6, 8, 0), "kv_replicas": 1,
                    "entries": {"weight": torch.nn.Parameter(vocab_rows, requires_grad=False), "class": "VocabParallelEmbedding"}},
            "norm": {"parallel": "replicated", "vocab": None, "kv_replicas": 1, "entries": {"weight": norm, "class": "RMSNorm"}},
        })
    expected = {name: state.digest_entries(entries) for name, entries in one.items()}
    assert _digests(ranks) == expected
    # a rank that holds a replicated module otherwise is not chosen between: the state differs there
    ranks[1]["norm"]["entries"]["weight"] = torch.nn.Parameter(norm * 2, requires_grad=False)
    assert [n for n, d in _digests(ranks).items() if d != expected[n]] == ["norm"]


def test_a_kv_head_held_by_two_ranks_is_counted_once():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n, 4, generator=g) for n in (8, 2, 2))
    one = _linear("column", ["q_proj", "k_proj", "v_proj"], [8, 2, 2], [q, k, v])["entries"]
    ranks = [{"qkv": _linear("column", ["q_proj", "k_proj", "v_proj"], [4, 2, 2], [_split(q, 2)[r], k, v], replicas=2)}
             for r in range(2)]
    assert _digests(ranks) == {"qkv": state.digest_entries(one)}


def test_the_module_read_names_the_rank_whose_rows_differ():
    w = torch.arange(16.0).reshape(4, 4)
    entry = {"module": "m", "class": "L", "quant_method": "Q", "scheme": None, "note": "", "parallel": "column",
             "vocab": None, "kv_replicas": 1}
    readings = [{"modules": {"m": {**entry, "shards": [{"shard": "m", "index": 0, "label": "unquantized", "weight": part,
                                                         "dtype": "float32", "bias": None, "bias_dtype": None, "note": ""}]}},
                 "packed": {}, "rank": r, "size": 2} for r, part in enumerate(_split(w, 2))]
    shard = vllm_ranks.gather_modules(readings)["modules"]["m"]["shards"][0]
    assert torch.equal(shard["weight"], w)
    assert shard["spans"] == [[0, 0, 2], [1, 2, 4]] and shard["span_dim"] == 0


# ------------------------------------------------------------------------------------ end to end

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
needs_two_cores = pytest.mark.skipif(probes.configuration_problem(loads(MATRIX).cells(tier="cpu-config")[1]) is not None,
                                     reason="two tensor-parallel ranks need two cores")


def run(tmp_path: Path, monkeypatch, capsys, k: str, mutations: str | None, name: str) -> dict[str, R.Record]:
    """``harness run --tier cpu-config -k K`` on MATRIX (the plain cells against copies of the
    committed cpu-tiny baselines), under ``mutations``; its records by cell id."""
    matrix = tmp_path / "models.yaml"
    matrix.write_text(MATRIX)
    baselines = tmp_path / f"baselines-{name}"
    shutil.copytree(ROOT / "baselines" / "cpu-tiny", baselines / "cpu-tiny")
    if mutations:
        monkeypatch.setenv(MUTATION_ENV, mutations)
    else:
        monkeypatch.delenv(MUTATION_ENV, raising=False)
    results = tmp_path / f"results-{name}"
    cli.main(["run", "--matrix", str(matrix), "--tier", "cpu-config", "--baselines", str(baselines),
              "--results", str(results), "-k", k])
    capsys.readouterr()
    return {p.name.removesuffix(".json"): R.load(p) for p in results.glob("*.json") if p.name != "summary.json"}


def check(rec: R.Record, kind: str) -> R.Check:
    return next(c for c in rec.checks if c.kind == kind)


@needs_vllm
@needs_two_cores
@pytest.mark.slow("runs vLLM at one rank and two ranks on the Llama fixture's dynamic FP8")
def test_a_configuration_of_a_scheme_that_quantizes_activations_is_judged_by_its_loaded_state(
        tmp_path, monkeypatch, capsys):
    # every configuration cell of models.yaml runs clean in `make test` (suites/matrix, --tier
    # cpu-tiny,cpu-config); this one says why dynamic FP8's pass is portable-pass: against one rank,
    # eager, its logprobs are shown, not judged, and what it loads is judged exactly
    recs = run(tmp_path, monkeypatch, capsys, "llama.fp8-dynamic", None, "clean")
    fp8 = recs["llama.fp8-dynamic.vllm-tp2"]
    assert fp8.verdict == "portable-pass", fp8.verdict_reason
    assert check(fp8, "loaded-state").ok and fp8.module_diff is None
    assert check(fp8, "teacher-forced").data["judged"] is False


@needs_vllm
@needs_two_cores
@pytest.mark.slow("runs vLLM at one rank, two ranks and compiled under two planted faults")
def test_a_wrong_shard_offset_and_a_compiled_only_path_are_caught(tmp_path, monkeypatch, capsys):
    recs = run(tmp_path, monkeypatch, capsys, "llama.unquantized", "tp-q-offset,compiled-only", "faulted")
    plain = recs["llama.unquantized.vllm"]
    assert plain.verdict == "pass", plain.verdict_reason  # one rank, eager: neither fault reaches it
    tp2 = recs["llama.unquantized.vllm-tp2"]
    assert tp2.verdict == "failed", tp2.verdict_reason
    assert tp2.module_diff.first_differing_module == "model.layers.0.self_attn.q_proj"
    assert "first in rank 1's part (rows 64-127 of 128)" in tp2.module_diff.detail
    compiled = recs["llama.unquantized.vllm-compiled"]
    assert compiled.verdict == "regressed", compiled.verdict_reason
    assert check(compiled, "loaded-state").ok and compiled.module_diff is None  # the same weights ...
    assert not check(compiled, "teacher-forced").ok  # ... computed otherwise, where the compiled graph's
    # own module traces part from the plain cell's: at the first row-parallel linear
    [where] = compiled.localisation
    assert where.against == "plain cell" and where.module == "model.layers.0.self_attn.o_proj", where
    assert not tp2.localisation  # ranks are not traced: the module diff names the module and the rank
    # the report puts each configuration beside its plain cell, named as its id names it
    html = (tmp_path / "results-faulted" / "report" / "report.html").read_text()
    assert ">vllm-tp2<" in html and ">vllm-compiled<" in html


@needs_vllm
@needs_two_cores
@pytest.mark.slow("runs vLLM at one rank and two ranks under a planted fault")
def test_a_scale_taken_from_another_ranks_shard_is_caught(tmp_path, monkeypatch, capsys):
    recs = run(tmp_path, monkeypatch, capsys, "llama.fp8-dynamic", "tp-scale-shard", "faulted")
    plain = recs["llama.fp8-dynamic.vllm"]
    assert plain.status == "ok" and plain.module_diff is None
    tp2 = recs["llama.fp8-dynamic.vllm-tp2"]
    assert tp2.verdict == "failed", tp2.verdict_reason
    assert tp2.module_diff.first_differing_module == "model.layers.0.self_attn.q_proj"
    assert "first in rank 1's part (rows 64-127 of 128)" in tp2.module_diff.detail
    assert not check(tp2, "loaded-state").ok
