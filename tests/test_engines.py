"""The engine interface, in-process: the reference and transformers engines produce the same record
shape from the same methods, score given sequences, probe before loading, and turn failures into
records. (The child process, timeouts and hooks: tests/test_runner.py.)"""
import json

import pytest

from harness import matrix as M
from harness import records as R
from harness.engines import base, execute
from harness.engines.reference import ReferenceEngine
from harness.engines.transformers import TransformersEngine
from harness.engines.worker import parse_hooks
from harness.registry import fuses_shards


@pytest.fixture(scope="module")
def cells():
    m = M.load()
    return {c.id: c for c in m.cells(tier="cpu-tiny")}


def _cell(cells, cell_id, **update):
    c = cells[cell_id]
    return c.model_copy(update={"max_tokens": 4, "top_k": 3, **update})


def _max_delta(a: R.Record, b: R.Record) -> float:
    worst = 0.0
    for sa, sb in zip(a.sequences, b.sequences):
        assert sa.scored.tokens == sb.scored.tokens
        worst = max([worst, *(abs(x - y) for x, y in zip(sa.scored.logprobs, sb.scored.logprobs))])
    return worst


def test_one_interface_and_registry():
    for cls in (ReferenceEngine, TransformersEngine):
        assert issubclass(cls, base.Engine)
        for method in ("version", "probe", "load", "greedy", "teacher_forced", "module_diff", "close"):
            assert callable(getattr(cls, method))
    assert base.engine_class("reference") is ReferenceEngine
    assert base.engine_class("transformers") is TransformersEngine
    assert fuses_shards("reference") and not fuses_shards("transformers") and fuses_shards("vllm")
    with pytest.raises(base.EngineUnavailable, match="the nope engine is not implemented"):
        base.engine_class("nope")


def test_both_engines_one_record_shape_same_sequences(cells):
    """whisper-bnb-nf4: audio prompts, cross-attention, 4-bit weights. Both engines score the same
    sequences and agree to float32 rounding (bitsandbytes' bf16 CPU path is off in the engine)."""
    ref_cell = _cell(cells, "whisper.bnb-nf4.reference")
    ref = execute.execute(ReferenceEngine(ref_cell), lambda: base.resolve_checkpoint(ref_cell))
    assert ref.status == "ok", ref.error
    assert ref.engine_info.version == "0.1.0" == ref_cell.engine_version  # the pinned harness version
    assert ref.engine_info.platform == R.cpu_platform()
    assert {"read", "decode", "fuse", "assign"} <= set(ref.load.phases) and ref.load.seconds > 0
    assert ref.fixture.name == "whisper-bnb-nf4" and len(ref.fixture.identity) == 64
    assert [s.prompt.id for s in ref.sequences] == ["p0", "p1", "p2"]
    for s in ref.sequences:
        assert s.prompt.kind == "audio"
        # no baseline: prompt + its own greedy continuation, every position scored with top-k
        assert s.scored.tokens == s.prompt_tokens + s.greedy.tokens and len(s.greedy.tokens) == 4
        assert len(s.scored.logprobs) == len(s.scored.tokens) - 1 and all(len(k) == 3 for k in s.scored.topk)
    seqs = {s.prompt.id: s.scored.tokens for s in ref.sequences}

    tf_cell = _cell(cells, "whisper.bnb-nf4.transformers")
    tf = execute.execute(TransformersEngine(tf_cell), lambda: base.resolve_checkpoint(tf_cell), sequences=seqs)
    assert tf.status == "ok", tf.error
    assert tf.engine_info.name == "transformers" and tf.engine_info.version == tf_cell.engine_version
    assert list(tf.load.phases) == ["from_pretrained"] and tf.load.seconds == tf.load.phases["from_pretrained"]
    assert _max_delta(ref, tf) < 1e-4
    assert set(R.Record.model_fields) == set(tf.model_dump())


