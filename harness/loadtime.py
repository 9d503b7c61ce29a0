"""The in-run calibration of load time, and the timed loads of a gated cell.

A load on a slower (or busier) machine is slower without the loader being any worse. The engine
child therefore times a fixed workload OUTSIDE the loader, in the same process, right before and
right after the load, and records it as the load phase ``calibration``; the comparison gates the
calibrated ratio (load / calibration, obtained, over the same of the baseline; harness.compare,
``loadcheck.check_load_time``). The workload resembles a load, in two parts whose times enter as their
geometric mean: a memory pass reads a fixed file through the page cache (a checkpoint's bytes),
converts its half-precision values to float32 (a decode) and reduces them (memory bandwidth), into
buffers allocated once per process (fresh memory's page faults cost what the process freed before); a
dispatch pass makes many small tensors and operations on them (the interpreter and torch's
dispatcher and allocator, where a loader's many small tensors spend their time: the gated loads take
tens of milliseconds and are bound by both). Their sizes are fixed, so a slower loader is never
calibrated away. (Which parts: `harness bench` data, docs/design.md, "Load time".) A load that is
mostly other work is calibrated by that work instead (the engine names it): vLLM's torchao load,
mostly torchao's ``quantize_`` over full-size weights, by one such ``quantize_``
(``TORCHAO_QUANTIZE``), whose speed follows torch's kernels as that load's does and the
memory-and-dispatch workload's does not.

``timed_load(load_once, gated, checkpoint_dir)`` runs, on a gated tier, an untimed read of the
checkpoint's files into the page cache (``warm_page_cache``), a full garbage collection, the
calibration, ``LOAD_REPEATS`` loads, the calibration again, and returns the LoadInfo: ``seconds``
the ``STATISTIC`` of the loads (the rule chosen from measurements, docs/design.md, "Load time"),
``samples`` every load, ``phases["calibration"]`` the faster of the two calibrations, plus the
engine's own phases of the load reported.

One child is one draw of a shared machine's mood: on a busy host a whole child runs several percent
slow, loads and calibration alike but not by the same factor. So across children, ``confirm``
re-times a gated cell found over its bound in up to ``CONFIRMATIONS`` fresh children and reports
the fastest (the cell flags only when every child is over). Those children share the host's level
of the moment, which wanders over minutes (an AMX Xeon: two cells 7-8% over their recording for
several minutes and back within 18, docs/decisions.md, "A later look for a load over its bound"): a cell over the bound in every
child is therefore looked at again ``LATER_LOOK_S`` after its first child, in as many fresh
children, and flags only when over in those too. And ``baseline_load`` records the
median of ``BASELINE_CHILDREN`` children as a baseline, whose own error would otherwise enter every
later comparison. The runner provides the fresh children (harness.runner, a ``load`` child).
"""
from __future__ import annotations

import functools
import gc
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from harness import cpu
from harness.fixtures.cache import bench_cache_root
from harness import records as R

