"""Module traces and first-diverging-module localisation (harness.traces; docs/design.md,
"Localisation").

The five faults of issue 14, each injected into the reference's reading of the checkpoint or into
its modules after loading (harness.hooks.faults), never into the recording: each is localised
to its module, on the reference against transformers (which reads the clean checkpoint) and
against the fingerprint of the clean reference; a clean run names none. Then the rule on
synthetic differences, the fingerprint's format, and the runner end to end: a failed cell is
localised against the other engine and against its committed baseline's fingerprint.
"""
import functools
import json

import pytest

from harness import baselines as B
from harness import cli
from harness import matrix as M
from harness import files
from harness import records as R
from harness.hooks import faults
from harness.engines import base
from harness.engines.reference import ReferenceEngine
from harness.engines.transformers import TransformersEngine
from harness.quant import fp8
from harness.quant.source import TensorSource
from harness.traces import diff
from harness.traces import fingerprint as F
from harness.traces.localise import Delta, PromptDeltas, localise

CONTINUATION = [5, 6, 7, 8]  # scored after each prompt: the localisation needs no greedy run


@functools.cache
def _cells() -> dict:
    return {c.id: c for c in M.load().cells(tier="cpu-tiny")}


def _trace(engine, ckpt, after_load=None):
    engine.load(ckpt)
    if after_load is not None:
        after_load(engine)
    prompts = base.prompts_for(engine.cell, ckpt)
    try:
        return engine.trace(prompts, [p.tokens + CONTINUATION for p in prompts])
    finally:
        engine.close()


@functools.cache
def clean(model: str, scheme: str):
    """(checkpoint, transformers' traces, the clean reference's fingerprint) of a group."""
    cells = _cells()
    ref = cells[f"{model}.{scheme}.reference"]
    ckpt = base.resolve_checkpoint(ref)
    tf = _trace(TransformersEngine(cells[f"{model}.{scheme}.transformers"]), ckpt)
    fp = F.make(_trace(ReferenceEngine(ref), ckpt), "reference", True)
    return ckpt, tf, fp


@pytest.fixture
def fault(monkeypatch):
    """Installs a fault (harness.hooks.faults) for one test: what it patches is restored after."""
    monkeypatch.setattr(TensorSource, "get", TensorSource.get)
    monkeypatch.setattr(fp8, "_read_scale", fp8._read_scale)
    return faults.install


def localised(model: str, scheme: str, after_load=None) -> tuple[R.Localisation, R.Localisation]:
    """The reference (faulted when a fault is installed) against transformers and against the
    clean reference's fingerprint."""
    ckpt, tf, fp = clean(model, scheme)
    ref = _cells()[f"{model}.{scheme}.reference"]
    unfused = _trace(ReferenceEngine(ref, {"fuse": False}), ckpt, after_load)  # as transformers executes
    fused = _trace(ReferenceEngine(ref), ckpt, after_load)  # as the baseline's reference executed
    return (diff.cross_engine(unfused, tf, "transformers"),
            localise(F.deltas(fp, fused), "baseline"))


FAULTS = [
    pytest.param("llama", "fp8-static-kv", "tensor-scaled:model.layers.3.self_attn.k_proj.weight_scale:1.5",
                 {"model.layers.3.self_attn.k_proj"}, "weights", id="fp8-projection-wrong-scale"),
    pytest.param("mllama", "bnb-nf4", "tensors-swapped:language_model.model.layers.3.cross_attn.k_proj."
                                      ":language_model.model.layers.3.cross_attn.v_proj.",
                 {"model.language_model.layers.3.cross_attn.k_proj", "model.language_model.layers.3.cross_attn.v_proj"},
                 "weights", id="cross-attention-kv-swapped"),
    pytest.param("llama", "bnb-nf4", "mask-shifted:model.layers.3.self_attn",
                 {"model.layers.3.self_attn"}, "attention", id="attention-mask-off-by-one"),
    pytest.param("llama", "fp8-static-kv", "fp8-scale-dropped:model.layers.3.self_attn.k",
                 {"model.layers.3.self_attn"}, "attention", id="kv-cache-scale-dropped"),
    pytest.param("whisper", "fp8-static-kv", "fp8-scale-dropped:model.decoder.layers.1.encoder_attn.k",
                 {"model.decoder.layers.1.encoder_attn"}, "attention", id="cross-attention-kv-cache-scale-dropped"),
    pytest.param("llama", "bnb-nf4", "tensor-scaled:model.layers.3.mlp.down_proj.weight.absmax:2",
                 {"model.layers.3.mlp.down_proj"}, "weights", id="bnb-absmax-corrupted"),
    pytest.param("llama", "bnb-nf4", "output-scaled:model.layers.3.mlp.down_proj:1.02",
                 {"model.layers.3.mlp.down_proj"}, "kernel", id="matmul-output-off-by-2-percent"),
]


