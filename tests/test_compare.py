"""The comparison rules and every branch of the verdict."""

import pytest

from harness import compare as C
from harness import judging, loadcheck
from harness import matrix as M
from harness import records as R
from harness.baselines import Baseline

BOUNDS = M.Bounds(logprob=1e-3, topk=1e-3, load_time=1.5)
INFO = R.EngineInfo(name="vllm", version="0.32.0", environment="vllm-cpu-0.32", torch="2.13.0+cpu", platform="cpu-x86_64-avx2")


def seq(pid="p0", lps=(-1.0, -2.0, -0.5), greedy=(5, 6), greedy_topk=None, tokens=(1, 2, 3, 4)):
    toks = list(tokens)
    gtk = greedy_topk or [[(t, -0.1), (7, -2.0)] for t in greedy]
    return R.SequenceResult(
        prompt=R.PromptRef(id=pid, kind="text"),
        prompt_tokens=toks[:2],
        scored=R.Scored(tokens=toks, logprobs=list(lps), topk=[[(t, lp), (9, -3.0)] for t, lp in zip(toks[1:], lps)]),
        greedy=R.Greedy(tokens=list(greedy), topk=gtk),
    )


def record(engine="vllm", **kw):
    info = kw.pop("engine_info", INFO.model_copy(update={"name": engine}))
    base = dict(cell=f"llama.fp8-dynamic.{engine}", model="llama", scheme="fp8-dynamic", engine=engine, tier="cpu-tiny",
                fixture=R.FixtureRef(name="llama-fp8-dynamic", identity="abc"), engine_info=info, status="ok",
                sequences=[seq()], load=R.LoadInfo(seconds=1.0), computation=R.Computation(dtype="float32"),
                started_at="2026-01-02T03:04:05Z", duration_s=1.0)
    base.update(kw)
    return R.Record(**base)


def baseline(rec=None, **provenance):
    b = Baseline.from_record(rec or record(), commit="c0ffee")
    if provenance:
        b = b.model_copy(update={"provenance": b.provenance.model_copy(update=provenance)})
    return b


def kf(pattern="teacher-forced", versions=">=0.32,<0.33", engine="vllm", reason="vLLM 0.32 mis-scales k_proj"):
    return M.KnownFailure(engine=engine, versions=versions, pattern=pattern, reason=reason, link="https://example.org/1")


def error_record(message="KeyError: 'k_scale'", log_tail="", type_="KeyError"):
    return record(status="error", sequences=[], load=None, error=R.ErrorInfo(type=type_, message=message, log_tail=log_tail))


# ------------------------------------------------------------------------------- checks


def test_teacher_forced_reports_max_worst_and_per_position():
    base = [seq(lps=(-1.0, -2.0, -0.5))]
    obt = [seq(lps=(-1.0, -2.0004, -0.5))]
    (c,) = C.check_teacher_forced(base, obt, logprob_bound=1e-3, topk_bound=1e-3, against="baseline")
    assert c.name == "teacher-forced:baseline" and c.ok
    assert c.data["worst"]["position"] == 2 and c.data["worst"]["prompt"] == "p0"
    assert c.data["max_abs_delta"] == pytest.approx(4e-4)
    assert c.data["per_position"]["p0"] == pytest.approx([0.0, 4e-4, 0.0])
    assert c.data["prompt_len"] == {"p0": 2}
    (c,) = C.check_teacher_forced(base, [seq(lps=(-1.0, -2.0, -0.49))], logprob_bound=1e-3, topk_bound=1.0, against="baseline")
    assert not c.ok and "exceeds bound" in c.detail and c.data["worst"]["position"] == 3


def test_teacher_forced_shared_topk_bound():
    base = seq()
    obt = seq()
    obt.scored.topk[0] = [(2, -1.0), (9, -3.5)]  # the scored token agrees, a shared top-k entry moved
    (c,) = C.check_teacher_forced([base], [obt], logprob_bound=1e-3, topk_bound=1e-3, against="baseline")
    assert not c.ok and c.data["max_abs_delta_topk"] == pytest.approx(0.5) and c.data["worst"]["what"] == "topk"
    obt.scored.topk[0] = [(2, -1.0), (11, -3.5)]  # not shared: not bounded
    (c,) = C.check_teacher_forced([base], [obt], logprob_bound=1e-3, topk_bound=1e-3, against="baseline")
    assert c.ok