# 32 MiB of float16 values (16 Mi elements): about as long as a small load's read and decode here.
CALIBRATION_BYTES = 32 << 20
# The dispatch pass's small operations (~12 ms here).
CALIBRATION_OPS = 3000
# The reads that bring a gated checkpoint into the page cache before its loads are timed.
PAGE_CACHE_CHUNK = 16 << 20
# The timed passes of each part before the loads and after them; each part's fastest is kept. A
# memory pass is ~25-80 ms here: its own noise enters every calibrated ratio, and more passes cost little.
CALIBRATION_REPEATS = 4
CALIBRATION_REPEATS_AFTER = 2
# The loads a gated cell times in each child and the statistic it reports, the fresh children that
# confirm a cell over its bound, with models.yaml's load_time bound the gate's rule, chosen by
# `harness bench` (BENCHMARKS.md, target 3; docs/decisions.md, "The committed rule: first load, two
# confirmations, bound 1.113": one load per child, child-to-child spread 1.8% (1.8% back to back), 2 confirmations, bound 1.113).
LOAD_REPEATS = 1
STATISTIC = "min"
CONFIRMATIONS = 2
# How long after a cell's first child its later look begins: longer than the one excursion of the
# host's level measured (over for at least 3.5 minutes, back by 18; docs/decisions.md, "A later look for a load over its bound").
# Paid only by a cell over its bound in every child of its first look, so by a real regression.
LATER_LOOK_S = 600.0
# The pairs of fresh children that time a candidate build's gated load against the pinned build's
# (:func:`paired`): even, so that each build loads first as often as second; four, because the
# median of four children is the steadiest of the rules tried on vLLM's cells (docs/decisions.md,
# "A candidate build's load time against the base, in balanced pairs").
CANDIDATE_PAIRS = 4
# The rounds of such pairs a candidate outside its bound is timed in, at most: over (or under) only
# when every one is (one clean round in 14 read over, docs/decisions.md, "A candidate build's load time against the
# base, in balanced pairs").
CANDIDATE_ROUNDS = 2
# The children a gated baseline is the median of (the detection bench takes its baseline the same way).
BASELINE_CHILDREN = 5
# Variables that change what a load's first touch of fresh memory costs, and so its time, but no
# result: torch's huge-page allocations and the C library's allocator tunables (glibc.malloc.hugetlb
# gives its allocations huge pages too). Under THP_MEM_ALLOC_ENABLE=1 vLLM's loads and the
# calibrations moved apart, each its own way (BENCHMARKS.md, "Why vLLM's loads do not carry
# across kinds of CPU"). Not LD_PRELOAD: vLLM's CPU platform rewrites it for its own processes (libgomp).
# A gated load says which were set (LoadInfo.allocation).
ALLOCATION_ENV = ("THP_MEM_ALLOC_ENABLE", "GLIBC_TUNABLES")
REPO_ROOT = Path(__file__).resolve().parents[1]


def calibration_path() -> Path:
    return bench_cache_root() / f"calibration-{CALIBRATION_BYTES}.bin"


