"""Measuring each module's noise for the localisation (docs/design.md, "Localisation"): the
parent side, which the tracer calls. The reference traces the same sequences in fresh interpreters
(harness.noise_child) under this machine's kernels and under other ones, because a kernel variable
such as ``ATEN_CPU_CAPABILITY`` only takes effect before torch is imported: run A (this machine's
own kernels) against one run per set of :func:`other_kernels`. A module's noise tells kernel
rounding from a bug in a module diff; no verdict is predicted from it.
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
from harness.traces.noise import Measured, noise_between

if TYPE_CHECKING:
    from harness.matrix import Cell

PROBE_TIMEOUT_S = 600


class NoiseError(Exception):
    """The module noise of a cell could not be measured. ``str()`` is one line."""


# Lowered capabilities to measure against, in order of preference: the first one that differs
# from the record's own.
CAPABILITIES = ("default", "avx2")


def other_kernels(own: str | None) -> list[tuple[str, str | None, dict[str, str]]]:
    """``(label, capability, environment overlay)`` of each kernel set module noise is measured against,
    beside ``own`` (the capability the record ran under): harness.cpu.KERNEL_CONDITIONS, with the
    lowered capability the first of CAPABILITIES that is not ``own``, and the AVX2
    machine left out where ``own`` is AVX2 already (it is then the libraries' AVX2 paths)."""
    lowered = next((c for c in CAPABILITIES if c != own), None)
    out = [(lowered or "?", lowered, {}), (f"{own or '?'}+libraries-avx2", own, cpu.LIBRARIES_AVX2)]
    if own != cpu.AVX2_MACHINE["ATEN_CPU_CAPABILITY"]:
        out.append(("avx2+libraries-avx2", None, cpu.AVX2_MACHINE))
    return out


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
        raise NoiseError(f"module noise probe timed out after {PROBE_TIMEOUT_S} s") from None
    if p.returncode != 0 or not out.exists():
        last = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise NoiseError(f"module noise probe (capability {capability or 'native'}) failed: {last}")


def measure_modules(cell: Cell, sequences: dict[str, list[int]], fuse: bool, own: str | None) -> Measured:
    """The traces of reference children, A under ``own`` (the capability the cell's record ran
    under, its ``engine_info.cpu``) and one per set of :func:`other_kernels`, and the noise of every
    module (harness.traces.noise). Raises NoiseError with one line when a child fails."""
    job = {"cell": cell.model_dump(mode="json"), "sequences": sequences, "fuse": fuse}
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
