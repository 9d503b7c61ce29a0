"""Schedules and judges the selected cells: engine child -> record -> verdict -> baselines -> results.

One :class:`Runner` serves ``harness run`` (a group at a time, ``-j`` groups at once) and the
pytest plugin (one cell per test, any number of xdist workers). A *group* is one (model, scheme):
its engines' cells score the same token sequence (harness.sequences) and are compared with each
other. The engine children are harness.supervise's, their files where harness.layout says.

**Probes before fetching.** harness.probes.preflight (:meth:`Runner.decided`) makes a
misconfigured cell an ``error`` record and one this machine cannot run ``unsupported``, before any
child, fixture or fetch (docs/design.md, "Probes before fetching").

**Judging** (:meth:`Runner.judge`). First the evidence: the baselines chosen (harness.resolver),
the checks against them and the group's other records of this run (harness.evidence; the reference
executed unfused stands in where fusing differs: docs/design.md, "Fusion rule"), the localisation
of a failing cell and the rounding flips it shows. Then the one judgement, judging.decide.

**Load time across children** (harness.gate, harness.loadtime): on a gated tier a cell over its
bound is timed again in fresh children, and a later look, before its verdict.

**Baselines** (harness.baseline_step). A cell whose baseline the run writes (``update_baselines``,
or ``update_kernel_baselines`` where its baseline does not carry) is judged against what it
writes; failed, error and unsupported cells are refused. Else a mismatch's obtained file is written.

**Writes checked first.** :meth:`Runner.writes` (harness.run_writes) lists every path the run may
write; ``harness run`` refuses a run in one line when one cannot be written, before anything runs.

**A candidate build** (``harness run --candidate``): after its group is judged, each cell of that
engine runs again under the candidate's interpreter with the same sequences, judged against the
base's record of this run (:meth:`Runner.judge_candidate`; docs/design.md, "Candidate builds").

**A configuration cell** (models.yaml ``configurations``: tensor-parallel, compiled): run once its
plain cell is judged, judged against it (harness.configurations); selecting it adds its plain cell.

**Traces.** A cell with a failing check its known failures do not excuse (every cell with
``trace``) is localised against the engines it disagrees with and its baseline's fingerprint;
``update_fingerprints`` refreshes those fingerprints (harness.traces.jobs; docs/design.md,
"Localisation").
"""
from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from filelock import FileLock

from harness import baselines as B
from harness import compare as C
from harness import judging
from harness import configurations, cpu, evidence, loadtime, probes, resolver
from harness import records as R
from harness import run_writes, supervise
from harness.accuracy.store import AccuracyBaseline
from harness.files import Written
from harness.baseline_step import BaselineStep
from harness.gate import LoadGate
from harness.layout import Layout, group_key
from harness.matrix import CPU_TIERS, ENGINES, TIERS, Cell, Matrix, expand
from harness.registry import fuses_shards
from harness.sequences import ScoredSequences
from harness.traces.jobs import BASE_BUILD, PLAIN_CELL, Tracer

if TYPE_CHECKING:
    from harness.candidates import Candidate

__all__ = ["CellResult", "Runner", "group_key"]


# What one running cell may hold resident: a vLLM cell peaks at ~2 GiB here (1 GiB of it the KV
# cache, VLLM_CPU_KVCACHE_SPACE=1), the most of any cpu-tiny cell.
CELL_MEMORY_BYTES = 3 * 2**30


