"""Accuracy gates (docs/design.md, "Accuracy"), without running an engine: the models.yaml schema of
tasks and gates, the statistics of the gates, the lm-eval model over a scripted engine, the checks
and their place in the verdict, and the accuracy baselines."""
import math
from pathlib import Path

import pytest

from harness import compare as C
from harness import judging
from harness import matrix
from harness import selection
from harness import records as R
from harness.accuracy import gates, store
from harness.engines.base import Checkpoint, Stop

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "harness" / "fixtures" / "assets" / "llama-tokenizer"

MATRIX = """
version: 1
environments:
  core:
    engines: {reference: "0.1.0", transformers: "5.19.0"}
defaults:
  max_tokens: 4
  top_k: 3
  timeout_s: 60
  bounds:
    unquantized: {logprob: 1.0e-4, topk: 1.0e-4, load_time: 1.5}
    bnb:         {logprob: 2.0e-3, topk: 2.0e-3, load_time: 1.5}
accuracy_tasks:
  choice:
    task: harness/accuracy/data/llama-choice.yaml
    metric: acc
    gate: GATE
  real:
    task: gsm8k
    metric: exact_match
    filter: strict-match
    num_fewshot: 5
    gate: {rel: 0.05}
models:
  llama:
    arch: LlamaForCausalLM
    fixture: llama
    prompts: fixture
    tier: cpu-tiny
    engines: {reference: core, transformers: core}
    accuracy: MODEL_TASKS
    schemes:
      unquantized:
      bnb-nf4:
        accuracy: []
"""


def load(gate="{test: two-proportion, alpha: 0.01}", tasks="[choice]"):
    return matrix.loads(MATRIX.replace("GATE", gate).replace("MODEL_TASKS", tasks), base_dir=ROOT)


# ------------------------------------------------------------------------------------ schema


def test_cells_carry_their_tasks_resolved_and_are_selected_by_the_accuracy_marker():
    cells = {c.id: c for c in load().cells()}
    (task,) = cells["llama.unquantized.reference"].accuracy
    assert task.name == "choice" and task.metric == "acc" and task.filter == "none"
    assert task.path == str(ROOT / "harness/accuracy/data/llama-choice.yaml")
    assert cells["llama.bnb-nf4.reference"].accuracy == ()  # a scheme's [] replaces the model's list
    assert "accuracy" in cells["llama.unquantized.reference"].markers
    assert [c.id for c in selection.select(cells.values(), "accuracy")] == [
        "llama.unquantized.reference", "llama.unquantized.transformers"]


def test_accuracy_engines_limit_which_engines_run_the_tasks():
    text = MATRIX.replace("GATE", "{abs: 0.1}").replace("MODEL_TASKS", "[choice]")
    m = matrix.loads(text.replace("      unquantized:\n", "      unquantized:\n        accuracy_engines: [reference]\n"), base_dir=ROOT)
    cells = {c.id: c for c in m.cells()}
    assert cells["llama.unquantized.reference"].accuracy and not cells["llama.unquantized.transformers"].accuracy
    with pytest.raises(matrix.MatrixError, match=r"models\.llama\.schemes\.unquantized\.accuracy_engines\[0\]: 'vllm' is not one of this cell's engines"):
        matrix.loads(text.replace("      unquantized:\n", "      unquantized:\n        accuracy_engines: [vllm]\n"), base_dir=ROOT)


@pytest.mark.parametrize("gate, tasks, error", [
    ("{abs: 0.1, rel: 0.1}", "[choice]", "accuracy_tasks.choice.gate: a gate needs exactly one of abs, rel, test (found: abs, rel)"),
    ("{test: two-proportion}", "[choice]", "accuracy_tasks.choice.gate: alpha goes with test"),
    ("{test: wilson, alpha: 0.7}", "[choice]", "accuracy_tasks.choice.gate.alpha: must be less than 0.5 (got 0.7)"),
    ("{abs: 0.1}", "[nope]", "models.llama.accuracy[0]: accuracy task 'nope' is not defined under accuracy_tasks (defined: choice, real)"),
])
def test_bad_tasks_are_one_line_errors(gate, tasks, error):
    with pytest.raises(matrix.MatrixError) as e:
        load(gate, tasks)
    assert str(e.value).startswith(f"models.yaml: {error}") and "\n" not in str(e.value)