@pytest.mark.slow("loads the llama fixture in the reference engine, greedy and scoring in process")
def test_scored_sequences_given_or_own_greedy(cells):
    cell = _cell(cells, "llama.unquantized.reference")
    ckpt = base.resolve_checkpoint(cell)
    prompts = base.prompts_for(cell, ckpt)
    given = {"p0": prompts[0].tokens + [7, 8, 9], "p1": [1, 2, 3]}  # p1 does not begin with its prompt
    rec = execute.execute(ReferenceEngine(cell), ckpt, sequences=given)
    by_id = {s.prompt.id: s for s in rec.sequences}
    assert by_id["p0"].scored.tokens == given["p0"]
    for pid in ("p1", "p2"):
        assert by_id[pid].scored.tokens == by_id[pid].prompt_tokens + by_id[pid].greedy.tokens


@pytest.mark.slow("three in-process engine runs (reference fused, unfused, transformers) of an FP8 fixture")
def test_reference_unfused_is_what_transformers_executes(cells):
    """FP8 per-tensor shards fused into one projection are requantized to the largest scale (as
    engines do); transformers runs them unfused. The runner's witness: the reference unfused."""
    ref_cell = _cell(cells, "llama.fp8-static-kv.reference")
    ckpt = base.resolve_checkpoint(ref_cell)
    fused = execute.execute(ReferenceEngine(ref_cell), ckpt)
    seqs = {s.prompt.id: s.scored.tokens for s in fused.sequences}
    unfused = execute.execute(ReferenceEngine(ref_cell, {"fuse": False}), ckpt, sequences=seqs)
    tf_cell = _cell(cells, "llama.fp8-static-kv.transformers")
    tf = execute.execute(TransformersEngine(tf_cell), ckpt, sequences=seqs)
    assert _max_delta(unfused, tf) < 1e-4
    assert _max_delta(fused, tf) > 1e-2  # far beyond the fp8 bound: requantization changes the numbers


@pytest.mark.parametrize("cell_id", ["llama.torchao-int4wo.reference", "llama.bnb-nf4.transformers",
                                     "llama.fp8-dynamic.reference", "llama.fp8-dynamic.transformers"])
def test_batched_text_rows_are_what_each_computes_alone(cells, cell_id):
    """The accuracy tasks' plain sequences run many to a forward pass, right-padded (harness.scoring):
    each row's logprobs, top-k and greedy tokens are those of the sequence alone, and a row that
    reaches its stop leaves the batch while the others decode on. Dynamic FP8 inputs are
    quantized per token, so their rows are alone too."""
    cell = _cell(cells, cell_id)
    engine = {"reference": ReferenceEngine, "transformers": TransformersEngine}[cell.engine](cell)
    checkpoint = base.resolve_checkpoint(cell)
    assert engine.rows_alone(checkpoint)
    engine.load(checkpoint)
    sequences = [[1, *range(5 + 7 * i, 9 + 7 * i + i % 4)] for i in range(12)]  # lengths 5 to 8
    prompts = [base.EnginePrompt(id=f"s{i}", kind="text", tokens=s[:1]) for i, s in enumerate(sequences)]
    alone = engine.teacher_forced(prompts, sequences, 3)
    together = engine.teacher_forced(prompts, sequences, 3, batch_tokens=40)  # 5 rows of 8, or fewer
    for a, b in zip(alone, together):
        assert b.tokens == a.tokens and [[t for t, _ in k] for k in b.topk] == [[t for t, _ in k] for k in a.topk]
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)
    starts = [base.EnginePrompt(id=f"g{i}", kind="text", tokens=s[:3 + i % 3]) for i, s in enumerate(sequences)]
    stop = base.Stop(token_ids=(engine.greedy(starts[:1], 1, 1)[0].tokens[0],))  # the first row stops at once
    alone = engine.greedy(starts, 6, 2, stop=stop)
    together = engine.greedy(starts, 6, 2, stop=stop, batch_tokens=40)
    assert [g.tokens for g in together] == [g.tokens for g in alone]
    assert len({len(g.tokens) for g in alone}) > 1  # some stopped before others

