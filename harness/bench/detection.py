"""Detection: does the load-time gate catch a slower loader, and only then? (issue 13, target 3)

The load-time set is models.yaml's ``cpu-load`` tier. A *child* is what an engine child of
``harness run`` does for one cell's load: a fresh process (forked from a parent that imported the
libraries, as the runner's fork server does) runs the engine's own ``load`` (import warm-up, the
calibration workload, the timed loads; harness.loadtime). A *cell-run* is what the gate
does for one cell in one run: one child, and while the last child is over the threshold up to
``confirmations`` more (flagged when every child is over; harness.loadtime.confirm, as the
runner does it). A *run* is one cell-run of every cell; it flags when any cell flags. The issue's
rates are per run: a slower loader is caught when its run flags, and a clean run of the whole set
must not; the per-cell-run rates are reported beside them. The baseline a cell is compared with is
the median child of ``BASELINE_CHILDREN`` (harness.loadtime.baseline_load).

1. Choice: ``choice_runs`` clean runs of one child per cell with ``max(REPEATS)`` loads each (or
   ``loads``: vLLM builds a whole engine per load, so its cells are measured with one), each
   child followed at once by a second (``back_to_back``: as a confirmation follows). The first
   ``BASELINE_CHILDREN`` runs make the baseline. For every candidate rule (the first k loads, their
   min or median, 0 to ``max(CONFIRMATIONS)`` confirmations), the spread of the per-child log of
   load/calibration (pooled over cells; a robust standard deviation, the MAD's) and that of the
   back-to-back pairs give a normal model of a run (`Noise`): a level the children of one cell-run
   share (what moves between runs, and the baseline's own error: the median of B children has
   about pi/(2B) of a child's variance) and each child's own part. A confirmation only helps
   against the child's own part: the level stays (a slow drift over minutes made most of the
   false alarms of the runs that took confirmations as independent draws). Its threshold is
   where the model flags a clean run as often as it misses a run slowed by 20%, the two errors the
   issue bounds (rather than a false-alarm rate picked in advance: this host's tails are fatter than
   the normal's, on both sides); never below the largest value the rule compared with the threshold
   on the clean choice runs that made no baseline. The rule kept has the smallest of those errors,
   then the fewest confirmations and loads.
2. Held out: new runs under the rule, interleaved: clean runs (every cell) and runs slowed by 10%,
   20% and 50% (``HARNESS_TEST_HOOK=slow=F``, harness.hooks.slowdown: the reference loader's own
   reading repeated, vLLM's weight copies repeated; transformers' loader has no such hook; a slowed
   run is the cells of the engines with one slowed), each cell-run with its real confirmation children. Reported: the
   fraction of slowed runs flagged and of slowed cell-runs, the slowdown actually injected (per
   cell, the median calibrated ratio of the slowed runs' first children over that of the clean
   held-out runs', and its median over the cells), where the clean held-out runs sit against the
   baseline (``clean_level``, per cell: the drift the gate has to bear), the fraction of clean runs with a
   false alarm and of clean cell-runs, and the false-alarm rate per run the normal model predicts
   from the held-out spread (the statistical argument when the clean runs are fewer than 1 / rate);
   and the rates with the gate's later look, each flagged cell-run paired with the same cell's
   cell-run half the held-out phase later (``with_later_look``).
   Every child's samples are kept (``raw``), so that another rule can be judged on the same
   measurements.
"""
from __future__ import annotations

import atexit
import gc
import importlib
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from harness import loadtime
from harness import records as R
from harness.bench.noise_model import Noise, balanced_threshold, modelled_flag, robust_sd
from harness.loadtime import BASELINE_CHILDREN, load_statistic, lower_median, retimed
from harness.registry import ENGINES

REPEATS = (1, 3, 5, 9)
STATISTICS = ("min", "median")
CONFIRMATIONS = (0, 1, 2)
SLOWDOWNS = (0.1, 0.2, 0.5)
SLOWDOWN_TARGET = 0.2  # the slowdown the gate must catch (issue 13, target 3)
# Real load-time bugs re-introduced by a test-only mutation (harness.engines.vllm_mutations), each
# with the cells it applies to; timed in the held-out runs beside the slowdowns (issue 31, target 1).
MUTATIONS: dict[str, Callable[..., bool]] = {
    "torchao-full-size-dummy": lambda cell: cell.engine == "vllm" and cell.scheme.startswith("torchao"),
}


