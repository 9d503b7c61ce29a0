"""Cells as pytest parameters: ``pytest suites -k "whisper and torchao"``.

Wired in from suites/conftest.py. Every test that takes the ``harness_cell`` argument is
parametrized with the matrix's cells of the selected tier and engines; the test id is the cell id,
``<model>.<scheme>.<engine>``, so ``-k`` selects cells exactly as ``harness cells -k`` does (pytest
also matches the markers below, and the test's own file and function names).

Options: ``--tier`` (default cpu-tiny; several joined by commas, or ``all``), ``--engine
NAME[,NAME]``, ``--candidate ENGINE=SPEC`` (``harness run --candidate``: each selected cell of
ENGINE also runs on that build, as the test ``test_candidate_cell[<cell id>]``, judged against the
pinned build's result; it never writes a baseline), ``--update-baselines``, ``--harness-trace``
(``harness run --trace``: pytest's own ``--trace`` is its debugger), ``--results DIR`` (default
results/pytest-<UTC timestamp>; the session owns it, its xdist workers share it, and another run's
directory is refused at start, harness.runs), ``--baselines DIR`` (default baselines/), ``--matrix
FILE`` (default models.yaml).

Markers (registered in pyproject.toml): the tier (``cpu_tiny``, ``cpu_config``, ``gpu_tiny``, ``gpu_full``), the
hardware class (``cpu`` or ``gpu``), and for GPU cells ``hardware(gpus=, gpu_memory_gb=,
compute_capability=)`` with the cell's needs: ``pytest suites -m "not gpu"``.

Verdict -> test outcome: the ``pytest`` column of harness.verdicts' table (``pytest_outcome``):

- passed: ``pass``, ``improved``.
- FAILED, with the reason, the failing checks and, for an error, the end of the engine child's log:
  every verdict that fails the run (``regressed``, ``failed``, ``error``; ``unexpected-pass``, so a
  fixed known failure gets noticed and its entry removed; ``missing-baseline`` and
  ``stale-baseline`` unless ``--update-baselines`` wrote the baseline, after which the cell is
  judged against it and passes: CI can never pass without baselines).
- SKIPPED: ``unsupported`` from the capability probe (the engine did not run the cell here; it is
  not a pass, and a session in which nothing passed fails, see conftest.py).
- XFAIL: ``waived``, and ``unsupported`` through a known failure (the engine ran and failed in the
  documented way).

A path the session would write that cannot be written (``--results``, ``--baselines``, the caches)
fails every cell test with one line naming it, before any engine runs or anything is built.

Several tests of one (model, scheme) share their engines' records through the results directory
(file locks), so each engine runs once per session, and under ``-n 2`` the engines of a group run
on two workers at once. At the end, the terminal summary shows the verdict table and every
baseline that was written or refused.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from harness import baselines, files, matrix, runs, verdicts
from harness import records as R
from harness.terminal import one_line
from harness.matrix import DEFAULT_PATH, TIERS, MatrixError, tier_selection

__all__ = [
    "harness_runner",
    "pytest_addoption",
    "pytest_collection_finish",
    "pytest_collection_modifyitems",
    "pytest_configure",
    "pytest_generate_tests",
    "pytest_runtest_logreport",
    "pytest_terminal_summary",
    "pytest_unconfigure",
]



def pytest_addoption(parser):
    g = parser.getgroup("harness", "the quantized-loading matrix (harness)")
    g.addoption("--tier", default="cpu-tiny", type=tier_selection, metavar="TIER[,TIER]",
                help=f"the matrix tiers to run ({', '.join(TIERS)}; several joined by commas; default: cpu-tiny; "
                     "all: every tier but cpu-load)")
    g.addoption("--engine", default=None, metavar="NAME[,NAME]", help="limit the engines (reference, transformers, vllm)")
    g.addoption("--update-baselines", action="store_true", default=False,
                help="write the baselines of cells that may become one (never failed/error/unsupported)")
    g.addoption("--update-kernel-baselines", action="store_true", default=False,
                help="write a baseline for this machine's kernels of each cell whose logprobs were not judged "
                     "against a baseline from other kernels, and of each load-time gated cell whose baseline is "
                     "from other kernels (harness run --update-kernel-baselines)")
    g.addoption("--candidate", action="append", default=[], metavar="ENGINE=SPEC",
                help="also run each selected cell of ENGINE on a candidate build (harness run --candidate), as the "
                     "tests test_candidate_cell[<cell id>]")
    g.addoption("--harness-trace", action="store_true", default=False,
                help="record module traces of every cell and localise it (harness run --trace; failed and "
                     "regressed cells are always localised)")
    g.addoption("--results", default=None, metavar="DIR",
                help="results directory, new or empty: the session owns it (default: a new results/pytest-<timestamp>)")
    g.addoption("--baselines", default=None, metavar="DIR", help="baselines root (default: baselines/)")
    g.addoption("--matrix", default=None, metavar="FILE", help="matrix file (default: models.yaml)")


class _State:
    def __init__(self, config):
        opt = config.option
        self.config = config
        self.matrix_path = Path(opt.matrix or DEFAULT_PATH)
        self.baselines = Path(opt.baselines) if opt.baselines else baselines.DEFAULT_ROOT
        self.update = bool(opt.update_baselines)
        self.update_kernels = bool(opt.update_kernel_baselines)
        self.trace = bool(opt.harness_trace)
        self.tier = None if opt.tier == "all" else opt.tier
        self.engines = opt.engine
        self.candidate_specs: list[str] = list(opt.candidate)
        self.chosen_candidates: dict[str, str] = {}
        self.results: Path | None = None
        self.run = None  # the session's harness.runs.Run (the controller's; None in a worker)
        self.existed = False  # --results named a directory that was there before the session
        self._matrix = None
        self.runner = None
        self.prepared = False

    @property
    def matrix(self):
        if self._matrix is None:
            try:
                self._matrix = matrix.load(self.matrix_path)
            except MatrixError as e:
                raise pytest.UsageError(str(e)) from None
        return self._matrix

    def cells(self):
        try:
            return self.matrix.cells(tier=self.tier, engines=self.engines)
        except MatrixError as e:
            raise pytest.UsageError(str(e)) from None

    def candidate_engines(self) -> set[str]:
        """The engines --candidate names (their builds are prepared on the first cell test)."""
        if not self.candidate_specs:
            return set()
        # lazy: filelock, packaging; only with --candidate
        from harness import candidates

        try:
            return {candidates.parse(text)[0] for text in self.candidate_specs}
        except candidates.CandidateError as e:
            raise pytest.UsageError(str(e)) from None


class _XdistHooks:
    """Registered only when pytest-xdist is active: hands the results directory to the workers."""

    def __init__(self, state: _State):
        self.state = state

    @pytest.hookimpl
    def pytest_configure_node(self, node):
        node.workerinput["harness_results"] = str(self.state.results)
        node.workerinput["harness_run"] = self.state.run.id if self.state.run else None


def pytest_configure(config):
    state = _State(config)
    config.stash[_STASH] = state
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:  # a worker joins the controller's run, which owns the directory
        state.results = Path(workerinput["harness_results"])
        if workerinput.get("harness_run"):
            _refused_is_usage_error(lambda: runs.join(state.results, workerinput["harness_run"]))
        return
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_XdistHooks(state), "harness-xdist")
    if config.option.collectonly:  # nothing is written: no directory made or claimed
        state.results = Path(config.option.results or "results/pytest-collect-only")
        return
    # the session is one run and owns its results directory (docs/design.md, "Runs side by side"):
    # claimed now, before any cell test, so that another run's directory is refused up front
    state.run = runs.Run.new("pytest")
    if config.option.results:
        state.results = Path(config.option.results)
        state.existed = os.path.lexists(state.results)
        problem = files.write_problem([files.Written(state.results, "--results")])
        if problem:
            raise pytest.UsageError(f"harness: {problem}")
        _refused_is_usage_error(lambda: runs.claim(state.results, state.run))
    else:
        state.results = _refused_is_usage_error(lambda: runs.create(state.run, prefix="pytest-"))


def _refused_is_usage_error(claim):
    try:
        return claim()
    except runs.Refused as e:
        raise pytest.UsageError(f"harness: {e}") from None


def pytest_unconfigure(config):
    """A session that ran no cell leaves no results directory it made."""
    state = config.stash.get(_STASH, None)
    if state is None or state.run is None or state.results is None:
        return
    if not state.existed:
        runs.discard_if_unused(state.results, state.run)
    runs.release(state.results)


_STASH = pytest.StashKey[_State]()
_REPORTS: list[dict] = []  # controller: the harness property of every finished cell test


def _marks(cell):
    marks = [getattr(pytest.mark, m) for m in cell.markers]
    hw = cell.hardware
    if hw.gpus:
        marks.append(pytest.mark.hardware(gpus=hw.gpus, gpu_memory_gb=hw.gpu_memory_gb,
                                          compute_capability=hw.compute_capability))
    return marks


def pytest_generate_tests(metafunc):
    name = next((n for n in ("harness_cell", "harness_candidate_cell") if n in metafunc.fixturenames), None)
    if name is None:
        return
    state = metafunc.config.stash[_STASH]
    cells = state.cells()
    if name == "harness_candidate_cell":
        engines = state.candidate_engines()
        cells = [c for c in cells if c.engine in engines and c.configuration is None]
    metafunc.parametrize(name, [pytest.param(c, id=c.id, marks=_marks(c)) for c in cells])


def pytest_collection_modifyitems(config, items):
    """Without --candidate the candidate test has no cells: deselected rather than reported skipped."""
    state = config.stash.get(_STASH, None)
    if state is None or state.candidate_specs:
        return
    kept, dropped = [], []
    for item in items:
        (dropped if "harness_candidate_cell" in getattr(item, "fixturenames", ()) else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_collection_finish(session):
    state = session.config.stash.get(_STASH, None)
    if state is None:
        return
    params = [item.callspec.params for item in session.items if hasattr(item, "callspec")]
    selected = {p[k].id for p in params for k in ("harness_cell", "harness_candidate_cell") if k in p}
    if not selected:
        return
    cells = [c for c in state.cells() if c.id in selected]
    # lazy: numpy, filelock and more, +320 ms (scripts/import-graph --costs)
    from harness.runner import Runner

    state.chosen_candidates = _chosen_candidates(state, cells)
    state.runner = Runner(state.matrix, cells, results=state.results, baselines_root=state.baselines,
                          update_baselines=state.update, matrix_path=state.matrix_path, trace=state.trace,
                          update_kernel_baselines=state.update_kernels)


def _chosen_candidates(state: _State, cells) -> dict[str, str]:
    """--candidate's {engine: SPEC}, checked as harness run checks them; nothing is built yet."""
    if not state.candidate_specs:
        return {}
    # lazy: filelock, packaging; only with --candidate
    from harness import candidates

    updates = {"--update-baselines": state.update, "--update-kernel-baselines": state.update_kernels}
    try:
        return candidates.chosen(state.candidate_specs, cells, updates=updates)
    except candidates.CandidateError as e:
        raise pytest.UsageError(str(e)) from None