def test_probe_makes_unsupported_before_loading(cells):
    gpu_cell = _cell(cells, "llama.unquantized.transformers", hardware=M.Hardware(gpus=1))

    class NoLoad(TransformersEngine):
        def load(self, checkpoint):
            raise AssertionError("loaded despite the probe")

    rec = execute.execute(NoLoad(gpu_cell), lambda: base.resolve_checkpoint(gpu_cell))
    assert rec.status == "unsupported"
    assert rec.unsupported_reason == "needs 1 GPU(s); this machine has 0"


def test_engine_failure_is_an_error_record(cells, tmp_path):
    cell = _cell(cells, "llama.unquantized.reference")
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    rec = execute.execute(ReferenceEngine(cell), base.Checkpoint(tmp_path))
    assert rec.status == "error"
    assert rec.error.type in ("CheckpointError", "OSError", "ValueError", "KeyError", "EnvironmentError")
    assert "Traceback" in rec.error.log_tail
    assert rec.engine_info.version == "0.1.0"


@pytest.mark.parametrize("config, problem", [
    ({"architectures": 5}, "architectures: must be a list (got 5)"),
    ({"architectures": ["LlamaForCausalLM"], "quantization_config": ["bnb"]}, "quantization_config: must be an object (got list)"),
    ([1], "must be a JSON object (got list)"),
])
def test_a_config_field_the_engines_read_of_the_wrong_type_is_named(cells, tmp_path, config, problem):
    """Checked before an engine reads it: the cell's error names the field, not a Python attribute."""
    cell = _cell(cells, "llama.unquantized.reference")
    (tmp_path / "config.json").write_text(json.dumps(config))
    rec = execute.execute(ReferenceEngine(cell), base.Checkpoint(tmp_path))
    assert (rec.status, rec.error.type, rec.error.message) == ("error", "CheckpointError", f"{tmp_path}/config.json: {problem}")


def test_test_hooks_parse_and_target_cells():
    text = "sleep=600@whisper.unquantized.transformers; break=harness.quant.bnb:decode@*.reference;crash"
    assert parse_hooks(text, "whisper.unquantized.transformers") == [("sleep", "600"), ("crash", None)]
    assert parse_hooks(text, "llama.bnb-nf4.reference") == [("break", "harness.quant.bnb:decode"), ("crash", None)]
    assert parse_hooks(None, "x") == [] and parse_hooks("", "x") == []


def test_online_schemes_quantize_at_load_time(cells):
    """An online scheme loads the unquantized fixture with the preset named like the scheme:
    the reference quantizes it itself, transformers through the library; online FP8 has no CPU
    path in transformers, which its capability probe says before loading."""
    def online(engine, scheme):
        return _cell(cells, f"whisper.unquantized.{engine}", scheme=scheme, fixture_scheme="unquantized",
                     id=f"whisper.{scheme}.{engine}")

    assert base.online_quantization(online("reference", "online-bnb-nf4"))["bnb_4bit_quant_type"] == "nf4"
    assert base.online_quantization(cells["whisper.bnb-nf4.reference"]) is None
    ref_cell = online("reference", "online-bnb-nf4")
    ref = execute.execute(ReferenceEngine(ref_cell), lambda: base.resolve_checkpoint(ref_cell))
    assert ref.status == "ok" and ref.fixture.name == "whisper-unquantized"
    tf_cell = online("transformers", "online-bnb-nf4")
    tf = execute.execute(TransformersEngine(tf_cell), lambda: base.resolve_checkpoint(tf_cell),
                      sequences={s.prompt.id: s.scored.tokens for s in ref.sequences})
    assert tf.status == "ok" and _max_delta(ref, tf) < 1e-4
    unquantized = execute.execute(ReferenceEngine(cells["whisper.unquantized.reference"]),
                               lambda: base.resolve_checkpoint(cells["whisper.unquantized.reference"]),
                               sequences={s.prompt.id: s.scored.tokens for s in ref.sequences})
    assert _max_delta(ref, unquantized) > 1e-3  # it really was quantized

    fp8 = online("transformers", "online-fp8")
    rec = execute.execute(TransformersEngine(fp8), lambda: base.resolve_checkpoint(fp8))
    assert rec.status == "unsupported" and "no online FP8 quantization that runs on a CPU" in rec.unsupported_reason


