"""The vLLM child of tests/test_vllm_traces.py, forked from the vLLM fork server as an engine child
is (``main([JOB])``, harness.engines.forkserver), so it pays for its engines and not for vLLM's
imports. JOB holds ``runs``, each one engine loaded in list order: [cell id, a checkpoint copy to
load instead of the fixture (null: the fixture), the mutation (null: none)]; ``sequences``, prompt
id -> the tokens every engine traces (null: each prompt alone); ``out``, where the list of each
engine's traces is saved. A mutation patches vLLM's classes for the rest of the process, so a
job's clean runs come first."""
import dataclasses
import json
import os
from pathlib import Path

import torch

from harness import matrix
from harness.engines import base
from harness.engines.vllm import MUTATION_ENV, VllmEngine


def main(args: list[str]) -> int:
    job = json.loads(Path(args[0]).read_text())
    cells = {c.id: c for c in matrix.load().cells(tier="cpu-tiny")}
    out = []
    for cell_id, path, mutation in job["runs"]:
        cell = cells[cell_id]
        ckpt = base.resolve_checkpoint(cell)
        prompts = base.prompts_for(cell, ckpt)
        sequences = job["sequences"] or {p.id: p.tokens for p in prompts}
        os.environ[MUTATION_ENV] = mutation or ""
        engine = VllmEngine(cell)
        engine.load(dataclasses.replace(ckpt, path=Path(path)) if path else ckpt)
        out.append(engine.trace(prompts, [sequences[p.id] for p in prompts]))
        engine.close()
    torch.save(out, job["out"])
    return 0