def test_a_statistical_gate_needs_a_proportion_and_a_local_task_must_exist():
    text = MATRIX.replace("GATE", "{abs: 0.1}").replace("MODEL_TASKS", "[choice]")
    with pytest.raises(matrix.MatrixError, match=r"accuracy_tasks\.real: .*statistical gate \(wilson\) needs a proportion metric"):
        matrix.loads(text.replace("metric: exact_match", "metric: bits_per_byte").replace("{rel: 0.05}", "{test: wilson, alpha: 0.01}"),
                     base_dir=ROOT)
    # a task YAML in the repo is checked for the cells a run selects (harness run exits 2), as local checkpoints are
    m = matrix.loads(text.replace("llama-choice.yaml", "missing.yaml"), base_dir=ROOT)
    with pytest.raises(matrix.MatrixError, match=r"accuracy_tasks\.choice\.task: cannot read the task YAML .*missing\.yaml"):
        matrix.check_paths(m, m.cells())
    matrix.check_paths(load(), load().cells())


def test_models_yaml_declares_tiny_tasks_for_cpu_tiny_and_real_ones_for_gpu_full():
    cells = matrix.load().cells(tier=None)
    by_tier: dict[str, set[str]] = {}
    for c in cells:
        for t in c.accuracy:
            by_tier.setdefault(c.tier, set()).add(t.name)
            assert (t.path is not None) == (c.tier == "cpu-tiny"), c.id  # offline tasks on CPU, lm-eval's own on GPU
    assert by_tier.get("gpu-full") == {"gsm8k-5shot"}


# ------------------------------------------------------------------------------------ statistics


def test_two_proportion_and_wilson_match_textbook_values():
    # 60/100 vs 45/100: z = 2.124, p = 0.0337
    assert gates.two_proportion_p(0.60, 100, 0.45, 100) == pytest.approx(0.0337, abs=2e-4)
    assert gates.two_proportion_p(0.5, 100, 0.5, 100) == 1.0
    assert gates.two_proportion_p(1.0, 50, 1.0, 80) == 1.0 and gates.two_proportion_p(1.0, 50, 0.0, 50) < 1e-9
    lo, hi = gates.wilson_interval(0.5, 100, 0.05)
    assert (lo, hi) == (pytest.approx(0.4038, abs=1e-4), pytest.approx(0.5962, abs=1e-4))


def test_mcnemar_is_the_paired_rule_on_the_samples_that_moved():
    assert gates.mcnemar_p(0, 0) == 1.0 and gates.mcnemar_p(3, 3) == 1.0
    assert gates.mcnemar_p(8, 0) == pytest.approx(2 / 2 ** 8) and gates.mcnemar_p(6, 0) > 0.01
    gold = [1.0] * 36 + [0.0] * 4
    lost8 = [0.0] * 8 + [1.0] * 28 + [0.0] * 4
    # 8 of 40 samples lost: the two-proportion test at n=40 sees nothing, the paired rule does
    assert gates.within_gate({"test": "two-proportion", "alpha": 0.01}, 0.7, 40, 0.9, 40)[0]
    ok, found, _ = gates.within_gate({"test": "mcnemar", "alpha": 0.01}, 0.7, 40, 0.9, 40, lost8, gold)
    assert not ok and found.startswith("McNemar test p=0.00781 on 8 lost and 0 gained of 40 samples")
    ok, found, _ = gates.within_gate({"test": "mcnemar", "alpha": 0.01}, 0.7, 40, 0.9, 40)
    assert ok and found.endswith("(no per-sample values on both sides for McNemar)")


