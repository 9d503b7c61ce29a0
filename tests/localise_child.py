"""Run by tests/test_portability.py under a kernel condition, with a JSON list of [case, model,
scheme, fault spec or null] (the trace suite's faults, test_traces.FAULTS, and the clean cells):
per case, the reference with the fault, its traces of the committed baseline's sequences localised
against that baseline's fingerprint as the runner does (harness.traces.jobs.against_fingerprint).
Prints one JSON line per case."""
import json
import sys
from pathlib import Path

from harness import baselines as B
from harness import matrix as M
from harness import records as R
from harness.engines import base
from harness.engines.reference import ReferenceEngine
from harness.hooks import faults
from harness.quant import fp8
from harness.quant.source import TensorSource
from harness.traces.jobs import against_fingerprint

BASELINES = Path(__file__).resolve().parent.parent / "baselines"


def localised(model: str, scheme: str, spec: str | None) -> R.Localisation:
    cell = next(c for c in M.load().cells(tier="cpu-tiny") if c.id == f"{model}.{scheme}.reference")
    baseline = B.read(BASELINES, cell.tier, cell.id)
    sequences = {s.prompt.id: [r.token for r in s.scored] for s in baseline.sequences}
    saved = TensorSource.get, fp8._read_scale
    after_load = faults.install(spec) if spec else None
    engine = ReferenceEngine(cell)
    try:
        checkpoint = base.resolve_checkpoint(cell)
        engine.load(checkpoint)
        if after_load is not None:
            after_load(engine)
        record = R.Record.model_construct(loaded_state=engine.loaded_state(), engine_info=engine.info())
        prompts = [p for p in base.prompts_for(cell, checkpoint) if p.id in sequences]
        traces = engine.trace(prompts, [sequences[p.id] for p in prompts])
    finally:
        engine.close()
        TensorSource.get, fp8._read_scale = saved
    return against_fingerprint(record, baseline, traces)


for case, model, scheme, spec in json.loads(sys.argv[1]):
    loc = localised(model, scheme, spec)
    print(json.dumps({"case": case, "module": loc.module, "kind": loc.kind, "detail": loc.detail}), flush=True)
