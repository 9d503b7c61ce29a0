"""Verdicts that carry across CPUs by construction (docs/design.md, "Portability across CPUs").

One machine can select other kernels for itself (``harness.cpu.KERNEL_CONDITIONS``): a lowered
torch capability, MKL's and oneDNN's AVX2 paths, and torch's and the libraries' AVX2 kernels
together. Under each, against the committed baselines: no cell is red; a cell whose computation
carries (float32, no quantized activation) is judged in full; one that does not is judged by its
loaded state and the other engines of its run, never a silent pass; every planted loading fault is
caught by the loaded state; a compute fault is caught by a witness engine; and a carrying cell that
moved beyond its family bound is caught. No assertion depends on which kind of CPU runs it: on the
kind that recorded a baseline everything is judged, elsewhere what carries.
"""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness import baselines as B
from harness import cpu
from matrix_overlay import without_accuracy

REPO = Path(__file__).resolve().parent.parent
# Every FP8 family (dynamic, static with a KV cache, online, a skipped vision tower), one bnb, one
# torchao, and cross-attention.
REPRESENTATIVE = ("llama.fp8-dynamic. or llama.fp8-static-kv. or llama.online-fp8. or whisper.fp8-static-kv. "
                  "or whisper.fp8-dynamic. or qwen2_5_vl.fp8-dynamic. or qwen2_5_vl.fp8-dynamic-ignore-vision. "
                  "or llama.bnb-nf4. or llama.torchao-int8wo. or mllama.bnb-nf4.")
GOOD = {"pass", "portable-pass", "unsupported", "waived"}
CONDITIONS = cpu.KERNEL_CONDITIONS
# Each planted loading fault on its own cell (the hook's @glob): the loaded state must show it.
LOADING_FAULTS = {
    "llama.bnb-nf4.reference": "break=harness.quant.bnb:decode",  # a broken decode
    "llama.fp8-dynamic.reference": "fault=tensors-swapped:model.layers.0.self_attn.k_proj.:model.layers.0.self_attn.v_proj.",
    "llama.fp8-static-kv.reference": "fault=tensor-scaled:model.layers.1.self_attn.o_proj.input_scale:1.01",
    "llama.fp8-static-kv-skip-kproj.reference": "fault=tensor-scaled:model.layers.1.self_attn.k_scale:1.01",
    "whisper.fp8-static-kv.reference": "fault=fp8-requantize-dropped",
    "whisper.fp8-dynamic.reference": "fault=fp8-scale-dropped:model.decoder.layers.1.fc1.weight",  # one scale 1.0
    "llama.online-fp8.reference": "fault=skip-ignored",  # the lm_head quantized despite the skip list
}
CAUGHT = {"regressed", "failed", "error"}
# The accuracy tasks the representative runs keep: one scheme whose computation carries, judged in
# full under every condition. The others' tasks are the same code on other checkpoints, and slow
# under lowered kernels (an FP8 cell's, 25 s under aten-default); that accuracy from other kernels
# is shown but not judged where the computation does not carry is test_accuracy's. The fault runs
# keep none: what they plant is caught by the loaded state and the logprobs.
ACCURACY_KEPT = {"llama.bnb-nf4"}

pytestmark = pytest.mark.slow("each test runs harness run or the trace suite's faults in a subprocess under a kernel condition")


@pytest.fixture(scope="module")
def representative(tmp_path_factory) -> Path:
    return without_accuracy(tmp_path_factory.mktemp("matrix") / "models.yaml", ACCURACY_KEPT)


@pytest.fixture(scope="module")
def no_accuracy(tmp_path_factory) -> Path:
    return without_accuracy(tmp_path_factory.mktemp("matrix") / "models.yaml")


def _run(tmp: Path, name: str, k: str, baselines: Path, matrix: Path, overlay: dict[str, str] | None,
         *extra: str) -> dict[str, dict]:
    results = tmp / name
    p = subprocess.run([sys.executable, "-m", "harness.cli", "run", "-k", k, "--engine", "reference,transformers",
                        "--matrix", str(matrix), "--baselines", str(baselines), "--results", str(results), *extra],
                       env=cpu.condition_env(overlay), cwd=REPO, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=1200)
    records = {}
    for f in results.glob("*.json"):
        data = json.loads(f.read_text())
        if isinstance(data, dict) and "verdict" in data and "cell" in data:
            records[data["cell"]] = data
    assert records, f"no records (exit {p.returncode}): {p.stderr[-2000:]}"
    return records


def _verdicts(records: dict[str, dict]) -> dict[str, str]:
    return {c: r["verdict"] for c, r in records.items()}


def _check(record: dict, kind: str, against: str = "baseline") -> dict | None:
    return next((c for c in record["checks"] if (c["kind"], c["against"]) == (kind, against)), None)


@pytest.fixture(scope="module")
def committed(tmp_path_factory) -> Path:
    """A copy of the committed baselines: runs write obtained files beside them."""
    root = tmp_path_factory.mktemp("baselines")
    shutil.copytree(REPO / "baselines", root, dirs_exist_ok=True)
    return root


def _judged_by_what_carries(records: dict[str, dict]) -> None:
    """No red; a carrying cell is never judged by less than its baseline; a portable-pass names
    what it judged and shows its logprobs unjudged; a loaded state compared is exact."""
    red = {c: (r["verdict"], r["verdict_reason"]) for c, r in records.items() if r["verdict"] not in GOOD}
    assert not red, red
    for c, r in records.items():
        computation = r.get("computation")
        if computation is None:  # unsupported, or the engine did not run
            continue
        carries = computation["dtype"] == "float32" and not computation["quantized_activations"]
        tf = _check(r, "teacher-forced")
        if carries:
            assert r["verdict"] != "portable-pass" and (tf is None or tf["data"].get("judged", True)), (c, r["verdict_reason"])
        if r["verdict"] == "portable-pass":
            assert "logprobs against the baseline not judged" in r["verdict_reason"], r["verdict_reason"]
            assert tf is not None and tf["detail"].startswith("not judged: "), tf
        state = _check(r, "loaded-state")
        if c.endswith((".reference", ".transformers")) and r["verdict"] in {"pass", "portable-pass"}:
            assert state is not None and state["ok"], f"{c}: the loaded state was not checked exactly: {state}"