@dataclass(frozen=True)
class CellRun:
    """One child's timed loads of one cell: every load's seconds and the calibration."""

    cell: str
    samples: tuple[float, ...]
    calibration: float
    slow: float = 0.0
    workload: int | str = loadtime.CALIBRATION_WORKLOAD  # what the calibration timed

    def value(self, k: int, statistic: str, calibrated: bool = True) -> float:
        """load/calibration under a rule (the first ``k`` loads, their ``statistic``); the load
        seconds alone when not ``calibrated``."""

        return load_statistic(list(self.samples[:k]), statistic) / (self.calibration if calibrated else 1.0)

    def load_info(self) -> R.LoadInfo:
        """The child as the gate records it (its loads' ``loadtime.STATISTIC``)."""
        return R.LoadInfo(seconds=load_statistic(list(self.samples)), phases={"calibration": self.calibration},
                          calibration_workload=self.workload)


# One cell's children in one run: the first, then its confirmations.
Children = Sequence[CellRun]


@dataclass(frozen=True)
class Rule:
    repeats: int
    statistic: str
    threshold: float
    spread: float  # the robust sd of log(load/calibration) of one child
    confirmations: int = 0
    modelled_20: float | None = None  # the model's chance to flag a run slowed by 20%
    modelled_false_alarm: float | None = None  # ... and a clean run
    # the part of `spread` that differs between two children timed back to back (a confirmation's
    # distance); the rest is a level shared by both. None: every child independent.
    within: float | None = None
    calibrated: bool = True  # load / calibration; False: the load seconds alone

    def value(self, child: CellRun) -> float:
        return child.value(self.repeats, self.statistic, self.calibrated)

    def describe(self) -> str:
        again = (f", timed again in up to {self.confirmations} fresh children while over it (flag when all are)"
                 if self.confirmations else "")
        back = "" if self.within is None else f", {100 * self.within:.1f}% back to back"
        over, ratio = ("over the calibration", "calibrated ratio") if self.calibrated else ("in seconds", "ratio")
        return (f"{self.statistic} of {self.repeats} load(s) per child {over}; flag when the "
                f"{ratio} > {self.threshold:.3f}{again} (child-to-child spread {100 * self.spread:.1f}%"
                f"{back})")


@dataclass
class Detection:
    rule: Rule
    candidates: list[Rule]
    rates: dict[str, float | None]  # slowdown_10/20/50 (runs flagged), false_alarm (runs)
    cell_rates: dict[str, float | None]  # slowdown_10/20/50: the slowed cell-runs flagged
    injected: dict[str, float | None]  # slowdown_10/20/50: the slowdown measured (median over the cells)
    injected_by_cell: dict[str, dict[str, float]]  # slowdown_10/20/50: cell -> the slowdown measured
    clean_level: dict[str, float]  # cell -> the clean held-out runs' median calibrated ratio to the baseline
    clean_runs: int
    clean_cell_runs: int
    clean_cell_false_alarms: int
    confirmation_children: int  # children timed again over all held-out cell-runs
    slowed_runs: dict[str, int]
    slowed_cell_runs: dict[str, int]
    predicted_false_alarm: float
    seconds: float
    raw: dict = field(default_factory=dict)  # {"choice", "clean": [runs], "slowed": {fraction: [runs]}, "mutated"}
    # per mutation of MUTATIONS that applies to a cell: {"cells", "cell_runs", "flagged" (share of
    # its cell-runs the rule flags), "ratio" (median calibrated ratio of the first children to the baseline)}
    mutations: dict[str, dict] = field(default_factory=dict)
    # the rates with the gate's later look (:func:`with_later_look`): false_alarm, slowdown_10/20/50
    later_look: dict[str, float | None] = field(default_factory=dict)
    # the same measurement judged without the calibration (:func:`uncalibrated`): its rule and rates
    uncalibrated: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------ the statistics


