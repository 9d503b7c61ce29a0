"""The module-noise child: ``python -m harness.noise_child JOB``, forked by harness.measure_noise
from a fork server that imported torch under the kernels it measures (harness.supervise). It loads the reference as the job says (fused
or not), turns FP8 rounding of activations off (harness.reference.linear.without_activation_rounding:
a flip would move every later module by far more than the kernels' noise, which is what the noise
tells a flip from) and records the module traces of the job's sequences (harness.traces.noise).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from harness import traces
from harness.engines import base
from harness.engines.reference import ReferenceEngine
from harness.matrix import Cell
from harness.reference.linear import without_activation_rounding
from harness.traces.record import torch_module


def run_trace(job: dict, out: Path) -> None:
    torch.set_num_threads(1)
    cell = Cell.model_validate(job["cell"])
    engine = ReferenceEngine(cell, {"fuse": job["fuse"]})
    checkpoint = base.resolve_checkpoint(cell)
    engine.load(checkpoint)
    prompts = {p.id: p for p in base.prompts_for(cell, checkpoint)}
    without_activation_rounding(torch_module(engine.model))
    ids = [pid for pid in prompts if pid in job["sequences"]]
    traces.save(out, engine.trace([prompts[pid] for pid in ids], [job["sequences"][pid] for pid in ids]))


def main(argv: list[str] | None = None) -> int:
    """JOB: ``{"cell", "sequences", "fuse", "out"}``; the traces are written to ``out``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m harness.noise_child JOB", file=sys.stderr)
        return 2
    job = json.loads(Path(args[0]).read_text())
    run_trace(job, Path(job["out"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
