"""CI proves portability on every run (docs/design.md, "Portability across CPUs").

torch's ``ATEN_CPU_CAPABILITY`` switches its CPU kernels, which reproduces on one machine what
another CPU does to the numbers. A representative set of cells (every FP8 family, one bnb, one
torchao, cross-attention) is run against the committed baselines under the native kernels and
under ``default``, and must give the same verdicts; a static-FP8 fixture must build with the same
identity under both.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness import baselines as B

REPO = Path(__file__).resolve().parent.parent
REPRESENTATIVE = ("llama.fp8-dynamic. or llama.fp8-static-kv. or llama.online-fp8. or whisper.fp8-static-kv. "
                  "or llama.bnb-nf4. or llama.torchao-int8wo. or mllama.bnb-nf4.")
GOOD = {"pass", "unsupported", "waived"}


def _env(capability: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if capability:
        env["ATEN_CPU_CAPABILITY"] = capability
    return env


def _run(tmp: Path, name: str, k: str, baselines: Path, capability: str | None) -> dict[str, str]:
    results = tmp / name
    p = subprocess.run([sys.executable, "-m", "harness.cli", "run", "-k", k, "--engine", "reference,transformers",
                        "--baselines", str(baselines), "--results", str(results)],
                       env=_env(capability), cwd=REPO, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=900)
    verdicts = {}
    for f in results.glob("*.json"):
        data = json.loads(f.read_text())
        if isinstance(data, dict) and "verdict" in data and "cell" in data:
            verdicts[data["cell"]] = data["verdict"]
    assert verdicts, f"no records (exit {p.returncode}): {p.stderr[-2000:]}"
    return verdicts


@pytest.fixture(scope="module")
def committed(tmp_path_factory) -> Path:
    """A copy of the committed baselines: runs write obtained files beside them."""
    root = tmp_path_factory.mktemp("baselines")
    shutil.copytree(REPO / "baselines", root, dirs_exist_ok=True)
    return root


def test_lowered_kernels_give_the_native_verdicts(tmp_path, committed):
    native = _run(tmp_path, "native", REPRESENTATIVE, committed, None)
    lowered = _run(tmp_path, "default", REPRESENTATIVE, committed, "default")
    assert set(native.values()) <= GOOD, native
    assert lowered == native


def test_a_shift_before_the_fragile_onset_is_regressed_under_other_kernels(tmp_path, committed):
    cell = "llama.fp8-dynamic.reference"
    b = B.read(committed, "cpu-tiny", cell)
    prompt, onset = next((pid, p.onset.position) for pid, p in b.noise.prompts.items() if p.onset and p.onset.position > 1)
    seq = next(s for s in b.sequences if s.prompt.id == prompt)
    row = seq.scored[onset]  # logprob index onset - 1 scores this row: before the onset
    seq.scored[onset] = row.model_copy(update={"logprob": row.logprob - 0.05})
    root = tmp_path / "altered"
    shutil.copytree(committed, root)
    (root / "cpu-tiny" / f"{cell}.json").write_text(b.to_text())
    assert _run(tmp_path, "altered-run", f"{cell} and not mllama", root, "default") == {cell: "regressed"}


def _identity(cache: Path, capability: str | None) -> str:
    p = subprocess.run([sys.executable, "-m", "harness.cli", "fixtures", "--build", "llama-fp8-static-kv"],
                       env={**_env(capability), "HARNESS_FIXTURE_CACHE": str(cache)}, cwd=REPO,
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    (manifest,) = cache.glob("llama-fp8-static-kv-*/manifest.json")
    return json.loads(manifest.read_text())["identity"]


def test_static_fp8_fixture_identity_is_the_same_under_other_kernels(tmp_path):
    assert _identity(tmp_path / "native", None) == _identity(tmp_path / "default", "default")
