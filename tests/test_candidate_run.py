"""``harness run --candidate`` and ``harness bisect`` end to end, with no download (issue 28,
target 7): the candidate "builds" are stand-ins, Python environments whose interpreter is this
venv's, one of them with a test-only vLLM mutation (harness.engines.vllm_mutations) set in its
environment alone, so only the candidate's engine children are broken.

The cell is llama.unquantized.vllm: ``merged-shards-swapped`` loads gate_proj into up_proj's rows,
which the module diff inside the vLLM child names (gate_proj of layer 0). Each run starts vLLM once per build (~10-20 s here).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness import cli
from harness import records as R
from harness.engines.vllm import MUTATION_ENV
from tests.stand_in_build import stand_in_build as make_stand_in

if importlib.util.find_spec("vllm") is None:  # not imported here: the engine children import it
    pytest.skip("vLLM is not installed", allow_module_level=True)

pytestmark = pytest.mark.slow("each test runs vLLM children or pytest sessions against stand-in candidate builds")

ROOT = Path(__file__).resolve().parent.parent
CELL = "llama.unquantized.vllm"
MATRIX = """
version: 1
environments:
  vllm-cpu-0.32:
    engines: {vllm: "0.32.0"}
    env: {HF_HUB_OFFLINE: "1", VLLM_CPU_KVCACHE_SPACE: "1"}
defaults:
  max_tokens: 8
  top_k: 5
  timeout_s: 600
  bounds:
    unquantized: {logprob: 1.0e-4, topk: 1.0e-4, load_time: 1.5}
models:
  llama:
    arch: LlamaForCausalLM
    fixture: llama
    prompts: fixture
    tier: cpu-tiny
    engines: {vllm: vllm-cpu-0.32}
    schemes:
      unquantized:
"""


def stand_in_build(root: Path, mutation: str | None) -> Path:
    """A stand-in build with ``mutation`` in its environment alone."""
    return make_stand_in(root, {MUTATION_ENV: mutation})


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """The module's stand-in build of each mutation (None: the base build's own code), made once: a
    build's fork server (one per interpreter) then imports vLLM once for all the tests using it."""
    made: dict[str | None, Path] = {}

    def build(mutation: str | None) -> Path:
        if mutation not in made:
            made[mutation] = stand_in_build(tmp_path_factory.mktemp("build"), mutation)
        return made[mutation]
    return build


@pytest.fixture
def setup(tmp_path, monkeypatch):
    monkeypatch.delenv(MUTATION_ENV, raising=False)
    matrix = tmp_path / "models.yaml"
    matrix.write_text(MATRIX)
    baselines = tmp_path / "baselines" / "cpu-tiny"
    baselines.mkdir(parents=True)
    shutil.copy(ROOT / "baselines" / "cpu-tiny" / f"{CELL}.json", baselines)  # a failing run writes beside it
    return matrix, tmp_path / "baselines"


def run_candidate(tmp_path: Path, setup, capsys, build: Path):
    """``harness run --candidate`` with a stand-in build: (exit code, output, base record, candidate
    record, results directory)."""
    matrix, baselines = setup
    results = tmp_path / "results"
    code = cli.main(["run", "--matrix", str(matrix), "--baselines", str(baselines), "--results", str(results),
                     "-k", CELL, "--candidate", f"vllm={build}"])
    base, cand = R.load(results / f"{CELL}.json"), R.load(results / "candidate" / f"{CELL}.json")
    return code, capsys.readouterr().out, base, cand, results


def test_a_candidate_that_is_the_base_build_passes(tmp_path, setup, capsys, builds):
    build = builds(None)
    code, out, base, cand, _ = run_candidate(tmp_path, setup, capsys, build)
    assert base.candidate is None and cand.candidate == str(build)
    assert cand.verdict == "pass", cand.verdict_reason
    assert cand.verdict_reason.startswith("against base vllm 0.32.0: ")
    assert "vs base 0.32.0: 0 cells changed, 0 fixed" in out
    assert re.search(r"^candidate cost: wall \d+ s; cells' own time: base \d+ s, candidate \d+ s; vllm 0\.32\.0: "
                     r"its own environment$", out, re.M), out
    assert code == (1 if base.verdict not in ("pass", "waived") else 0)