def _spread(runs: Sequence[Sequence[CellRun]], k: int, stat: str, calibrated: bool = True) -> float:
    """Robust sd of log(value) around each cell's median, pooled over cells."""
    by_cell: dict[str, list[float]] = {}
    for run in runs:
        for cr in run:
            by_cell.setdefault(cr.cell, []).append(math.log(cr.value(k, stat, calibrated)))
    deviations = [v - statistics.median(vs) for vs in by_cell.values() for v in vs]
    return max(robust_sd(deviations), 1e-6)


def _back_to_back_sd(pairs: Sequence[tuple[CellRun, CellRun]], k: int, stat: str,
                     calibrated: bool = True) -> float | None:
    """The sd of one child's own part, from pairs of children timed back to back: the robust sd
    of their log difference over sqrt(2). None without pairs."""
    if not pairs:
        return None
    return max(robust_sd([math.log(a.value(k, stat, calibrated) / b.value(k, stat, calibrated)) for a, b in pairs])
               / math.sqrt(2), 1e-6)


def baseline_of(choice: Sequence[Sequence[CellRun]], k: int, stat: str, children: int,
                calibrated: bool = True) -> dict[str, float]:
    """Each cell's baseline value under a rule: its median child (the lower of an even count) of
    the first ``children`` choice runs, as harness.loadtime.baseline_load records one."""

    return {cell: lower_median([cr.value(k, stat, calibrated) for run in choice[:children] for cr in run
                                if cr.cell == cell], key=float)
            for cell in (cr.cell for cr in choice[0])}


def cell_flags(base: dict[str, float], children: Children, rule: Rule) -> bool:
    """A cell-run flags when every child the rule would time (the first and its confirmations)
    is over the threshold: the children of a cell-run gated for two rules at once (:func:`measure`)
    can go on past this rule's confirmations."""
    return all(rule.value(cr) / base[cr.cell] > rule.threshold for cr in children[:1 + rule.confirmations])


def choose(choice: Sequence[Sequence[CellRun]], *, slowed_cells: int, baseline_children: int,
           pairs: Sequence[tuple[CellRun, CellRun]] = (), calibrated: bool = True) -> tuple[Rule, list[Rule]]:
    """The rule (and every candidate) from clean choice runs (one child per cell each); the first
    ``baseline_children`` runs make the baseline. ``pairs``: children timed back to back, as a
    confirmation is (without them the model takes every child as independent). ``calibrated``:
    each child's load over its calibration, or its load seconds alone."""
    if len(choice) < baseline_children + 2:
        raise ValueError(f"choosing a rule needs >= {baseline_children + 2} clean choice runs "
                         f"({baseline_children} for the baseline), got {len(choice)}")
    cells = len(choice[0])
    held = choice[baseline_children:]
    most = min(len(cr.samples) for run in choice for cr in run)
    candidates = []
    for k in (r for r in REPEATS if r <= most):
        for stat in STATISTICS if k > 1 else ("min",):
            base = baseline_of(choice, k, stat, baseline_children, calibrated)
            sd, within = _spread(choice, k, stat, calibrated), _back_to_back_sd(pairs, k, stat, calibrated)
            noise = Noise.of(sd, within, baseline_children)
            for conf in CONFIRMATIONS:
                # What the rule compared with the threshold on the clean runs: each cell's lowest
                # of 1 + conf consecutive children.
                seen = max(min(run[i].value(k, stat, calibrated) for run in held[j:j + conf + 1]) / base[held[0][i].cell]
                           for i in range(cells) for j in range(max(1, len(held) - conf)))
                threshold = max(balanced_threshold(noise, conf, cells, slowed_cells, SLOWDOWN_TARGET), seen)
                candidates.append(Rule(k, stat, threshold, sd, conf,
                                       modelled_flag(threshold, noise, conf, slowed_cells, SLOWDOWN_TARGET),
                                       modelled_flag(threshold, noise, conf, cells, 0.0),
                                       None if within is None else min(within, sd), calibrated))

    def merit(r: Rule):  # the likelier error, then the cheaper rule: fewer confirmations, then loads
        return (max(1 - r.modelled_20, r.modelled_false_alarm), r.confirmations, r.repeats)

    return min(candidates, key=merit), candidates