@pytest.mark.parametrize("gate, value, ok", [
    ({"abs": 0.02}, 0.79, True), ({"abs": 0.02}, 0.77, False),
    ({"rel": 0.05}, 0.765, True), ({"rel": 0.05}, 0.75, False),
    ({"test": "two-proportion", "alpha": 0.01}, 0.75, True), ({"test": "two-proportion", "alpha": 0.01}, 0.60, False),
    ({"test": "wilson", "alpha": 0.01}, 0.75, True), ({"test": "wilson", "alpha": 0.01}, 0.68, False),
])
def test_gates_are_two_sided_rules_on_the_value(gate, value, ok):
    assert gates.within_gate(gate, value, 200, 0.8, 200)[0] is ok
    assert gates.within_gate(gate, 1.6 - value, 200, 0.8, 200)[0] is ok  # as far above the baseline


# ------------------------------------------------------------------------- the lm-eval model


class ScriptedEngine:
    """An engine whose logprob of token t after any prefix is -t/100 and whose top-1 is token 300;
    greedy decoding emits the ids in ``script`` and honours a Stop."""

    def __init__(self, script=(), rows_alone=True):
        self.script = list(script)
        self.scored: list[list[int]] = []
        self._rows_alone = rows_alone
        self.batch_tokens: set[int] = set()

    def rows_alone(self, checkpoint):
        return self._rows_alone

    def teacher_forced(self, prompts, sequences, top_k, batch_tokens=0):
        self.batch_tokens.add(batch_tokens)
        out = []
        for seq in sequences:
            self.scored.append(list(seq))
            out.append(R.Scored(tokens=list(seq), logprobs=[-t / 100 for t in seq[1:]],
                                topk=[[(300, -0.1)] for _ in seq[1:]]))
        return out

    def greedy(self, prompts, max_tokens, top_k, stop=None, batch_tokens=0):
        self.batch_tokens.add(batch_tokens)
        out = []
        for _ in prompts:
            tokens = []
            for t in self.script[:max_tokens]:
                tokens.append(t)
                if stop is not None and stop.reached(tokens):
                    break
            out.append(R.Greedy(tokens=tokens, topk=[[(t, -0.1), (1, -0.9)] for t in tokens]))
        return out


class Request:
    def __init__(self, *args):
        self.args = args


def harness_lm(engine):
    from harness.accuracy.lmeval import make_lm

    return make_lm(engine, Checkpoint(TOKENIZER))


def test_loglikelihood_sums_the_continuation_and_reports_whether_it_is_greedy():
    engine = ScriptedEngine()
    lm = harness_lm(engine)
    tok = lm.tokenizer
    ctx, cont = tok("hello", add_special_tokens=False)["input_ids"], tok(" world", add_special_tokens=False)["input_ids"]
    (ll, greedy), (ll2, _) = lm.loglikelihood([Request("hello", " world"), Request("hello", " world")])
    assert ll == pytest.approx(-sum(cont) / 100) and ll2 == ll and greedy is False
    assert engine.scored == [[tok.bos_token_id, *ctx, *cont]]  # BOS once, each sequence scored once


def test_loglikelihood_rolling_covers_every_token_once():
    engine = ScriptedEngine()
    lm = harness_lm(engine)
    text = " ".join(f"w{i}" for i in range(120))  # no repeated window (those are scored once)
    ids = lm.tok_encode(text)
    lm._max_length = 32
    (total,) = lm.loglikelihood_rolling([Request(text)])
    assert total == pytest.approx(-sum(ids) / 100)
    assert len(engine.scored) == math.ceil(len(ids) / 31) and all(len(s) <= 32 for s in engine.scored)


def test_generate_until_stops_on_the_string_and_cuts_the_text_there():
    lm = harness_lm(ScriptedEngine())
    ids = lm.tok_encode("ab;cd;ef")
    lm.engine.script = ids
    (text,) = lm.generate_until([Request("x", {"until": [";"], "max_gen_toks": 10})])
    assert text == "ab"
    stop = Stop(strings=(";",), token_ids=(lm.eot_token_id,), decode=lm.tok_decode)
    assert not stop.reached(lm.tok_encode("ab")) and stop.reached(lm.tok_encode("ab;"))
    assert stop.reached([lm.eot_token_id])
    with pytest.raises(ValueError, match="greedily only"):
        lm.generate_until([Request("x", {"until": [";"], "do_sample": True, "temperature": 0.7})])