def _prepare_candidates(state: _State) -> None:
    """The candidate builds, built or reused from the cache on the first cell test (never at
    collection: --collect-only builds nothing), in every process that runs cells."""
    if not state.chosen_candidates:
        return
    # lazy: filelock, packaging; only with --candidate
    from harness import candidates

    try:
        state.runner.candidates = candidates.prepare_all(
            state.chosen_candidates, echo=lambda line: print(line, file=sys.stderr, flush=True))
    except candidates.CandidateError as e:
        pytest.fail(f"harness: {e}", pytrace=False)


@pytest.fixture
def harness_runner(request):
    state = request.config.stash[_STASH]
    if state.runner is None:
        pytest.fail("harness: no runner (the harness_cell parametrization did not run)", pytrace=False)
    if not state.prepared:  # created on first use: --collect-only leaves no results directory
        _prepare_candidates(state)
        # every path the session writes, checked before anything is built or run, as harness run does
        problem = files.write_problem(state.runner.writes())
        if problem:
            pytest.fail(f"harness: {problem}", pytrace=False)
        # lazy: numpy, regex, +300 ms (scripts/import-graph --costs)
        from harness.fixtures import benchmark

        benchmark.ensure_for_cells(state.matrix, state.runner.cells)  # cpu-load's, built on demand (locked)
        state.runner.prepare(fresh=False)
        state.prepared = True
    return state.runner


