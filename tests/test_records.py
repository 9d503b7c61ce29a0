"""The result record: round trip, validation, schema_version, atomic save, helpers."""
import json
import math

import pytest

from harness import matrix as M
from harness import records as R
from harness import registry

INFO = R.EngineInfo(name="reference", version="0.1.0", environment="core", torch="2.13.0+cpu", platform="cpu-x86_64-avx2")


def seq(pid="p0", lps=(-1.0, -2.0, -0.5), greedy=(5, 6)):
    toks = [1, 2, 3, 4]
    return R.SequenceResult(
        prompt=R.PromptRef(id=pid, kind="text"),
        prompt_tokens=[1, 2],
        scored=R.Scored(tokens=toks, logprobs=list(lps), topk=[[(t, lp), (9, -3.0)] for t, lp in zip(toks[1:], lps)]),
        greedy=R.Greedy(tokens=list(greedy), topk=[[(t, -0.1), (7, -2.0)] for t in greedy]),
    )


def record(**kw):
    base = dict(cell="llama.bnb-nf4.reference", model="llama", scheme="bnb-nf4", engine="reference", tier="cpu-tiny",
                fixture=R.FixtureRef(name="llama-bnb-nf4", identity="abc"), engine_info=INFO, status="ok",
                sequences=[seq()], load=R.LoadInfo(seconds=0.01, phases={"read": 0.004, "calibration": 0.002}),
                started_at="2026-01-02T03:04:05.000Z", duration_s=1.5)
    base.update(kw)
    return R.Record(**base)


def test_round_trip_is_exact_and_keeps_every_field():
    r = record(module_diff=R.ModuleDiff(first_differing_module="model.layers.0.mlp.down_proj", detail="max |Δw| 0.5"),
               checks=[R.Check(kind="greedy", against="baseline", ok=True, detail="equal", data={"divergences": []})], verdict="pass")
    text = r.to_json()
    assert R.Record.from_json(text) == r
    data = json.loads(text)
    assert list(data)[:6] == ["schema_version", "cell", "model", "scheme", "engine", "tier"]
    assert data["schema_version"] == 1
    assert data["sequences"][0]["scored"]["topk"][0] == [[2, -1.0], [9, -3.0]]
    # lists of numbers stay on one line
    assert '"prompt_tokens": [1, 2]' in text


def test_non_finite_logprobs_round_trip():
    r = record(sequences=[seq(lps=(float("nan"), float("-inf"), -0.5))])
    back = R.Record.from_json(r.to_json())
    assert math.isnan(back.sequences[0].scored.logprobs[0]) and back.sequences[0].scored.logprobs[1] == -math.inf


@pytest.mark.parametrize("version, fragment", [(2, "schema_version 2 is not supported"), ("1", "schema_version '1' is not supported")])
def test_unknown_schema_version_is_a_clear_error(version, fragment):
    data = json.loads(record().to_json())
    data["schema_version"] = version
    with pytest.raises(R.RecordError, match=f"results/x.json: {fragment}"):
        R.Record.from_json(json.dumps(data), "results/x.json")
    with pytest.raises(R.RecordError, match="not a result record"):
        R.Record.from_json("{}", "results/x.json")
    with pytest.raises(R.RecordError, match="not JSON"):
        R.Record.from_json("{", "results/x.json")


@pytest.mark.parametrize("change, problem", [
    (dict(duration_s="1.5"), 'duration_s: must be a number (got "1.5")'),
    (dict(duration_s=True), "duration_s: must be a number (got true)"),
    (dict(cell=5), "cell: must be a string (got 5)"),
    (dict(schema_version=1.0), "schema_version 1.0 is not supported (this harness reads 1); rerun the cell or use the "
                               "harness version that wrote it"),
])
def test_a_field_of_the_wrong_json_type_is_refused_not_coerced(change, problem):
    data = {**json.loads(record().to_json()), **change}
    with pytest.raises(R.RecordError) as e:
        R.Record.from_json(json.dumps(data), "r.json")
    assert str(e.value) == f"r.json: {problem}"


def test_an_engine_is_checked_against_the_registry_when_a_record_is_read():
    """Not a list fixed at import: an installed package's engine is as good as this project's own
    (tests/test_engine_plugins.py); a name none registered is one line listing those that are."""
    data = {**json.loads(record().to_json()), "engine": "nope", "cell": "llama.bnb-nf4.nope"}
    with pytest.raises(R.RecordError) as e:
        R.Record.from_json(json.dumps(data), "r.json")
    assert str(e.value) == f"r.json: engine: unknown engine 'nope' (registered: {', '.join(registry.ENGINES)})"
    for name in registry.ENGINES:
        assert R.EngineInfo(name=name).name == name


