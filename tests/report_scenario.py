"""Realistic judged result records for the report and pipeline tests (not a test module).

Records are built for cells of the repo's models.yaml, judged by harness.judging against
baselines made from a reference run, so the checks carry the same data a real run has.
"""
from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone
from pathlib import Path

from harness import judging, matrix
from harness.baselines import Baseline
from harness.records import (
    Computation,
    CpuInfo,
    EngineInfo,
    ErrorInfo,
    Greedy,
    LoadInfo,
    ModuleDiff,
    PromptRef,
    Record,
    Scored,
    SequenceResult,
    save,
)

MATRIX = matrix.load()
CELLS = {c.id: c for c in MATRIX.cells()}
VOCAB = 250
EVIL = "<script>window.__pwned = 1; alert('x')</script>"

REGRESSED = "llama.bnb-nf4-skip-ambiguous.reference"
PORTABLE = "llama.fp8-dynamic.vllm"  # on another CPU than its baseline, FP8 activations: portable-pass
REGRESSED_GPU = "llama-gpu.fp8-static-kv.vllm"  # a cell with one engine: no cross-engine comparison
KNOWN_FAILURE = "mllama-11b-fp8-kv.fp8-static-kv.vllm"
KF = matrix.KnownFailure(
    engine="vllm", versions=">=0.10,<0.11", pattern=r"module-diff:reference: first differing module .*cross_attn",
    reason="vLLM 0.10.2 skips process_weights_after_loading for the cross-attention layers of FP8 Mllama, "
           "so their k/v scales are never applied",
    link="https://github.com/vllm-project/vllm/issues",
)


def _topk(token: int, lp: float, rng: random.Random, k: int = 5) -> list[list]:
    others = [t for t in rng.sample(range(1, VOCAB), k + 1) if t != token][: k - 1]
    return [[token, lp]] + [[t, lp - 0.4 * (j + 1) - rng.random() * 0.1] for j, t in enumerate(others)]


def sequence(pid: str, seed: int, n_prompt: int = 6, n_gen: int = 8) -> SequenceResult:
    rng = random.Random(seed)
    prompt = [rng.randrange(1, VOCAB) for _ in range(n_prompt)]
    gen = [rng.randrange(1, VOCAB) for _ in range(n_gen)]
    tokens = prompt + gen
    lps = [-rng.uniform(0.3, 5.0) for _ in range(len(tokens) - 1)]
    topk = [_topk(tokens[i + 1], lps[i], rng) for i in range(len(lps))]
    g_topk = [_topk(t, -rng.uniform(0.05, 1.0), rng) for t in gen]
    return SequenceResult(prompt=PromptRef(id=pid, kind="text"), prompt_tokens=prompt,
                          scored=Scored(tokens=tokens, logprobs=lps, topk=topk),
                          greedy=Greedy(tokens=gen, topk=g_topk))


def perturb(seq: SequenceResult, deltas, swap_step: int | None = None, outside_topk: bool = False) -> SequenceResult:
    """The same sequence with logprob i shifted by deltas(i); optionally a greedy token swapped at
    ``swap_step`` (for the second top-k token, or for a token in neither top-k)."""
    lps = [lp + deltas(i) for i, lp in enumerate(seq.scored.logprobs)]
    topk = [[[t, lp + deltas(i)] for t, lp in row] for i, row in enumerate(seq.scored.topk)]
    g_tokens = list(seq.greedy.tokens)
    g_topk = [[list(x) for x in row] for row in seq.greedy.topk]
    if swap_step is not None:
        if outside_topk:
            used = {t for t, _ in g_topk[swap_step]}
            new = next(t for t in range(1, VOCAB) if t not in used)
            g_tokens[swap_step] = new
            g_topk[swap_step] = [[new, -0.2]] + [[t, lp - 1.5] for t, lp in g_topk[swap_step][1:]]
        else:
            g_tokens[swap_step] = g_topk[swap_step][1][0]
            g_topk[swap_step] = [g_topk[swap_step][1], g_topk[swap_step][0], *g_topk[swap_step][2:]]
    return SequenceResult(prompt=seq.prompt, prompt_tokens=seq.prompt_tokens,
                          scored=Scored(tokens=seq.scored.tokens, logprobs=lps, topk=topk),
                          greedy=Greedy(tokens=g_tokens, topk=g_topk))