@pytest.mark.parametrize("model, scheme, spec, modules, kind", FAULTS)
def test_each_fault_is_localised_to_its_module(fault, model, scheme, spec, modules, kind):
    clean(model, scheme)  # before the fault
    after_load = fault(spec)
    for loc in localised(model, scheme, after_load):
        assert loc.module in modules, loc.detail
        assert loc.kind == kind, loc.detail
        assert loc.delta > loc.noise
        assert [s.module for s in loc.path].count(loc.module) == 1


@pytest.mark.parametrize("model, scheme", [("llama", "fp8-static-kv"), ("llama", "bnb-nf4"), ("mllama", "bnb-nf4"),
                                           ("whisper", "fp8-static-kv")])
def test_a_clean_run_names_no_module(model, scheme):
    for loc in localised(model, scheme):
        assert loc.module is None, loc.detail
        assert loc.detail.startswith("no module differs beyond its noise")


def test_hooks_are_removed_after_recording():
    ckpt, _, _ = clean("llama", "bnb-nf4")
    engine = ReferenceEngine(_cells()["llama.bnb-nf4.reference"])
    engine.load(ckpt)
    prompts = base.prompts_for(engine.cell, ckpt)[:1]
    engine.trace(prompts, [prompts[0].tokens])
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in engine.model.modules())


def test_a_fused_projection_is_recorded_as_its_checkpoint_shards():
    """The reference fuses Mllama's cross-attention k/v into one matmul; the trace splits it back."""
    _, _, fp = clean("mllama", "bnb-nf4")
    names = [r.module for r in fp.modules]
    assert "model.language_model.layers.3.cross_attn.k_proj" in names
    assert not any(n.endswith("cross_kv_proj") for n in names)


# ------------------------------------------------------------------------------- the rule


def _deltas(order, moved=(), inputs_moved=(), weights_moved=(), quantizers=()):
    outputs = {n: Delta(1.0 if n in moved else 0.0, 0.5, 0 if n in moved else None, scale=1.0) for n in order}
    inputs = {n: Delta(1.0 if n in inputs_moved else 0.0, 0.5) for n in order if n.endswith("_proj")}
    weights = {n: n in weights_moved for n in order if n.endswith("_proj")}
    return PromptDeltas("p0", list(order), outputs, inputs, weights, set(quantizers))


LAYER = ["", "model", "model.layers.0", "model.layers.0.self_attn", "model.layers.0.self_attn.q_proj",
         "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj", "model.layers.0.self_attn.o_proj",
         "model.layers.0.mlp", "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"]
AFTER_K = {"", "model", "model.layers.0", "model.layers.0.self_attn", "model.layers.0.self_attn.k_proj",
           "model.layers.0.self_attn.o_proj", "model.layers.0.mlp", "model.layers.0.mlp.up_proj",
           "model.layers.0.mlp.down_proj"}


@pytest.mark.parametrize("weights_moved, quantizers, kind", [
    ({"model.layers.0.self_attn.k_proj"}, (), "weights"),
    ((), ("model.layers.0.self_attn.k_proj",), "quantizer"),
    ((), (), "kernel"),
])
def test_a_leaf_with_equal_inputs_is_weights_quantizer_or_kernel(weights_moved, quantizers, kind):
    loc = localise([_deltas(LAYER, AFTER_K, weights_moved=weights_moved, quantizers=quantizers)], "x")
    assert (loc.module, loc.kind) == ("model.layers.0.self_attn.k_proj", kind)