def predicted_false_alarm(rule: Rule, clean: Sequence[Sequence[Children]], base: dict[str, float]) -> float:
    """The per-run false-alarm rate of the normal model fitted to held-out clean first children
    (their mean and spread; the back-to-back part of the spread as the rule's choice measured it)."""
    logs = [math.log(rule.value(ch[0]) / base[ch[0].cell]) for run in clean for ch in run]
    mu, sd = statistics.fmean(logs), max(robust_sd(logs), 1e-6)
    within = sd if rule.within is None else min(rule.within, sd)
    noise = Noise(math.sqrt(sd ** 2 - within ** 2), within)
    return modelled_flag(rule.threshold, noise, rule.confirmations, len(base), 0.0, mu)


def evaluate(rule: Rule, base: dict[str, float], clean: Sequence[Sequence[Children]],
             slowed: dict[float, list[list[Children]]]) -> dict:
    """Rates of the rule on held-out runs (see the module docstring); ``base`` each cell's
    baseline value under the rule."""
    def flags(runs):
        return [[cell_flags(base, ch, rule) for ch in run] for run in runs]

    clean_flags = flags(clean)
    out = {"false_alarm": _share(any(f) for f in clean_flags), "clean_cell_runs": sum(map(len, clean_flags)),
           "later_look": {"false_alarm": _share(with_later_look(clean_flags))},
           "clean_cell_false_alarms": sum(map(sum, clean_flags)),
           "confirmation_children": sum(len(ch) - 1 for runs in [clean, *slowed.values()] for run in runs for ch in run),
           "rates": {}, "cell_rates": {}, "injected": {}, "injected_by_cell": {}, "slowed_runs": {},
           "slowed_cell_runs": {}, "clean_level": _levels(rule, base, clean)}
    for fraction, runs in sorted(slowed.items()):
        key = slowdown_key(fraction)
        cells = caught(rule, base, runs)
        out["rates"][key] = _share(any(f) for f in flags(runs))
        out["later_look"][key] = _share(with_later_look(flags(runs)))
        out["cell_rates"][key] = cells["flagged"]
        # against the clean runs held out beside them, not the baseline: the level of a whole
        # held-out phase can sit apart from the choice runs' (drift), which is the gate's noise
        by_cell = {cell: level / out["clean_level"][cell] - 1 for cell, level in _levels(rule, base, runs).items()
                   if out["clean_level"].get(cell)}
        out["injected_by_cell"][key] = by_cell
        out["injected"][key] = statistics.median(by_cell.values()) if by_cell else None
        out["slowed_runs"][key], out["slowed_cell_runs"][key] = len(runs), cells["cell_runs"]
    return out