def calibration_file() -> Path:
    """The workload's input file, written once (deterministic bytes; its writing is never timed)."""
    path = calibration_path()
    root = path.parent
    if not path.is_file() or path.stat().st_size != CALIBRATION_BYTES:
        import numpy as np

        root.mkdir(parents=True, exist_ok=True)
        values = np.random.Generator(np.random.PCG64(0)).standard_normal(CALIBRATION_BYTES // 2).astype(np.float16)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_bytes(values.tobytes())
        os.replace(tmp, path)
    return path


# The calibration workload's version, recorded beside it (LoadInfo.calibration_workload): a ratio
# of two calibrations of different workloads means nothing, so harness.compare calibrates only
# between equal versions. 2: the memory pass into reused buffers (2026-12-04); 1, or none, before.
CALIBRATION_WORKLOAD = 2
# The workload of a load that is mostly torchao quantizing full-size float weights (vLLM's torchao
# load, docs/findings.md): one int8 weight-only quantize_ of a fixed [5632, 2048] float32 weight,
# as vLLM's torchao_quantize_param_data runs it (docs/decisions.md, "vLLM's torchao load calibrated by
# torchao's quantize_").
TORCHAO_QUANTIZE = "torchao-quantize-1"
TORCHAO_QUANTIZE_SHAPE = (5632, 2048)
# The memory pass's two buffers, allocated once per process and reused: a pass that allocated its
# own would time the page faults of fresh memory, which depend on what the process had freed before
# (in a vLLM child a pass after the load ran 0.6-0.95 of one before it, docs/decisions.md, "The
# calibration's memory pass reuses its buffers").
_MEMORY_BUFFERS: dict[int, tuple[bytearray, object]] = {}


def memory_buffers(size: int) -> tuple[bytearray, object]:
    """The memory pass's buffers for a file of ``size`` bytes: its bytes, and them as float32."""
    import torch

    if size not in _MEMORY_BUFFERS:
        _MEMORY_BUFFERS[size] = (bytearray(size), torch.empty(size // 2, dtype=torch.float32))
    return _MEMORY_BUFFERS[size]


def memory_pass(path: Path) -> float:
    """One memory pass: read the file into its buffer, float16 -> float32 into the other, sum.
    Returns its seconds."""
    import torch

    raw, wide = memory_buffers(path.stat().st_size)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as stream:
        stream.readinto(raw)
    total = wide.copy_(torch.frombuffer(raw, dtype=torch.float16)).sum()
    seconds = time.perf_counter() - t0
    del total
    return seconds


def dispatch_pass() -> float:
    """One dispatch pass: ``CALIBRATION_OPS`` times a small tensor made, filled and scaled."""
    import torch

    source = torch.zeros(64)
    t0 = time.perf_counter()
    for _ in range(CALIBRATION_OPS):
        torch.empty(64).copy_(source).mul_(2)
    return time.perf_counter() - t0


@functools.cache
def torchao_quantize_weight():
    """The torchao pass's fixed weight, made once per process (deterministic values)."""
    import torch

    return torch.randn(TORCHAO_QUANTIZE_SHAPE, generator=torch.Generator().manual_seed(0))


def torchao_quantize_pass() -> float:
    """One torchao pass: a linear layer built on the meta device given the fixed weight, then
    torchao's int8 weight-only ``quantize_`` over it. Returns its seconds."""
    import torch
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    rows, columns = TORCHAO_QUANTIZE_SHAPE
    with torch.device("meta"):
        # quantize_ swaps the weights of submodules, never of the module it is given
        holder = torch.nn.Sequential(torch.nn.Linear(columns, rows, bias=False))
    holder[0].weight = torch.nn.Parameter(torchao_quantize_weight(), requires_grad=False)
    t0 = time.perf_counter()
    quantize_(holder, Int8WeightOnlyConfig())
    return time.perf_counter() - t0


# Each workload's passes (looked up when called, so a test can replace one); its calibration is the
# geometric mean of each pass's fastest.
WORKLOADS: dict[int | str, tuple[Callable[[], float], ...]] = {
    CALIBRATION_WORKLOAD: (lambda: memory_pass(calibration_file()), lambda: dispatch_pass()),
    TORCHAO_QUANTIZE: (lambda: torchao_quantize_pass(),),
}


def calibrate(repeats: int = CALIBRATION_REPEATS, warm: bool = True,
              workload: int | str = CALIBRATION_WORKLOAD) -> float:
    """The calibration of ``workload``, in seconds: the geometric mean of the fastest of ``repeats``
    runs of each of its passes (the default: a memory pass and a dispatch pass); with ``warm``, after
    a first run of each that brings the file into the page cache and the code paths in."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown calibration workload {workload!r} (known: {', '.join(map(repr, WORKLOADS))})")
    passes = WORKLOADS[workload]
    if warm:
        for one_pass in passes:
            one_pass()
    fastest = [min(one_pass() for _ in range(repeats)) for one_pass in passes]
    return math.prod(fastest) ** (1 / len(fastest))


def load_statistic(samples: list[float], statistic: str | None = None) -> float:
    """The load time a cell reports from its timed loads: their minimum or median."""
    statistic = statistic or STATISTIC
    if statistic == "min":
        return min(samples)
    if statistic == "median":
        return float(statistics.median(samples))
    raise ValueError(f"unknown load statistic {statistic!r} (min, median)")


def warm_page_cache(directory: Path) -> bool:
    """Read the checkpoint's files once, untimed, so that the timed loads find them in the page
    cache; only where they fit in half the memory available. Whether it did."""
    files = [f for f in directory.iterdir() if f.is_file()]
    available = cpu.available_memory()
    if available is None or sum(f.stat().st_size for f in files) > available // 2:
        return False
    for f in files:
        with open(f, "rb", buffering=0) as stream:
            while stream.read(PAGE_CACHE_CHUNK):
                pass
    return True


def timed_load(load_once: Callable[[], tuple[float, dict[str, float]]], gated: bool,
               checkpoint_dir: Path | None = None, workload: int | str = CALIBRATION_WORKLOAD) -> R.LoadInfo:
    """Time the loads of one cell (``load_once() -> (seconds, phases)``): on a gated tier, the
    checkpoint's files read into the page cache (``checkpoint_dir``) and a full collection, then
    ``LOAD_REPEATS`` loads between two calibrations of ``workload``; elsewhere one load,
    uncalibrated. The caller keeps whatever the last load produced."""
    repeats = LOAD_REPEATS if gated else 1
    if gated and checkpoint_dir is not None:
        warm_page_cache(checkpoint_dir)
    if gated:
        # A full collection starts every child's timed loads from the same state: else one lands
        # in the load that crosses the collector's threshold, which depends on what the parent had
        # allocated before the fork (docs/design.md, "The garbage collector").
        gc.collect()
    before = calibrate(workload=workload) if gated else None
    runs = [load_once() for _ in range(repeats)]
    after = calibrate(CALIBRATION_REPEATS_AFTER, warm=False, workload=workload) if gated else None
    samples = [s for s, _ in runs]
    seconds = load_statistic(samples)
    phases = dict(min(runs, key=lambda r: abs(r[0] - seconds))[1])  # the phases of the load reported
    if gated:
        phases["calibration"] = min(before, after)
    return R.LoadInfo(seconds=seconds, phases=phases, samples=samples if repeats > 1 else [],
                      calibration_workload=workload if gated else None,
                      allocation=allocation_env() if gated else {})


def allocation_env() -> dict[str, str]:
    """The :data:`ALLOCATION_ENV` variables set in this process."""
    return {k: os.environ[k] for k in ALLOCATION_ENV if os.environ.get(k)}


def calibrated(info: R.LoadInfo) -> float:
    """The quantity the gate compares: load / calibration (the plain load where none was timed)."""
    cal = info.phases.get("calibration")
    return info.seconds / cal if cal else info.seconds


def retimed(first, retime: Callable, over: Callable[..., bool], confirmations: int | None = None) -> list:
    """``first`` and, while the last is ``over`` the bound, another timing from a fresh child
    (``retime()``; None when that child failed), at most ``confirmations`` more: every timing, in
    order. The gate's confirmation, shared with harness.bench.detection's measurement of it."""
    confirmations = CONFIRMATIONS if confirmations is None else confirmations
    timings = [first]
    while over(timings[-1]) and len(timings) <= confirmations:
        again = retime()
        if again is None:
            break
        timings.append(again)
    return timings


def confirm(first: R.LoadInfo, retime: Callable[[], R.LoadInfo | None],
            over: Callable[[R.LoadInfo], bool], confirmations: int | None = None,
            later: Callable[[], None] | None = None) -> R.LoadInfo:
    """:func:`retimed` for a cell's LoadInfo: the fastest child is reported, every child listed.
    When every child is over, ``later()`` (it waits until the later look is due) and a second
    :func:`retimed` from a fresh child: the cell is over only when every child of both is."""
    infos = retimed(first, retime, over, confirmations)
    if later is not None and all(map(over, infos)):
        later()
        again = retime()
        if again is not None:
            infos += retimed(again, retime, over, confirmations)
    return _reported(infos, min(infos, key=calibrated))


def paired(retime: Callable[[], R.LoadInfo | None], retime_base: Callable[[], R.LoadInfo | None], bound: float,
           pairs: int = CANDIDATE_PAIRS, rounds: int = CANDIDATE_ROUNDS) -> tuple[R.LoadInfo, R.LoadInfo] | None:
    """A candidate build's load against the pinned build's: a round is ``pairs`` pairs of fresh
    children (``retime``, ``retime_base``; None when a child failed) in alternating order, the
    candidate first, then the base first, so that neither build always loads right after the
    other, and its ratio is the candidate's median child over the base's (the lower of an even
    count), by load seconds. A round outside [1/``bound``, ``bound``] is confirmed by another, at
    most ``rounds`` in all; the round nearest a ratio of 1 decides, so the candidate is over (or
    under) only when every round is (a spell of the host can cover a round). Uncalibrated: the two builds share the host of the
    same minutes, which is what the calibration stands in for elsewhere, and its own noise would
    only widen the ratio (docs/decisions.md, "A candidate build's load time against the base, in
    balanced pairs"); for the same reason no
    later look. Returns (candidate, base), each the deciding round's median child without its
    ``calibration`` phase, every child of every round listed; None when no round was completed."""
    done: list[tuple[list[R.LoadInfo], list[R.LoadInfo]]] = []
    while len(done) < rounds and (not done or not 1 / bound <= _ratio_of(done[-1]) <= bound):
        timed = _round(retime, retime_base, pairs)
        if timed is None:
            break
        done.append(timed)
    if not done:
        return None
    mine, theirs = min(done, key=lambda timed: abs(math.log(_ratio_of(timed))))
    every_mine = [info for timed, _ in done for info in timed]
    every_theirs = [info for _, timed in done for info in timed]
    return _median_uncalibrated(every_mine, mine), _median_uncalibrated(every_theirs, theirs)


def _round(retime, retime_base, pairs: int) -> tuple[list[R.LoadInfo], list[R.LoadInfo]] | None:
    mine, theirs = [], []
    for n in range(pairs):
        order = ((retime_base, theirs), (retime, mine)) if n % 2 else ((retime, mine), (retime_base, theirs))
        for timer, into in order:
            again = timer()
            if again is None:
                return None
            into.append(again)
    return mine, theirs


def round_ratios(mine: R.LoadInfo, theirs: R.LoadInfo, pairs: int = CANDIDATE_PAIRS) -> list[float]:
    """Each round's ratio, in order, of a candidate's and a base's loads as :func:`paired` returns
    them (every child of every round listed, round by round)."""
    return [_ratio_of((mine.children[n:n + pairs], theirs.children[n:n + pairs]))
            for n in range(0, len(mine.children), pairs)]


def _ratio_of(timed: tuple[Sequence[R.LoadInfo | R.ChildLoad], Sequence[R.LoadInfo | R.ChildLoad]]) -> float:
    mine, theirs = timed
    return _median_child(mine).seconds / _median_child(theirs).seconds


def _median_child(infos: Sequence[R.LoadInfo | R.ChildLoad]):
    return lower_median(list(infos), key=lambda info: info.seconds)


def _median_uncalibrated(every: list[R.LoadInfo], deciding: list[R.LoadInfo]) -> R.LoadInfo:
    chosen = _median_child(deciding)
    phases = {k: v for k, v in chosen.phases.items() if k != "calibration"}
    return _reported(every, chosen.model_copy(update={"phases": phases}))


def lower_median(items: list, key: Callable):
    """The median item by ``key`` (the lower one of an even count)."""
    ranked = sorted(items, key=key)
    return ranked[(len(ranked) - 1) // 2]


def baseline_load(first: R.LoadInfo, retime: Callable[[], R.LoadInfo | None],
                  children: int | None = None) -> R.LoadInfo:
    """The load a baseline records: the median child (the lower one of an even count) of
    ``children`` fresh children, ``first`` among them; every child listed."""
    infos = [first]
    for _ in range((BASELINE_CHILDREN if children is None else children) - 1):
        again = retime()
        if again is None:
            break
        infos.append(again)
    return _reported(infos, lower_median(infos, key=calibrated))


def unsteady_baseline(load: R.LoadInfo, bound: float) -> str | None:
    """What to say when a baseline's fastest child is faster than its median child (the level it
    stores) by more than the cell's bound, calibrated: the median is then not the cell's level on
    this machine, and a loader slower by up to that much passes whenever its child loads fast
    (vLLM unquantized on the AMX Xeon: 0.75-2.14 s, docs/decisions.md, "Confirmations in fresh
    children; a baseline the median of five").
    A slow child alone leaves the median where it was; a gate child that slow is timed again
    (:func:`confirm`)."""
    values = sorted(c.seconds / c.calibration if c.calibration else c.seconds for c in load.children)
    if len(values) < 2 or values[0] <= 0:
        return None
    median = values[(len(values) - 1) // 2]
    if median / values[0] <= bound:
        return None
    return (f"load time: unsteady here: of its {len(values)} children the fastest loaded {median / values[0]:.2f}x "
            f"faster than the median it stores (calibrated), more than the bound {bound:g}, so the median is not "
            "this cell's level on this machine and the gate cannot hold its bound against it")


def _reported(infos: list[R.LoadInfo], chosen: R.LoadInfo) -> R.LoadInfo:
    if len(infos) == 1:
        return chosen
    return chosen.model_copy(update={"children": [
        R.ChildLoad(seconds=i.seconds, calibration=i.phases.get("calibration")) for i in infos]})