def test_the_committed_baselines_judge_this_machines_own_kernels(tmp_path, committed, no_accuracy):
    """The control of the kernel conditions below; the cells' accuracy on this machine's own kernels
    is the matrix suite's (suites/matrix)."""
    _judged_by_what_carries(_run(tmp_path, "native", REPRESENTATIVE, committed, no_accuracy, None))


@pytest.mark.parametrize("condition", sorted(CONDITIONS))
def test_under_other_kernels_only_what_carries_is_judged_and_nothing_is_red(tmp_path, committed, representative,
                                                                           condition):
    records = _run(tmp_path, condition, REPRESENTATIVE, committed, representative, CONDITIONS[condition])
    _judged_by_what_carries(records)
    # under a kernel condition no committed baseline shares the run's kernels, so every cell that
    # quantizes activations is judged by what carries, and says so
    fp8 = {c: r["verdict"] for c, r in records.items() if (r.get("computation") or {}).get("quantized_activations")}
    assert fp8 and set(fp8.values()) <= {"portable-pass", "waived", "unsupported"}, fp8


@pytest.mark.parametrize("condition", sorted(CONDITIONS))
def test_every_planted_loading_fault_is_caught_under_other_kernels(tmp_path, committed, no_accuracy, condition):
    hooks = ";".join(f"{hook}@{cell}" for cell, hook in LOADING_FAULTS.items())
    records = _run(tmp_path, "faults", " or ".join(f"{c} and not mllama" for c in LOADING_FAULTS), committed, no_accuracy,
                   {**CONDITIONS[condition], "HARNESS_TEST_HOOK": hooks}, "--engine", "reference")
    assert set(records) == set(LOADING_FAULTS)
    missed = {c: (r["verdict"], r["verdict_reason"]) for c, r in records.items() if r["verdict"] not in CAUGHT}
    assert not missed, missed


def test_a_compute_fault_in_an_fp8_engine_is_caught_by_the_witness_engine_of_its_run(tmp_path, committed, no_accuracy):
    """The loaded state is exact, the logprobs against a baseline from other kernels are not
    judged: the other engine of the same run, on the same kernels, catches it. The fault halves
    every dynamically quantized activation of the reference's code (its unfused witness, through
    which it is compared with transformers, runs the same code)."""
    cell = "llama.fp8-dynamic-ignore.reference"
    hook = f"break=harness.quant.fp8:quantize_dynamic_per_token@{cell}"
    records = _run(tmp_path, "compute", "llama.fp8-dynamic-ignore.", committed, no_accuracy,
                   {**CONDITIONS["libraries-avx2"], "HARNESS_TEST_HOOK": hook})
    r = records[cell]
    assert r["verdict"] == "failed" and "teacher-forced:transformers" in r["verdict_reason"], r["verdict_reason"]


def test_a_carrying_cell_shifted_beyond_its_family_bound_is_caught_under_other_kernels(tmp_path, committed, no_accuracy):
    cell = "llama.bnb-nf4.reference"
    b = B.read(committed, "cpu-tiny", cell)
    seq = b.sequences[0]
    row = seq.scored[3]
    seq.scored[3] = row.model_copy(update={"logprob": row.logprob - 0.05})
    root = tmp_path / "altered"
    shutil.copytree(committed, root)
    (root / "cpu-tiny" / f"{cell}.json").write_text(b.to_text())
    records = _run(tmp_path, "altered-run", f"{cell} and not mllama", root, no_accuracy, CONDITIONS["aten-default"],
                   "--engine", "reference")
    assert _verdicts(records) == {cell: "regressed"}
    assert "teacher-forced:baseline: exceeds bound" in records[cell]["verdict_reason"]


@pytest.mark.parametrize("condition", sorted(CONDITIONS))
def test_the_trace_suites_faults_are_localised_against_fingerprints_from_other_kernels(condition):
    """Each fault of test_traces.FAULTS names its module and kind against the committed baseline's
    fingerprint, written on other kernels; a clean cell whose computation carries names none."""
    import test_traces

    expected = {param.id: param.values for param in test_traces.FAULTS}
    cases = [[case, model, scheme, spec] for case, (model, scheme, spec, _, _) in expected.items()]
    cases += [[f"{model}.{scheme} clean", model, scheme, None] for model, scheme in dict.fromkeys(tuple(c[1:3]) for c in cases)]
    p = subprocess.run([sys.executable, str(REPO / "tests" / "localise_child.py"), json.dumps(cases)],
                       env=cpu.condition_env(CONDITIONS[condition]), cwd=REPO, stdin=subprocess.DEVNULL, capture_output=True,
                       text=True, timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    found = {d["case"]: d for d in map(json.loads, p.stdout.splitlines())}
    assert set(found) == {c[0] for c in cases}, p.stdout
    wrong = {case: found[case]["detail"] for case, (_, _, _, modules, kind) in expected.items()
             if found[case]["module"] not in modules or found[case]["kind"] != kind}
    assert not wrong, wrong
    # a static-FP8 cell's activations may round across a boundary on other kernels; a bnb one's cannot
    named = {case: d["detail"] for case, d in found.items()
             if case.endswith(" clean") and "fp8" not in case and d["module"] is not None}
    assert not named, named