def with_later_look(flags: Sequence[Sequence[bool]]) -> list[bool]:
    """Each run's flag under the gate's later look (loadtime.LATER_LOOK_S): a cell flags only when
    its cell-run half the held-out phase later (counted round) flags too, a fresh look at the same
    gate minutes away, as the later look is. ``flags``: per run, each cell's flag, cells in one order."""
    n = len(flags)
    return [any(f and flags[(i + n // 2) % n][j] for j, f in enumerate(run)) for i, run in enumerate(flags)]


def _levels(rule: Rule, base: dict[str, float], runs: Sequence[Sequence[Children]]) -> dict[str, float]:
    """Each cell's median calibrated ratio to its baseline over the first children of ``runs``."""
    ratios: dict[str, list[float]] = {}
    for run in runs:
        for ch in run:
            ratios.setdefault(ch[0].cell, []).append(rule.value(ch[0]) / base[ch[0].cell])
    return {cell: statistics.median(r) for cell, r in ratios.items()}


def caught(rule: Rule, base: dict[str, float], runs: Sequence[Sequence[Children]]) -> dict:
    """How the rule judges a mutation's cell-runs: the share flagged and how large it is (the
    median calibrated ratio of their first children to the baseline)."""
    children = [ch for run in runs for ch in run]
    ratios = [rule.value(ch[0]) / base[ch[0].cell] for ch in children]
    return {"cells": sorted({ch[0].cell for ch in children}), "cell_runs": len(children),
            "flagged": _share(cell_flags(base, ch, rule) for ch in children),
            "ratio": statistics.median(ratios) if ratios else None}


def _share(flags) -> float | None:
    """The fraction of true values (None when there are none)."""
    flags = list(flags)
    return sum(flags) / len(flags) if flags else None


def slowdown_key(fraction: float) -> str:
    return f"slowdown_{round(100 * fraction)}"


# ------------------------------------------------------------------------------- the measuring


def _in_child(fn: Callable[[], dict]) -> dict:
    """``fn()`` in a forked child (its output silenced); its JSON-able result."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(r)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        try:
            data, code = json.dumps(fn()), 0
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            data, code = json.dumps({"error": f"{type(e).__name__}: {e}"}), 1
        with os.fdopen(w, "w") as f:
            f.write(data)
        os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        data = f.read()
    os.waitpid(pid, 0)
    result = json.loads(data or '{"error": "the child wrote nothing"}')
    if "error" in result:
        raise RuntimeError(f"load-time cell-run failed: {result['error']}")
    return result


def cell_run(cell, path, repeats: int, slow: float = 0.0, mutation: str | None = None) -> CellRun:
    """One cell-run: the engine's own load in a fresh (forked) process, ``repeats`` loads; slowed
    by ``slow``, or with the test-only vLLM ``mutation``."""

    def child() -> dict:
        # lazy: yaml, +80 ms (scripts/import-graph --costs)
        from harness.engines import base, vllm, worker

        loadtime.LOAD_REPEATS = repeats
        if mutation:
            os.environ[vllm.MUTATION_ENV] = mutation
        if slow:
            os.environ[worker.HOOK_ENV] = f"slow={slow}"
            worker.apply_hooks(cell.id)
        engine = base.engine_class(cell.engine)(cell)
        info = engine.load_timed_only(base.resolve_checkpoint(cell, str(path)))
        engine.close()
        return {"samples": info.samples or [info.seconds], "calibration": info.phases["calibration"],
                "workload": info.calibration_workload}

    out = _in_child(child)
    return CellRun(cell.id, tuple(out["samples"]), out["calibration"], slow, out["workload"])


def preload(cells, paths: dict) -> None:
    """Import in this (parent) process what the children would import, as the fork server does."""
    import torch

    # the reference engine too, so that the children it forks have it imported
    # lazy: torch and the engines, +1.1 s (scripts/import-graph --costs)
    from harness.engines import base, reference, transformers  # noqa: F401

    torch.set_num_threads(1)
    loadtime.calibration_file()
    for cell in cells:
        transformers.warm_imports(base.Checkpoint(paths[cell.id]))
    engines = {c.engine for c in cells}
    if len(engines) == 1:
        # one engine's cells (--detection-k): its fork server's imports too (vLLM's: ~10 s a child
        # otherwise); a mixed set leaves them to each child, as vLLM's would change the others' process
        importlib.import_module(ENGINES[engines.pop()].preload)
    gc.freeze()  # as the fork server does, and unfrozen at exit as its children are (harness.engines.forkserver)
    atexit.register(gc.unfreeze)


def gated(child: Callable[[], CellRun], *rules: tuple[Rule, dict[str, float]]) -> list[CellRun]:
    """One cell-run as the gate makes it: a ``child()``, and while the last is over the threshold
    up to ``rule.confirmations`` more. Given several (rule, baseline) pairs, while any of them has
    the last child over its threshold, up to the most confirmations: each rule then judges its own
    first children (:func:`cell_flags`), as if it alone had gated them."""

    return retimed(child(), child, lambda cr: any(cell_flags(base, [cr], rule) for rule, base in rules),
                   max(rule.confirmations for rule, _ in rules))


def measure(cells, paths: dict, *, choice_runs: int, held_out_runs: int, slowed_runs: int,
            echo: Callable[[str], None] = print, loads: int = max(REPEATS),
            slowdowns: Sequence[float] = SLOWDOWNS, baseline_children: int = BASELINE_CHILDREN) -> Detection:
    """Choose the rule on clean runs, then evaluate it on held-out runs (module docstring), slowed
    by each of ``slowdowns``."""

    t0 = time.perf_counter()
    preload(cells, paths)
    slow_cells = [c for c in cells if ENGINES[c.engine].slowdown_entry is not None]
    most = loads  # each choice child's loads: the candidate rules time at most that many
    choice, pairs = [], []
    for i in range(choice_runs):
        run = []
        for c in cells:  # each cell timed twice back to back, as a confirmation is
            run.append(cell_run(c, paths[c.id], most))
            pairs.append((run[-1], cell_run(c, paths[c.id], most)))
        choice.append(run)
        echo(f"  detection: choice run {i + 1}/{choice_runs} ({time.perf_counter() - t0:.0f} s)")
    rule, candidates = choose(choice, slowed_cells=len(slow_cells), baseline_children=baseline_children, pairs=pairs)
    echo(f"  detection: rule: {rule.describe()}")
    base = baseline_of(choice, rule.repeats, rule.statistic, baseline_children)
    # the same measurement judged on the load seconds alone: does the calibration earn its keep?
    plain, _ = choose(choice, slowed_cells=len(slow_cells), baseline_children=baseline_children, pairs=pairs,
                      calibrated=False)
    plain_base = baseline_of(choice, plain.repeats, plain.statistic, baseline_children, calibrated=False)
    both = ((rule, base), (plain, plain_base))
    loads_timed = max(rule.repeats, plain.repeats)
    clean, slowed = [], {f: [] for f in slowdowns}
    mutated = {name: [] for name, applies in MUTATIONS.items() if any(map(applies, cells))}
    for i in range(max(held_out_runs, slowed_runs)):
        if i < held_out_runs:
            clean.append([gated(lambda c=c: cell_run(c, paths[c.id], loads_timed), *both) for c in cells])
        if i < slowed_runs:
            for f in slowdowns:
                slowed[f].append([gated(lambda c=c: cell_run(c, paths[c.id], loads_timed, f), *both)
                                  for c in slow_cells])
            for name, runs in mutated.items():
                runs.append([gated(lambda c=c: cell_run(c, paths[c.id], loads_timed, mutation=name), *both)
                             for c in cells if MUTATIONS[name](c)])
        echo(f"  detection: held-out run {i + 1}/{max(held_out_runs, slowed_runs)} ({time.perf_counter() - t0:.0f} s)")
    ev = evaluate(rule, base, clean, slowed)
    return Detection(rule=rule, candidates=candidates, rates={**ev["rates"], "false_alarm": ev["false_alarm"]},
                     cell_rates=ev["cell_rates"], injected=ev["injected"], injected_by_cell=ev["injected_by_cell"],
                     clean_level=ev["clean_level"], clean_runs=len(clean),
                     clean_cell_runs=ev["clean_cell_runs"], clean_cell_false_alarms=ev["clean_cell_false_alarms"],
                     confirmation_children=ev["confirmation_children"],
                     slowed_runs=ev["slowed_runs"], slowed_cell_runs=ev["slowed_cell_runs"],
                     predicted_false_alarm=predicted_false_alarm(rule, clean, base) if clean else float("nan"),
                     mutations={name: caught(rule, base, runs) for name, runs in mutated.items()},
                     later_look=ev["later_look"], uncalibrated=uncalibrated(plain, plain_base, clean, slowed),
                     seconds=time.perf_counter() - t0,
                     raw={"choice": [[vars(cr) for cr in run] for run in choice],
                          "back_to_back": [vars(b) for _, b in pairs], "clean": _plain(clean),
                          "slowed": {str(f): _plain(runs) for f, runs in slowed.items()},
                          "mutated": {name: _plain(runs) for name, runs in mutated.items()}})


def uncalibrated(rule: Rule, base: dict[str, float], clean: Sequence[Sequence[Children]],
                 slowed: dict[float, list[list[Children]]]) -> dict:
    """The rule chosen on the load seconds alone and its rates on the same held-out children, to
    weigh against the calibrated rule's (docs/design.md, "Load time")."""
    ev = evaluate(rule, base, clean, slowed)
    return {"rule": rule.describe(), "threshold": rule.threshold, "spread": rule.spread,
            "confirmations": rule.confirmations, "false_alarm": ev["false_alarm"],
            "false_alarm_runs": round((ev["false_alarm"] or 0) * len(clean)),
            "clean_cell_false_alarms": ev["clean_cell_false_alarms"], "rates": ev["rates"],
            "cell_rates": ev["cell_rates"], "later_look": ev["later_look"],
            "predicted_false_alarm": predicted_false_alarm(rule, clean, base) if clean else float("nan")}


def _plain(runs: Sequence[Sequence[Children]]) -> list[list[list[dict]]]:
    return [[[vars(cr) for cr in ch] for ch in run] for run in runs]