@pytest.mark.parametrize(
    "change, fragment",
    [
        (dict(cell="llama.bnb-nf4.vllm"), "is not <model>.<scheme>.<engine>"),
        (dict(status="error"), "status error needs error"),
        (dict(status="unsupported", sequences=[]), "status unsupported needs unsupported_reason"),
        (dict(sequences=[]), "status ok needs at least one sequence"),
        (dict(started_at="2026-01-02T03:04:05+02:00"), "must be UTC"),
        (dict(verdict="fine"), "verdict"),
        (dict(engine_info=R.EngineInfo(name="transformers", version="5.19.0", platform="cpu")), "differs from engine"),
        (dict(sequences=[seq(), seq()]), "prompt ids must be unique"),
    ],
)
def test_inconsistent_records_are_rejected(change, fragment):
    with pytest.raises(ValueError, match=fragment):
        record(**change)


def test_sequence_shape_is_validated():
    with pytest.raises(Exception, match="need len\\(tokens\\) - 1"):
        R.Scored(tokens=[1, 2, 3], logprobs=[-1.0], topk=[[]])
    with pytest.raises(Exception, match="one per step"):
        R.Greedy(tokens=[1], topk=[])
    with pytest.raises(Exception, match="must begin with prompt_tokens"):
        R.SequenceResult(prompt=R.PromptRef(id="p", kind="text"), prompt_tokens=[7],
                         scored=R.Scored(tokens=[1, 2], logprobs=[-1.0], topk=[[]]), greedy=R.Greedy(tokens=[], topk=[]))
    data = json.loads(record().to_json())
    data["sequences"][0]["scored"]["logprobs"].append(-1.0)
    with pytest.raises(R.RecordError, match=r"^r\.json: sequences\[0\]\.scored: scored: 4 logprobs for 4 tokens"):
        R.Record.from_json(json.dumps(data), "r.json")
    data = json.loads(record().to_json())
    data["surprise"] = 1
    with pytest.raises(R.RecordError, match="surprise: Extra inputs are not permitted"):
        R.Record.from_json(json.dumps(data), "r.json")


def test_error_and_unsupported_records():
    e = record(status="error", sequences=[], load=None,
               error=R.ErrorInfo(type="RuntimeError", message="boom", log_tail="...\nboom"))
    assert R.Record.from_json(e.to_json()) == e
    u = record(status="unsupported", sequences=[], load=None, unsupported_reason="needs AMX")
    assert R.Record.from_json(u.to_json()).unsupported_reason == "needs AMX"


def test_save_load_and_for_cell(tmp_path):
    cells = {c.id: c for c in M.expand(M.load())}
    r = R.Record.for_cell(cells["whisper.torchao-int8wo.transformers"],
                          engine_info=R.EngineInfo(name="transformers", version="5.19.0", platform="cpu-x86_64-avx2"),
                          fixture_identity="f00", sequences=[seq()], load=R.LoadInfo(seconds=0.1))
    assert (r.cell, r.model, r.scheme, r.engine, r.tier) == (
        "whisper.torchao-int8wo.transformers", "whisper", "torchao-int8wo", "transformers", "cpu-tiny")
    assert r.fixture == R.FixtureRef(name="whisper-torchao-int8wo", identity="f00")
    p = R.save(tmp_path / "results" / "a.json", r)
    assert R.load(p) == r
    assert [x.name for x in p.parent.iterdir()] == ["a.json"]  # no temp file left
    hub = R.Record.for_cell(cells["whisper-large-v3.unquantized.vllm"], status="unsupported",
                            engine_info=R.EngineInfo(name="vllm"), unsupported_reason="no GPU")
    assert hub.source == R.SourceRef(hub="openai/whisper-large-v3", revision="unpinned") and hub.fixture is None


def test_platform_helpers():
    assert R.platform_key("cpu-x86_64-avx2") == R.platform_key("cpu-x86_64-avx512") == "cpu-x86_64"
    assert R.platform_key("cuda-sm90") == "cuda-sm90" != R.platform_key("cuda-sm80")
    assert R.cuda_platform(9, 0) == "cuda-sm90"
    assert R.cpu_platform().startswith("cpu-")
    assert R.utc_now().endswith("Z")
