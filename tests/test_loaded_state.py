"""The loaded state, module by module, checked bit for bit against the baseline on any machine
(docs/design.md, "Loaded state"), and the rounding-flip rule between engines on the same kernels."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness import compare as C
from harness import evidence, judging
from harness import cpu
from harness import loaded_state
from harness import records as R
from tests.test_compare import BOUNDS, INFO, baseline, record, seq

REPO = Path(__file__).resolve().parent.parent
STATE = {"model.layers.0.self_attn.qkv_proj": "a" * 16, "model.layers.0.mlp.down_proj": "b" * 16, "lm_head": "c" * 16}
CPU = R.CpuInfo(vendor="GenuineIntel", model="Xeon", flags=["avx2", "avx512f"], capability="avx512")
OTHER_CPU = CPU.model_copy(update={"vendor": "AuthenticAMD", "model": "EPYC", "flags": ["avx2"], "capability": "avx2"})


# ------------------------------------------------------------------------------- digests


def test_a_digest_covers_values_dtype_shape_scales_and_class():
    a = torch.nn.Linear(4, 3)
    base = loaded_state.digest(a)[""]
    assert loaded_state.digest(a)[""] == base
    with torch.no_grad():
        a.weight[1, 2] = torch.nextafter(a.weight[1, 2], torch.tensor(1.0))  # one ulp
    assert loaded_state.digest(a)[""] != base
    b = torch.nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    with_scale = loaded_state.digest(b)[""]
    assert with_scale == loaded_state.digest(a)[""]
    b.k_scale = torch.tensor(0.5)  # a scale attached as a plain attribute still counts
    assert loaded_state.digest(b)[""] != with_scale
    c = torch.nn.Linear(4, 3).double()
    assert loaded_state.digest(c)[""] != loaded_state.digest(a)[""]


def test_modules_holding_nothing_are_left_out_and_the_order_is_the_models():
    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
    assert list(loaded_state.digest(m)) == ["0", "2"]


# Loads each argument's cell in turn and prints {argument: its loaded state}; an argument
# ``<cell>:<mutations>`` builds a vLLM cell under those test-only mutations (HARNESS_VLLM_MUTATION).
_CHILD = """
import json, os, sys
from harness import matrix
from harness.engines.base import engine_class, resolve_checkpoint
from harness.engines.vllm import MUTATION_ENV
cells = {c.id: c for c in matrix.load(matrix.DEFAULT_PATH).cells(tier="cpu-tiny")}
out = {}
for arg in sys.argv[1:]:
    cid, _, os.environ[MUTATION_ENV] = arg.partition(":")
    e = engine_class(cells[cid].engine)(cells[cid])
    e.load(resolve_checkpoint(cells[cid]))
    out[arg] = e.loaded_state()
    e.close()
