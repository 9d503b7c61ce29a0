"""Runs selected cells: fixture -> engine (child process) -> record -> verdict -> baselines -> results.

One :class:`Runner` serves both ``harness run`` (all selected cells, a group at a time, ``-j``
groups at once) and the pytest plugin (one cell per test, any number of xdist workers). A *group*
is one (model, scheme): the cells of its engines must score the same token sequence and are
compared with each other.

Results directory (``--results``; one per run)::

    <cell id>.json               the judged result record of each cell (the report reads *.json)
    logs/<cell id>.log           the engine child's stdout and stderr
    raw/<cell id>.json           the unjudged record, shared between pytest-xdist workers
    raw/<cell id>.info.json      the engine identity, written by the child before it loads
    witness/<cell id>.unfused.json   the reference executed unfused (see below)
    sequences/<model>.<scheme>.json  the scored sequences of a group computed in this run
    summary.txt                  the verdict table (harness run)

**The scored sequence.** All engines of a (model, scheme) score the same tokens, decided in this
order, per prompt:

1. the stored baseline's scored tokens, read from the group's reference baseline first, then from
   the other engines' baselines in matrix order (baselines are written from one run, so they agree);
   a baseline whose scored tokens no longer begin with the prompt's tokens is not used;
2. otherwise prompt + the reference engine's greedy continuation on the cell's fixture (its
   ``max_tokens`` tokens, no EOS stop), computed ONCE per results directory under a file lock and
   cached in ``sequences/``: by the reference cell itself when it is selected (its own greedy
   continuation is the continuation), else by a continuation-only reference child. With one
   torch thread the reference is deterministic on a machine, so cells run separately (pytest -n 2,
   one Buildkite step per cell) compute the same continuation;
3. for a source the reference cannot load (hub checkpoints on GPU tiers without a baseline yet),
   each engine's own greedy continuation (cross-engine checks then report the differing sequences).

**Cross-engine checks.** Each record is compared with the other selected engines' ok records of its
group, within the cell's bounds (harness.compare). An engine that does not fuse projections
(transformers) is compared with the *reference executed unfused*: FP8 per-tensor shards fused into
one projection are requantized to the largest scale (docs/design.md, "Fusion rule"), which an unfused engine never
does. The reference child writes that witness when a non-fusing engine is in the group. Two
non-reference engines with different fusion are not compared directly (each is compared with the
reference variant that models it). An engine whose cell has a known failure covering its version
is no witness for the others.

**Baselines.** After the verdict, harness.baselines.handle(): with ``update_baselines``, a record
that may become a baseline is written (printing what changed) and then judged again against what
was written, so the run's verdict says "pass" with the old verdict in its reason; failed, error,
unsupported and waived cells are refused.

The child process runs under the cell's ``timeout_s``: a timeout, a crash or a child that writes
no record becomes an ``error`` record carrying the end of the child's log.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from filelock import FileLock

from harness import baselines as B
from harness import compare as C
from harness import records as R
from harness.engines.base import fuses_shards
from harness.matrix import ENGINES, Cell, Matrix, expand

REPO_ROOT = Path(__file__).resolve().parent.parent
LOG_TAIL_CHARS = 4000
KILL_GRACE_S = 3.0
THREADS_ENV = "HARNESS_TORCH_THREADS"
ISOLATION_ENV = "HARNESS_ISOLATION"  # "fork" (default): children forked from a preloaded fork server; "spawn"
SPAWN_ENGINES = frozenset({"vllm"})  # engines that always get a fresh interpreter


def default_results_dir(base: str | Path = "results", prefix: str = "") -> Path:
    """``results/<prefix><UTC timestamp>``, made unique with a suffix when it exists."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = Path(base) / f"{prefix}{stamp}"
    n = 1
    while path.exists():
        n += 1
        path = Path(base) / f"{prefix}{stamp}-{n}"
    return path


def group_key(cell: Cell) -> str:
    return f"{cell.model}.{cell.scheme}"


def _engine_order(cell: Cell) -> int:
    return ENGINES.index(cell.engine)


def tail(path: Path, chars: int = LOG_TAIL_CHARS) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - chars))
            data = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    if size > chars:
        data = "…" + data[data.find("\n") + 1:] if "\n" in data else "…" + data
    return data


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


_FORK_LOCK = threading.Lock()
_FORK_CONTEXT = None