def test_an_output_projection_whose_input_moved_names_its_attention():
    moved = AFTER_K - {"model.layers.0.self_attn.k_proj"}
    loc = localise([_deltas(LAYER, moved, inputs_moved={"model.layers.0.self_attn.o_proj"})], "x")
    assert (loc.module, loc.kind) == ("model.layers.0.self_attn", "attention")


def test_a_module_whose_submodules_all_agree_is_its_own_code():
    loc = localise([_deltas(LAYER, {"", "model", "model.layers.0"})], "x")
    assert (loc.module, loc.kind) == ("model.layers.0", "code")


def test_the_earliest_module_over_all_prompts_is_named():
    late = _deltas(LAYER, {"", "model", "model.layers.0", "model.layers.0.mlp", "model.layers.0.mlp.up_proj"},
                   weights_moved={"model.layers.0.mlp.up_proj"})
    early = _deltas(LAYER, AFTER_K, weights_moved={"model.layers.0.self_attn.k_proj"})
    early.prompt = "p1"
    loc = localise([late, early], "x")
    assert (loc.prompt, loc.module) == ("p1", "model.layers.0.self_attn.k_proj")


def test_a_difference_within_the_noise_is_none():
    p = _deltas(LAYER)
    p.outputs["model.layers.0.mlp.down_proj"] = Delta(0.4, 0.5)
    assert localise([p], "x").module is None


def test_against_other_kernels_a_difference_at_the_noise_is_passed_over_for_the_fault_after_it():
    p = _deltas(LAYER, AFTER_K - {"model.layers.0.self_attn.k_proj"}, inputs_moved={"model.layers.0.self_attn.o_proj"})
    for deltas in (p.outputs, p.inputs):
        deltas.update({n: Delta(d.delta, 0.01, d.position, d.scale) for n, d in deltas.items()})  # a fault: 100x
    p.outputs["model.layers.0.self_attn.q_proj"] = Delta(5.03e-4, 5.01e-4)  # issue 31's AVX2 EPYC
    assert localise([p], "baseline").module == "model.layers.0.self_attn.q_proj"
    loc = localise([p], "baseline", margin=10)
    assert (loc.module, loc.kind) == ("model.layers.0.self_attn", "attention")
    assert "from other kernels: a module differs beyond 10 x its noise" in loc.detail


def test_a_loaded_state_that_differs_is_named_before_any_output():
    # a flip in an earlier module moves every output after it; the loaded state is exact on any kernel
    p = _deltas(LAYER, AFTER_K | {"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"},
                weights_moved={"model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"})
    p.outputs["model.layers.0.self_attn.v_proj"] = Delta(0.3, 0.001, scale=1.0)
    p.outputs["model.layers.0.self_attn.k_proj"] = Delta(0.9, 0.001, scale=1.0)
    loc = localise([p], "baseline", changed_state=["model.layers.0.self_attn.qkv_proj"])  # fused: its shards are traced
    assert (loc.module, loc.kind) == ("model.layers.0.self_attn.k_proj", "weights")
    assert "the loaded state of model.layers.0.self_attn.qkv_proj differs from the baseline's" in loc.detail
    loc = localise([p], "baseline", changed_state=["model.layers.0.mlp.down_proj", "model.layers.0.self_attn"])
    assert (loc.module, loc.kind) == ("model.layers.0.self_attn", "attention")  # its k_scale: the earlier


# ------------------------------------------------------------------------------ the format


def test_the_fingerprint_is_a_few_tens_of_kilobytes_and_survives_its_text():
    _, _, fp = clean("llama", "fp8-static-kv")
    text = files.render_json(fp.model_dump())
    assert len(text.encode()) < 64_000
    assert F.Fingerprint.model_validate_json(text) == fp
    rows = [line for line in text.splitlines() if line.lstrip().startswith('{"module"')]
    assert len(rows) == len(fp.modules) and all(len(line) < 400 for line in rows)  # one reviewable line per module