print(json.dumps(out))
"""
PORTABLE = ["llama.fp8-static-kv.reference", "llama.fp8-static-kv.transformers", "llama.bnb-nf4-dq.reference",
            "llama.bnb-nf4-dq.transformers", "llama.torchao-int8wo.reference", "llama.torchao-int8wo.transformers",
            "whisper.fp8-dynamic.reference"]


def loaded_states(env: dict[str, str], cells: list[str] = PORTABLE) -> dict:
    """The loaded state of each of ``cells`` (cell ids, or ``<cell>:<vLLM mutations>``), loaded in
    turn in one fresh interpreter with ``env`` over this one's."""
    p = subprocess.run([sys.executable, "-c", _CHILD, *cells], env={**os.environ, "OMP_NUM_THREADS": "1", **env},
                       cwd=REPO, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.slow("three fresh interpreters loading 7 cells each: native, default+AVX2 kernels, no C decoders")
def test_the_loaded_state_is_the_same_under_every_kernel_condition():
    """Native kernels, a lowered torch capability with the libraries' AVX2 paths, and the torch
    decoders instead of the C ones (HARNESS_NATIVE=0): one digest per module."""
    native = loaded_states({})
    assert all(len(v) > 10 for v in native.values()), native
    assert loaded_states({"ATEN_CPU_CAPABILITY": "default", **cpu.LIBRARIES_AVX2}) == native
    assert loaded_states({"HARNESS_NATIVE": "0"}) == native


# ---------------------------------------------------------------------------- the check


def test_equal_state_passes_and_names_the_module_count():
    c = C.check_loaded_state(record(loaded_state=STATE), baseline(record(loaded_state=STATE)))
    assert c.ok and c.data["modules"] == 3 and "all 3 modules" in c.detail


def test_a_changed_missing_or_extra_module_fails_naming_the_first_in_model_order():
    changed = {**STATE, "model.layers.0.mlp.down_proj": "d" * 16, "lm_head": "e" * 16}
    c = C.check_loaded_state(record(loaded_state=changed), baseline(record(loaded_state=STATE)))
    assert not c.ok and c.data["first"] == "model.layers.0.mlp.down_proj" and c.data["differing"] == [
        "model.layers.0.mlp.down_proj", "lm_head"]
    missing = {k: v for k, v in STATE.items() if k != "lm_head"}
    c = C.check_loaded_state(record(loaded_state=missing), baseline(record(loaded_state=STATE)))
    assert not c.ok and c.data["missing"] == ["lm_head"] and "not loaded (lm_head)" in c.detail
    c = C.check_loaded_state(record(loaded_state={**STATE, "extra": "f" * 16}), baseline(record(loaded_state=STATE)))
    assert not c.ok and c.data["extra"] == ["extra"]


def test_no_digest_on_either_side_is_no_check():
    assert C.check_loaded_state(record(), baseline(record(loaded_state=STATE))) is None
    assert C.check_loaded_state(record(loaded_state=STATE), baseline(record())) is None


def test_a_state_difference_is_regressed_on_the_same_and_on_other_kernels():
    info = INFO.model_copy(update={"cpu": CPU})
    b = baseline(record(loaded_state=STATE, engine_info=info))
    changed = {**STATE, "lm_head": "0" * 16}
    for run_cpu in (CPU, OTHER_CPU):
        rec = record(loaded_state=changed, engine_info=INFO.model_copy(update={"cpu": run_cpu}))
        j = judging.verdict(rec, b, bounds=BOUNDS)
        assert j.verdict == "regressed" and "loaded-state:baseline" in j.reason and "lm_head" in j.reason


# ------------------------------------------------------------------------ rounding flips


def _flip(explained=True, prompt="p0", against="transformers") -> R.Localisation:
    at = [R.FlipAt(prompt=prompt, module="model.layers.0.mlp.gate_proj", fragile=3, moved=0.01, bound=0.04, steps=1.2)]
    return R.Localisation(against=against, module="model.layers.0.mlp.gate_proj", kind="quantizer", detail="...",
                          rounding_flip=R.RoundingFlip(explained=explained, detail="rounding flip at X" if explained
                                                       else "not a rounding flip: Y", at=at if explained else []))


def test_a_flip_is_never_explained_away_against_a_baseline_on_any_kernels():
    """Against a baseline nothing predicts or explains: a cell whose logprobs moved is regressed,
    on the baseline's own kernels and, where its computation carries, on other kernels too."""
    b = baseline(record(loaded_state=STATE, engine_info=INFO.model_copy(update={"cpu": CPU})))
    for run_cpu in (CPU, OTHER_CPU):
        rec = record(loaded_state=STATE, sequences=[seq(lps=(-1.0, -2.5, -0.5))], computation=R.Computation(dtype="float32"),
                     engine_info=INFO.model_copy(update={"cpu": run_cpu}))
        rec = judging.verdict(rec, b, bounds=BOUNDS).apply(rec)
        rec = rec.model_copy(update={"localisation": [_flip(against="baseline")]})
        assert rec.verdict == "regressed" and judging.rounding_flip(rec) is None


def _trace(x, scale, weight, *, out_factor=1.0, prompt="p0"):
    """A two-module trace: ``norm`` makes x, ``q`` quantizes it with a static scale and projects."""
    from harness.quant import fp8
    from harness.traces import PromptTrace, weight_probe

    y = (fp8.fake_quant(x, torch.tensor(scale)) @ weight.T) * out_factor
    return PromptTrace(prompt=prompt, order=["norm", "q"], outputs={"norm": x.clone(), "q": y},
                       inputs={"q": x.clone()}, weights={"q": weight @ weight_probe(weight.shape[1])},
                       quantizers={"q"}, input_scales={"q": scale},
                       column_norms={"q": weight.norm(dim=0)})


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(3, 8, generator=g) * 8  # below 16: steps of 1 or less, nowhere near 17
    x[1, 2] = 17.0 + 1e-6  # just above the boundary between 16 and 18
    w = torch.randn(5, 8, generator=g)
    return x, w


def _across_the_boundary(x):
    """``x`` with its element just above 17 moved just below, within the noise: it now rounds to 16,
    not 18."""
    moved = x.clone()
    moved[1, 2] = 17.0 - 1e-6
    return moved


def test_an_input_element_that_crosses_a_boundary_within_noise_is_a_rounding_flip():
    x, w = _inputs()
    moved = _across_the_boundary(x)
    flip = _across(_trace(x, 1.0, w), _trace(moved, 1.0, w))
    assert flip.explained, flip.detail
    (at,) = flip.at
    assert at.module == "q" and at.fragile == 1 and 0.5 < at.steps <= 1.0 + 1e-6 and at.moved <= at.bound
    assert flip.detail.startswith("rounding flip at q")


def test_a_quantizer_output_moved_beyond_a_few_flips_is_not_a_rounding_flip():
    x, w = _inputs()
    moved = _across_the_boundary(x)
    flip = _across(_trace(x, 1.0, w), _trace(moved, 1.0, w, out_factor=1.5))  # its own code is off
    assert not flip.explained and "more than 4 one-step flips" in flip.detail


def test_a_quantizer_with_no_fragile_input_or_a_moved_input_is_not_a_rounding_flip():
    x, w = _inputs()
    x[1, 2] = 15.0  # nothing near a boundary within the noise
    flip = _across(_trace(x, 1.0, w), _trace(x, 1.0, w, out_factor=1.01))
    assert not flip.explained and "none can flip" in flip.detail
    moved = x.clone()
    moved[0] += 0.5  # the input itself moved: the first diverging module is the one that made it
    flip = _across(_trace(x, 1.0, w), _trace(moved, 1.0, w))
    assert not flip.explained and "first diverging module norm" in flip.detail


def test_identical_traces_are_no_flip_and_say_why():
    x, w = _inputs()
    flip = _across(_trace(x, 1.0, w), _trace(x, 1.0, w))
    assert not flip.explained and "no module differs" in flip.detail


# ------------------------------------------ rounding flips between two engines on the same kernels


def _disagreeing(flip: R.Localisation | None,
                 failing: tuple[tuple[str, str], ...] = (("teacher-forced", "transformers"),),
                 prompts=("p0",)) -> R.Record:
    """The reference's record, failed against transformers on the same machine."""
    worst = {"delta": 0.07, "prompt": prompts[0], "position": 16}
    checks = [R.Check(kind=kind, against=against, ok=False, detail="exceeds bound",
                      data={"exceeding_prompts": list(prompts), "worst": worst} if kind == "teacher-forced" else
                      {"divergences": [{"prompt": p, "ok": False} for p in prompts]}) for kind, against in failing]
    rec = record(sequences=[seq()], computation=R.Computation(dtype="float32")).model_copy(
        update={"verdict": "failed", "checks": checks})
    return rec.model_copy(update={"localisation": [flip]}) if flip is not None else rec


def test_a_rounding_flip_between_two_engines_on_the_same_kernels_passes_and_says_so():
    checks, reason = judging.rounding_flip(_disagreeing(_flip()))
    assert all(c.ok for c in checks)
    assert "rounding flip at X" in reason and "effective weights equal to transformers's" in reason
    assert "largest move 0.07 at prompt p0 position 16" in reason


def test_a_disagreement_between_engines_needs_a_flip_shown_against_that_engine_on_its_failing_prompts():
    against_transformers = _flip()
    assert judging.rounding_flip(_disagreeing(None)) is None  # not localised
    assert judging.rounding_flip(_disagreeing(_flip(against="baseline"))) is None  # shown against the baseline, not transformers
    assert judging.rounding_flip(_disagreeing(_flip(explained=False))) is None
    assert judging.rounding_flip(_disagreeing(against_transformers, prompts=("p1",))) is None  # another prompt
    # a check a flip cannot move: the module diff, or accuracy
    assert judging.rounding_flip(_disagreeing(against_transformers, (("teacher-forced", "transformers"), ("module-diff", "reference")))) is None


def test_a_flip_between_engines_leaves_the_baseline_and_the_load_time_to_judge():
    """A disagreement with another engine is judged before the baseline is read (step 3), so once
    a rounding flip explains it the rest of the verdict order runs (judging.explain_flips, then the
    one judgement): a load over its bound is still regressed, a baseline of another engine version
    stale, and a cell within both passes with the baseline's checks in its record."""
    flip = _flip()
    cross = _disagreeing(flip).checks

    def settled(load_s, **provenance):
        rec = _disagreeing(flip).model_copy(update={"load": R.LoadInfo(seconds=load_s)})
        b = baseline(record(sequences=[seq()]), **provenance)
        gathered = evidence.gather(rec, b, bounds=BOUNDS, cross_engine_checks=cross, gate_load_time=True)
        assert judging.decide(gathered).verdict == "failed"
        assert judging.needs_localisation(gathered)
        return judging.decide(judging.explain_flips(gathered))

    slow = settled(2.0)
    assert slow.verdict == "regressed" and "load-time:baseline" in slow.reason and "rounding flip at X" in slow.reason
    assert settled(1.0, engine_version="0.31.0").verdict == "stale-baseline"
    clean = settled(1.0)
    assert clean.verdict == "pass" and "rounding flip at X" in clean.reason and all(c.ok for c in clean.checks)
    assert {"teacher-forced:transformers", "teacher-forced:baseline", "load-time:baseline"} <= {c.name for c in clean.checks}


def _across(base, fresh, element_noise=1e-5, fresh_weight=None):
    from harness.traces import diff, flips
    from harness.traces.noise import ModuleNoise

    noise = ModuleNoise(outputs={"norm": element_noise, "q": element_noise}, inputs={"q": element_noise},
                        measured_by="reference")
    if fresh_weight is not None:
        fresh.weights["q"] = fresh_weight
    deltas = [diff.prompt_deltas(fresh, base, noise)]
    return flips.explain_across([fresh], [base], noise, deltas, "transformers")


def test_across_engines_a_flip_is_explained_and_a_moved_output_or_another_weight_is_not():
    from harness.traces import weight_probe

    x, w = _inputs()
    moved = _across_the_boundary(x)
    flip = _across(_trace(x, 1.0, w), _trace(moved, 1.0, w))
    assert flip.explained, flip.detail
    (at,) = flip.at
    assert at.module == "q" and at.fragile == 1 and 0.99 < at.steps <= 1.0 + 1e-6 and at.moved <= at.bound
    off = _across(_trace(x, 1.0, w), _trace(moved, 1.0, w, out_factor=1.02))  # a 2% error in its own code
    assert not off.explained and "more than 4 one-step flips of its fragile input elements there" in off.detail
    other = w.clone()
    other[0, 0] += 0.5
    changed = _across(_trace(x, 1.0, w), _trace(moved, 1.0, w), fresh_weight=other @ weight_probe(w.shape[1]))
    assert not changed.explained and "q's effective weights differ from transformers's" in changed.detail


def test_an_input_recorded_in_rows_other_than_its_features_is_not_explained_and_raises_nothing():
    # Mllama's vision tiles: a 4-D input the traces flatten to tiles x (patches x features)
    x, w = _inputs()
    moved = _across_the_boundary(x)
    base, fresh = _trace(x, 1.0, w), _trace(moved, 1.0, w, out_factor=1.02)
    for t in (base, fresh):
        t.inputs["q"] = t.inputs["q"].reshape(1, -1)
    flip = _across(base, fresh)
    assert not flip.explained and "recorded as 1 rows of 24, not of its 8 input features" in flip.detail