def test_nan_logprob_fails_and_data_stays_json_safe():
    (c,) = C.check_teacher_forced([seq()], [seq(lps=(-1.0, float("nan"), -0.5))], logprob_bound=1, topk_bound=1, against="baseline")
    assert not c.ok and c.data["per_position"]["p0"][1] is None and c.data["max_abs_delta"] is None


def test_different_scored_tokens_are_a_distinct_failure():
    checks = C.check_teacher_forced([seq()], [seq(tokens=(1, 2, 8, 4))], logprob_bound=1, topk_bound=1, against="baseline")
    assert [c.name for c in checks] == ["scored-tokens:baseline"]
    assert not checks[0].ok and "position 2: baseline 3 vs obtained 8" in checks[0].detail


def test_greedy_rule_of_vllm():
    base = seq(greedy=(5, 6, 7))
    # diverges at step 1, each token in the other's top-k: passes, and the divergence is reported
    ok = seq(greedy=(5, 8, 9), greedy_topk=[[(5, -0.1)], [(8, -0.5), (6, -0.6)], [(9, -0.1)]])
    base.greedy.topk[1] = [(6, -0.5), (8, -0.6)]
    c = C.check_greedy([base], [ok], against="baseline")
    assert c.ok and c.data["divergences"][0]["step"] == 1 and "step 1" in c.detail
    # obtained token 8 is not in the baseline's top-k
    bad = seq(greedy=(5, 8, 9), greedy_topk=[[(5, -0.1)], [(8, -0.5), (6, -0.6)], [(9, -0.1)]])
    base.greedy.topk[1] = [(6, -0.5), (4, -0.6)]
    c = C.check_greedy([base], [bad], against="baseline")
    assert not c.ok
    d = c.data["divergences"][0]
    assert (d["step"], d["baseline"], d["obtained"]) == (1, 6, 8)
    assert d["baseline_topk"] == [[6, -0.5], [4, -0.6]] and d["obtained_topk"] == [[8, -0.5], [6, -0.6]]
    # a shorter run that agrees on every shared step passes (as in vLLM)
    assert C.check_greedy([seq(greedy=(5, 6, 7))], [seq(greedy=(5, 6))], against="baseline").ok


def test_prompt_set_mismatch_fails():
    c = C.check_prompts([seq("a"), seq("b")], [seq("a"), seq("c")], against="baseline")
    assert not c.ok and c.data == {"missing": ["b"], "extra": ["c"]}


# ------------------------------------------------------------------------------ verdicts


def test_pass():
    j = judging.verdict(record(), baseline(), bounds=BOUNDS)
    assert j.verdict == "pass"
    assert {c.name for c in j.checks} == {"teacher-forced:baseline", "greedy:baseline", "load-time:baseline"}
    out = j.apply(record())
    assert out.verdict == "pass" and out.checks == j.checks and R.Record.from_json(out.to_json()) == out


def test_unsupported_from_capability_probe():
    r = record(status="unsupported", sequences=[], load=None, unsupported_reason="fp8 static needs AMX on CPU")
    j = judging.verdict(r, baseline(), bounds=BOUNDS)
    assert (j.verdict, j.reason) == ("unsupported", "fp8 static needs AMX on CPU")


def test_error_matching_known_failure_is_unsupported_otherwise_error():
    j = judging.verdict(error_record(), None, bounds=BOUNDS, known_failures=[kf(pattern=r"KeyError: .*k_scale")])
    assert j.verdict == "unsupported" and j.reason == "known failure: vLLM 0.32 mis-scales k_proj"
    assert j.apply(error_record()).known_failure.link == "https://example.org/1"
    # the pattern may match the log tail
    j = judging.verdict(error_record(message="engine core died", log_tail="...\nValueError: bad k_scale"), None, bounds=BOUNDS,
                  known_failures=[kf(pattern="bad k_scale")])
    assert j.verdict == "unsupported"
    # version outside the range, other engine, or pattern not matching: error
    for k in (kf(pattern="k_scale", versions="<0.32"), kf(pattern="k_scale", engine="transformers"), kf(pattern="v_scale")):
        j = judging.verdict(error_record(), None, bounds=BOUNDS, known_failures=[k])
        assert j.verdict == "error" and j.reason == "KeyError: KeyError: 'k_scale'"


def test_local_version_label_is_ignored_by_known_failures():
    r = error_record().model_copy(update={"engine_info": INFO.model_copy(update={"version": "0.32.0+cpu"})})
    assert judging.verdict(r, None, bounds=BOUNDS, known_failures=[kf(pattern="k_scale")]).verdict == "unsupported"


