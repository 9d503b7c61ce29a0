"""The driver: one engine and one job in, one unjudged record out (harness.engines.base names the
engine's steps). The engine child (harness.engines.worker) calls :func:`execute` for a cell and
:func:`trace_cell` for its module traces; neither raises for the engine's own failures.
"""
from __future__ import annotations

import math
import os
import time
import traceback
from collections.abc import Callable

from harness import synthetic, traces
from harness import records as R
from harness.accuracy import lmeval
from harness.checks import logprob_difference
from harness.engines.base import Checkpoint, Engine, EnginePrompt, prompts_for, topk_lists


def execute(engine: Engine, checkpoint: Checkpoint | Callable[[], Checkpoint], *,
            sequences: dict[str, list[int]] | None = None,
            on_sequences: Callable[[dict[str, list[int]]], None] | None = None,
            witness: Callable[[Engine, Checkpoint, list[EnginePrompt], dict[str, list[int]]], None] | None = None,
            log: Callable[[str], None] = lambda s: None, accuracy: bool = True, close: bool = True) -> R.Record:
    """Run one cell on one engine and return its (unjudged) record. Never raises for the engine's
    own failures: an exception becomes ``status: error`` with its traceback in ``log_tail``.

    ``sequences`` maps prompt id -> the token sequence to score (prompt + continuation). A prompt
    missing from it, or all prompts when it is None, is scored on prompt + this engine's own greedy
    tokens; ``on_sequences`` then receives the sequences that were scored (the runner caches the
    reference's as the scored sequences of the cell). ``witness`` runs after the record's results,
    with the same prompts and sequences (the reference's unfused variant). With ``accuracy``, the
    cell's accuracy tasks then run on the same loaded engine (harness.accuracy; docs/design.md,
    "Accuracy"). ``close=False`` leaves the engine open, for a process that ends right after."""
    run = _CellRun(engine.cell)
    try:
        return _run_cell(engine, checkpoint, run, sequences=sequences, on_sequences=on_sequences, witness=witness,
                         log=log, accuracy=accuracy)
    except Exception as e:  # the engine's failure is the result
        tb = traceback.format_exc()
        log(tb)
        return run.record("error", error=R.ErrorInfo(type=type(e).__name__, message=str(e) or type(e).__name__,
                                                     log_tail=tb))
    finally:
        if close:
            try:
                engine.close()
            except Exception:
                pass


class _CellRun:
    """One cell's run as far as it got: what its record says however the run ends (the engine's
    info once the engine answered, the fixture's identity once the checkpoint was built)."""

    def __init__(self, cell):
        self.cell = cell
        self.started = R.utc_now()
        self.t0 = time.perf_counter()
        self.fixture_identity = None
        self.info = R.EngineInfo(name=cell.engine, environment=cell.environment, platform=R.cpu_platform())

    def record(self, status: R.Status, **fields) -> R.Record:
        return R.Record.for_cell(self.cell, engine_info=self.info, status=status,
                                 fixture_identity=self.fixture_identity, **fields, started_at=self.started,
                                 duration_s=time.perf_counter() - self.t0)


def _run_cell(engine: Engine, checkpoint: Checkpoint | Callable[[], Checkpoint], run: _CellRun, *,
              sequences: dict[str, list[int]] | None, on_sequences: Callable[[dict[str, list[int]]], None] | None,
              witness: Callable[[Engine, Checkpoint, list[EnginePrompt], dict[str, list[int]]], None] | None,
              log: Callable[[str], None], accuracy: bool) -> R.Record:
    """:func:`execute` up to its record, raising for the engine's failures."""
    run.info = engine.info()
    log(f"engine: {run.info.name} {run.info.version} on {run.info.platform} (torch {run.info.torch})")
    ckpt = checkpoint() if callable(checkpoint) else checkpoint
    run.fixture_identity = ckpt.identity
    log(f"checkpoint: {ckpt.path}")
    reason = engine.probe(ckpt)
    if reason:
        log(f"probe: unsupported: {reason}")
        return run.record("unsupported", unsupported_reason=reason)
    record, prompts, scored_seqs = _measure(engine, ckpt, run, sequences, log, accuracy)
    if on_sequences is not None:
        on_sequences({p.id: s for p, s in zip(prompts, scored_seqs)})
    if witness is not None:
        _run_witness(witness, engine, ckpt, prompts, scored_seqs, log)
    return record


def _measure(engine: Engine, ckpt: Checkpoint, run: _CellRun, sequences: dict[str, list[int]] | None,
             log: Callable[[str], None], accuracy: bool) -> tuple[R.Record, list[EnginePrompt], list[list[int]]]:
    """The ``ok`` record of a supported cell, with its prompts and the sequences it scored."""
    cell = run.cell
    load = engine.load(ckpt)
    log(f"load: {load.seconds:.4f} s " + ", ".join(f"{k}={v:.4f}" for k, v in load.phases.items()))
    loaded_state = engine.loaded_state()
    prompts = prompts_for(cell, ckpt)
    greedy = engine.greedy(prompts, cell.max_tokens, cell.top_k)
    scored_seqs = _sequences_to_score(prompts, greedy, sequences, log)
    scored = engine.teacher_forced(prompts, scored_seqs, cell.top_k)
    sensitivity = input_sensitivity(engine, prompts, scored_seqs, scored, log)
    diff = engine.module_diff(ckpt)
    acc = []
    if accuracy and cell.accuracy:
        acc = lmeval.evaluate(engine, ckpt, cell.accuracy, log=log)
    record = run.record("ok", sequences=_sequence_results(prompts, scored, greedy), load=load,
                        computation=engine.computation(ckpt), module_diff=diff,
                        loaded_state=loaded_state, accuracy=acc, input_sensitivity=sensitivity)
    return record, prompts, scored_seqs