@pytest.mark.parametrize("mutation, verdict, modules, kind", [
    # layer 0's gate_proj and up_proj rows swapped at load: either is the right name
    ("merged-shards-swapped", "failed", ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"), "weights"),
    # layer 3's causal mask off by one: a compute fault, the loaded state is the base's
    ("mask-shifted-layer", "regressed", ("model.layers.3.self_attn",), "attention"),
])
def test_a_failing_candidate_is_localised_against_the_base_build(tmp_path, setup, capsys, builds, mutation, verdict,
                                                                  modules, kind):
    """The candidate's cell fails, and its module traces against the pinned build's, both recorded
    in this run, name the module the mutation breaks. The base passes and is not traced."""
    code, out, base, cand, results = run_candidate(tmp_path, setup, capsys, builds(mutation))
    assert code == 1 and base.verdict == "pass" and not base.localisation, out
    assert cand.verdict == verdict, cand.verdict_reason
    [found] = cand.localisation
    assert found.against == "base build" and found.kind == kind and found.module in modules, found.detail
    assert "localisation against base build: " in out
    assert (results / "traces" / f"{CELL}.candidate.pt").exists() and (results / "traces" / f"{CELL}.pt").exists()


def test_bisect_names_the_first_build_with_the_mutation(tmp_path, setup, capsys, builds):
    matrix, _ = setup
    builds = [builds(None), builds("merged-shards-swapped"), stand_in_build(tmp_path / "b3", "merged-shards-swapped")]
    results = tmp_path / "bisect"
    code = cli.main(["bisect", "vllm", "--matrix", str(matrix), "-k", CELL, "--results", str(results),
                     "--versions", ",".join(map(str, builds)) + ",/nonexistent/vllm.whl"])
    out = capsys.readouterr().out
    assert code == 0, out
    data = json.loads((results / "bisect.json").read_text())
    assert [b["verdicts"].get(CELL) for b in data] == ["pass", "failed", "failed", None]
    assert [CELL in b["changed"] for b in data] == [False, True, False, False]
    assert data[3]["skipped"] == "candidate wheel /nonexistent/vllm.whl: no such file"  # a row of its own
    second = R.load(results / "build-2" / f"{CELL}.json")
    assert second.module_diff is not None and second.module_diff.first_differing_module == "model.layers.0.mlp.gate_proj"
    assert f"first changed at **{builds[1]}**" in (results / "bisect.md").read_text()
    # the stand-ins' mutation never reached the base build
    base = R.load(results / f"{CELL}.json")
    assert base.module_diff is None, base.module_diff
    assert os.environ.get(MUTATION_ENV) is None


def _pytest(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "suites/matrix", "-q", "-p", "no:cacheprovider", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)


def test_pytest_runs_a_candidate_beside_the_base_and_fails_on_what_it_changed(tmp_path, setup, builds):
    matrix, baselines = setup
    results = tmp_path / "results"
    build = builds("merged-shards-swapped")
    proc = _pytest("--matrix", str(matrix), "--baselines", str(baselines), "--results", str(results),
                   "-k", CELL, "--candidate", f"vllm={build}", "-rA")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert f"PASSED suites/matrix/test_cells.py::test_cell[{CELL}]" in out
    assert f"FAILED suites/matrix/test_cells.py::test_candidate_cell[{CELL}]" in out
    cand = R.load(results / "candidate" / f"{CELL}.json")
    assert cand.candidate == str(build) and cand.verdict == "failed", cand.verdict_reason
    assert cand.module_diff is not None and cand.module_diff.first_differing_module == "model.layers.0.mlp.gate_proj"
    assert f"candidate {build}, each cell against the pinned build's:" in out
    assert R.load(results / f"{CELL}.json").candidate is None


def test_pytest_collects_candidate_tests_only_with_a_candidate(tmp_path, setup, builds):
    matrix, _ = setup
    plain = _pytest("--matrix", str(matrix), "--collect-only")
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert f"test_cell[{CELL}]" in plain.stdout and "test_candidate_cell" not in plain.stdout
    build = builds(None)
    with_candidate = _pytest("--matrix", str(matrix), "--collect-only", "--candidate", f"vllm={build}")
    assert f"test_candidate_cell[{CELL}]" in with_candidate.stdout, with_candidate.stdout + with_candidate.stderr
    refused = _pytest("--matrix", str(matrix), "--candidate", f"vllm={build}", "--update-baselines")
    assert refused.returncode == 4
    assert ("--candidate with --update-baselines: a candidate build never writes baselines; run them apart"
            in refused.stdout + refused.stderr)