def test_rounding_to_stored_digits_is_within_half_a_unit():
    for v in (1.23456, -0.000987654, 12345.678):
        assert abs(F.rounded([v])[0] - v) <= F.half_unit(F.rounded([v])[0])


def test_a_baseline_keeps_its_fingerprint_only_while_its_results_are_unchanged(tmp_path):
    rec = R.Record.for_cell(_cells()["llama.bnb-nf4.reference"], engine_info=R.EngineInfo(
        name="reference", version="0", platform="cpu-x86_64"), sequences=[R.SequenceResult(
            prompt=R.PromptRef(id="p0", kind="text"), prompt_tokens=[1], scored=R.Scored(tokens=[1, 2], logprobs=[-1.0],
                                                                                       topk=[[(2, -1.0)]]),
            greedy=R.Greedy(tokens=[2], topk=[[(2, -1.0)]]))], load=R.LoadInfo(seconds=1.0), verdict="pass")
    B.update(tmp_path, rec, commit="c")
    fp = F.Fingerprint(engine="reference", fused=True, prompts=["p0"],
                       modules=[F.ModuleRow(module="lm_head", noise=[0.0, 0.0], out=[[1.0, 2.0, 3.0, 4.0]])])
    assert "added" in B.set_fingerprint(tmp_path, rec.tier, rec.cell, fp)
    assert "unchanged" in B.set_fingerprint(tmp_path, rec.tier, rec.cell, fp)
    B.update(tmp_path, rec.model_copy(update={"verdict": "regressed"}), commit="d")
    assert B.read(tmp_path, rec.tier, rec.cell).fingerprint == fp
    moved = rec.sequences[0].model_copy(update={"scored": R.Scored(tokens=[1, 2], logprobs=[-2.0], topk=[[(2, -2.0)]])})
    change = B.update(tmp_path, rec.model_copy(update={"sequences": [moved]}), commit="e")
    assert B.read(tmp_path, rec.tier, rec.cell).fingerprint is None
    assert any("trace fingerprint dropped" in m for m in change.messages)


# ------------------------------------------------------------------------------ end to end


WHISPER_FP8_STATIC_KV = ["whisper.fp8-static-kv.reference", "whisper.fp8-static-kv.transformers"]


def _run_with_a_dropped_k_scale(tmp_path, monkeypatch, capsys) -> tuple[int, str]:
    """``harness run`` of the Whisper fp8-static-kv cells against copies of their committed
    baselines, the reference reading one cross-attention's k_scale as 1.0: (exit code, stdout)."""
    baselines = tmp_path / "baselines"
    (baselines / "cpu-tiny").mkdir(parents=True)
    for c in WHISPER_FP8_STATIC_KV:
        (baselines / "cpu-tiny" / f"{c}.json").write_bytes(B.path_for(B.DEFAULT_ROOT, "cpu-tiny", c).read_bytes())
    monkeypatch.setenv("HARNESS_TEST_HOOK", "fault=fp8-scale-dropped:model.decoder.layers.1.encoder_attn.k@*.reference")
    code = cli.main(["run", "-k", " or ".join(WHISPER_FP8_STATIC_KV), "--baselines", str(baselines),
                     "--results", str(tmp_path / "r"), "-j", "1"])
    return code, capsys.readouterr().out


