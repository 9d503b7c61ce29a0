"""The engine child process: ``python -m harness.engines.worker JOB.json``.

The runner (harness.runner) writes a job file, starts this module in a new process group with its
stdout and stderr going to the cell's log, and waits for it under the cell's ``timeout_s``. The
child writes, each atomically:

- ``info``: the engine's identity (name, version, platform), as soon as it is known, so a record
  made by the parent for a crash or a timeout still names the engine version;
- ``record``: the unjudged result record (harness.records), whatever happened inside the engine;
- ``sequences_out`` (optional): the token sequences it scored, prompt id -> tokens;
- ``witness`` (optional, reference only): the record of the reference executed unfused.

Job fields: ``mode`` ("cell"; "continuation": the reference engine's greedy continuation only,
written to ``sequences_out``; "trace": the module traces of ``sequences`` only, written to
``trace``, harness.traces; "load": the engine's timed load only, its LoadInfo written to
``load_out``, for a gated cell timed again in a fresh child, harness.loadtime; a record
only on an error), ``options`` (the engine's, e.g. the reference's ``fuse``), ``cell``
(a harness.matrix.Cell), ``path`` (a local checkpoint),
``sequences`` (prompt id -> tokens to score, or null), ``threads`` (torch threads; default 1, which
also makes results independent of the core count), and the output paths above; ``main`` reads
them once, into a Job.

Test-only hooks (never set them outside tests): ``HARNESS_TEST_HOOK`` holds hooks separated by
``;``, each ``ACTION[=ARG][@CELL_GLOB]`` (fnmatch on the cell id; no glob: every cell):

- ``sleep=SECONDS``: sleep before loading (a hang; the parent's timeout must end it);
- ``crash[=SIGNAME]``: abort the child (SIGABRT, or that signal: ``crash=SIGKILL``) before loading;
- ``raise=MESSAGE``: raise RuntimeError(MESSAGE) before loading;
- ``break=MODULE:FUNCTION``: wrap a decode function (e.g. ``harness.quant.bnb:decode``) so that the
  weight it returns is halved, as a wrong absmax would make it: a deliberately broken decode of
  one format;
- ``fault=NAME[:ARG]``: a degradation of harness.hooks.faults (a dropped scale, a double-quant
  offset ignored, a skip list ignored, corrupted embedding rows after loading), which the accuracy
  gate must catch;
- ``slow=FRACTION``: the engine's loader (the reference's, or vLLM's) does FRACTION more of its own
  work (harness.hooks.slowdown; ``slow=0.2``: 20% slower), the load-time regression the load-time
  gate must catch (harness.bench.detection).
"""
from __future__ import annotations

import fnmatch
import importlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from harness import files
from harness import records as R
from harness.engines import base, execute
from harness.hooks import faults, slowdown
from harness.matrix import Cell

HOOK_ENV = "HARNESS_TEST_HOOK"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_hooks(text: str | None, cell_id: str) -> list[tuple[str, str | None]]:
    """The hooks of HARNESS_TEST_HOOK that apply to ``cell_id``: [(action, arg)]."""
    out = []
    for item in (text or "").split(";"):
        item = item.strip()
        if not item:
            continue
        spec, _, glob = item.partition("@")
        action, _, arg = spec.partition("=")
        if glob and not fnmatch.fnmatchcase(cell_id, glob):
            continue
        out.append((action.strip(), arg.strip() or None))
    return out


def _halve(result):
    import torch

    if isinstance(result, torch.Tensor):
        return result * 0.5
    weight = getattr(result, "weight", None)
    if isinstance(weight, torch.Tensor):
        result.weight = weight * 0.5
    return result