def _fork_context():
    """multiprocessing's "forkserver", preloaded with torch, transformers and the harness
    (harness.engines._forkserver_preload): started once per process that runs cells (harness run,
    each pytest-xdist worker), it forks one child per cell in milliseconds instead of paying the
    imports (several seconds) every time. A forked child is as isolated as a spawned one: its own
    address space and process group, its own log; nothing it does reaches the next cell."""
    global _FORK_CONTEXT
    with _FORK_LOCK:
        if _FORK_CONTEXT is None:
            import multiprocessing

            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(["harness.engines._forkserver_preload"])
            _FORK_CONTEXT = ctx
        return _FORK_CONTEXT


class _Child:
    """An engine child: forked from the fork server, or spawned as ``python -m harness.engines.worker``.
    Either way it leads its own process group, which kill() ends whole."""

    def __init__(self, proc, fork: bool):
        self.proc = proc
        self.fork = fork

    @classmethod
    def start(cls, job_path: Path, log: Path, env: dict[str, str], fork: bool) -> _Child:
        if fork:
            from harness.engines import worker

            proc = _fork_context().Process(target=worker.forked_main, args=(str(job_path), str(log), env),
                                           name=f"harness-{job_path.stem}")
            proc.start()
            return cls(proc, True)
        with open(log, "w") as logf:
            proc = subprocess.Popen([sys.executable, "-m", "harness.engines.worker", str(job_path)],
                                    stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                    env=env, cwd=str(REPO_ROOT), start_new_session=True)
        return cls(proc, False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait(self, timeout: float | None) -> int | None:
        """The exit status (negative: killed by that signal), or None when ``timeout`` passed."""
        if self.fork:
            self.proc.join(timeout)
            return self.proc.exitcode
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """SIGTERM to the child's process group, SIGKILL after a grace period."""
        for sig, grace in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.pid, sig)
            except (ProcessLookupError, PermissionError):
                if self.fork and self.proc.exitcode is None:
                    self.proc.kill()  # not yet its own group leader
            if self.wait(grace) is not None:
                return


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
                 echo: Callable[[str], None] | None = None):
        self.matrix = matrix
        self.cells = sorted(cells, key=lambda c: (group_key(c), _engine_order(c)))
        self.results = Path(results)
        self.baselines_root = Path(baselines_root)
        self.update_baselines = update_baselines
        self.matrix_dir = Path(matrix_path).resolve().parent if matrix_path else REPO_ROOT
        self.threads = threads or int(os.environ.get(THREADS_ENV) or 1)
        self.echo = echo or (lambda s: None)
        self._echo_lock = threading.Lock()
        self._seq_lock = threading.Lock()
        self._children: set[_Child] = set()
        self._stopping = False
        self._children_lock = threading.Lock()
        self._seq_cache: dict[str, tuple[dict[str, list[int]] | None, str]] = {}
        self.groups: dict[str, list[Cell]] = {}
        for c in self.cells:
            self.groups.setdefault(group_key(c), []).append(c)
        # every engine of a group in the matrix (selected or not), for baseline-derived sequences
        self._all_engines: dict[str, list[Cell]] = {}
        for c in sorted(expand(matrix), key=_engine_order):
            self._all_engines.setdefault(group_key(c), []).append(c)

    # ---- paths ---------------------------------------------------------------------------
    def record_path(self, cell: Cell) -> Path:
        return self.results / f"{cell.id}.json"

    def raw_path(self, cell: Cell) -> Path:
        return self.results / "raw" / f"{cell.id}.json"

    def info_path(self, cell: Cell) -> Path:
        return self.results / "raw" / f"{cell.id}.info.json"

    def log_path(self, cell: Cell, suffix: str = "") -> Path:
        return self.results / "logs" / f"{cell.id}{suffix}.log"

    def witness_path(self, cell: Cell) -> Path:
        return self.results / "witness" / f"{cell.id}.unfused.json"

    def sequences_path(self, key: str) -> Path:
        return self.results / "sequences" / f"{key}.json"

    def prepare(self, fresh: bool = True) -> None:
        """Create the results directory; with ``fresh``, forget raw results of the selected cells
        left by an earlier run into the same directory."""
        for sub in ("raw", "logs", "witness", "sequences"):
            (self.results / sub).mkdir(parents=True, exist_ok=True)
        if fresh:
            for c in self.cells:
                for p in (self.raw_path(c), self.info_path(c), self.witness_path(c), self.record_path(c)):
                    p.unlink(missing_ok=True)
            for key in self.groups:
                self.sequences_path(key).unlink(missing_ok=True)

    def say(self, line: str) -> None:
        with self._echo_lock:
            self.echo(line)

    # ---- the scored sequence ---------------------------------------------------------------
    def baseline_sequences(self, key: str) -> tuple[dict[str, list[int]], str]:
        """Prompt id -> scored tokens from the group's stored baselines (reference first)."""
        seqs: dict[str, list[int]] = {}
        sources = []
        for c in self._all_engines.get(key, []):
            try:
                b = B.read(self.baselines_root, c.tier, c.id)
            except B.BaselineError:
                continue
            if b is None:
                continue
            added = False
            for s in b.record_sequences():
                if s.prompt.id not in seqs:
                    seqs[s.prompt.id] = list(s.scored.tokens)
                    added = True
            if added:
                sources.append(c.id)
        return seqs, ("baseline " + ", ".join(sources)) if sources else ""

    def scored_sequences(self, key: str) -> tuple[dict[str, list[int]] | None, str]:
        """The sequences the group's engines score, and where they came from (see the module doc).
        A prompt missing from the result, or whose sequence does not begin with the prompt's
        tokens, is scored by each engine on its own greedy continuation."""
        with self._seq_lock:
            if key in self._seq_cache:
                return self._seq_cache[key]
        seqs, source = self.baseline_sequences(key)
        if not seqs:
            computed = self._computed_sequences(key, self.groups[key], self.sequences_path(key))
            if computed:
                seqs, source = computed, "reference greedy continuation (this run)"
        result = (seqs, source) if seqs else (None, "each engine's own greedy continuation")
        with self._seq_lock:
            self._seq_cache[key] = result
        return result

    def _computed_sequences(self, key: str, cells: list[Cell], path: Path) -> dict[str, list[int]] | None:
        if path.exists():
            return json.loads(path.read_text())
        with FileLock(str(path) + ".lock"):
            if path.exists():
                return json.loads(path.read_text())
            ref = next((c for c in cells if c.engine == "reference"), None)
            if ref is not None:
                self._ensure_raw_locked(ref, sequences=None, sequences_out=path)
            elif cells[0].source_kind == "fixture":
                self._continuation(cells[0], path)
            if path.exists():
                return json.loads(path.read_text())
        return None

    def _continuation(self, cell: Cell, out: Path) -> None:
        rec_path = self.results / "raw" / f"{group_key(cell)}.continuation.json"
        self.say(f"        computing the scored sequences of {group_key(cell)} with the reference engine")
        rec = self._run_child(cell, mode="continuation", sequences=None, record_path=rec_path,
                              sequences_out=out, log=self.log_path(cell, ".continuation"),
                              info_path=rec_path.with_name(rec_path.stem + ".info.json"))
        if rec is not None and rec.status != "ok":
            self.say(f"        reference continuation of {group_key(cell)} failed ({rec.status}); "
                     "each engine scores its own greedy continuation")

    # ---- raw records -------------------------------------------------------------------------
    def ensure_raw(self, cell: Cell) -> R.Record:
        """The cell's unjudged record: read from raw/ when another process made it, else run."""
        raw = self.raw_path(cell)
        if raw.exists():
            return R.load(raw)
        key = group_key(cell)
        seqs, _ = self.scored_sequences(key)
        with FileLock(str(raw) + ".lock"):
            if raw.exists():
                return R.load(raw)
            return self._run_raw(cell, seqs, None)

    def _ensure_raw_locked(self, cell: Cell, sequences, sequences_out: Path | None) -> R.Record:
        raw = self.raw_path(cell)
        with FileLock(str(raw) + ".lock"):
            if raw.exists():
                return R.load(raw)
            return self._run_raw(cell, sequences, sequences_out)

    def _run_raw(self, cell: Cell, sequences, sequences_out: Path | None) -> R.Record:
        key = group_key(cell)
        wants_witness = cell.engine == "reference" and any(not fuses_shards(c.engine) for c in self.groups[key])
        rec = self._run_child(cell, mode="cell", sequences=sequences, record_path=self.raw_path(cell),
                              sequences_out=sequences_out, log=self.log_path(cell),
                              witness=self.witness_path(cell) if wants_witness else None)
        R.save(self.raw_path(cell), rec)
        return rec

    def _child_env(self, cell: Cell) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.matrix.environments[cell.environment].env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env["OMP_NUM_THREADS"] = str(self.threads)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
        return env

    def _run_child(self, cell: Cell, *, mode: str, sequences, record_path: Path, log: Path,
                   sequences_out: Path | None = None, witness: Path | None = None,
                   info_path: Path | None = None) -> R.Record | None:
        """Run the engine child under the cell's timeout. Returns the record it wrote, or an error
        record for a timeout, a crash or a missing record (None in continuation mode on success)."""
        info_path = info_path or self.info_path(cell)
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
        }
        job_path = record_path.with_name(record_path.stem + ".job.json")
        R.atomic_write_text(job_path, json.dumps(job) + "\n")
        log.parent.mkdir(parents=True, exist_ok=True)
        started = R.utc_now()
        t0 = time.perf_counter()
        error: tuple[str, str] | None = None
        with self._children_lock:
            if self._stopping:
                raise KeyboardInterrupt("the run was interrupted")
            child = _Child.start(job_path, log, self._child_env(cell), fork=self.uses_fork_server(cell))
            self._children.add(child)
        try:
            code = child.wait(cell.timeout_s)
        except BaseException:
            child.kill()
            raise
        finally:
            with self._children_lock:
                self._children.discard(child)
        if code is None:
            child.kill()
            error = ("Timeout", f"the {cell.engine} engine child did not finish within the cell's timeout_s "
                                f"({cell.timeout_s:g} s) and was killed")
        wall = time.perf_counter() - t0
        if error is None and code != 0:
            what = f"was killed by {_signal_name(code)}" if code < 0 else f"exited with status {code}"
            error = ("EngineCrashed", f"the {cell.engine} engine child {what} without a record")
        if error is None and not record_path.exists():
            if mode == "continuation":
                return None
            error = ("EngineCrashed", f"the {cell.engine} engine child exited without writing a record")
        if error is None:
            try:
                rec = R.load(record_path)
            except R.RecordError as e:
                error = ("EngineCrashed", f"the {cell.engine} engine child wrote an unreadable record: {e}")
            else:
                update = {"duration_s": wall}
                if rec.error is not None:
                    update["error"] = rec.error.model_copy(update={"log_tail": tail(log)})
                return rec.model_copy(update=update)
        info = R.EngineInfo(name=cell.engine, environment=cell.environment, platform=R.cpu_platform())
        try:
            info = R.EngineInfo.model_validate(json.loads(info_path.read_text()))
        except (OSError, ValueError):
            pass
        return R.Record.for_cell(cell, engine_info=info, status="error",
                                 error=R.ErrorInfo(type=error[0], message=error[1], log_tail=tail(log)),
                                 started_at=started, duration_s=wall)

    def uses_fork_server(self, cell: Cell) -> bool:
        """Fork the child from the preloaded fork server (see _Child), unless HARNESS_ISOLATION=spawn,
        the engine needs a fresh interpreter (vLLM), or the cell's environment sets variables that
        libraries read at import time."""
        mode = os.environ.get(ISOLATION_ENV, "fork")
        if mode not in ("fork", "spawn"):
            raise ValueError(f"{ISOLATION_ENV}={mode!r}: expected 'fork' or 'spawn'")
        return (mode == "fork" and sys.platform == "linux" and cell.engine not in SPAWN_ENGINES
                and not self.matrix.environments[cell.environment].env)

    def kill_children(self) -> None:
        """End every running engine child and start no more (an interrupted run)."""
        with self._children_lock:
            self._stopping = True
            children = list(self._children)
        for child in children:
            child.kill()

    # ---- judging -------------------------------------------------------------------------
    def witness(self, cell: Cell, record: R.Record) -> R.Record:
        """The reference record executed unfused, when it exists and differs from ``record``."""
        path = self.witness_path(cell)
        if path.exists():
            try:
                w = R.load(path)
            except R.RecordError:
                return record
            if w.status == "ok" and w.sequences != record.sequences:
                return w
        return record

    def cross_engine_checks(self, cell: Cell, record: R.Record, raws: dict[str, R.Record]) -> list[R.Check]:
        if record.status != "ok":
            return []
        checks: list[R.Check] = []
        for other in self.groups[group_key(cell)]:
            o = raws.get(other.engine)
            if other.engine == cell.engine or o is None or o.status != "ok":
                continue
            if C.applicable(other.known_failures, o.engine, o.engine_info.version):
                continue  # an engine known to fail this cell is no witness
            mine, theirs, note = record, o, ""
            if cell.engine == "reference" and not fuses_shards(other.engine):
                mine = self.witness(cell, record)
                note = f" [reference executed unfused, as {other.engine} executes]" if mine is not record else ""
            elif other.engine == "reference" and not fuses_shards(cell.engine):
                theirs = self.witness(other, o)
                note = f" [reference executed unfused, as {cell.engine} executes]" if theirs is not o else ""
            elif fuses_shards(cell.engine) != fuses_shards(other.engine):
                continue
            for c in C.compare_sequences(theirs.sequences, mine.sequences, cell.bounds, against=other.engine):
                checks.append(c.model_copy(update={"detail": c.detail + note}) if note else c)
        return checks

    def judge(self, cell: Cell, record: R.Record, raws: dict[str, R.Record]) -> CellResult:
        checks = self.cross_engine_checks(cell, record, raws)
        try:
            baseline = B.read(self.baselines_root, cell.tier, cell.id)
        except B.BaselineError as e:
            j = C.Judgement("error", f"baseline unreadable: {e}", checks)
            return CellResult(cell, j.apply(record))
        j = self._verdict(cell, record, baseline, checks)
        judged = j.apply(record)
        result = CellResult(cell, judged)
        outcome = B.handle(self.baselines_root, judged, update_baselines=self.update_baselines)
        result.outcome = outcome
        if outcome.refused:
            result.messages.append(f"baseline refused: {outcome.refused}")
        if outcome.change is not None:
            result.messages.append(str(outcome.change))
            if outcome.change.written:
                new = B.read(self.baselines_root, cell.tier, cell.id)
                j2 = self._verdict(cell, record, new, checks)
                was = f"was {j.verdict}: {j.reason}"
                result.record = j2.apply(record).model_copy(update={
                    "verdict_reason": f"{j2.reason}; baseline {outcome.change.kind} by --update-baselines ({was})"})
        if outcome.obtained is not None:
            result.messages.append(f"obtained result written beside the baseline: {outcome.obtained}")
        return result

    @staticmethod
    def _verdict(cell: Cell, record: R.Record, baseline, checks) -> C.Judgement:
        return C.verdict(record, baseline, bounds=cell.bounds, known_failures=cell.known_failures,
                         cross_engine_checks=checks, expected_engine_version=cell.engine_version,
                         gate_load_time=cell.gate_load_time)

    def finish(self, result: CellResult) -> CellResult:
        R.save(self.record_path(result.cell), result.record)
        return result

    # ---- entry points ---------------------------------------------------------------------
    def run_cell(self, cell: Cell) -> CellResult:
        """One cell, judged against the other selected engines of its group (running them when no
        other process has): the pytest plugin's entry point."""
        group = self.groups[group_key(cell)]
        raws = {cell.engine: self.ensure_raw(cell)}
        for other in group:
            if other.engine != cell.engine:
                raws[other.engine] = self.ensure_raw(other)
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
        return out

    def run(self, jobs: int = 1, progress: Callable[[int, int, CellResult], None] | None = None) -> list[CellResult]:
        """Every selected cell, ``jobs`` groups at a time; results in cell order."""
        total = len(self.cells)
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

        keys = list(self.groups)
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
                self.kill_children()
                raise
            ex.shutdown()
        order = {c.id: i for i, c in enumerate(self.cells)}
        return sorted(done, key=lambda r: order[r.cell.id])


# --------------------------------------------------------------------------------- reporting


def one_line(text: str | None, width: int = 160) -> str:
    line = " ".join((text or "").split())
    return line if len(line) <= width else line[: width - 1] + "…"


def progress_line(i: int, n: int, r: CellResult) -> str:
    rec = r.record
    w = len(str(n))
    if rec.verdict in ("pass", "improved") and rec.load is not None:
        detail = f"load {rec.load.seconds:.3f} s, cell {rec.duration_s:.1f} s"
    else:
        detail = one_line(rec.verdict_reason)
    return f"[{i:>{w}}/{n}] {rec.verdict or 'error':<16} {rec.cell}  ({detail})"


def summary_text(results: Iterable[CellResult]) -> tuple[str, int]:
    """The verdict table and the exit code (compare.summarize)."""
    s = C.summarize([r.record for r in results])
    return s.table(), s.exit_code