def test_cross_engine_disagreement_is_failed_even_without_baseline():
    ref = record("reference", engine_info=R.EngineInfo(name="reference", version="0.1.0", platform="cpu-x86_64-avx2"))
    obt = record(sequences=[seq(lps=(-1.0, -2.5, -0.5))])
    cross = C.cross_engine(obt, [ref, obt, error_record()], BOUNDS)
    assert [c.name for c in cross] == ["teacher-forced:reference", "greedy:reference"]
    j = judging.verdict(obt, None, bounds=BOUNDS, cross_engine_checks=cross)
    assert j.verdict == "failed" and "teacher-forced:reference" in j.reason
    # waived only when a known failure matches the failing check
    j = judging.verdict(obt, baseline(obt), bounds=BOUNDS, cross_engine_checks=cross, known_failures=[kf(pattern="teacher-forced:reference")])
    assert j.verdict == "waived" and j.known_failure is not None
    j = judging.verdict(obt, None, bounds=BOUNDS, cross_engine_checks=cross, known_failures=[kf(pattern="greedy")])
    assert j.verdict == "failed"
    # agreement is not a failure
    ok = C.cross_engine(record(), [ref], BOUNDS)
    assert all(c.ok for c in ok) and judging.verdict(record(), None, bounds=BOUNDS, cross_engine_checks=ok).verdict == "missing-baseline"


XEON = R.CpuInfo(vendor="GenuineIntel", model="Xeon", flags=["avx2", "avx512f"], capability="avx512")


def _waived_case(**obtained):
    """A vLLM record that deviates from the reference as a known failure says, and what it checks."""
    obtained.setdefault("engine_info", INFO.model_copy(update={"cpu": XEON}))
    ref = record("reference", engine_info=R.EngineInfo(name="reference", version="0.1.0", platform="cpu-x86_64-avx2"))
    known = record(sequences=[seq(lps=(-1.0, -2.5, -0.5))], **obtained)
    return ref, known, [kf(pattern="teacher-forced:reference")]


def test_a_known_failure_excuses_a_deviation_only_as_far_as_the_cells_recorded_behaviour():
    ref, known, kfs = _waived_case()
    cross = C.cross_engine(known, [ref], BOUNDS)
    j = judging.verdict(known, None, bounds=BOUNDS, cross_engine_checks=cross, known_failures=kfs)
    assert j.verdict == "missing-baseline" and "only as far as this engine's recorded behaviour" in j.reason
    j = judging.verdict(known, baseline(known), bounds=BOUNDS, cross_engine_checks=cross, known_failures=kfs)
    assert j.verdict == "waived" and j.reason.endswith("; within its baseline") and j.evidence.not_judged is None
    # a second bug in the same cell: the deviation grows, and the cell leaves its recorded behaviour
    second = known.model_copy(update={"sequences": [seq(lps=(-1.0, -2.56, -0.5))]})
    j = judging.verdict(second, baseline(known), bounds=BOUNDS, cross_engine_checks=C.cross_engine(second, [ref], BOUNDS),
                        known_failures=kfs)
    assert j.verdict == "failed" and j.known_failure is not None
    assert j.reason.startswith("known failure 'teacher-forced:reference' (vllm >=0.32,<0.33) excuses teacher-forced:reference, "
                               "but this run left its recorded behaviour: teacher-forced:baseline: exceeds bound")


EPYC = XEON.model_copy(update={"vendor": "AuthenticAMD", "model": "EPYC", "flags": ["avx2"], "capability": "avx2"})
FP8_ACTIVATIONS = R.Computation(dtype="float32", quantized_activations=["input"])


def test_on_other_kernels_a_cell_whose_computation_carries_is_judged_as_on_its_own():
    """Float32 with no quantized activation: the family bound against a baseline from any kernels."""
    b = baseline(record(engine_info=INFO.model_copy(update={"cpu": XEON})))
    moved = record(sequences=[seq(lps=(-1.0, -2.05, -0.5))], engine_info=INFO.model_copy(update={"cpu": EPYC}))
    j = judging.verdict(moved, b, bounds=BOUNDS)
    assert j.verdict == "regressed" and "teacher-forced:baseline: exceeds bound" in j.reason
    same = record(engine_info=INFO.model_copy(update={"cpu": EPYC}))
    assert judging.verdict(same, b, bounds=BOUNDS).verdict == "pass"