def default_jobs(threads: int | None = None) -> int:
    """``harness run -j``'s default: a group per core (each cell runs ``threads`` torch threads;
    a vLLM cell binds one core), at most as many as the available memory holds at
    CELL_MEMORY_BYTES a running cell (a group runs one cell at a time)."""
    threads = threads or int(os.environ.get(supervise.THREADS_ENV) or 1)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    jobs = cores // threads
    memory = cpu.available_memory()
    if memory is not None:
        jobs = min(jobs, memory // CELL_MEMORY_BYTES)
    return max(1, jobs)


def _engine_order(cell: Cell) -> int:
    return ENGINES.index(cell.engine)


@dataclass
class CellResult:
    cell: Cell
    record: R.Record  # judged
    outcome: B.Outcome = field(default_factory=B.Outcome)
    messages: list[str] = field(default_factory=list)  # what the baseline handling did, one line each
    sequence_source: str = ""

    @property
    def verdict(self) -> str:
        return self.record.verdict or "error"


class Runner:
    def __init__(self, matrix: Matrix, cells: Sequence[Cell], *, results: str | Path,
                 baselines_root: str | Path = B.DEFAULT_ROOT, update_baselines: bool = False,
                 matrix_path: str | Path | None = None, threads: int | None = None,
                 echo: Callable[[str], None] | None = None, trace: bool = False, update_fingerprints: bool = False,
                 candidates: Mapping[str, Candidate] | None = None, candidate_dir: str = "candidate",
                 update_kernel_baselines: bool = False, later_look_s: float = loadtime.LATER_LOOK_S):
        self.matrix = matrix
        universe = expand(matrix, tier=TIERS)
        self.cells = sorted(configurations.with_bases(cells, universe), key=lambda c: (group_key(c), _engine_order(c)))
        # the configuration cells, each run once its plain cell is judged (harness.configurations)
        self.configured = configurations.ConfigurationRuns(self.cells)
        self.results = Path(results)
        self.layout = Layout(self.results)
        # engine -> the candidate build that runs beside the pinned one (harness run --candidate)
        self.candidates = dict(candidates or {})
        self.candidate_layout = self.layout.candidate(candidate_dir)
        self.baselines_root = Path(baselines_root)
        self.update_baselines = update_baselines
        self.update_fingerprints = update_fingerprints
        self.update_kernel_baselines = update_kernel_baselines
        self.baselines = BaselineStep(self.baselines_root, update_baselines, update_kernel_baselines)
        self.gate = LoadGate(self, later_look_s)
        self.tracer = Tracer(self, always=trace)
        self.matrix_dir = Path(matrix_path).resolve().parent if matrix_path else supervise.REPO_ROOT
        self.threads = threads or int(os.environ.get(supervise.THREADS_ENV) or 1)
        self.echo = echo or (lambda s: None)
        self._echo_lock = threading.Lock()
        self.supervisor = supervise.Supervisor()
        self._decided: dict[str, R.Record | None] = {}
        self.groups: dict[str, list[Cell]] = {}
        for c in self.cells:
            if c.configuration is None:
                self.groups.setdefault(group_key(c), []).append(c)
        # every engine of a group in the matrix (selected or not, on-demand tiers too), for baseline-derived sequences
        matrix_cells: dict[str, list[Cell]] = {}
        for c in sorted(universe, key=_engine_order):
            if c.configuration is None:
                matrix_cells.setdefault(group_key(c), []).append(c)
        self.sequences = ScoredSequences(self.baselines_root, matrix_cells, self.layout.sequences, self._compute_sequences)

    def record_path(self, cell: Cell) -> Path:
        return self.layout.record(cell.id)

    def prepare(self, fresh: bool = True) -> None:
        """Create the results directory; with ``fresh``, forget raw results of the selected cells
        left by an earlier run into the same directory."""
        if fresh:
            self.layout.prepare([c.id for c in self.cells], self.groups)
            self.tracer.forget([c.id for c in self.cells])
        else:
            self.layout.prepare()
        if self.candidates:
            self.candidate_layout.prepare([c.id for c in self.candidate_cells()] if fresh else ())

    def say(self, line: str) -> None:
        with self._echo_lock:
            self.echo(line)

    def writes(self) -> list[Written]:
        """Every path this run may write (harness.run_writes)."""
        return run_writes.writes(self)

    # ---- probes before fetching -----------------------------------------------------------------
    def decided(self, cell: Cell) -> R.Record | None:
        """The record harness.probes.preflight decided for the cell before any child starts, any
        fixture is built or any checkpoint fetched: ``error`` for a misconfigured cell,
        ``unsupported`` for hardware or an engine environment this machine cannot provide. None
        when the cell runs."""
        if cell.id not in self._decided:
            d = probes.preflight(cell, self.matrix_dir)
            rec = None
            if not d.runs:
                have = probes.installed(cell.engine)
                info = R.EngineInfo(name=cell.engine, version=have[1] if have else None,
                                    environment=cell.environment, platform=R.cpu_platform())
                if d.status == "unsupported":
                    rec = R.Record.for_cell(cell, engine_info=info, status="unsupported", unsupported_reason=d.reason)
                else:
                    rec = R.Record.for_cell(cell, engine_info=info, status="error",
                                            error=R.ErrorInfo(type="ConfigurationError", message=d.reason))
            self._decided[cell.id] = rec
        return self._decided[cell.id]

    # ---- engine children ---------------------------------------------------------------------
    def scored_sequences(self, key: str) -> tuple[dict[str, list[int]] | None, str]:
        if all(self.decided(c) is not None for c in self.groups[key]):
            return None, "none (no engine of this group runs here)"
        return self.sequences.get(key, self.groups[key])

    def _compute_sequences(self, cells: list[Cell], path: Path) -> None:
        """Rule 2 of harness.sequences: the reference cell writes its scored sequences to ``path``
        as it runs, or a continuation-only reference child does."""
        ref = next((c for c in cells if c.engine == "reference"), None)
        if ref is not None:
            self._ensure_raw(ref, sequences=None, sequences_out=path)
            return
        cell, key = cells[0], group_key(cells[0])
        rec_path = self.layout.continuation(key)
        self.say(f"        computing the scored sequences of {key} with the reference engine")
        rec = self.run_child(cell, mode="continuation", sequences=None, record_path=rec_path,
                              sequences_out=path, log=self.layout.log(f"{cell.id}.continuation"))
        if rec is not None and rec.status != "ok":
            self.say(f"        reference continuation of {key} failed ({rec.status}); "
                     "each engine scores its own greedy continuation")

    def ensure_raw(self, cell: Cell) -> R.Record:
        """The cell's unjudged record: read from raw/ when another process made it, else run."""
        raw = self.layout.raw(cell.id)
        if raw.exists():
            return R.load(raw)
        if self.decided(cell) is not None:
            return self._ensure_raw(cell, None, None)
        seqs, _ = self.scored_sequences(group_key(cell))
        return self._ensure_raw(cell, seqs, None)

    def _ensure_raw(self, cell: Cell, sequences, sequences_out: Path | None) -> R.Record:
        raw = self.layout.raw(cell.id)
        with FileLock(str(raw) + ".lock"):
            if raw.exists():
                return R.load(raw)
            rec = self.decided(cell)
            if rec is None:
                wants_witness = cell.engine == "reference" and any(not fuses_shards(c.engine)
                                                                   for c in self.groups[group_key(cell)])
                rec = self.run_child(cell, mode="cell", sequences=sequences, record_path=raw,
                                      sequences_out=sequences_out, log=self.layout.log(cell.id),
                                      witness=self.layout.witness(cell.id) if wants_witness else None)
            R.save(raw, rec)
            return rec

    def run_child(self, cell: Cell, *, mode: str, sequences, record_path: Path, log: Path,
                   sequences_out: Path | None = None, witness: Path | None = None,
                   extra: dict | None = None, python: str | None = None) -> R.Record | None:
        """Run the engine child under the cell's timeout (under ``python``: a candidate build's
        interpreter; default ours): its record, or an error record for a timeout, a crash or a
        missing record (None in continuation mode on success)."""
        info_path = self.layout.info(record_path)
        for p in (record_path, info_path):
            p.unlink(missing_ok=True)
        job = {
            "mode": mode,
            "cell": cell.model_dump(mode="json"),
            "path": str((self.matrix_dir / cell.path).resolve()) if cell.path else None,
            "sequences": sequences,
            "threads": self.threads,
            "record": str(record_path),
            "info": str(info_path),
            "sequences_out": str(sequences_out) if sequences_out else None,
            "witness": str(witness) if witness else None,
            **(extra or {}),  # a trace child's output path and engine options (harness.traces.jobs)
        }
        engine = "reference" if mode == "continuation" else cell.engine
        exit = self.supervisor.run(job, self.layout.job(record_path), log, self._child_env(cell),
                                   preload=supervise.preload_for(engine), timeout=cell.timeout_s, python=python)
        return supervise.child_record(cell, exit, record_path, info_path, log, record_expected=mode == "cell")

    def _child_env(self, cell: Cell) -> dict[str, str]:
        return supervise.child_env(self.matrix.environments[cell.environment].env, self.threads)

    def start_fork_servers(self) -> None:
        """Start the fork servers the cells to run need, now: their imports (vLLM's take 7-9 s)
        overlap the first cells instead of delaying the first cell of each engine environment."""
        for cell in self.cells:
            preload = supervise.preload_for(cell.engine)
            if preload is not None and self.decided(cell) is None:
                supervise.fork_server(preload, self._child_env(cell))
                if cell.engine in self.candidates:
                    supervise.fork_server(preload, self._child_env(cell), python=self.candidates[cell.engine].python)

    # ---- judging -------------------------------------------------------------------------
    def unfused(self, raws: dict[str, R.Record]) -> R.Record | None:
        """The group's reference executed unfused (its witness), when it ran and is ok."""
        ref = raws.get("reference")
        path = self.layout.witness(ref.cell) if ref is not None else None
        if path is None or not path.exists():
            return None
        try:
            w = R.load(path)
        except R.RecordError:
            return None
        return w if w.status == "ok" else None

    def _gather(self, cell: Cell, record: R.Record, raws: dict[str, R.Record], baseline,
                accuracy_baseline=None, load_baseline=None) -> R.Record:
        """The record with its checks and evidence against ``baseline`` and the group's other
        engines of this run (harness.evidence.gather_for)."""
        group = self.groups[group_key(cell)]
        return evidence.gather_for(cell, record, baseline, [r for e, r in raws.items() if e != cell.engine],
                                   known_failures=[k for c in group for k in c.known_failures],
                                   unfused=self.unfused(raws), accuracy_baseline=accuracy_baseline,
                                   load_baseline=load_baseline)

    def judge(self, cell: Cell, record: R.Record, raws: dict[str, R.Record]) -> CellResult:
        """Everything the verdict needs first (the baselines chosen, the checks, the localisation
        and the rounding flips it shows), then the one judgement (judging.decide), then the
        baselines it writes or the obtained files. A cell whose baseline this run writes is judged
        against what it writes."""
        try:
            found = resolver.resolve(self.baselines_root, record)
        except B.BaselineError as e:
            gathered = self._gather(cell, record, raws, None)
            return CellResult(cell, C.Judgement("error", f"baseline unreadable: {e}", gathered.checks,
                                                evidence=gathered.evidence).apply(record))
        load_here = (self.update_kernel_baselines and cell.gate_load_time
                     and (found.load_baseline is None or B.other_kernels(record, found.load_baseline)))
        record, retimed = self.gate.settle(cell, record, found.load_baseline,
                                           recording=self.update_baselines or load_here)
        stored = self._gather(cell, record, raws, found.baseline, found.accuracy, found.load_baseline)
        result = CellResult(cell, stored, messages=retimed + found.notes(self.baselines_root, record, cell.gate_load_time))
        into = self.baselines.writes_into(result, found, load_here)
        if into is not None and record.status == "ok":  # judged against what it writes
            written = B.Baseline.from_record(record)
            result.record = self._gather(cell, record, raws, written,
                                         AccuracyBaseline.from_record(record) if record.accuracy else found.accuracy)
        self._localise(result, raws)
        result.record = judging.explain_flips(result.record)
        result.record = judging.decide(result.record, cell.known_failures).apply(result.record)
        self.baselines.handle(result, into or found.root, into is not None, stored)
        done = self.tracer.refresh_fingerprint(result.cell, result.record) if self.update_fingerprints else None
        result.messages += [done] if done else []
        return result

    def _localise(self, result: CellResult, raws: dict[str, R.Record]) -> None:
        """The module traces' localisation (harness.traces.jobs) of a failed or regressed cell (of
        every cell under ``trace``), before its baseline is handled: a rounding flip it shows
        settles the verdict (judging.rounding_flip)."""
        self._add_localisation(result, self.tracer.localise(result.cell, result.record, raws))

    @staticmethod
    def _add_localisation(result: CellResult, found: list[R.Localisation]) -> None:
        if found:
            result.record = result.record.model_copy(update={"localisation": found})
            result.messages += [f"localisation against {loc.against}: {loc.detail}" for loc in found]
            result.messages += [f"against {loc.against}: {loc.rounding_flip.detail}" for loc in found if loc.rounding_flip]

    def finish(self, result: CellResult) -> CellResult:
        layout = self.candidate_layout if result.record.candidate is not None else self.layout
        R.save(layout.record(result.cell.id), result.record)
        return result

    # ---- a candidate build beside the pinned one ----------------------------------------------
    def candidate_cells(self) -> list[Cell]:
        """The selected cells whose engine has a candidate build in this run."""
        return [c for c in self.cells if c.engine in self.candidates and c.configuration is None]

    def judge_candidate(self, cell: Cell, base: CellResult, raws: dict[str, R.Record]) -> CellResult:
        """The cell run on its engine's candidate build, with the group's scored sequences, and
        judged against ``base``, the pinned build's judged result of this run
        (judging.judge_against_base), and localised against the pinned build when it fails
        (harness.traces.jobs). It writes no baseline."""
        candidate = self.candidates[cell.engine]
        layout = self.candidate_layout
        rec = self.decided(cell)
        if rec is None:
            rec = self.run_child(cell, mode="cell", sequences=self.scored_sequences(group_key(cell))[0],
                                 record_path=layout.raw(cell.id), log=layout.log(cell.id), python=candidate.python)
        rec = rec.model_copy(update={"candidate": candidate.spec})
        R.save(layout.raw(cell.id), rec)
        rec, against, retimed = self.gate.pair(cell, rec, base.record, layout, candidate.python)
        group = self.groups[group_key(cell)]
        j = judging.judge_against_base(cell, rec, against, [r for e, r in raws.items() if e != cell.engine],
                                       known_failures=[k for c in group for k in c.known_failures],
                                       unfused=self.unfused(raws))
        result = CellResult(cell, j.apply(rec), messages=retimed, sequence_source=base.sequence_source)
        self._add_localisation(result, self.tracer.against_base(cell, result.record, cell, BASE_BUILD, candidate.python))
        return result

    def judge_configuration(self, cell: Cell, base: CellResult, raws: dict[str, R.Record]) -> CellResult:
        """A configuration cell (harness.configurations) run with its group's scored sequences,
        judged against ``base``, its plain cell's judged result of this run, and localised against
        it when it fails and its traces are recorded (Cell.untraceable). It writes no baseline."""
        rec = self.decided(cell)
        if rec is None:
            rec = self.run_child(cell, mode="cell", sequences=self.scored_sequences(group_key(cell))[0],
                                 record_path=self.layout.raw(cell.id), log=self.layout.log(cell.id))
        judged = configurations.judge(cell, rec, base.record, raws, self.groups[group_key(cell)], self.unfused(raws))
        result = CellResult(cell, judged, sequence_source=base.sequence_source)
        if not cell.untraceable:
            self._add_localisation(result, self.tracer.against_base(cell, result.record, base.cell, PLAIN_CELL))
        return result

    # ---- entry points ---------------------------------------------------------------------
    def run_cell(self, cell: Cell) -> CellResult:
        """One cell, judged against the other selected engines of its group (running them when no
        other process has), a configuration cell against its plain cell: the pytest plugin's entry
        point."""
        if cell.base is None:
            return self._run_cell(cell, self._group_raws(cell))
        plain = next(c for c in self.groups[group_key(cell)] if c.id == cell.base)
        raws = self._group_raws(plain)
        return self.finish(self.judge_configuration(cell, self._run_cell(plain, raws), raws))

    def run_candidate_cell(self, cell: Cell) -> CellResult:
        """The cell on its engine's candidate build, judged against the pinned build's result of
        this session (judged again here: under pytest-xdist it may have run on another worker)."""
        raws = self._group_raws(cell)
        return self.finish(self.judge_candidate(cell, self._run_cell(cell, raws), raws))

    def _group_raws(self, cell: Cell) -> dict[str, R.Record]:
        raws = {cell.engine: self.ensure_raw(cell)}
        for other in self.groups[group_key(cell)]:
            if other.engine != cell.engine:
                raws[other.engine] = self.ensure_raw(other)
        return raws

    def _run_cell(self, cell: Cell, raws: dict[str, R.Record]) -> CellResult:
        result = self.judge(cell, raws[cell.engine], raws)
        result.sequence_source = self.scored_sequences(group_key(cell))[1]
        return self.finish(result)

    def run_group(self, key: str) -> list[CellResult]:
        group = self.groups[key]
        raws = {c.engine: self.ensure_raw(c) for c in group}
        source = self.scored_sequences(key)[1]
        out = []
        for c in group:
            r = self.judge(c, raws[c.engine], raws)
            r.sequence_source = source
            out.append(self.finish(r))
        out += [self.finish(self.judge_candidate(r.cell, r, raws)) for r in list(out) if r.cell.engine in self.candidates]
        out += [self.finish(self.judge_configuration(c, r, raws))
                for r in list(out) if r.record.candidate is None for c in self.configured.of(r.cell)]
        return out

    def run(self, jobs: int = 1, progress: Callable[[int, int, CellResult], None] | None = None) -> list[CellResult]:
        """Every selected cell, ``jobs`` groups at a time; results in cell order."""
        total = len(self.cells) + len(self.candidate_cells())
        done: list[CellResult] = []
        lock = threading.Lock()

        def work(key: str) -> list[CellResult]:
            rs = self.run_group(key)
            with lock:
                for r in rs:
                    done.append(r)
                    if progress is not None:
                        with self._echo_lock:
                            progress(len(done), total, r)
            return rs

        keys, timed = untimed_and_timed(self.groups)
        self.start_fork_servers()
        if jobs <= 1:
            for k in keys:
                work(k)
        else:
            ex = ThreadPoolExecutor(max_workers=jobs)
            try:
                for f in [ex.submit(work, k) for k in keys]:
                    f.result()
            except BaseException:  # Ctrl-C: the children lead their own process groups, end them
                ex.shutdown(wait=False, cancel_futures=True)
                self.supervisor.kill_all()
                raise
            ex.shutdown()
        self.gate.meanwhile.extend(functools.partial(work, k) for k in timed)
        while self.gate.meanwhile:
            self.gate.meanwhile.popleft()()
        order = {c.id: i for i, c in enumerate(self.cells)}
        return sorted(done, key=lambda r: (order[r.cell.id], r.record.candidate is not None))


def untimed_and_timed(groups: dict[str, list[Cell]]) -> tuple[list[str], list[str]]:
    """The group keys run ``jobs`` at a time, and those run after them one at a time with nothing
    beside them: the groups whose CPU load time is gated (cpu-load), as harness bench's detection
    timed them when it chose their rule."""
    timed = [k for k, cells in groups.items() if any(c.gate_load_time and c.tier in CPU_TIERS for c in cells)]
    return [k for k in groups if k not in timed], timed
