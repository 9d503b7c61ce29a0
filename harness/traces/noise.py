"""Each module's own noise (docs/design.md, "Localisation"): the reference traces the same
sequences in fresh interpreters (harness.noise's child machinery), executed as the cell's engine
executes (fused or not): A under this machine's kernels, B under a lowered ``ATEN_CPU_CAPABILITY``
(harness.noise's choice), C under MKL's and oneDNN's AVX2 paths (harness.cpu.LIBRARIES_AVX2). A
lowered torch capability alone leaves the BLAS kernels as they were, and an AVX2-only CPU moved
modules beyond a noise measured that way (issue 26). A module's noise is ``NOISE_FACTOR`` x the
largest |A - B| or |A - C| of its output (and of its input), measured with FP8 rounding of
activations turned off (harness.reference.linear.without_activation_rounding): a flip in B or C
would move every module after it by far more than the kernels' noise, which is what the noise is
for telling a flip from (harness.traces.flips).

``python -m harness.traces.noise JOB OUT`` is the child: it writes its traces (harness.traces.save).
"""
from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from harness import noise as logprob_noise

if TYPE_CHECKING:
    from harness.matrix import Cell
    from harness.traces import PromptTrace

NOISE_FACTOR = logprob_noise.NOISE_FACTOR


@dataclass
class ModuleNoise:
    outputs: dict[str, float] = field(default_factory=dict)
    inputs: dict[str, float] = field(default_factory=dict)
    measured_by: str | None = None  # "reference" or "reference-unfused"; None: not measured
    kernels: list[str] = field(default_factory=list)  # [A's capability, B's capability]


@dataclass
class Measured:
    noise: ModuleNoise
    a: list[PromptTrace]  # the traces under this machine's kernels (activations not rounded)
    b: list[PromptTrace]  # under the lowered capability
    c: list[PromptTrace]  # under the libraries' AVX2 kernels


def measure(cell: Cell, sequences: dict[str, list[int]], fuse: bool, own: str | None) -> Measured:
    """Three reference children (harness.noise's): the traces A, B and C and the noise of every
    module. ``own`` is the capability the cell's record ran under (its ``engine_info.cpu``). Raises
    harness.noise.NoiseError with one line when a child fails."""
    from harness import cpu, traces

    other = logprob_noise.other_capability(own)
    job = {"cell": cell.model_dump(mode="json"), "sequences": sequences, "fuse": fuse, "role": "trace"}
    with tempfile.TemporaryDirectory(prefix="harness-trace-noise-") as tmp:
        runs = []
        for name, capability, env in (("a", own, None), ("b", other, None), ("c", own, cpu.LIBRARIES_AVX2)):
            out = Path(tmp) / f"{name}.pt"
            logprob_noise._child(job, out, tmp, capability=capability, module=__name__, kernel_env=env)
            runs.append(traces.load(out))
    a, b, c = runs
    kernels = [own or "?", other or "?", f"{own or '?'}+libraries-avx2"]
    return Measured(noise_between(a, [b, c], "reference" if fuse else "reference-unfused", kernels), a, b, c)


def noise_between(a: list[PromptTrace], others: list[list[PromptTrace]], measured_by: str,
                  kernels: list[str]) -> ModuleNoise:
    """NOISE_FACTOR x the largest difference, per module, between ``a`` and any of ``others``."""
    noise = ModuleNoise(measured_by=measured_by, kernels=kernels)
    for ta, tb in ((ta, tb) for b in others for ta, tb in zip(a, b)):
        for store, xa, xb in ((noise.outputs, ta.outputs, tb.outputs), (noise.inputs, ta.inputs, tb.inputs)):
            for name, x in xa.items():
                y = xb.get(name)
                if y is not None and y.shape == x.shape:
                    d = NOISE_FACTOR * float((x - y).abs().max()) if x.numel() else 0.0
                    store[name] = max(store.get(name, 0.0), d)
    return noise


def run(job: dict, out: Path) -> None:
    from harness import traces

    from harness.reference.linear import without_activation_rounding
    from harness.traces.record import torch_module

    engine, prompts = logprob_noise.load_reference(job)
    without_activation_rounding(torch_module(engine.model))
    ids = [pid for pid in prompts if pid in job["sequences"]]
    traces.save(out, engine.trace([prompts[pid] for pid in ids], [job["sequences"][pid] for pid in ids]))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m harness.traces.noise JOB OUT", file=sys.stderr)
        return 2
    run(json.loads(Path(args[0]).read_text()), Path(args[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