def test_on_other_kernels_fp8_activations_are_shown_not_judged_and_never_a_plain_pass():
    state = {"model.layers.0.mlp.down_proj": "b" * 16}
    b = baseline(record(loaded_state=state, engine_info=INFO.model_copy(update={"cpu": XEON})))
    moved = record(sequences=[seq(lps=(-1.0, -2.05, -0.5))], loaded_state=state, computation=FP8_ACTIVATIONS,
                   engine_info=INFO.model_copy(update={"cpu": EPYC}))
    j = judging.verdict(moved, b, bounds=BOUNDS)
    assert j.verdict == "portable-pass" and j.evidence.not_judged is not None
    assert j.reason.startswith("loaded state exact (1 modules); no other engine in this run to agree with; logprobs "
                               "against the baseline not judged: the baseline is from other kernels (")
    assert "it quantizes activations (input)" in j.reason and "--update-kernel-baselines -k fp8-dynamic" in j.reason
    tf = next(c for c in j.checks if c.name == "teacher-forced:baseline")
    assert tf.ok and tf.detail.startswith("not judged: ") and tf.data["judged"] is False and not tf.data["within_bounds"]
    # the loaded state is judged exactly, and so are the other engines of the run
    off = moved.model_copy(update={"loaded_state": {"model.layers.0.mlp.down_proj": "0" * 16}})
    j = judging.verdict(off, b, bounds=BOUNDS)
    assert j.verdict == "regressed" and "loaded-state:baseline" in j.reason and "teacher-forced:baseline" not in j.reason
    witness = record("reference", sequences=[seq(lps=(-1.0, -2.5, -0.5))],
                     engine_info=INFO.model_copy(update={"name": "reference", "cpu": EPYC}))
    j = judging.verdict(moved, b, bounds=BOUNDS, cross_engine_checks=C.cross_engine(moved, [witness], BOUNDS))
    assert j.verdict == "failed" and "teacher-forced:reference" in j.reason
    # on the baseline's own kernels everything is judged
    home = moved.model_copy(update={"engine_info": INFO.model_copy(update={"cpu": XEON})})
    assert judging.verdict(home, b, bounds=BOUNDS).verdict == "regressed"
    bf16 = moved.model_copy(update={"computation": R.Computation(dtype="bfloat16")})
    assert "it computes in bfloat16" in judging.verdict(bf16, b, bounds=BOUNDS).reason


def test_against_recorded_behaviour_from_other_kernels_a_waived_cell_is_held_to_its_loaded_state():
    state = {"model.layers.0.mlp.down_proj": "b" * 16}
    ref, known, kfs = _waived_case(loaded_state=state)
    elsewhere = known.model_copy(update={"sequences": [seq(lps=(-1.0, -2.56, -0.5))], "computation": FP8_ACTIVATIONS,
                                         "engine_info": INFO.model_copy(update={"cpu": EPYC})})
    cross = C.cross_engine(elsewhere, [ref], BOUNDS)
    j = judging.verdict(elsewhere, baseline(known), bounds=BOUNDS, cross_engine_checks=cross, known_failures=kfs)
    assert j.verdict == "waived" and "; its loaded state equal to its baseline's; logprobs against the baseline not judged: " in j.reason
    assert j.evidence.not_judged is not None  # what harness run --update-kernel-baselines records a baseline of these kernels for
    loaded_other = elsewhere.model_copy(update={"loaded_state": {"model.layers.0.mlp.down_proj": "0" * 16}})
    j = judging.verdict(loaded_other, baseline(known), bounds=BOUNDS, cross_engine_checks=cross, known_failures=kfs)
    assert j.verdict == "failed" and "loaded-state:baseline" in j.reason and "teacher-forced:baseline" not in j.reason
    # a gated load over its bound is regressed, and the rest is still held to the loaded state alone:
    # what --update-kernel-baselines needs to record these kernels' load (vLLM's bnb cpu-load cell)
    slow = elsewhere.model_copy(update={"load": R.LoadInfo(seconds=2.0)})
    j = judging.verdict(slow, baseline(known), bounds=BOUNDS, cross_engine_checks=cross, known_failures=kfs,
                        gate_load_time=True)
    assert j.verdict == "regressed" and j.reason.startswith("load-time:baseline") and j.evidence.not_judged is not None