IMPORT_SPY = """
import json, sys
from harness import matrix
from harness import loadtime
from harness.engines import base

cell = next(c for c in matrix.load().cells(tier="cpu-tiny") if c.id == sys.argv[1])
timed_load, imported = loadtime.timed_load, []

def spy(load_once, gated, **options):
    before = set(sys.modules)
    info = timed_load(load_once, gated, **options)
    imported.extend(sorted(set(sys.modules) - before))
    return info

loadtime.timed_load = spy
engine = base.engine_class(cell.engine)(cell)
engine.load(base.resolve_checkpoint(cell, None))
print(json.dumps(imported))
"""


@pytest.mark.slow("a fresh interpreter per cell that imports torch and loads the cell's fixture")
@pytest.mark.parametrize("cell_id", ["llama.unquantized.reference", "llama.bnb-nf4.reference",
                                     "llama.fp8-dynamic.reference", "llama.torchao-int8wo.reference",
                                     "llama.bnb-nf4.transformers", "llama.fp8-dynamic.transformers",
                                     "llama.torchao-int8wo.transformers"])
def test_no_import_is_timed_as_load_in_a_fresh_process(cell_id):
    """A spawned child imports nothing in advance: everything a load imports lazily must be imported
    by the engine's warm-up, before the clock starts (docs/design.md, "Load time")."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", IMPORT_SPY, cell_id], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_a_load_only_child_times_the_load_alone_with_the_hooks_before_it(monkeypatch, tmp_path):
    """Worker mode ``load`` (a gated cell's confirmation and baseline children) calls
    Engine.load_timed_only, after the test hooks a load would get, and writes only the LoadInfo."""
    from types import SimpleNamespace

    from harness.engines import worker

    calls = []
    monkeypatch.setattr(worker, "apply_hooks", lambda cell_id: calls.append(("hooks", cell_id)) or [])

    class Engine:
        cell = SimpleNamespace(id="m.s.vllm")

        def load(self, ckpt):
            raise AssertionError("a load-only child must not build the whole engine")

        def load_timed_only(self, ckpt):
            calls.append(("timed", ckpt))
            return R.LoadInfo(seconds=0.5, phases={"calibration": 0.04})

        def close(self):
            calls.append(("close",))

    out = tmp_path / "load.json"
    job = SimpleNamespace(checkpoint=lambda: "ckpt", load_out=out, record=tmp_path / "record.json", cell=Engine.cell)
    worker._run_load(job, Engine(), None)
    assert calls == [("hooks", "m.s.vllm"), ("timed", "ckpt")]  # not closed: the child ends right after
    assert json.loads(out.read_text())["seconds"] == 0.5


def test_a_child_leaves_its_engine_to_the_process_end(monkeypatch, tmp_path):
    """run_job keeps the engine referenced after the job: released, vLLM's LLM would shut down
    first (a garbage collection, its KV cache freed, its rank workers waited for), seconds that
    change no output, before main's os._exit."""
    import weakref
    from types import SimpleNamespace

    from harness.engines import worker

    released = []

    class Engine:
        def __init__(self, cell, options):
            self.cell = cell
            weakref.finalize(self, released.append, "shut down")

        def info(self):
            return R.EngineInfo(name="reference", environment="e", platform=R.cpu_platform())

    monkeypatch.setattr(worker.base, "engine_class", lambda name: Engine)
    monkeypatch.setitem(worker.RUN_MODES, "cell", lambda job, engine, info: None)
    monkeypatch.setattr(worker, "_OPEN_UNTIL_EXIT", [])
    job = SimpleNamespace(mode="cell", cell=SimpleNamespace(id="m.s.reference", engine="reference"), options={},
                          threads=1, info=None)
    assert worker.run_job(job) == 0
    assert released == []
    worker._OPEN_UNTIL_EXIT.clear()
    assert released == ["shut down"]  # the finalizer can run: the engine was held, not lost
