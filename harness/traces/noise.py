"""Each module's own noise (docs/design.md, "Localisation"), measured as harness.noise measures
each position's: the reference traces the same sequences twice, each in a fresh interpreter,
under this machine's kernels and under a lowered ``ATEN_CPU_CAPABILITY`` (harness.noise's child
machinery and capability choice), executed as the cell's engine executes (fused or not). A
module's noise is ``NOISE_FACTOR`` x the largest |A - B| of its output (and of its input).

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
    a: list[PromptTrace]  # the traces under this machine's kernels
    b: list[PromptTrace]  # under the lowered capability


def measure(cell: Cell, sequences: dict[str, list[int]], fuse: bool, own: str | None) -> Measured:
    """Two reference children (harness.noise's): the traces A and B and the noise of every module.
    ``own`` is the capability the cell's record ran under (its ``engine_info.cpu``). Raises
    harness.noise.NoiseError with one line when a child fails."""
    from harness import traces

    other = logprob_noise.other_capability(own)
    job = {"cell": cell.model_dump(mode="json"), "sequences": sequences, "fuse": fuse, "role": "trace"}
    with tempfile.TemporaryDirectory(prefix="harness-trace-noise-") as tmp:
        runs = []
        for name, capability in (("a", own), ("b", other)):
            out = Path(tmp) / f"{name}.pt"
            logprob_noise._child(job, out, tmp, capability=capability, module=__name__)
            runs.append(traces.load(out))
    a, b = runs
    return Measured(noise_between(a, b, "reference" if fuse else "reference-unfused", [own or "?", other or "?"]), a, b)


def noise_between(a: list[PromptTrace], b: list[PromptTrace], measured_by: str, kernels: list[str]) -> ModuleNoise:
    noise = ModuleNoise(measured_by=measured_by, kernels=kernels)
    for ta, tb in zip(a, b):
        for store, xa, xb in ((noise.outputs, ta.outputs, tb.outputs), (noise.inputs, ta.inputs, tb.inputs)):
            for name, x in xa.items():
                y = xb.get(name)
                if y is not None and y.shape == x.shape:
                    d = NOISE_FACTOR * float((x - y).abs().max()) if x.numel() else 0.0
                    store[name] = max(store.get(name, 0.0), d)
    return noise


def run(job: dict, out: Path) -> None:
    from harness import traces

    engine, prompts = logprob_noise.load_reference(job)
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