def test_a_known_failure_that_does_not_show_on_other_kernels_is_a_portable_pass():
    # whisper.fp8-dynamic.vllm under MKL_ENABLE_INSTRUCTIONS=AVX2: vLLM agrees with the reference
    # there, so nothing is waived, while its baseline records the known deviation from the Xeon
    state = {"model.layers.0.mlp.down_proj": "b" * 16}
    ref, known, kfs = _waived_case(loaded_state=state)
    agreeing = record(loaded_state=state, computation=FP8_ACTIVATIONS, engine_info=INFO.model_copy(update={"cpu": EPYC}))
    cross = C.cross_engine(agreeing, [ref], BOUNDS)
    assert all(c.ok for c in cross)
    j = judging.verdict(agreeing, baseline(known), bounds=BOUNDS, cross_engine_checks=cross, known_failures=kfs)
    assert j.verdict == "portable-pass" and "agrees with reference in this run" in j.reason
    assert j.reason.endswith("known failure 'teacher-forced:reference' (vllm >=0.32,<0.33) does not show on these kernels")
    assert j.evidence.not_judged is not None
    assert any(c.name == "teacher-forced:baseline" and not c.data["within_bounds"] for c in j.checks)
    # the loaded state still holds it
    moved = agreeing.model_copy(update={"loaded_state": {"model.layers.0.mlp.down_proj": "0" * 16}})
    j = judging.verdict(moved, baseline(known), bounds=BOUNDS, cross_engine_checks=cross, known_failures=kfs)
    assert j.verdict == "regressed" and "loaded-state:baseline" in j.reason and "teacher-forced:baseline" not in j.reason


def test_module_diff_is_failed():
    r = record(module_diff=R.ModuleDiff(first_differing_module="model.layers.1.self_attn.qkv_proj", detail="quantized, reference says unquantized"))
    j = judging.verdict(r, baseline(), bounds=BOUNDS)
    assert j.verdict == "failed" and "model.layers.1.self_attn.qkv_proj" in j.reason


def test_missing_baseline():
    assert judging.verdict(record(), None, bounds=BOUNDS).verdict == "missing-baseline"


@pytest.mark.parametrize(
    "kwargs, provenance, fragment",
    [
        ({}, {"engine_version": "0.31.0"}, "baseline recorded with vllm 0.31.0, this run is 0.32.0"),
        ({}, {"platform": "cuda-sm90"}, "baseline recorded on cuda-sm90"),
        ({"expected_engine_version": "0.33.0"}, {}, "is not the environment's pinned 0.33.0"),
    ],
)
def test_stale_baseline(kwargs, provenance, fragment):
    bad = record(sequences=[seq(lps=(-1.0, -3.0, -0.5))])  # numbers moved too: still stale, checks still reported
    j = judging.verdict(bad, baseline(**provenance), bounds=BOUNDS, **kwargs)
    assert j.verdict == "stale-baseline" and fragment in j.reason
    assert any(c.name == "teacher-forced:baseline" and not c.ok for c in j.checks)


def test_stale_when_fixture_changed_on_any_platform_but_not_for_another_isa_alone():
    new_fixture = record(fixture=R.FixtureRef(name="llama-fp8-dynamic", identity="def"))
    assert judging.verdict(new_fixture, baseline(), bounds=BOUNDS).verdict == "stale-baseline"
    # Fixtures build bit-identically on every CPU, so another ISA does not excuse a new identity...
    other_isa = baseline(platform="cpu-x86_64-avx512")
    assert judging.verdict(new_fixture, other_isa, bounds=BOUNDS).verdict == "stale-baseline"
    # ...and another ISA alone is not stale: it is compared (docs/design.md, "Portability across CPUs").
    assert judging.verdict(record(), other_isa, bounds=BOUNDS).verdict == "pass"
    assert judging.verdict(record(), baseline(), bounds=BOUNDS, expected_engine_version="0.32.0").verdict == "pass"


def test_regressed_on_hand_altered_baseline_logprob():
    b = baseline()
    row = b.sequences[0].scored[2]
    b.sequences[0].scored[2] = row.model_copy(update={"logprob": row.logprob + 0.01})
    j = judging.verdict(record(), b, bounds=BOUNDS)
    assert j.verdict == "regressed" and "teacher-forced:baseline" in j.reason and "position 2" in j.reason


def test_regressed_on_scored_tokens_and_greedy():
    j = judging.verdict(record(sequences=[seq(tokens=(1, 2, 3, 5))]), baseline(), bounds=BOUNDS)
    assert j.verdict == "regressed" and j.reason.startswith("scored-tokens:baseline")
    j = judging.verdict(record(sequences=[seq(greedy=(5, 99), greedy_topk=[[(5, -0.1)], [(99, -0.1)]])]), baseline(), bounds=BOUNDS)
    assert j.verdict == "regressed" and j.reason.startswith("greedy:baseline")