def apply_hooks(cell_id: str) -> list:
    """Apply the hooks before loading; returns what to run on the engine after loading (faults)."""
    after_load = []
    for action, arg in parse_hooks(os.environ.get(HOOK_ENV), cell_id):
        log(f"test hook: {action}{'=' + arg if arg else ''}")
        if action == "sleep":
            time.sleep(float(arg or 3600))
        elif action == "crash":
            sys.stderr.flush()
            os.kill(os.getpid(), getattr(signal, arg or "SIGABRT"))
        elif action == "raise":
            raise RuntimeError(arg or "test hook")
        elif action == "break":
            module_name, _, func_name = (arg or "").partition(":")
            module = importlib.import_module(module_name)
            original = getattr(module, func_name)

            def broken(*a, __original=original, **kw):
                return _halve(__original(*a, **kw))

            setattr(module, func_name, broken)
        elif action == "slow":
            slowdown.install(float(arg or 0), *slowdown.targets(cell_id.rpartition(".")[2]))
        elif action == "fault":
            after = faults.install(arg or "")
            if after is not None:
                after_load.append(after)
        else:
            raise ValueError(f"{HOOK_ENV}: unknown test hook {action!r}")
    return after_load


class _HookedEngine:
    """Applies the test hooks after the capability probe, just before loading."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def load(self, checkpoint):
        after_load = apply_hooks(self._engine.cell.id)
        info = self._engine.load(checkpoint)
        for after in after_load:
            after(self._engine)
        return info

    def load_timed_only(self, checkpoint):
        # The hooks after a load change the loaded model, which a timed load alone does not keep.
        apply_hooks(self._engine.cell.id)
        return self._engine.load_timed_only(checkpoint)


def die_with_parent() -> None:
    """Linux: SIGKILL this child when its parent dies (the runner, or harness.engines.forkserver,
    which exits with the runner), so a cancelled job (SIGTERM, SIGKILL) leaves no engine running in
    its own process group. Elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        parent = os.getppid()
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the call
            os._exit(1)
    except Exception:
        pass


def _write_json(path: str, data) -> None:
    files.atomic_write_text(Path(path), json.dumps(data) + "\n")


@dataclass(frozen=True)
class Job:
    """A job file (the fields of the module docstring), read once, where the child starts. ``cell``
    is the cell this child runs: in continuation mode the reference engine's of the job's model and
    scheme."""

    mode: Literal["cell", "continuation", "trace", "load"]
    cell: Cell
    record: str
    path: str | None = None
    sequences: dict[str, list[int]] | None = None
    threads: int = 1
    options: dict | None = None
    info: str | None = None
    sequences_out: str | None = None
    witness: str | None = None
    trace: str | None = None
    load_out: str | None = None

    @classmethod
    def from_json(cls, data: dict) -> Job:
        mode = data.get("mode", "cell")
        if mode not in RUN_MODES:
            raise ValueError(f"job mode {mode!r}: not one of {', '.join(RUN_MODES)}")
        cell = Cell.model_validate(data["cell"])
        if mode == "continuation":
            cell = cell.model_copy(update={"engine": "reference", "id": f"{cell.model}.{cell.scheme}.reference"})
        return cls(mode=mode, cell=cell, record=data["record"], path=data.get("path"), sequences=data.get("sequences"),
                   threads=int(data.get("threads") or 1), options=data.get("options"), info=data.get("info"),
                   sequences_out=data.get("sequences_out"), witness=data.get("witness"),
                   trace=data["trace"] if mode == "trace" else None,
                   load_out=data["load_out"] if mode == "load" else None)

    def checkpoint(self):
        return base.resolve_checkpoint(self.cell, self.path)


def _quiet_libraries(threads: int) -> None:
    """The torch thread count the results are independent of, and no progress bars in the log."""
    try:
        import torch

        torch.set_num_threads(threads)
    except Exception:
        pass
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except Exception:
        pass


def _run_trace(job: Job, engine, info: R.EngineInfo) -> None:
    """The module traces of the job's sequences only (harness.traces)."""
    failed = execute.trace_cell(_HookedEngine(engine), job.checkpoint, job.sequences, job.trace, log=log)
    if failed is not None:
        R.save(job.record, failed)
    log(f"worker: done, traces {'not ' if failed else ''}recorded")