@pytest.mark.parametrize("rows_alone", [True, False])
def test_sequences_are_batched_only_where_each_row_is_computed_alone(rows_alone):
    """A cell whose activation scales span tokens (Engine.rows_alone) scores one sequence a pass."""
    from harness.accuracy.lm import BATCH_TOKENS

    lm = harness_lm(ScriptedEngine(script=[5], rows_alone=rows_alone))
    lm.loglikelihood([Request("hello", " world")])
    lm.generate_until([Request("x", {"until": [";"], "max_gen_toks": 2})])
    assert lm.engine.batch_tokens == ({BATCH_TOKENS} if rows_alone else {0})


# ------------------------------------------------------------------------------ checks, verdict


def acc(value, task="choice", samples=200, items=None, task_hash="h1", gate=None):
    return R.Accuracy(task=task, lm_eval_task="t", metric="acc", filter="none", value=value, stderr=0.02,
                      samples=samples, task_hash=task_hash, gate=gate or {"test": "two-proportion", "alpha": 0.01},
                      items=items, seconds=1.0)


def record(engine="reference", accuracy=()):
    seq = R.SequenceResult(prompt=R.PromptRef(id="p0", kind="text"), prompt_tokens=[1, 2],
                           scored=R.Scored(tokens=[1, 2, 3], logprobs=[-1.0, -2.0], topk=[[(2, -1.0)], [(3, -2.0)]]),
                           greedy=R.Greedy(tokens=[3], topk=[[(3, -2.0)]]))
    info = R.EngineInfo(name=engine, version="0.1.0" if engine == "reference" else "5.19.0", platform="cpu-x86_64-avx512")
    return R.Record(cell=f"llama.unquantized.{engine}", model="llama", scheme="unquantized", engine=engine,
                    tier="cpu-tiny", fixture=R.FixtureRef(name="llama-unquantized", identity="i"), engine_info=info,
                    status="ok", sequences=[seq], load=R.LoadInfo(seconds=0.1), accuracy=list(accuracy),
                    computation=R.Computation(dtype="float32"), started_at=R.utc_now(), duration_s=1.0)


def stored(tmp_path, rec):
    from harness import baselines as B

    j = C.Judgement("pass", "ok").apply(rec)
    B.update(tmp_path, j, commit="c")
    store.handle(tmp_path, j, update_baselines=True)
    return B.read(tmp_path, "cpu-tiny", rec.cell), store.read(tmp_path, "cpu-tiny", rec.cell)


def verdict_of(rec, baseline, acc_baseline, others=(), unfused=None):
    cell = {c.id: c for c in load().cells()}[rec.cell]
    return judging.judge(cell, rec, baseline, others, accuracy_baseline=acc_baseline, unfused=unfused)


def test_accuracy_joins_the_verdict(tmp_path):
    base, acc_base = stored(tmp_path, record(accuracy=[acc(0.80, items=[1.0] * 160 + [0.0] * 40)]))
    assert store.path_for(tmp_path, "cpu-tiny", "llama.unquantized.reference").exists()
    assert acc_base.tasks["choice"].value == 0.80 and acc_base.tasks["choice"].samples == 200

    j = verdict_of(record(accuracy=[acc(0.79, items=[1.0] * 158 + [0.0] * 42)]), base, acc_base)
    assert j.verdict == "pass", j.reason
    c = next(c for c in j.checks if c.name == "accuracy/choice:baseline")
    assert c.ok and "2 of 200 samples differ (2 lost, 0 gained)" in c.detail

    j = verdict_of(record(accuracy=[acc(0.62)]), base, acc_base)
    assert j.verdict == "regressed" and j.reason.startswith("accuracy/choice:baseline: outside the gate")

    j = verdict_of(record(accuracy=[acc(0.80, task_hash="h2")]), base, acc_base)
    assert j.verdict == "stale-baseline" and "accuracy task choice changed since its baseline" in j.reason

    j = verdict_of(record(accuracy=[acc(0.80)]), base, None)
    assert j.verdict == "missing-baseline" and "no accuracy baseline for choice" in j.reason
    assert any(c.name == "teacher-forced:baseline" for c in j.checks)  # the logprob checks still ran

    # across fusion (transformers does not fuse) only where the unfused witness equals the reference
    mine, other = record(accuracy=[acc(0.80)]), record("transformers", accuracy=[acc(0.60)])
    j = verdict_of(mine, base, acc_base, [other], unfused=record())
    assert j.verdict == "failed" and j.reason.startswith("accuracy/choice:transformers: outside the gate")
    moved = record()
    moved.sequences[0].scored.logprobs[0] = -1.5  # fusing changed the numerics: no accuracy comparison
    j = verdict_of(mine, base, acc_base, [other], unfused=moved)
    assert not any(c.name.startswith("accuracy/choice:transformers") for c in j.checks)