def test_waived_regression():
    j = judging.verdict(record(sequences=[seq(lps=(-1.0, -3.0, -0.5))]), baseline(), bounds=BOUNDS, known_failures=[kf()])
    assert j.verdict == "waived" and j.reason.startswith("known failure: vLLM 0.32 mis-scales k_proj")


def test_unexpected_pass():
    j = judging.verdict(record(), baseline(), bounds=BOUNDS, known_failures=[kf(pattern="anything")])
    assert j.verdict == "unexpected-pass" and "remove or narrow it" in j.reason
    # a known failure for another version range does not apply
    assert judging.verdict(record(), baseline(), bounds=BOUNDS, known_failures=[kf(versions="<0.32")]).verdict == "pass"


def test_a_known_failure_about_an_engine_that_did_not_run_is_judged_by_the_baseline_that_records_it():
    """`harness run -k vllm`: the reference did not run, so a known failure about vLLM's comparison
    with it can neither show nor be refuted; the cell held its baseline, which records that
    behaviour, so it stays waived, and says which engine to run. Run with the reference, a known
    failure that no longer shows is an unexpected pass."""
    about_the_reference = kf(pattern="^(teacher-forced|greedy):reference")
    native = record(engine_info=INFO.model_copy(update={"cpu": XEON}))
    j = judging.verdict(native, baseline(native), bounds=BOUNDS, known_failures=[about_the_reference])
    assert j.verdict == "waived" and j.known_failure is about_the_reference
    assert j.reason.startswith("no comparison with the reference ran here") and "run the reference too" in j.reason
    reference = record(engine="reference", engine_info=native.engine_info.model_copy(update={"name": "reference"}))
    agreeing = C.cross_engine(native, [reference], BOUNDS)
    assert agreeing and all(c.ok for c in agreeing)
    j = judging.verdict(native, baseline(native), bounds=BOUNDS, known_failures=[about_the_reference],
                        cross_engine_checks=agreeing)
    assert j.verdict == "unexpected-pass"
    # a known failure about the cell's own load is refuted by a run of its engine alone
    own_error = kf(pattern="KeyError: .*k_scale")
    assert judging.verdict(native, baseline(native), bounds=BOUNDS, known_failures=[own_error]).verdict == "unexpected-pass"
    # and the baseline still holds the cell: moved from it, it is regressed
    moved = native.model_copy(update={"sequences": [seq(lps=(-1.0, -2.5, -0.5))]})
    j = judging.verdict(moved, baseline(native), bounds=BOUNDS, known_failures=[about_the_reference])
    assert j.verdict == "regressed"


def _load(seconds):
    return R.LoadInfo(seconds=seconds, phases={"read": seconds / 2})


def test_load_time_never_gated_on_cpu_tiny():
    slow = record(load=_load(10.0))
    j = judging.verdict(slow, baseline(), bounds=BOUNDS, gate_load_time=False)
    assert j.verdict == "pass"
    (lt,) = [c for c in j.checks if c.name == "load-time:baseline"]
    assert lt.ok and lt.data["ratio"] == pytest.approx(10.0) and "not gated" in lt.detail


def test_load_time_gated_regressed_and_improved():
    b = baseline()  # 1.0 s
    assert judging.verdict(record(load=_load(2.0)), b, bounds=BOUNDS, gate_load_time=True).verdict == "regressed"
    assert judging.verdict(record(load=_load(0.5)), b, bounds=BOUNDS, gate_load_time=True).verdict == "improved"
    j = judging.verdict(record(load=_load(1.2)), b, bounds=BOUNDS, gate_load_time=True)
    assert j.verdict == "pass"
    (lt,) = [c for c in j.checks if c.name == "load-time:baseline"]
    assert lt.data["ratio"] == pytest.approx(1.2) and "calibrat" not in lt.detail


def _calibrated(seconds, calibration):
    return R.LoadInfo(seconds=seconds, phases={"read": seconds / 2, "calibration": calibration})


