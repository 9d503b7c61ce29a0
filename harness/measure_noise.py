"""Measuring a cell's noise (docs/design.md, "Portability across CPUs" and "Localisation"): the
parent side, which the runner and the tracer call. Each measurement runs the reference in fresh
interpreters (harness.noise_child) under this machine's kernels and under other ones, because a
kernel variable such as ``ATEN_CPU_CAPABILITY`` only takes effect before torch is imported.

- :func:`for_cell` / :func:`measure`: the logprob noise a baseline stores (harness.noise.Noise);
- :func:`measure_modules`: the per-module noise of a fingerprint (harness.traces.noise).

Both compare run A (this machine's own kernels) with one run per set of :func:`other_kernels`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from harness import cpu, traces
from harness.noise import Noise, NoiseError, other_capability
from harness.registry import fuses_shards
from harness.traces.noise import Measured, noise_between

if TYPE_CHECKING:
    from harness.matrix import Cell
    from harness.records import Record

PROBE_TIMEOUT_S = 600


_measured: dict[tuple, Noise] = {}


def for_cell(cell: Cell):
    """The ``measure_noise`` step of baselines.handle for ``cell``: measures on CPU records only
    (the kernel variable means nothing to a GPU), once per model, scheme, fixture, sequences and
    execution (fused or not), which is all the engines of a cell can differ in here."""
    def measure_record(record: Record) -> Noise | None:
        if not (record.engine_info.platform or "").startswith("cpu-"):
            return None
        key = (cell.model, cell.scheme, fuses_shards(cell.engine), record.fixture.identity if record.fixture else None,
               json.dumps({s.prompt.id: s.scored.tokens for s in record.sequences}))
        if key not in _measured:
            _measured[key] = measure(cell, record)
        return _measured[key]
    return measure_record


def other_kernels(own: str | None) -> list[tuple[str, str | None, dict[str, str]]]:
    """``(label, capability, environment overlay)`` of each kernel set a noise is measured against,
    beside ``own`` (the capability the record ran under): harness.cpu.KERNEL_CONDITIONS, with the
    lowered capability the first of harness.noise.CAPABILITIES that is not ``own``, and the AVX2
    machine left out where ``own`` is AVX2 already (it is then the libraries' AVX2 paths)."""
    lowered = other_capability(own)
    out = [(lowered or "?", lowered, {}), (f"{own or '?'}+libraries-avx2", own, cpu.LIBRARIES_AVX2)]
    if own != cpu.AVX2_MACHINE["ATEN_CPU_CAPABILITY"]:
        out.append(("avx2+libraries-avx2", None, cpu.AVX2_MACHINE))
    return out


def measure(cell: Cell, record: Record) -> Noise:
    """The noise of ``cell`` on the sequences ``record`` scored, from reference children that
    execute the checkpoint as the cell's engine does: fused per-tensor FP8 shards share one
    requantized weight, which moves every activation after them (docs/design.md, "Fusion rule"),
    so an engine that never fuses is measured on the unfused reference."""
    own = record.engine_info.cpu.capability if record.engine_info.cpu else None
    sequences = {s.prompt.id: s.scored.tokens for s in record.sequences}
    with tempfile.TemporaryDirectory(prefix="harness-noise-") as tmp:
        job = {"cell": cell.model_dump(mode="json"), "sequences": sequences, "fuse": fuses_shards(cell.engine)}
        others = []
        for i, (label, capability, env) in enumerate(other_kernels(own)):
            out = Path(tmp) / f"other{i}.pt"
            _child({**job, "role": "record"}, out, tmp, capability=capability, kernel_env=env)
            others.append({"path": str(out), "kernels": label})
        a_out = Path(tmp) / "a.json"
        _child({**job, "role": "analyse", "others": others}, a_out, tmp, capability=own)
        return Noise.model_validate_json(a_out.read_text())


def _child(job: dict, out: Path, tmp: str, capability: str | None, kernel_env: dict[str, str] | None = None) -> None:
    """Run ``python -m harness.noise_child JOB OUT`` under ``capability`` and ``kernel_env``
    (harness.cpu's kernel-restricting variables)."""
    job_path = Path(tmp) / f"{out.stem}.job.json"
    job_path.write_text(json.dumps(job))
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if capability:
        env["ATEN_CPU_CAPABILITY"] = capability
    env.update(kernel_env or {})
    env.setdefault("OMP_NUM_THREADS", "1")
    try:
        p = subprocess.run([sys.executable, "-m", "harness.noise_child", str(job_path), str(out)], env=env,
                           stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise NoiseError(f"noise probe ({job['role']}) timed out after {PROBE_TIMEOUT_S} s") from None
    if p.returncode != 0 or not out.exists():
        last = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise NoiseError(f"noise probe ({job['role']}, capability {capability or 'native'}) failed: {last}")


def measure_modules(cell: Cell, sequences: dict[str, list[int]], fuse: bool, own: str | None) -> Measured:
    """The traces of reference children, A under ``own`` (the capability the cell's record ran
    under, its ``engine_info.cpu``) and one per set of :func:`other_kernels`, and the noise of every
    module (harness.traces.noise). Raises NoiseError with one line when a child fails."""
    job = {"cell": cell.model_dump(mode="json"), "sequences": sequences, "fuse": fuse, "role": "trace"}
    kernels = [(own or "?", own, {}), *other_kernels(own)]
    with tempfile.TemporaryDirectory(prefix="harness-trace-noise-") as tmp:
        runs = []
        for i, (_, capability, env) in enumerate(kernels):
            out = Path(tmp) / f"run{i}.pt"
            _child(job, out, tmp, capability=capability, kernel_env=env)
            runs.append(traces.load(out))
    a, others = runs[0], runs[1:]
    labels = [label for label, _, _ in kernels]
    return Measured(noise_between(a, others, "reference" if fuse else "reference-unfused", labels), a, others)
