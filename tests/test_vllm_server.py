"""A cell forked from a fork server gives the record a fresh interpreter gives
(``HARNESS_ISOLATION=spawn``): the vLLM server (vLLM imported before the fork, the engine's
variables set before that import) and the torch one (the reference engine). Each run starts
vLLM once (~20 s here)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import cli, supervise
from harness.registry import ENGINES

ROOT = Path(__file__).resolve().parent.parent

if importlib.util.find_spec("vllm") is None:  # not imported here: the engine children import it
    pytest.skip("vLLM is not installed", allow_module_level=True)

pytestmark = pytest.mark.slow("each test imports vLLM in a child: two harness runs (forked, spawned) or its preload")

MATRIX = """
version: 1
environments:
  core:
    engines: {reference: "0.1.0"}
  vllm-cpu-0.32:
    engines: {vllm: "0.32.0"}
    env: {HF_HUB_OFFLINE: "1", VLLM_CPU_KVCACHE_SPACE: "1"}
defaults:
  max_tokens: 8
  top_k: 5
  timeout_s: 600
  bounds:
    unquantized: {logprob: 1.0e-4, topk: 1.0e-4, load_time: 1.5}
accuracy_tasks:
  llama-choice:
    task: ROOT/harness/accuracy/data/llama-choice.yaml
    metric: acc
    gate: {test: mcnemar, alpha: 0.01}
  llama-continue:
    task: ROOT/harness/accuracy/data/llama-continue.yaml
    metric: exact_match
    gate: {test: mcnemar, alpha: 0.01}
models:
  llama:
    arch: LlamaForCausalLM
    fixture: llama
    prompts: fixture
    tier: cpu-tiny
    engines: {reference: core, vllm: vllm-cpu-0.32}
    accuracy: [llama-choice, llama-continue]
    schemes:
      unquantized:
"""
CELLS = ("llama.unquantized.reference", "llama.unquantized.vllm")


def _without_timings(record: dict) -> dict:
    """The record less what differs between any two runs: when, how long, load times."""
    out = {k: v for k, v in record.items() if k not in ("started_at", "duration_s", "load")}
    out["accuracy"] = [{k: v for k, v in a.items() if k != "seconds"} for a in record.get("accuracy") or []]
    return out


def _run(tmp_path: Path, capsys, name: str) -> dict[str, dict]:
    results = tmp_path / name
    cli.main(["run", "--matrix", str(tmp_path / "models.yaml"), "--baselines", str(tmp_path / "baselines"),
              "--results", str(results), "-j", "1"])
    out, err = capsys.readouterr()
    assert all((results / "raw" / f"{c}.json").exists() for c in CELLS), out + err
    return {c: json.loads((results / "raw" / f"{c}.json").read_text()) for c in CELLS}


def test_forked_cells_give_the_records_of_fresh_interpreters(tmp_path, monkeypatch, capsys, cache_dir):
    (tmp_path / "models.yaml").write_text(MATRIX.replace("ROOT", str(ROOT)))
    monkeypatch.delenv(supervise.ISOLATION_ENV, raising=False)
    supervise.stop_fork_servers()
    forked = _run(tmp_path, capsys, "forked")
    preloads = {preload for preload, *_ in supervise._SERVERS}
    assert preloads == {supervise.DEFAULT_PRELOAD, ENGINES["vllm"].preload}  # both cells were forked
    monkeypatch.setenv(supervise.ISOLATION_ENV, "spawn")
    spawned = _run(tmp_path, capsys, "spawned")
    for cell in CELLS:
        assert forked[cell]["status"] == "ok", forked[cell]["error"]
        assert forked[cell]["sequences"] and forked[cell]["accuracy"]
        assert _without_timings(forked[cell]) == _without_timings(spawned[cell]), cell


def test_the_vllm_preload_starts_no_thread():
    """What a fork loses: threads. After the vLLM server's imports only the main thread runs, plus
    pyarrow's jemalloc background thread (jemalloc has its own fork handlers), which the torch
    server has too; no OpenMP or BLAS pool."""
    r, w = os.pipe()
    script = ("import json, os, threading\nimport harness.engines._vllm_preload\n"
              "tasks = sorted(open(f'/proc/self/task/{t}/comm').read().strip() for t in os.listdir('/proc/self/task'))\n"
              f"os.write({w}, json.dumps([len(threading.enumerate()), tasks]).encode())\n")
    proc = subprocess.Popen([sys.executable, "-c", script], pass_fds=(w,), cwd=ROOT, env=supervise.child_env({}, 1),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(w)
    with os.fdopen(r) as f:
        threads, tasks = json.loads(f.read() or "[null, null]")
    assert proc.wait(300) == 0
    assert threads == 1
    assert len([t for t in tasks if t != "jemalloc_bg_thd"]) == 1, tasks
