"""Measuring each module's noise for the localisation (docs/design.md, "Localisation"): the
parent side, which the tracer calls. The reference traces the same sequences in children
(harness.noise_child) under this machine's kernels and under other ones: run A (this machine's own
kernels) against one run per set of :func:`other_kernels`. A kernel variable such as
``ATEN_CPU_CAPABILITY`` only takes effect before torch is imported, so each set of kernels has its
own fork server (harness.supervise), whose environment holds it; the servers are started together,
their imports overlapping, and serve every later measurement of the process. A module's noise tells
kernel rounding from a bug in a module diff; no verdict is predicted from it.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from harness import cpu, supervise, traces
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


def _env(capability: str | None, kernel_env: dict[str, str]) -> dict[str, str]:
    """A noise child's environment: ours under ``capability`` and ``kernel_env`` (harness.cpu's
    kernel-restricting variables)."""
    env = supervise.child_env(kernel_env, threads=1)
    env.pop("ATEN_CPU_CAPABILITY", None)
    if capability:
        env["ATEN_CPU_CAPABILITY"] = capability
    return env


def _child(job: dict, tmp: Path, env: dict[str, str], preload: str | None) -> None:
    """Run one noise child (forked from ``preload``'s server; spawned when None); raises NoiseError
    naming the capability and the end of its log."""
    name = Path(job["out"]).stem
    log = tmp / f"{name}.log"
    exit = supervise.Supervisor().run(job, tmp / f"{name}.job.json", log, env, main="harness.noise_child",
                                      preload=preload, timeout=PROBE_TIMEOUT_S)
    if exit.code is None:
        raise NoiseError(f"module noise probe timed out after {PROBE_TIMEOUT_S} s")
    if exit.code != 0 or not Path(job["out"]).exists():
        last = (log.read_text(errors="replace").strip().splitlines() or ["no output"])[-1]
        raise NoiseError(f"module noise probe (capability {env.get('ATEN_CPU_CAPABILITY', 'native')}) failed: {last}")


def measure_modules(cell: Cell, sequences: dict[str, list[int]], fuse: bool, own: str | None) -> Measured:
    """The traces of reference children, A under ``own`` (the capability the cell's record ran
    under, its ``engine_info.cpu``) and one per set of :func:`other_kernels`, and the noise of every
    module (harness.traces.noise). Raises NoiseError with one line when a child fails."""
    kernels = [(own or "?", own, {}), *other_kernels(own)]
    envs = [_env(capability, kernel_env) for _, capability, kernel_env in kernels]
    preload = supervise.preload_for("reference")
    if preload is not None:
        for env in envs:  # all started now: their imports overlap
            supervise.fork_server(preload, env)
    with tempfile.TemporaryDirectory(prefix="harness-trace-noise-") as tmp:
        runs = []
        for i, env in enumerate(envs):
            job = {"cell": cell.model_dump(mode="json"), "sequences": sequences, "fuse": fuse,
                   "out": str(Path(tmp) / f"run{i}.pt")}
            _child(job, Path(tmp), env, preload)
            runs.append(traces.load(Path(job["out"])))
    a, others = runs[0], runs[1:]
    labels = [label for label, _, _ in kernels]
    return Measured(noise_between(a, others, "reference" if fuse else "reference-unfused", labels), a, others)
