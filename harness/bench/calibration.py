"""The in-run calibration of load time, and the timed loads of a gated cell.

A load on a slower (or busier) machine is slower without the loader being any worse. The engine
child therefore times a fixed workload OUTSIDE the loader, in the same process, right before and
right after the load, and records it as the load phase ``calibration``; the comparison gates the
calibrated ratio (load / calibration, obtained, over the same of the baseline; harness.compare,
``check_load_time``). The workload resembles a load: it reads a fixed file through the page cache
(a checkpoint's bytes), converts its half-precision values to float32 (a decode) and reduces them
(memory bandwidth). Its size is fixed, so a slower loader is never calibrated away.

``timed_load(load_once, repeats)`` runs the calibration, ``repeats`` loads, the calibration again,
and returns the LoadInfo: ``seconds`` the fastest load (the statistic chosen from measurements,
docs/design.md, "Load time"), ``samples`` every load, ``phases["calibration"]`` the faster of the
two calibrations, plus the engine's own phases of its fastest load.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from harness import records as R

# 32 MiB of float16 values (16 Mi elements): about as long as a small load's read and decode here.
CALIBRATION_BYTES = 32 << 20
# The repetitions of the workload in one calibration (the fastest is kept).
CALIBRATION_REPEATS = 3
REPO_ROOT = Path(__file__).resolve().parents[2]


def calibration_file() -> Path:
    """The workload's input file, written once (deterministic bytes; its writing is never timed)."""
    root = Path(os.environ.get("HARNESS_BENCH_CACHE") or REPO_ROOT / ".cache" / "bench")
    path = root / f"calibration-{CALIBRATION_BYTES}.bin"
    if not path.is_file() or path.stat().st_size != CALIBRATION_BYTES:
        import numpy as np

        root.mkdir(parents=True, exist_ok=True)
        values = np.random.Generator(np.random.PCG64(0)).standard_normal(CALIBRATION_BYTES // 2).astype(np.float16)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_bytes(values.tobytes())
        os.replace(tmp, path)
    return path


def workload(path: Path) -> float:
    """One pass of the workload: read the file, float16 -> float32, sum. Returns its seconds."""
    import torch

    t0 = time.perf_counter()
    data = bytearray(path.read_bytes())
    total = torch.frombuffer(data, dtype=torch.float16).to(torch.float32).sum()
    seconds = time.perf_counter() - t0
    del total
    return seconds


def calibrate(repeats: int = CALIBRATION_REPEATS) -> float:
    """The calibration: the fastest of ``repeats`` passes of the workload, in seconds."""
    path = calibration_file()
    workload(path)  # the first pass brings the file into the page cache and the code paths in
    return min(workload(path) for _ in range(repeats))


def timed_load(load_once: Callable[[], tuple[float, dict[str, float]]], repeats: int = 1,
               calibrated: bool = True) -> R.LoadInfo:
    """Time ``repeats`` loads (``load_once() -> (seconds, phases)``), between two calibrations
    when ``calibrated``. The caller keeps whatever the last load produced."""
    before = calibrate() if calibrated else None
    runs = [load_once() for _ in range(max(1, repeats))]
    after = calibrate() if calibrated else None
    seconds, phases = min(runs, key=lambda r: r[0])
    phases = dict(phases)
    if calibrated:
        phases["calibration"] = min(before, after)
    return R.LoadInfo(seconds=seconds, phases=phases, samples=[s for s, _ in runs] if repeats > 1 else [])
