"""The load-time gate's fresh children for a run (docs/design.md, "Load time" and "Candidate
builds"): what a gated cell's first child does not settle alone.

- :meth:`LoadGate.settle`: a cell against its stored baseline: the median of several children
  when a baseline may be written (``loadtime.baseline_load``); while over its bound, confirmation
  children, and when over in every one a later look (``loadtime.confirm``). While a cell waits for
  its later look, the timed groups the run has still to start run (``meanwhile``, which
  :meth:`harness.runner.Runner.run` fills), so a slowdown every gated cell shares costs the run one
  wait, not one per cell.
- :meth:`LoadGate.pair`: a candidate build's cell against the pinned build's of the same run,
  both builds timed in balanced pairs of fresh children (``loadtime.paired``).

Child N of a cell is ``raw/<cell id>.load<N>.json`` in the run's layout (the candidate's layout for
a candidate; the pinned build's children timed in pairs: ``<cell id>.base.load<N>``).
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from harness import loadcheck, loadtime, terminal
from harness import records as R
from harness.layout import Layout

if TYPE_CHECKING:
    from harness.matrix import Cell


class GateHost(Protocol):
    """What the gate uses of the run it serves (harness.runner.Runner, which owns it)."""

    layout: Layout

    def run_child(self, cell: Cell, *, mode: str, sequences, record_path: Path, log: Path,
                  extra: dict | None = None, python: str | None = None) -> R.Record | None: ...

    def say(self, line: str) -> None: ...


class LoadGate:
    def __init__(self, runner: GateHost, later_look_s: float = loadtime.LATER_LOOK_S):
        self.runner = runner
        # seconds after a gated cell's first child that a cell over its bound in every child is
        # timed again (harness.loadtime.LATER_LOOK_S)
        self.later_look_s = later_look_s
        # the timed groups the run has still to start: a cell waiting for its later look runs them
        self.meanwhile: deque[Callable[[], object]] = deque()

    def settle(self, cell: Cell, record: R.Record, baseline, *, recording: bool) -> tuple[R.Record, list[str]]:
        """A gated cell's load timed in more fresh children: the median of several when its
        baseline may be written (``recording``), a confirmation when the first is over the bound,
        and a later look when every child of those is. (the record with that load, what to say)"""
        if not cell.gate_load_time or record.status != "ok" or record.load is None:
            return record, []
        messages: list[str] = []
        retime = self.timer(cell, self.runner.layout, cell.id, messages)
        if recording:
            load = loadtime.baseline_load(record.load, retime)
            what = "median of"
            unsteady = loadtime.unsteady_baseline(load, cell.bounds.load_time)
            if unsteady:
                messages.append(unsteady)
        elif baseline is not None and baseline.load is not None and baseline.load.seconds > 0:
            bound = cell.bounds.load_time
            load = loadtime.confirm(record.load, retime, lambda info: loadcheck.load_ratio(info, baseline.load)[0] > bound,
                                    later=self._later_look(cell, messages))
            what = "over the bound: fastest of"
        else:
            return record, []
        said = [f"load time: {what} {len(load.children)} children (load / calibration: {_children(load)})"
                ] if load.children else []
        return record.model_copy(update={"load": load}), said + messages

    def pair(self, cell: Cell, record: R.Record, base: R.Record, layout: Layout,
             python: str) -> tuple[R.Record, R.Record, list[str]]:
        """A gated candidate cell (``record``, its children under ``python``, its files in
        ``layout``) against the pinned build of this run, in balanced pairs of load children:
        (the candidate's record, the base's record to judge it against, what to say). The base's
        own record is left as it was judged; where a child failed, the two cell children's loads
        are compared instead."""
        if (not cell.gate_load_time or record.status != "ok" or record.load is None
                or base.status != "ok" or base.load is None):
            return record, base, []
        messages: list[str] = []
        timed = loadtime.paired(self.timer(cell, layout, cell.id, messages, python),
                                self.timer(cell, layout, f"{cell.id}.base", messages), cell.bounds.load_time)
        if timed is None:
            return record, base, messages
        mine, theirs = timed
        rounds = loadtime.round_ratios(mine, theirs)
        messages.insert(0, f"load time: against the base build in {len(rounds)} round(s) of {loadtime.CANDIDATE_PAIRS} "
                        f"pairs of fresh children, each build first as often, their medians uncalibrated (ratio "
                        f"{', '.join(f'{r:.3f}' for r in rounds)}; load / calibration, candidate: {_children(mine)}; "
                        f"base: {_children(theirs)})")
        return record.model_copy(update={"load": mine}), base.model_copy(update={"load": theirs}), messages

    def timer(self, cell: Cell, layout: Layout, name: str, messages: list[str],
              python: str | None = None) -> Callable[[], R.LoadInfo | None]:
        """A function that times the cell's load in a fresh ``load`` child (under ``python``) and
        returns its LoadInfo; None, with a line in ``messages``, when that child failed. Child N's
        files: ``layout``'s ``raw/<name>.load<N>.json`` and its log."""
        children = itertools.count(1)

        def retime() -> R.LoadInfo | None:
            n = next(children)
            out, log = layout.load_child(name, n), layout.log(f"{name}.load{n}")
            out.unlink(missing_ok=True)
            failed = self.runner.run_child(cell, mode="load", sequences=None, record_path=out.with_suffix(".error.json"),
                                           log=log, extra={"load_out": str(out)}, python=python)
            try:
                if failed is None:
                    return R.LoadInfo.model_validate_json(out.read_text())
                why = f"{failed.error.type}: {failed.error.message}" if failed.error else failed.status
            except (OSError, ValueError) as e:
                why = f"its timing is unreadable: {e}"
            messages.append(f"load time: timing it again in a fresh child failed ({terminal.one_line(why, 120)}; {log})")
            return None
        return retime

    def _later_look(self, cell: Cell, messages: list[str]) -> Callable[[], None]:
        """What a cell over its bound in every child of its first look does before its later look:
        says so, runs the timed groups the run has still to start (their cells see the same host,
        one at a time) while the look is not yet due, and waits out the rest of ``later_look_s``
        after now (its first child was timed moments ago)."""
        due = time.monotonic() + self.later_look_s

        def wait() -> None:
            meanwhile = ", timing the other gated cells meanwhile" if self.meanwhile else ""
            self.runner.say(f"        {cell.id}: load time over its bound in every child; looking again in "
                            f"{max(0.0, due - time.monotonic()):.0f} s{meanwhile} "
                            "(the host's level wanders over minutes; harness run --later-look)")
            while self.meanwhile and time.monotonic() < due:
                self.meanwhile.popleft()()
            time.sleep(max(0.0, due - time.monotonic()))
            messages.append(f"load time: over the bound in every child of its first look; looked again "
                            f"{time.monotonic() - due + self.later_look_s:.0f} s after it")
        return wait


def _children(load: R.LoadInfo) -> str:
    return ", ".join(f"{c.seconds:.4g} / {c.calibration or 0:.4g} s" for c in load.children)
