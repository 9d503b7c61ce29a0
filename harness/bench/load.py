"""Load measurement: one load of one checkpoint by one engine, in a fresh child process.

``measure(engine, path)`` starts ``python -m harness.bench.load`` and returns what the child
measured (:class:`LoadResult`). The child imports everything the load imports lazily first (the
engines' own warm-ups, harness.engines.reference/transformers ``warm_imports``), so import time is
never load time, then records:

- ``rss_after_imports_mb``: its resident set after the imports;
- ``load_s``: the engine's load (``harness.reference.load``, or transformers' ``from_pretrained``
  as the transformers engine calls it) plus touching every parameter and buffer (a sum over
  each, so nothing lazily mapped is left unread). The reference's quantized weights are no
  parameters: they stay stored and are read by the forward pass, which ``load_forward_s`` counts;
- ``forward_s``: one forward pass of a fixed 16-token prompt after it (``load_forward_s`` is their sum);
- ``peak_mb``: the peak resident set since exec (``VmHWM``); ``library_mb``: the shared
  libraries' code and data paged in after the imports (file-backed pages of every mapping but
  the checkpoint's files: the first call of a kernel pages its code in, about 14 MB on an S
  forward pass, whichever engine calls it); ``peak_extra_mb``: the peak less the resident set
  after the imports and less ``library_mb``, the memory the load itself needed
  (``peak_raw_extra_mb`` keeps the library pages in);
- ``phases``: the reference's load phases; ``profile``: a cProfile top-N when asked for.

``floor(path)`` is the time to read the checkpoint's weight files from the page cache into one
preallocated buffer (the fastest of three reads after a first one that fills the page cache): no
loader can load the bytes faster than it can read them.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from harness.engines import reference as reference_engine
from harness.engines import transformers as transformers_engine
from harness.engines.base import Checkpoint
from harness.fixtures.benchmark import weight_files
from harness.loadtime import warm_page_cache

ENGINES = ("reference", "transformers")
PROMPT_TOKENS = 16
PROFILE_TOP = 15


@dataclass
class LoadResult:
    engine: str
    load_s: float
    forward_s: float
    rss_after_imports_mb: float
    peak_mb: float
    library_mb: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    profile: str | None = None

    @property
    def load_forward_s(self) -> float:
        return self.load_s + self.forward_s

    @property
    def peak_raw_extra_mb(self) -> float:
        return self.peak_mb - self.rss_after_imports_mb

    @property
    def peak_extra_mb(self) -> float:
        return self.peak_raw_extra_mb - self.library_mb


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def _peak_mb() -> float:
    """This process's peak resident set since its exec: ``VmHWM``. Not getrusage's ``ru_maxrss``,
    which Linux carries over exec from the forked parent: a child of a parent holding 1.8 GB
    reported a 1.8 GB peak for a load that never held 0.4 GB."""
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return kib * 1024 / 1e6


_MAPPING = re.compile(r"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \S+\s*(.*)$")


def _library_mb(checkpoint_files: set[str]) -> float:
    """Resident file-backed pages of every mapping but the checkpoint's files, in MB."""
    total_kb, path = 0, ""
    with open("/proc/self/smaps") as f:
        for line in f:
            if (header := _MAPPING.match(line)) is not None:
                path = header.group(1).strip()
            elif line.startswith("Rss:") and path.startswith("/") and path not in checkpoint_files:
                total_kb += int(line.split()[1])
    return total_kb / 1e3


def _plain(t) -> list:
    """The plain tensors holding ``t``'s data (a quantized tensor subclass holds several)."""
    if hasattr(t, "__tensor_flatten__") and type(t).__name__ not in ("Tensor", "Parameter"):
        names, _ = t.__tensor_flatten__()
        return [x for n in names for x in _plain(getattr(t, n))]
    return [t]


def _touch(model) -> None:
    """Read every weight: a sum over every parameter's and buffer's data."""
    import torch

    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            for plain in _plain(t.data if isinstance(t, torch.nn.Parameter) else t):
                plain.reshape(-1).sum(dtype=torch.float32)


def _loader(engine: str, path: Path):
    """The engine's load (after its warm-up), as a function returning the model."""
    checkpoint = Checkpoint(path)
    if engine == "reference":
        from harness import reference  # lazy: torch and the formats' libraries, ~5 s (scripts/import-graph --costs)

        reference_engine.warm_imports(checkpoint)
        return lambda: reference.load(path)
    import torch
    import transformers

    transformers_engine.warm_imports(checkpoint)
    cls = getattr(transformers, checkpoint.config["architectures"][0])

    def load():
        model = cls.from_pretrained(path, device_map="cpu", dtype=torch.float32).eval()
        transformers_engine.bnb_float_compute(model)
        return model

    return load


def _child(engine: str, path: Path, profile: bool) -> dict:
    import torch

    torch.set_num_threads(1)
    load = _loader(engine, path)
    checkpoint_files = {str(f.resolve()) for f in weight_files(path)}
    rss, library = _rss_mb(), _library_mb(checkpoint_files)
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    t0 = time.perf_counter()
    loaded = load()
    model = loaded.model if engine == "reference" else loaded
    _touch(model)
    load_s = time.perf_counter() - t0
    if profiler is not None:
        profiler.disable()
    t1 = time.perf_counter()
    with torch.no_grad():
        model(input_ids=torch.arange(1, PROMPT_TOKENS + 1).unsqueeze(0), use_cache=False)
    forward_s = time.perf_counter() - t1
    phases = {k: float(v) for k, v in loaded.report.timings.items()} if engine == "reference" else {}
    library = max(0.0, _library_mb(checkpoint_files) - library)
    return asdict(LoadResult(engine=engine, load_s=load_s, forward_s=forward_s, rss_after_imports_mb=rss,
                             peak_mb=_peak_mb(), library_mb=library, phases=phases,
                             profile=_top(profiler) if profiler else None))


def _top(profiler) -> str:
    import io
    import pstats

    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(PROFILE_TOP)
    return out.getvalue()


def _child_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
            "PYTHONWARNINGS": "ignore"}


def measure(engine: str, path: Path, profile: bool = False, timeout_s: float = 1800) -> LoadResult:
    """One load of ``path`` by ``engine`` in a fresh child process."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r} (known: {', '.join(ENGINES)})")
    cmd = [sys.executable, "-m", "harness.bench.load", engine, str(path), *(["--profile"] if profile else [])]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=_child_env(), check=False)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"{path}: the {engine} load child failed (exit {done.returncode}): {tail[0]}")
    return LoadResult(**json.loads(done.stdout.strip().splitlines()[-1]))


def floor(path: Path, repeats: int = 3) -> float:
    """Seconds to read the weight files from the page cache into one preallocated buffer."""
    files = weight_files(path)
    buffer = bytearray(max(f.stat().st_size for f in files))
    warm_page_cache(path)  # the gated engines' own: a floor read from the disk is no floor
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                view = memoryview(buffer)
                while (n := fh.readinto(view)):
                    view = view[n:]
        best = min(best, time.perf_counter() - t0)
    return best


if __name__ == "__main__":  # python -m harness.bench.load ENGINE PATH [--profile]
    print(json.dumps(_child(sys.argv[1], Path(sys.argv[2]), "--profile" in sys.argv[3:])))