def trace_cell(engine: Engine, checkpoint: Callable[[], Checkpoint], sequences: dict[str, list[int]], out: str, *,
               log: Callable[[str], None] = lambda s: None) -> R.Record | None:
    """Load the cell and record the module traces of ``sequences`` (prompt id -> tokens) to ``out``
    (harness.traces.save): docs/design.md, "Localisation". None on success; the error record when
    the engine cannot run or fails (never raises for the engine's own failures). The engine is left
    open: it is the caller's (the engine child's, which ends right after)."""
    cell = engine.cell
    info = R.EngineInfo(name=cell.engine, environment=cell.environment, platform=R.cpu_platform())
    try:
        info = engine.info()
        ckpt = checkpoint()
        reason = engine.probe(ckpt)
        if reason:
            return R.Record.for_cell(cell, engine_info=info, status="unsupported", unsupported_reason=reason)
        engine.prepare_trace()
        engine.load(ckpt)
        prompts = [p for p in prompts_for(cell, ckpt) if p.id in sequences]
        t0 = time.perf_counter()
        recorded = engine.trace(prompts, [sequences[p.id] for p in prompts])
        traces.save(out, recorded)
        log(f"traces: {len(recorded)} prompt(s), {len(recorded[0].order) if recorded else 0} modules, "
            f"{time.perf_counter() - t0:.2f} s, {os.path.getsize(out)} bytes")
        return None
    except Exception as e:
        tb = traceback.format_exc()
        log(tb)
        return R.Record.for_cell(cell, engine_info=info, status="error",
                                 error=R.ErrorInfo(type=type(e).__name__, message=str(e) or type(e).__name__, log_tail=tb))


# The positions the input-sensitivity check compares: from the prompt's last input token on.
SENSITIVITY_POSITIONS = 8


def input_sensitivity(engine: Engine, prompts: list[EnginePrompt], sequences: list[list[int]],
                      scored: list[R.Scored], log: Callable[[str], None]) -> R.InputSensitivity | None:
    """Each image or audio prompt scored again on the same sequence with a second input
    (harness.synthetic.contrast), and the scored-token logprobs of both at the first
    SENSITIVITY_POSITIONS positions after the input (docs/design.md, "Input sensitivity"); None
    for a cell without such prompts. The verdict is harness.compare.check_input_sensitivity's."""
    picked = [(p, seq, s) for p, seq, s in zip(prompts, sequences, scored) if p.input is not None]
    if not picked:
        return None
    t0 = time.perf_counter()
    contrasts = [p.with_input(synthetic.contrast(p.kind, p.input, p.audio[1] if p.audio else None),
                              f"contrast of {p.input_name}") for p, _, _ in picked]
    again = engine.teacher_forced(contrasts, [seq for _, seq, _ in picked], engine.cell.top_k)
    seconds = time.perf_counter() - t0
    out = []
    for (p, _, s), c, a in zip(picked, contrasts, again):
        first = min(p.input_end, len(s.logprobs) - 1)
        mine, theirs = s.logprobs[first:first + SENSITIVITY_POSITIONS], a.logprobs[first:first + SENSITIVITY_POSITIONS]
        out.append(R.PromptSensitivity(prompt=p.id, kind=p.kind, input=p.input_name, contrast=c.input_name,
                                       first=first, logprobs=mine, contrast_logprobs=theirs,
                                       max_delta=_largest([logprob_difference(x, y, nan="unknown") for x, y in zip(mine, theirs)])))
    log(f"input sensitivity: {len(out)} prompt(s) scored with a second input in {seconds:.2f} s; max |Δlogprob| "
        + ", ".join(f"{o.prompt}={o.max_delta:.3g}" for o in out))
    return R.InputSensitivity(prompts=out, gates=engine.cross_attention_gates(), seconds=seconds)


def _largest(deltas: list[float]) -> float:
    return math.nan if any(math.isnan(d) for d in deltas) else max(deltas)


def _sequences_to_score(prompts: list[EnginePrompt], greedy: list[R.Greedy],
                        sequences: dict[str, list[int]] | None, log: Callable[[str], None]) -> list[list[int]]:
    """Per prompt, the given sequence where it starts with the prompt, else prompt + this engine's
    own greedy tokens (said in the log)."""
    wanted = dict(sequences or {})
    scored_seqs = []
    own = {}
    for p, g in zip(prompts, greedy):
        s = wanted.get(p.id)
        if s is None or list(s[: len(p.tokens)]) != p.tokens:
            s = p.tokens + list(g.tokens)
            own[p.id] = s
        scored_seqs.append(list(s))
    if own:
        log(f"scored sequences: prompt + own greedy for {', '.join(own)}")
    return scored_seqs


def _sequence_results(prompts: list[EnginePrompt], scored: list[R.Scored],
                      greedy: list[R.Greedy]) -> list[R.SequenceResult]:
    return [
        R.SequenceResult(prompt=p.ref, prompt_tokens=p.tokens,
                         scored=R.Scored(tokens=s.tokens, logprobs=s.logprobs, topk=topk_lists(s.topk)),
                         greedy=R.Greedy(tokens=g.tokens, topk=topk_lists(g.topk)))
        for p, s, g in zip(prompts, scored, greedy)
    ]


def _run_witness(witness, engine: Engine, ckpt: Checkpoint, prompts: list[EnginePrompt],
                 scored_seqs: list[list[int]], log: Callable[[str], None]) -> None:
    try:
        witness(engine, ckpt, prompts, {p.id: s for p, s in zip(prompts, scored_seqs)})
    except Exception:  # the cell's own record stands; the runner falls back to it
        log("witness failed:\n" + traceback.format_exc())
