"""The verdict table: one row per verdict, and one for the report's state ``missing``.

Every output reads its policy from here, so none can disagree with another (docs/design.md,
"Verdicts"): ``harness run``'s exit status and ``harness report --strict`` (``fails_run``), the
pytest plugin (``pytest``), JUnit XML (``junit``), the Buildkite annotation (``annotation``,
``emoji``), the HTML report (``colour``, ``text``, ``meaning``, ``severity``, ``shows_log``), the
baselines (``baseline``: may a baseline be written from it; ``obtained``: is the obtained result
written beside the baseline, or a stale one removed; ``acceptable``) and the report's cross-check
(``has_results``). Adding a verdict means one row here, and the check that gives it. ``harness.records.Verdict`` is built from this table's verdict rows.

The policy: a cell fails the run when it is wrong (regressed, failed, error), when it cannot be
judged against a baseline of its own (missing-baseline, stale-baseline), when a known failure no
longer fails (unexpected-pass: the models.yaml entry must go), and, at merge, when an expected
cell sent no record (missing). unsupported and waived do not fail the run and are not passes:
pytest skips or xfails them, JUnit marks them skipped.

Nothing here imports anything of the harness.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

MISSING = "missing"  # not a verdict: an expected cell for which no record came back

PytestOutcome = Literal["passed", "failed", "skipped", "xfailed"]
JunitKind = Literal["passed", "failure", "error", "skipped"]
AnnotationStyle = Literal["error", "warning", "info", "success"]
ObtainedFile = Literal["write", "clear", "keep"]


@dataclass(frozen=True)
class Row:
    name: str
    fails_run: bool  # harness run exits 1; harness report --strict exits 1
    severity: int  # 0 is the worst: the banner, the annotation style and "needs attention" order by it
    pytest: PytestOutcome | None  # the test's outcome (None: no test has this state)
    junit: JunitKind
    baseline: bool  # --update-baselines may write a baseline from a record with this verdict
    # Without --update-baselines, the obtained result beside the baseline: written, a stale one
    # removed, or left as it is.
    obtained: ObtainedFile
    annotation: AnnotationStyle  # the Buildkite annotation's style when this is the worst state
    colour: str  # background colour in the report
    text: str  # text colour on that background
    emoji: str  # the annotation's symbol
    meaning: str  # one line, the legend's
    # The report shows the tail of the engine child's log.
    shows_log: bool = False
    # The failure message says how to accept the result as the baseline.
    acceptable: bool = False
    # The record holds results that the report's cross-check compares across engines.
    has_results: bool = True
    verdict: bool = True  # False for ``missing``, which only the report knows


_ROWS = (
    Row("pass", False, 12, "passed", "passed", True, "clear", "success", "#2e7d32", "#ffffff", "✅",
        "matches the baseline within the bounds"),
    # A cell that quantizes activations or computes in bfloat16, against a baseline from other
    # kernels: judged by what carries by construction (harness.evidence.judged_against).
    Row("portable-pass", False, 11, "passed", "passed", True, "clear", "success", "#689f38", "#ffffff", "☑️",
        "on other kernels than its baseline's: loaded state exact, agrees with the other engines here; logprobs against the baseline shown, not judged"),
    Row("regressed", True, 2, "failed", "failure", True, "write", "error", "#d32f2f", "#ffffff", "📉",
        "differs from the baseline beyond the bounds (or loads slower)", shows_log=True),
    Row("improved", False, 9, "passed", "passed", True, "write", "success", "#00897b", "#ffffff", "🚀",
        "loads faster than 1/bound of the baseline (gated tiers)"),
    Row("failed", True, 1, "failed", "failure", False, "write", "error", "#7b1fa2", "#ffffff", "❌",
        "engines disagree beyond the bounds, or a module differs from the reference", shows_log=True),
    Row("error", True, 0, "failed", "error", False, "keep", "error", "#212121", "#ffffff", "💥",
        "crashed, timed out, or was never judged", shows_log=True, has_results=False),
    # skipped when a capability probe says so; xfailed when a known failure does (pytest_outcome)
    Row("unsupported", False, 8, "skipped", "skipped", False, "keep", "info", "#b0bec5", "#263238", "⚪",
        "a capability probe or a known failure says this engine cannot run it", has_results=False),
    # A waived cell has a baseline of its own: the engine's recorded known behaviour, which a second
    # bug in the same cell would leave (harness.judging, steps 3 and 6).
    Row("waived", False, 7, "xfailed", "skipped", True, "clear", "info", "#8d6e63", "#ffffff", "🟤",
        "fails, exactly as a known failure in models.yaml says, and as its baseline recorded", shows_log=True),
    # Only a candidate build gets it (harness.judging.judge_against_base): the base build's known
    # failure does not show on the candidate, which agrees with the other engines of the run.
    Row("fixed", False, 10, "passed", "passed", False, "keep", "success", "#43a047", "#ffffff", "🩹",
        "a candidate build no longer shows the known failure of the base build"),
    Row("unexpected-pass", True, 5, "failed", "failure", True, "keep", "warning", "#fbc02d", "#3e2723", "❗",
        "passes although a known failure covers it: narrow models.yaml"),
    Row("stale-baseline", True, 4, "failed", "failure", True, "write", "warning", "#ef6c00", "#ffffff", "⏳",
        "the baseline is from another engine version, platform or fixture: not a pass", acceptable=True),
    Row("missing-baseline", True, 6, "failed", "failure", True, "write", "warning", "#1976d2", "#ffffff", "❔",
        "no baseline stored: not a pass", acceptable=True),
    Row(MISSING, True, 3, None, "error", False, "keep", "error", "#ffffff", "#424242", "⛔",
        "expected, but no result record came back (crash, lost agent, cancel)", has_results=False, verdict=False),
)

ROWS: dict[str, Row] = {r.name: r for r in _ROWS}
VERDICTS: tuple[str, ...] = tuple(r.name for r in _ROWS if r.verdict)  # the order of every table
STATES: tuple[str, ...] = (*VERDICTS, MISSING)
SEVERITY: tuple[str, ...] = tuple(sorted(STATES, key=lambda s: ROWS[s].severity))  # worst first
FAILING: frozenset[str] = frozenset(s for s in STATES if ROWS[s].fails_run)
REFUSED_BASELINE: frozenset[str] = frozenset(v for v in VERDICTS if not ROWS[v].baseline)
WRITES_OBTAINED: frozenset[str] = frozenset(v for v in VERDICTS if ROWS[v].obtained == "write")
CLEARS_OBTAINED: frozenset[str] = frozenset(v for v in VERDICTS if ROWS[v].obtained == "clear")


def row(state: str) -> Row:
    """The row of a state; anything unknown (a record never judged) is ``error``'s."""
    return ROWS.get(state, ROWS["error"])