@pytest.mark.slow("a harness run of two faulted Whisper FP8 cells, then traced re-runs of both engines")
def test_a_failed_cell_is_localised_against_the_other_engine_and_its_baseline(tmp_path, monkeypatch, capsys):
    """The runner re-runs the failed cells' engines with tracing; the committed baselines of the
    Whisper fp8-static-kv cells carry fingerprints (and the per-module noise the comparison uses).
    The fault: the reference reads one cross-attention's k_scale as 1.0."""
    cells = WHISPER_FP8_STATIC_KV
    for c in cells:
        assert B.read(B.DEFAULT_ROOT, "cpu-tiny", c).fingerprint is not None, f"{c}: harness run --update-fingerprints"
    code, out = _run_with_a_dropped_k_scale(tmp_path, monkeypatch, capsys)
    assert code == 1, out
    ref = R.load(tmp_path / "r" / f"{cells[0]}.json")
    assert ref.verdict == "failed"
    by_against = {loc.against: loc for loc in ref.localisation}
    assert set(by_against) == {"transformers", "baseline"}
    for loc in by_against.values():
        assert (loc.module, loc.kind) == ("model.decoder.layers.1.encoder_attn", "attention"), loc.detail
    assert "noise: whisper.fp8-static-kv.transformers's baseline fingerprint" in by_against["transformers"].detail
    tf = R.load(tmp_path / "r" / f"{cells[1]}.json")
    to_reference, to_baseline = tf.localisation
    assert (to_reference.against, to_reference.module) == ("reference", "model.decoder.layers.1.encoder_attn")
    # the clean cell against its own baseline names no module; only on other kernels than the
    # baseline's (an AVX512-BF16 EPYC against the Xeon's) may it name one, and says so
    assert to_baseline.against == "baseline"
    assert to_baseline.module is None or "from other kernels" in to_baseline.detail, to_baseline.detail
    assert "localisation against transformers: first diverging module model.decoder.layers.1.encoder_attn" in out
    html = (tmp_path / "r" / "report" / "report.html").read_text()
    assert "Localisation by module traces" in html and "◀ first diverging" in html


def test_a_bug_in_localisation_costs_its_explanation_not_the_verdict_or_the_run(tmp_path, monkeypatch, capsys):
    """A localisation that raises (here against the baseline) is recorded as failed, with the
    error; the cell keeps its verdict, the other localisation stands, and the run goes on."""
    from harness.traces import jobs

    def broken(*args, **kwargs):
        raise IndexError("too many indices for tensor of dimension 4\nsecond line")

    monkeypatch.setattr(jobs, "against_fingerprint", broken)
    cells = WHISPER_FP8_STATIC_KV
    code, out = _run_with_a_dropped_k_scale(tmp_path, monkeypatch, capsys)
    assert code == 1, out
    ref = R.load(tmp_path / "r" / f"{cells[0]}.json")
    assert ref.verdict == "failed", ref.verdict_reason
    by_against = {loc.against: loc for loc in ref.localisation}
    assert by_against["transformers"].module == "model.decoder.layers.1.encoder_attn"
    assert by_against["baseline"].module is None
    assert by_against["baseline"].detail == ("localisation failed (a harness bug; the verdict stands without it): "
                                             "IndexError: too many indices for tensor of dimension 4")
    tf = {loc.against: loc for loc in R.load(tmp_path / "r" / f"{cells[1]}.json").localisation}
    assert tf["reference"].module == "model.decoder.layers.1.encoder_attn"
    assert tf["baseline"].detail.startswith("localisation failed (a harness bug"), tf["baseline"].detail


@pytest.mark.slow("a harness run of a Whisper fp8-static-kv cell with --update-fingerprints")
def test_a_fingerprint_is_written_only_from_the_baselines_own_kernels(tmp_path, capsys):
    """--update-fingerprints on a run from other kernels than the baseline's leaves the baseline's
    fingerprint as it was and says why: localisation compares a fingerprint as the traces of the
    baseline's kernels."""
    cell = WHISPER_FP8_STATIC_KV[0]
    baselines = tmp_path / "baselines"
    path = baselines / "cpu-tiny" / f"{cell}.json"
    path.parent.mkdir(parents=True)
    data = json.loads(B.path_for(B.DEFAULT_ROOT, "cpu-tiny", cell).read_text())
    data["provenance"]["cpu"] = {"vendor": "AuthenticAMD", "model": "Another EPYC", "capability": "avx2",
                                 "flags": ["avx2"], "kernel_env": {}}
    path.write_text(json.dumps(data, indent=2))
    before = path.read_text()
    code = cli.main(["run", "-k", cell, "--baselines", str(baselines), "--results", str(tmp_path / "r"),
                     "--update-fingerprints"])
    out = capsys.readouterr().out
    # a static-FP8 cell on other kernels is judged by what carries
    assert code == 0 and R.load(tmp_path / "r" / f"{cell}.json").verdict == "portable-pass", out
    assert f"{path}: fingerprint not written: only a cell run on its baseline's own kernels is" in out
    assert path.read_text() == before