def _info(cell, version: str | None = None) -> EngineInfo:
    gpu = (cell.hardware.gpus or 0) > 0
    # an engine names the CPU it ran on (the host's, on a GPU), as harness.engines.base.Engine.info does
    return EngineInfo(name=cell.engine, version=version or cell.engine_version, environment=cell.environment,
                      torch="2.13.0+cpu" if not gpu else "2.9.0+cu128",
                      platform="cuda-sm90" if gpu else "cpu-x86_64-avx2", cpu=CpuInfo(**CPU))


def ok_record(cell_id: str, seqs, *, load_s: float = 0.05, started: datetime, version: str | None = None,
              module_diff: ModuleDiff | None = None) -> Record:
    cell = CELLS[cell_id]
    return Record.for_cell(cell, engine_info=_info(cell, version), fixture_identity="f" * 64,
                           sequences=list(seqs), module_diff=module_diff,
                           load=LoadInfo(seconds=load_s, phases={"read": load_s * 0.4, "dequantize": load_s * 0.35,
                                                                 "fuse": load_s * 0.1, "assign": load_s * 0.15}),
                           started_at=started.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                           duration_s=1.5 + load_s)


def judged(cell_id: str, record: Record, baseline_record: Record | None, known=()) -> Record:
    cell = CELLS[cell_id]
    baseline = Baseline.from_record(baseline_record) if baseline_record is not None else None
    j = judging.verdict(record, baseline, bounds=cell.bounds, known_failures=known,
                        expected_engine_version=cell.engine_version, gate_load_time=cell.gate_load_time)
    return j.apply(record)


def _seqs(cell_id: str) -> list[SequenceResult]:
    # every engine of one model x scheme scores the same tokens (the fixture's prompts)
    seed = sum(cell_id.rsplit(".", 1)[0].encode())
    return [sequence("p0", seed), sequence("p1", seed + 1, n_prompt=4, n_gen=8)]


def _moved(seq: SequenceResult):
    """Deltas of ~0.05 from the first generated position on, beyond every bound."""
    plen = len(seq.prompt_tokens)
    return lambda i: 0.05 + 0.01 * (i % 4) if i + 1 >= plen else 2e-6


def _portable(record: Record) -> Record:
    """The record as computed on another kind of CPU than the scenario's baselines (EPYC), with
    FP8-quantized activations: a computation that does not carry to other kernels, so its
    logprobs against the baseline are shown, not judged (docs/design.md, "Portability across CPUs")."""
    info = record.engine_info.model_copy(update={"cpu": CpuInfo(**EPYC)})
    return record.model_copy(update={"engine_info": info,
                                     "computation": Computation(dtype="float32", quantized_activations=["input"])})