def _run_load(job: Job, engine, info: R.EngineInfo) -> None:
    """The engine's timed load only (harness.loadtime; Engine.load_timed_only: vLLM builds no engine
    after it); a record only on an error."""
    hooked = _HookedEngine(engine)
    try:
        load = hooked.load_timed_only(job.checkpoint())
    except Exception as e:
        R.save(job.record, _error_record(job.cell, info, e))
        return
    _write_json(job.load_out, load.model_dump())
    log(f"worker: done, load {load.seconds:.4f} s")


def _witness(job: Job):
    """What records the reference executed unfused, when the job asks for it; else None."""
    if not job.witness or job.cell.engine != "reference":
        return None

    def witness(_engine, ckpt, prompts, seqs):
        # Not hooked again: hooks that patch functions are already in place in this process.
        # No accuracy tasks: compare.cross_engine compares accuracy across fusion only where the
        # witness shows that fusing changes nothing (docs/design.md, "Accuracy").
        w = execute.execute(base.engine_class("reference")(job.cell, {"fuse": False}), ckpt, sequences=seqs, log=log,
                         accuracy=False)
        R.save(job.witness, w)
        log(f"witness: reference executed unfused: {w.status}")

    return witness


def _run_execute(job: Job, engine, info: R.EngineInfo) -> None:
    """The cell's whole execution; in continuation mode only its sequences matter, so the record is
    written only when something failed."""
    def on_sequences(seqs):
        if job.sequences_out:
            _write_json(job.sequences_out, seqs)

    record = execute.execute(_HookedEngine(engine), job.checkpoint, sequences=job.sequences,
                          on_sequences=on_sequences, witness=_witness(job), log=log, accuracy=job.mode == "cell",
                          close=False)
    if job.mode == "cell" or record.status != "ok":
        R.save(job.record, record)
    log(f"worker: done, status {record.status}")


# The engine of the job, never closed nor released: the process ends right after the job (`main`'s
# os._exit), and releasing the engine would run its shutdown first, which changes no output (vLLM's:
# a garbage collection and freeing its KV cache, ~1.2 s at one rank; at two, ~3 s waiting for its
# workers, which end on their own when this process has gone).
_OPEN_UNTIL_EXIT: list = []

RUN_MODES = {"cell": _run_execute, "continuation": _run_execute, "trace": _run_trace, "load": _run_load}


def run_job(job: Job) -> int:
    _quiet_libraries(job.threads)
    die_with_parent()
    cell = job.cell
    log(f"worker: {job.mode} {cell.id} (pid {os.getpid()}, {job.threads} torch thread(s))")
    try:
        engine = base.engine_class(cell.engine)(cell, job.options)
        info = engine.info()
    except Exception as e:
        R.save(job.record, _error_record(cell, R.EngineInfo(name=cell.engine, environment=cell.environment,
                                                             platform=R.cpu_platform()), e))
        return 0
    if job.info:
        _write_json(job.info, info.model_dump())
    RUN_MODES[job.mode](job, engine, info)
    _OPEN_UNTIL_EXIT.append(engine)
    return 0


def _error_record(cell, info: R.EngineInfo, e: Exception) -> R.Record:
    """The record of an exception raised outside harness.engines.execute.execute, traceback logged."""
    import traceback

    tb = traceback.format_exc()
    log(tb)
    return R.Record.for_cell(cell, engine_info=info, status="error",
                             error=R.ErrorInfo(type=type(e).__name__, message=str(e), log_tail=tb))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m harness.engines.worker JOB.json", file=sys.stderr)
        return 2
    job = Job.from_json(json.loads(Path(args[0]).read_text()))
    code = run_job(job)
    # Everything the job writes is written and closed by now. What is left for the interpreter's
    # exit (engine shutdown, finalizers, a full collection of every object) changes no output and
    # costs seconds per cell.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())

