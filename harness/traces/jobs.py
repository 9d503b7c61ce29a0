"""Module traces in a run (docs/design.md, "Localisation"): the runner's trace children, the
localisation of a judged cell, and refreshing its baseline's fingerprint.

Nothing here runs in a normal run. A cell is traced when ``harness run --trace`` asks, or when it
is judged ``failed`` or ``regressed``: then each engine involved runs once more in a trace child
(worker mode ``trace``: load, record the traces of the cell's scored sequences, nothing else), and

- against each engine whose check failed (with ``--trace``: each other ok engine of the group),
  the two traces are compared module by module (harness.traces.diff), the reference executed
  unfused where the other engine does not fuse (the cross-engine rule's witness), with the
  per-module noise of a baseline fingerprint measured that way, else measured now;
- against the baseline, the cell's trace against the fingerprint the baseline stores
  (harness.traces.fingerprint);
- a candidate build's failed or regressed cell (``harness run --candidate``): its trace, from a
  trace child under the candidate's interpreter, against the pinned build's of the same sequences;
- a configuration cell's (harness.configurations): its trace against its plain cell's of the same
  sequences (a compiled cell's recorded by the compiled graph; ranks are not traced).

``--update-fingerprints`` adds or refreshes the fingerprint of the baseline of each cell that
passes against it, nothing else of the file.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from filelock import FileLock

from harness import judging, measure_noise, traces
from harness import baselines as B
from harness import compare as C
from harness import records as R
from harness.layout import Layout, group_key
from harness.matrix import ENGINES
from harness.measure_noise import NoiseError
from harness.registry import fuses_shards
from harness.traces import diff, fingerprint
from harness.traces.localise import OTHER_KERNELS_MARGIN, localise

if TYPE_CHECKING:
    from harness.matrix import Cell
    from harness.traces import PromptTrace
    from harness.traces.noise import Measured, ModuleNoise

CANDIDATE = ".candidate"  # the file name variant of a candidate build's traces
BASE_BUILD = "base build"  # what a candidate build's cell is localised against
PLAIN_CELL = "plain cell"  # what a configuration cell is localised against


def _contained(against: str, step) -> R.Localisation | None:
    """One localisation ``step``; where it raises, a localisation that says so. Localisation only
    explains a verdict, so a bug in it costs that explanation, not the cell's verdict or the
    rest of the run (Mllama's 4-D vision input once took a whole run down: docs/decisions.md,
    "A failing localisation costs only its explanation")."""
    try:
        return step()
    except Exception as e:  # noqa: BLE001 - any bug here; the record says which
        return R.Localisation(against=against, detail=f"localisation failed (a harness bug; the verdict stands "
                                                      f"without it): {type(e).__name__}: {(str(e).splitlines() or [''])[0]}")


class TraceUnavailable(Exception):
    """A trace child did not record traces; ``str()`` is one line."""


class TraceHost(Protocol):
    """What the tracer uses of the run it serves (harness.runner.Runner, which owns the tracer)."""

    layout: Layout
    baselines_root: Path
    groups: dict[str, list[Cell]]

    def run_child(self, cell: Cell, *, mode: str, sequences, record_path: Path, log: Path,
                  extra: dict | None = None, python: str | None = None) -> R.Record | None: ...


class Tracer:
    def __init__(self, runner: TraceHost, *, always: bool = False):
        self.runner = runner
        self.always = always  # --trace: every cell, not only failed or regressed ones
        self._lock = threading.Lock()
        self._locks: dict[tuple, threading.Lock] = {}
        self._noise: dict[tuple, Measured | str] = {}

    # ---- children -------------------------------------------------------------------------
    def _path(self, cell_id: str, variant: str = "") -> Path:
        return self.runner.layout.traces() / f"{cell_id}{variant}.pt"

    def forget(self, cell_ids: list[str]) -> None:
        """Remove the traces an earlier run into the same results directory left for these cells."""
        for cell_id in cell_ids:
            for variant in ("", ".fused", ".unfused", CANDIDATE):
                self._path(cell_id, variant).unlink(missing_ok=True)

    def traces(self, cell: Cell, fuse: bool | None, sequences: dict[str, list[int]],
               candidate: str | None = None) -> list[PromptTrace]:
        """The cell's traces of ``sequences`` (the reference executed fused or not as ``fuse``
        says; None: as the engine executes; ``candidate``: under that build's interpreter), from a
        trace child, once per run (a file lock shares them between the runner's threads and
        pytest-xdist workers)."""
        variant = "" if fuse is None or fuse == fuses_shards(cell.engine) else ".fused" if fuse else ".unfused"
        variant += CANDIDATE if candidate else ""
        out = self._path(cell.id, variant)
        out.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(out) + ".lock"):
            if not out.exists():
                self._record(cell, variant, fuse, sequences, out, candidate)
            return traces.load(out)

    def _record(self, cell: Cell, variant: str, fuse: bool | None, sequences, out: Path, python: str | None) -> None:
        layout = self.runner.layout
        failed = self.runner.run_child(cell, mode="trace", sequences=sequences,
                                       record_path=layout.root / "raw" / f"{cell.id}{variant}.trace.json",
                                       log=layout.log(f"{cell.id}{variant}.trace"), python=python,
                                       extra={"trace": str(out), "options": None if fuse is None else {"fuse": fuse}})
        if failed is not None:
            why = failed.error.message if failed.error else failed.unsupported_reason or failed.status
            raise TraceUnavailable(f"{cell.id}: traces not recorded: {why}")
        if not out.exists():
            raise TraceUnavailable(f"{cell.id}: traces not recorded: the trace child wrote none")

    def measured(self, cell: Cell, fuse: bool, record: R.Record) -> Measured | str:
        """The per-module noise of the cell's reference executed fused or not (harness.traces.noise)
        (harness.measure_noise) on ``record``'s sequences and kernels, once per group and execution; a one-line reason
        when it could not be measured."""
        key = (group_key(cell), fuse)
        with self._lock:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:  # one measurement per group and execution, whichever thread asks first
            if key not in self._noise:
                try:
                    self._noise[key] = measure_noise.measure_modules(cell, scored(record), fuse,
                                                     record.engine_info.cpu.capability if record.engine_info.cpu else None)
                except NoiseError as e:
                    self._noise[key] = str(e)
            return self._noise[key]

    # ---- localisation ----------------------------------------------------------------------
    def wanted(self, cell: Cell, record: R.Record) -> bool:
        """Whether to trace the cell: every cell under ``trace``; else one with a failing check that
        its known failures do not excuse, other than its load time, which traces of the loaded
        model cannot place (judging.needs_localisation)."""
        return record.status == "ok" and (self.always or judging.needs_localisation(record, cell.known_failures))

    def localise(self, cell: Cell, record: R.Record, raws: dict[str, R.Record]) -> list[R.Localisation]:
        """The record's localisations (empty when the cell is not traced)."""
        if not self.wanted(cell, record):
            return []
        steps = [(engine, lambda e=engine: self._against_engine(cell, e, record)) for engine in self._engines(record, raws)]
        steps.append(("baseline", lambda: self._against_baseline(cell, record)))
        out = [_contained(against, step) for against, step in steps]
        return [loc for loc in out if loc is not None]

    def against_base(self, cell: Cell, record: R.Record, base: Cell, against: str,
                     python: str | None = None) -> list[R.Localisation]:
        """A cell judged against another run of its scheme and engine (judging.judge_against_base)
        localised against ``base``'s traces of the same sequences, with the per-module noise the
        cross-engine localisation uses and the engine's kernel floor: a candidate build's cell (its
        children under ``python``) against the pinned build's (``base`` is the cell itself), a
        configuration cell against its plain cell. Empty when the cell is not traced."""
        if not self.wanted(cell, record):
            return []
        sequences = scored(record)
        try:
            mine = self.traces(cell, None, sequences, candidate=python)
            theirs = self.traces(base, None, sequences)
        except TraceUnavailable as e:
            return [R.Localisation(against=against, detail=str(e))]
        noise, note = self._noise_for(cell, fuses_shards(cell.engine), record)
        return [diff.cross_engine(mine, theirs, against, noise, note, diff.kernel_rtol(cell.engine))]

    def _engines(self, record: R.Record, raws: dict[str, R.Record]) -> list[str]:
        if self.always:
            return [e for e, r in raws.items() if e != record.engine and r.status == "ok"]
        failing = {c.against for c in record.checks if not c.ok}
        return [e for e in ENGINES if e in failing and e in raws and raws[e].status == "ok"]

    def _against_engine(self, cell: Cell, engine: str, record: R.Record) -> R.Localisation | None:
        other = next((c for c in self.runner.groups[group_key(cell)] if c.engine == engine), None)
        fused = fuses_shards(cell.engine) and fuses_shards(engine)
        if other is None or (fuses_shards(cell.engine) != fuses_shards(engine) and "reference" not in (cell.engine, engine)):
            return None  # not compared, as the cross-engine rule does not compare them
        try:
            mine = self.traces(cell, fused if cell.engine == "reference" else None, scored(record))
            theirs = self.traces(other, fused if engine == "reference" else None, scored(record))
        except TraceUnavailable as e:
            return R.Localisation(against=engine, detail=str(e))
        noise, note = self._noise_for(cell, fused, record)
        return diff.cross_engine(mine, theirs, engine, noise, note, diff.kernel_rtol(cell.engine, engine))

    def _noise_for(self, cell: Cell, fused: bool, record: R.Record) -> tuple[ModuleNoise | None, str]:
        """A stored fingerprint's noise measured on this execution, else measured now."""
        measured_by = "reference" if fused else "reference-unfused"
        for c in self.runner.groups[group_key(cell)]:
            try:
                baseline = B.read(self.runner.baselines_root, c.tier, c.id)
            except B.BaselineError:
                continue
            fp = baseline.fingerprint if baseline is not None else None
            if fp is not None and fp.noise_measured_by == measured_by:
                return fp.noise(), f" (noise: {c.id}'s baseline fingerprint)"
        m = self.measured(cell, fused, record)
        if isinstance(m, str):
            return None, f" (per-module noise not measured: {m})"
        return m.noise, " (noise measured now)"

    def _against_baseline(self, cell: Cell, record: R.Record) -> R.Localisation | None:
        try:
            baseline = B.read(self.runner.baselines_root, cell.tier, cell.id)
        except B.BaselineError as e:
            return R.Localisation(against="baseline", detail=f"baseline unreadable: {e}")
        if baseline is None:
            return None
        if baseline.fingerprint is None:
            return R.Localisation(against="baseline", detail="the baseline stores no trace fingerprint "
                                                            "(harness run --update-fingerprints adds one)")
        sequences = scored(record)
        stored = {s.prompt.id: [r.token for r in s.scored] for s in baseline.sequences}
        same = {pid: tokens for pid, tokens in sequences.items() if stored.get(pid) == tokens}
        if not same:
            return R.Localisation(against="baseline", detail="no prompt scored the baseline's sequence: "
                                                            "the fingerprint cannot be compared")
        try:
            mine = self.traces(cell, None, sequences)
        except TraceUnavailable as e:
            return R.Localisation(against="baseline", detail=str(e))
        skipped = sorted(set(sequences) - set(same))
        note = f"; prompts {', '.join(skipped)} scored other sequences than the baseline's, not compared" if skipped else ""
        return against_fingerprint(record, baseline, [t for t in mine if t.prompt in same], note)

    # ---- fingerprints ----------------------------------------------------------------------
    def refresh_fingerprint(self, cell: Cell, record: R.Record) -> str | None:
        """Add or refresh the fingerprint of the cell's baseline ``record`` passed against, where it
        ran on the baseline's own kernels (a fingerprint is compared as the baseline's kernels'
        traces); returns what was done, one line (None when the record did not pass)."""
        baseline = B.read(self.runner.baselines_root, cell.tier, cell.id)
        if baseline is not None and B.other_kernels(record, baseline):
            return (f"{B.path_for(self.runner.baselines_root, cell.tier, cell.id)}: fingerprint not written: only a "
                    "cell run on its baseline's own kernels is")
        if record.verdict != "pass":
            return None
        fused = fuses_shards(cell.engine)
        m = self.measured(cell, fused, record)
        if isinstance(m, str):
            return f"fingerprint not written: per-module noise not measured: {m}"
        try:
            mine = self.traces(cell, None, scored(record))
        except TraceUnavailable as e:
            return f"fingerprint not written: {e}"
        fp = fingerprint.make(mine, cell.engine, fused, m.a, m.others, m.noise)
        return B.set_fingerprint(self.runner.baselines_root, cell.tier, cell.id, fp)


def against_fingerprint(record: R.Record, baseline: B.Baseline, traces: list[PromptTrace], note: str = "") -> R.Localisation:
    """The localisation of ``record``'s ``traces`` against its baseline's fingerprint: the loaded
    state first, then the outputs, beyond OTHER_KERNELS_MARGIN x their noise where the baseline is
    from other kernels."""
    deltas = fingerprint.deltas(baseline.fingerprint, traces)
    margin = OTHER_KERNELS_MARGIN if B.other_kernels(record, baseline) else 1.0
    return localise(deltas, "baseline", note, changed_state=changed_state(record, baseline), margin=margin)


def changed_state(record: R.Record, baseline: B.Baseline) -> list[str]:
    """The modules whose loaded state differs from the baseline's (compare.check_loaded_state)."""
    c = C.check_loaded_state(record, baseline)
    return [] if c is None or c.ok else [*c.data["differing"], *c.data["missing"], *c.data["extra"]]


def scored(record: R.Record) -> dict[str, list[int]]:
    """The record's scored sequences, prompt id -> tokens: what its traces are taken on."""
    return {s.prompt.id: s.scored.tokens for s in record.sequences}