def build(cell_id: str, kind: str, *, started: datetime, load_s: float = 0.05) -> Record:
    """A judged record of one kind: pass, portable-pass, regressed, improved, failed, error,
    unsupported, waived, unexpected-pass, stale-baseline, missing-baseline."""
    cell = CELLS[cell_id]
    base = _seqs(cell_id)
    base_rec = ok_record(cell_id, base, load_s=0.05, started=started - timedelta(days=7))
    tiny = lambda i: 1e-6 * ((i % 3) + 1)  # noqa: E731 - within every bound
    if kind == "pass":
        return judged(cell_id, ok_record(cell_id, [perturb(s, tiny) for s in base], load_s=load_s, started=started), base_rec)
    if kind == "regressed":
        # from the first generated position on, the logprobs move by ~0.05: a wrongly quantized layer
        seqs = [perturb(base[0], _moved(base[0]), swap_step=2, outside_topk=True), perturb(base[1], tiny)]
        return judged(cell_id, ok_record(cell_id, seqs, load_s=load_s, started=started), base_rec)
    if kind == "portable-pass":
        return judged(cell_id, _portable(ok_record(cell_id, [perturb(base[0], _moved(base[0])), base[1]], load_s=load_s,
                                                   started=started)), base_rec)
    if kind == "improved":
        assert cell.gate_load_time
        return judged(cell_id, ok_record(cell_id, [perturb(s, tiny) for s in base], load_s=0.02, started=started), base_rec)
    if kind in ("failed", "waived"):
        md = ModuleDiff(first_differing_module="language_model.model.layers.3.cross_attn.kv_proj",
                        detail="k_scale differs: engine 1.0 (default), reference 0.0123 (from checkpoint); "
                               f"max |Δw| 0.41 {EVIL}")
        rec = ok_record(cell_id, [perturb(s, tiny) for s in base], load_s=load_s, started=started, module_diff=md)
        return judged(cell_id, rec, base_rec, known=[KF] if kind == "waived" else [])
    if kind == "error":
        rec = Record.for_cell(cell, engine_info=EngineInfo(name=cell.engine, environment=cell.environment),
                              status="error", started_at=started.isoformat().replace("+00:00", "Z"), duration_s=3.0,
                              error=ErrorInfo(type="RuntimeError", message=f"shape mismatch in {EVIL}",
                                              log_tail=f"INFO loading weights\nTraceback (most recent call last):\n"
                                                       f"  File \"x.py\", line 1\nRuntimeError: {EVIL}\n"))
        return judged(cell_id, rec, None)
    if kind == "unsupported":
        rec = Record.for_cell(cell, engine_info=EngineInfo(name=cell.engine, environment=cell.environment),
                              status="unsupported", unsupported_reason="static FP8 kernels need AMX on CPU",
                              started_at=started.isoformat().replace("+00:00", "Z"), duration_s=0.1)
        return judged(cell_id, rec, None)
    if kind == "unexpected-pass":
        return judged(cell_id, ok_record(cell_id, [perturb(s, tiny) for s in base], load_s=load_s, started=started),
                      base_rec, known=[KF.model_copy(update={"engine": cell.engine, "versions": ">=0"})])
    if kind == "stale-baseline":
        return judged(cell_id, ok_record(cell_id, [perturb(s, tiny) for s in base], load_s=load_s, started=started,
                                         version=cell.engine_version + ".post1"), base_rec)
    if kind == "missing-baseline":
        return judged(cell_id, ok_record(cell_id, base, load_s=load_s, started=started), None)
    raise ValueError(kind)


ALL_KINDS = {
    "llama.unquantized.reference": "pass",
    PORTABLE: "portable-pass",
    REGRESSED: "regressed",
    "llama-gpu.fp8-dynamic.vllm": "improved",
    "whisper-gpu.fp8-static-kv.vllm": "failed",
    "whisper.fp8-static-kv.transformers": "error",
    "whisper.fp8-static-kv.reference": "unsupported",
    KNOWN_FAILURE: "waived",
    "llama.torchao-int8wo.transformers": "unexpected-pass",
    "llama.bnb-nf4.reference": "stale-baseline",
    "whisper.bnb-nf4.reference": "missing-baseline",
}
MISSING_CELL = "whisper.unquantized.transformers"


def write(results: Path, kinds: dict[str, str], *, started: datetime | None = None, load_scale: float = 1.0,
          logs: bool = True) -> list[str]:
    """Write judged records (and engine logs) into ``results``; returns the cell ids written."""
    started = started or datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    results.mkdir(parents=True, exist_ok=True)
    for i, (cid, kind) in enumerate(kinds.items()):
        rec = build(cid, kind, started=started + timedelta(seconds=i), load_s=0.05 * load_scale)
        save(results / f"{cid}.json", rec)
        if logs:  # where harness run writes the engine child's log
            (results / "logs").mkdir(exist_ok=True)
            (results / "logs" / f"{cid}.log").write_text(f"engine log of {cid}\nloading...\nERROR {EVIL}\n")
    return list(kinds)


def full_matrix_kinds(overrides: dict[str, str]) -> dict[str, str]:
    """Every cell of models.yaml passes, except the overrides. Cells a known failure covers are
    left out: such a cell never passes (where its failure does not show it is unexpected-pass, as
    the merge's judgement finds once every engine is compared), and the scenario plants its own.
    So are configuration cells, judged against their plain cell in their own run
    (harness.configurations), not against the stored baselines this scenario judges by."""
    return {cid: overrides.get(cid, "pass") for cid, cell in CELLS.items()
            if cid in overrides or not (cell.known_failures or cell.configuration)}


EPYC = {"vendor": "AuthenticAMD", "model": "AMD EPYC 7R13 Processor", "flags": ["avx2"], "capability": "avx2"}
CPU = {"vendor": "GenuineIntel", "model": "Intel(R) Xeon(R) Platinum 8488C", "flags": ["avx2", "avx512f", "amx_tile"],
       "capability": "avx512"}