# ------------------------------------------------------------------------------------ outcome


def check(result, record_property=None, record_path=None) -> None:
    """Turn a judged cell into the test's outcome (see the module docstring)."""
    rec: R.Record = result.record
    verdict = rec.verdict or "error"
    reason = one_line(rec.verdict_reason, 400)
    if record_property is not None:
        record_property("harness", {"cell": rec.cell, "verdict": verdict, "reason": reason,
                                    "messages": list(result.messages), "candidate": rec.candidate})
    outcome = verdicts.pytest_outcome(verdict, known_failure=rec.known_failure is not None)
    if outcome == "passed":
        return
    if outcome == "skipped":
        pytest.skip(f"{verdict}: {reason}")
    if outcome == "xfailed":
        by_known = "" if verdicts.row(verdict).pytest == "xfailed" else " (known failure)"
        pytest.xfail(f"{verdict}{by_known}: {reason}")
    lines = [f"{rec.cell}: {verdict}: {reason}"]
    for c in rec.checks:
        if not c.ok:
            lines.append(f"  check {c.name}: {c.detail}")
    if verdicts.row(verdict).acceptable and rec.candidate is None:  # a candidate never writes a baseline
        lines.append(f"  to accept this result: pytest suites --update-baselines -k '{rec.cell}'  "
                     f"(or: harness run --update-baselines -k '{rec.cell}')")
    for m in result.messages:
        lines.append("  " + m.replace("\n", "\n  "))
    if rec.error is not None and rec.error.log_tail:
        lines.append("  engine log (tail):")
        lines += ["    " + ln for ln in rec.error.log_tail.splitlines()[-40:]]
    if record_path is not None:
        lines.append(f"  record: {record_path}")
    pytest.fail("\n".join(lines), pytrace=False)