def test_load_time_calibrated_ratio_cancels_a_slower_machine():
    b = baseline(record(load=_calibrated(1.0, 0.1)))
    # twice the load time on a machine that runs the calibration workload twice as slowly: no regression
    j = judging.verdict(record(load=_calibrated(2.0, 0.2)), b, bounds=BOUNDS, gate_load_time=True)
    assert j.verdict == "pass"
    (lt,) = [c for c in j.checks if c.name == "load-time:baseline"]
    assert lt.data["calibrated"] and lt.data["ratio"] == pytest.approx(1.0) and "calibrated ratio 1" in lt.detail


def test_load_time_calibration_does_not_absorb_a_slower_loader():
    b = baseline(record(load=_calibrated(1.0, 0.1)))
    tight = BOUNDS.model_copy(update={"load_time": 1.1})
    j = judging.verdict(record(load=_calibrated(1.2, 0.1)), b, bounds=tight, gate_load_time=True)
    assert j.verdict == "regressed"
    (lt,) = [c for c in j.checks if c.name == "load-time:baseline"]
    assert lt.data["ratio"] == pytest.approx(1.2) and lt.detail.startswith("slower than bound")


def test_a_load_over_its_bound_says_when_the_baseline_comes_from_other_kernels():
    epyc = XEON.model_copy(update={"vendor": "AuthenticAMD", "model": "EPYC", "flags": ["avx2"], "capability": "avx2"})
    recorded_on_xeon = baseline(record(load=_calibrated(1.0, 0.1), engine_info=INFO.model_copy(update={"cpu": XEON})))
    tight = BOUNDS.model_copy(update={"load_time": 1.1})
    for seconds, verdict in ((1.5, "regressed"), (0.5, "improved"), (1.0, "pass")):
        for here, said in ((epyc, True), (XEON, False)):
            obtained = record(load=_calibrated(seconds, 0.1), engine_info=INFO.model_copy(update={"cpu": here}))
            j = judging.verdict(obtained, recorded_on_xeon, bounds=tight, gate_load_time=True)
            (lt,) = [c for c in j.checks if c.name == "load-time:baseline"]
            assert j.verdict == verdict
            assert ("recorded on other kernels (xeon-avx512f-" in lt.detail) == (said and verdict != "pass"), lt.detail


def test_a_load_outside_its_bound_says_when_it_was_timed_under_other_memory_allocation():
    """Huge pages move vLLM's loads and the calibrations apart (harness.loadtime.ALLOCATION_ENV):
    the check says so where the reading is outside the bound, and judges as before."""
    recorded = baseline(record(load=_calibrated(1.0, 0.1)))  # the defaults: an older baseline has no field
    tight = BOUNDS.model_copy(update={"load_time": 1.1})
    for seconds, verdict in ((1.5, "regressed"), (0.5, "improved"), (1.0, "pass")):
        for allocation in ({"THP_MEM_ALLOC_ENABLE": "1"}, {}):
            obtained = _calibrated(seconds, 0.1).model_copy(update={"allocation": allocation})
            j = judging.verdict(record(load=obtained), recorded, bounds=tight, gate_load_time=True)
            (lt,) = [c for c in j.checks if c.name == "load-time:baseline"]
            assert j.verdict == verdict
            said = "timed under other memory allocation than the baseline's (THP_MEM_ALLOC_ENABLE=1 here, the defaults there)"
            assert (said in lt.detail) == bool(allocation and verdict != "pass"), lt.detail


def test_load_time_without_calibration_on_either_side_is_the_plain_ratio():
    for obtained, base in ((_calibrated(2.0, 0.2), _load(1.0)), (_load(2.0), _calibrated(1.0, 0.1))):
        ratio, calibrated = loadcheck.load_ratio(obtained, base)
        assert (ratio, calibrated) == (pytest.approx(2.0), False)


def test_a_baseline_calibrated_with_another_workload_is_compared_uncalibrated_and_says_so():
    older = baseline(record(load=_calibrated(1.0, 0.04)))  # no calibration_workload: the first workload
    newer = R.LoadInfo(seconds=1.0, phases={"calibration": 0.02}, calibration_workload=2)
    j = judging.verdict(record(load=newer), older, bounds=BOUNDS, gate_load_time=True)
    (lt,) = [c for c in j.checks if c.name == "load-time:baseline"]
    assert not lt.data["calibrated"] and lt.data["ratio"] == pytest.approx(1.0)  # calibrated, it would read 2.0
    assert "another workload" in lt.detail and "--update-baselines" in lt.detail
    same = baseline(record(load=R.LoadInfo(seconds=1.0, phases={"calibration": 0.01}, calibration_workload=2)))
    assert loadcheck.load_ratio(newer, same.load) == (pytest.approx(0.5), True)
    # a named workload (vLLM's torchao loads, harness.loadtime) against the default: not calibrated
    quantize = R.LoadInfo(seconds=1.0, phases={"calibration": 0.08}, calibration_workload="torchao-quantize-1")
    assert loadcheck.load_ratio(quantize, same.load) == (pytest.approx(1.0), False)
    assert R.LoadInfo.model_validate_json(quantize.model_dump_json()).calibration_workload == "torchao-quantize-1"