def fails_run(state: str) -> bool:
    return row(state).fails_run


def needs_attention(state: str) -> bool:
    """Everything but a plain pass: what the report lists under "needs attention"."""
    return row(state).pytest != "passed"


def worst(states: Iterable[str]) -> str | None:
    present = set(states)
    return next((s for s in SEVERITY if s in present), None)


def pytest_outcome(verdict: str, known_failure: bool = False) -> PytestOutcome:
    """The test outcome of a verdict. A verdict skipped by the table becomes xfailed when a known
    failure produced it (the engine ran and failed in the documented way)."""
    outcome = row(verdict).pytest or "failed"
    return "xfailed" if outcome == "skipped" and known_failure else outcome


# ---------------------------------------------------------------------------------- summary


@dataclass
class Summary:
    counts: dict[str, int]  # every verdict, in the table's order
    total: int

    @property
    def exit_code(self) -> int:
        """0 when no cell fails the run, 1 otherwise."""
        return 1 if any(n and fails_run(v) for v, n in self.counts.items()) else 0

    def table(self) -> str:
        width = max(len(v) for v in VERDICTS)
        lines = [f"{'verdict':<{width}}  cells"]
        lines += [f"{v:<{width}}  {n}" for v, n in self.counts.items() if n]
        lines.append(f"{'total':<{width}}  {self.total}")
        return "\n".join(lines)


def summarize(items: Iterable[Any]) -> Summary:
    """Counts per verdict of records (anything with ``.verdict``) or verdict names. A record that
    was never judged, or an unknown name, counts as error."""
    counts = {v: 0 for v in VERDICTS}
    total = 0
    for item in items:
        v = item if isinstance(item, str) or item is None else item.verdict
        counts[v if v in counts else "error"] += 1
        total += 1
    return Summary(counts, total)


def exit_code_for(verdicts: dict[str, int] | Iterable[Any]) -> int:
    """0 when no cell fails the run; 1 otherwise (counts per verdict, or what summarize takes)."""
    if isinstance(verdicts, dict):
        return Summary(dict(verdicts), sum(verdicts.values())).exit_code
    return summarize(verdicts).exit_code
