"""The pytest plugin: verdict -> test outcome, and cells as parameters selected with -k."""
import subprocess
import sys
from pathlib import Path

import pytest
from _pytest.outcomes import Failed, Skipped, XFailed

from harness import records as R
from harness.pytest_plugin import check
from harness.runner import CellResult

ROOT = Path(__file__).resolve().parent.parent


def result(verdict, known_failure=False, error=False, messages=()):
    from harness import matrix

    cell = {c.id: c for c in matrix.load().cells()}["whisper.bnb-nf4.transformers"]
    kw = {}
    if error:
        kw = dict(status="error", error=R.ErrorInfo(type="Timeout", message="too slow", log_tail="line 1\nlast line"))
    else:
        kw = dict(status="unsupported", unsupported_reason="needs a GPU") if verdict == "unsupported" and not known_failure else {}
    if not kw:
        kw = dict(status="ok", load=R.LoadInfo(seconds=0.1), sequences=[R.SequenceResult(
            prompt=R.PromptRef(id="p0", kind="audio"), prompt_tokens=[1],
            scored=R.Scored(tokens=[1, 2], logprobs=[-1.0], topk=[[(2, -1.0)]]),
            greedy=R.Greedy(tokens=[2], topk=[[(2, -1.0)]]))])
    rec = R.Record.for_cell(cell, engine_info=R.EngineInfo(name="transformers", version="5.19.0", platform="cpu-x86_64"),
                            **kw)
    kf = R.KnownFailureRef(engine="transformers", versions=">=5", pattern="x", reason="known") if known_failure else None
    checks = [R.Check(kind="teacher-forced", against="baseline", ok=False, detail="exceeds bound: max 0.5")] if verdict == "regressed" else []
    rec = rec.model_copy(update={"verdict": verdict, "verdict_reason": f"why {verdict}", "known_failure": kf, "checks": checks})
    return CellResult(cell, rec, messages=list(messages))


@pytest.mark.parametrize("verdict", ["pass", "improved"])
def test_pass_and_improved_pass(verdict):
    props = []
    check(result(verdict), lambda k, v: props.append((k, v)))
    assert props == [("harness", {"cell": "whisper.bnb-nf4.transformers", "verdict": verdict,
                                  "reason": f"why {verdict}", "messages": [], "candidate": None})]


@pytest.mark.parametrize("verdict", ["regressed", "failed", "error", "unexpected-pass", "missing-baseline", "stale-baseline"])
def test_bad_and_baseline_verdicts_fail(verdict):
    with pytest.raises(Failed) as e:
        check(result(verdict, error=verdict == "error"))
    text = str(e.value)
    assert text.startswith(f"whisper.bnb-nf4.transformers: {verdict}: why {verdict}")
    if verdict == "regressed":
        assert "check teacher-forced:baseline: exceeds bound: max 0.5" in text
    if verdict in ("missing-baseline", "stale-baseline"):
        assert "pytest suites --update-baselines -k 'whisper.bnb-nf4.transformers'" in text
    if verdict == "error":
        assert "engine log (tail):\n    line 1\n    last line" in text


def test_unsupported_by_probe_is_skipped_known_failures_are_xfail():
    with pytest.raises(Skipped, match="unsupported: why unsupported"):
        check(result("unsupported"))
    with pytest.raises(XFailed, match=r"unsupported \(known failure\): why unsupported"):
        check(result("unsupported", known_failure=True))
    with pytest.raises(XFailed, match="waived: why waived"):
        check(result("waived", known_failure=True))


@pytest.mark.slow("a pytest --collect-only of suites/matrix and a harness cells, both subprocesses")
def test_collect_selects_exactly_the_cells():
    select = ["-k", "whisper and torchao", "--engine", "reference,transformers"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "suites/matrix", "--collect-only", "-q", "-p", "no:cacheprovider",
                           *select], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ids = [ln.split("[", 1)[1].rstrip("]") for ln in proc.stdout.splitlines() if "::test_cell[" in ln]
    listed = subprocess.run([sys.executable, "-m", "harness.cli", "cells", *select], cwd=ROOT,
                            capture_output=True, text=True, timeout=300).stdout.split()
    assert ids == listed == [
        "whisper.online-torchao-int8wo.reference", "whisper.online-torchao-int8wo.transformers",
        "whisper.torchao-float8wo.reference", "whisper.torchao-float8wo.transformers",
        "whisper.torchao-int4wo.reference", "whisper.torchao-int4wo.transformers",
        "whisper.torchao-int8wo-skip-encoder.reference", "whisper.torchao-int8wo-skip-encoder.transformers",
        "whisper.torchao-int8wo.reference", "whisper.torchao-int8wo.transformers"]


@pytest.mark.slow("three pytest --collect-only subprocesses of suites/matrix")
def test_markers_and_options():
    proc = subprocess.run([sys.executable, "-m", "pytest", "suites/matrix", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "--tier", "gpu-tiny", "-m", "gpu and gpu_tiny"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "test_cell[llama-gpu.fp8-dynamic.vllm]" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "pytest", "suites/matrix", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "--engine", "nope"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "--engine: unknown engine 'nope'" in proc.stdout + proc.stderr
    # tiers joined by commas, as `make test` selects the configuration cells beside the default tier's
    proc = subprocess.run([sys.executable, "-m", "pytest", "suites/matrix", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "--tier", "cpu-tiny,cpu-config", "-k", "whisper.unquantized.vllm"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [ln.split("[", 1)[1].rstrip("]") for ln in proc.stdout.splitlines() if "::test_cell[" in ln] == [
        "whisper.unquantized.vllm", "whisper.unquantized.vllm-compiled", "whisper.unquantized.vllm-tp2"]


def test_a_path_the_session_cannot_write_fails_its_cells_before_any_runs(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "cpu-tiny").write_text("not a directory")
    results = tmp_path / "r"
    proc = subprocess.run([sys.executable, "-m", "pytest", "suites/matrix", "-q", "-p", "no:cacheprovider",
                           "-k", "whisper.bnb-nf4.transformers", "--baselines", str(tmp_path / "b"),
                           "--results", str(results)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"harness: {tmp_path}/b/cpu-tiny: is not a directory (--baselines)" in proc.stdout
    assert not list(results.rglob("*.json")), "a cell ran"