def test_cpu_load_cells_gate_load_time():
    cells = {c.id: c for c in M.expand(M.load(), tier="cpu-load")}
    assert cells and all(c.gate_load_time for c in cells.values())
    assert not any(c.tier == "cpu-load" for c in M.expand(M.load()))  # on demand: only when named


def test_judge_takes_settings_from_the_cell():
    cells = {c.id: c for c in M.expand(M.load())}
    cell = cells["llama.fp8-dynamic.transformers"]
    info = R.EngineInfo(name="transformers", version="5.19.0", platform="cpu-x86_64-avx2")
    r = record("transformers", engine_info=info, load=_load(100.0))
    assert judging.judge(cell, r, baseline(r.model_copy(update={"load": _load(1.0)}))).verdict == "pass"  # cpu-tiny: not gated
    other = record("reference", engine_info=info.model_copy(update={"name": "reference", "version": "0.1.0"}),
                   sequences=[seq(lps=(-1.0, -2.5, -0.5))])
    assert judging.judge(cell, r, None, [other], unfused=other).verdict == "failed"


def test_cross_engine_rule_fusion_witnesses_and_known_failures():
    """transformers does not fuse shards: it is compared with the reference executed unfused, and
    only when that is at hand; an engine a known failure covers is no witness."""
    ref = record("reference", engine_info=R.EngineInfo(name="reference", version="0.1.0", platform="cpu-x86_64-avx2"))
    tf = record("transformers", engine_info=INFO.model_copy(update={"name": "transformers", "version": "5.19.0"}))
    assert C.cross_engine(tf, [ref], BOUNDS) == []  # no unfused reference (a merge of separate runs)
    assert C.cross_engine(ref, [tf], BOUNDS) == []
    unfused = ref.model_copy(update={"sequences": [seq(lps=(-1.0, -2.5, -0.5))]})
    checks = C.cross_engine(tf, [ref], BOUNDS, unfused=unfused)
    assert not checks[0].ok and checks[0].detail.endswith("[reference executed unfused, as transformers executes]")
    checks = C.cross_engine(ref, [tf], BOUNDS, unfused=ref)  # unfused equal to fused: no note
    assert all(c.ok and "unfused" not in c.detail for c in checks) and checks
    vllm = record("vllm")
    assert C.cross_engine(tf, [vllm], BOUNDS, unfused=ref) == []  # two non-reference engines, different fusion
    assert [c.name for c in C.cross_engine(ref, [vllm], BOUNDS)] == ["teacher-forced:vllm", "greedy:vllm"]
    assert C.cross_engine(ref, [vllm], BOUNDS, known_failures=[kf(pattern="x")]) == []  # vLLM 0.32 is no witness


def test_disagreement_judges_only_the_checks_not_against_the_baseline():
    bad = R.Check(kind="teacher-forced", against="vllm", ok=False, detail="exceeds bound: 0.5")
    base = R.Check(kind="teacher-forced", against="baseline", ok=False, detail="exceeds bound: 0.5")
    assert C.disagreement(record(), [base]) is None
    j = C.disagreement(record(), [base, bad])
    assert (j.verdict, j.reason, len(j.checks)) == ("failed", "teacher-forced:vllm: exceeds bound: 0.5", 2)
    j = C.disagreement(record(), [bad], [kf(pattern="teacher-forced:vllm")])
    assert j.verdict == "waived" and j.known_failure is not None


def test_nan_against_nan_is_the_same_result_but_nan_against_a_number_is_not():
    nan = float("nan")
    (c,) = C.check_teacher_forced([seq(lps=(-1.0, nan, -0.5))], [seq(lps=(-1.0, nan, -0.5))], logprob_bound=1e-3,
                                  topk_bound=1e-3, against="baseline")
    assert c.ok
    (c,) = C.check_teacher_forced([seq(lps=(-1.0, nan, -0.5))], [seq()], logprob_bound=1e-3, topk_bound=1e-3, against="baseline")
    assert not c.ok