def test_accuracy_from_other_kernels_is_judged_only_where_the_computation_carries(tmp_path):
    """The accuracy baseline's own kernels decide, not the logprob baseline's: a kind that recorded
    its logprob baseline but not its accuracy one still shows that accuracy, not judged."""
    xeon = R.CpuInfo(vendor="GenuineIntel", model="Xeon", flags=["avx2", "avx512f"], capability="avx512")
    epyc = xeon.model_copy(update={"vendor": "AuthenticAMD", "model": "EPYC"})

    def on(cpu, value, computation=R.Computation(dtype="float32")):
        r = record(accuracy=[acc(value)])
        return r.model_copy(update={"engine_info": r.engine_info.model_copy(update={"cpu": cpu}), "computation": computation})

    base, _ = stored(tmp_path / "here", on(epyc, 0.80))
    _, acc_elsewhere = stored(tmp_path / "there", on(xeon, 0.80))
    fp8 = R.Computation(dtype="float32", quantized_activations=["input"])
    j = verdict_of(on(epyc, 0.62, fp8), base, acc_elsewhere)
    assert j.verdict == "portable-pass" and "accuracy against its baseline not judged: the baseline is from other kernels" in j.reason
    c = next(c for c in j.checks if c.name == "accuracy/choice:baseline")
    assert c.ok and c.detail.startswith("not judged: ") and c.data["within_bounds"] is False
    assert next(c for c in j.checks if c.name == "teacher-forced:baseline").data.get("judged", True)
    assert verdict_of(on(epyc, 0.62), base, acc_elsewhere).verdict == "regressed"  # float32 carries


def test_accuracy_baselines_are_refused_like_any_baseline(tmp_path):
    rec = C.Judgement("failed", "x").apply(record(accuracy=[acc(0.8)]))
    out = store.handle(tmp_path, rec, update_baselines=True)
    assert not out.written and "refusing" in out.messages[0]
    assert store.read(tmp_path, "cpu-tiny", rec.cell) is None
    path = store.path_for(tmp_path, "cpu-tiny", rec.cell)
    path.parent.mkdir(parents=True)
    path.write_text("{")
    from harness.baselines import BaselineError

    with pytest.raises(BaselineError, match=r"accuracy/llama\.unquantized\.reference\.json: not JSON"):
        store.read(tmp_path, "cpu-tiny", rec.cell)


def test_the_report_and_the_annotation_show_accuracy_next_to_the_verdicts(tmp_path, capsys):
    from harness import cli

    base, acc_base = stored(tmp_path / "b", record(accuracy=[acc(0.80)]))
    j = verdict_of(record(accuracy=[acc(0.62)]), base, acc_base)
    R.save(tmp_path / "r" / "llama.unquantized.reference.json", j.apply(record(accuracy=[acc(0.62)])))
    assert cli.main(["report", str(tmp_path / "r"), "-o", str(tmp_path / "out")]) in (0, 1)
    annotation = (tmp_path / "out" / "annotation.md").read_text()
    assert "| `llama.unquantized.reference` | choice | acc,none | 0.62 ± 0.02 \\(n=200\\) | ❌ baseline |" in annotation
    html = (tmp_path / "out" / "report.html").read_text()
    assert "Accuracy (lm-eval, on this engine)" in html and "✗ baseline (0.8)" in html