# ------------------------------------------------------------------------------ terminal summary


def pytest_runtest_logreport(report):
    if report.when != "call":
        return
    for name, value in getattr(report, "user_properties", ()):
        if name == "harness" and isinstance(value, dict):
            _REPORTS.append(value)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if getattr(config, "workerinput", None) is not None or not _REPORTS:
        return

    state = config.stash.get(_STASH, None)
    tr = terminalreporter
    tr.section("harness matrix")
    s = verdicts.summarize([r["verdict"] for r in _REPORTS if r.get("candidate") is None])
    for line in s.table().splitlines():
        tr.write_line(line)
    for spec in sorted({r["candidate"] for r in _REPORTS if r.get("candidate") is not None}):
        tr.write_line("")
        tr.write_line(f"candidate {spec}, each cell against the pinned build's:")
        for line in verdicts.summarize([r["verdict"] for r in _REPORTS if r.get("candidate") == spec]).table().splitlines():
            tr.write_line(line)
    messages = [(r["cell"], m) for r in _REPORTS for m in r.get("messages", ())]
    shown = [(c, m) for c, m in messages if not m.startswith("obtained result")]
    if shown:
        tr.write_line("")
        tr.write_line("baselines:")
        for cell, m in shown:
            tr.write_line("  " + m.replace("\n", "\n  "))
    if state is not None and state.results is not None:
        tr.write_line(f"records in {state.results}")
