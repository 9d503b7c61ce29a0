"""The verdict table: one row per verdict, and one for the report's state ``missing``.

Every output reads its policy from here, so none can disagree with another (docs/design.md,
"Verdicts"): ``harness run``'s exit status and ``harness report --strict`` (``fails_run``), the
pytest plugin (``pytest``), JUnit XML (``junit``), the Buildkite annotation (``annotation``,
``emoji``), the HTML report (``colour``, ``text``, ``meaning``, ``severity``) and the baselines
(``baseline``: may a baseline be written from it; ``obtained``: is the obtained result written
beside the baseline). ``harness.records.Verdict`` is built from this table's verdict rows.

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


@dataclass(frozen=True)
class Row:
    name: str
    fails_run: bool  # harness run exits 1; harness report --strict exits 1
    severity: int  # 0 is the worst: the banner, the annotation style and "needs attention" order by it
    pytest: PytestOutcome | None  # the test's outcome (None: no test has this state)
    junit: JunitKind
    baseline: bool  # --update-baselines may write a baseline from a record with this verdict
    obtained: bool  # without --update-baselines, the obtained result is written beside the baseline
    annotation: AnnotationStyle  # the Buildkite annotation's style when this is the worst state
    colour: str  # background colour in the report
    text: str  # text colour on that background
    emoji: str  # the annotation's symbol
    meaning: str  # one line, the legend's
    verdict: bool = True  # False for ``missing``, which only the report knows


_ROWS = (
    Row("pass", False, 10, "passed", "passed", True, False, "success", "#2e7d32", "#ffffff", "✅",
        "matches the baseline within the bounds"),
    Row("regressed", True, 2, "failed", "failure", True, True, "error", "#d32f2f", "#ffffff", "📉",
        "differs from the baseline beyond the bounds (or loads slower)"),
    Row("improved", False, 9, "passed", "passed", True, True, "success", "#00897b", "#ffffff", "🚀",
        "loads faster than 1/bound of the baseline (gated tiers)"),
    Row("failed", True, 1, "failed", "failure", False, True, "error", "#7b1fa2", "#ffffff", "❌",
        "engines disagree beyond the bounds, or a module differs from the reference"),
    Row("error", True, 0, "failed", "error", False, False, "error", "#212121", "#ffffff", "💥",
        "crashed, timed out, or was never judged"),
    # skipped when a capability probe says so; xfailed when a known failure does (pytest_outcome)
    Row("unsupported", False, 8, "skipped", "skipped", False, False, "info", "#b0bec5", "#263238", "⚪",
        "a capability probe or a known failure says this engine cannot run it"),
    Row("waived", False, 7, "xfailed", "skipped", False, True, "info", "#8d6e63", "#ffffff", "🟤",
        "fails, exactly as a known failure in models.yaml says"),
    Row("unexpected-pass", True, 5, "failed", "failure", True, False, "warning", "#fbc02d", "#3e2723", "❗",
        "passes although a known failure covers it: narrow models.yaml"),
    Row("stale-baseline", True, 4, "failed", "failure", True, True, "warning", "#ef6c00", "#ffffff", "⏳",
        "the baseline is from another engine version, platform or fixture: not a pass"),
    Row("missing-baseline", True, 6, "failed", "failure", True, True, "warning", "#1976d2", "#ffffff", "❔",
        "no baseline stored: not a pass"),
    Row(MISSING, True, 3, None, "error", False, False, "error", "#ffffff", "#424242", "⛔",
        "expected, but no result record came back (crash, lost agent, cancel)", verdict=False),
)

ROWS: dict[str, Row] = {r.name: r for r in _ROWS}
VERDICTS: tuple[str, ...] = tuple(r.name for r in _ROWS if r.verdict)  # the order of every table
STATES: tuple[str, ...] = (*VERDICTS, MISSING)
SEVERITY: tuple[str, ...] = tuple(sorted(STATES, key=lambda s: ROWS[s].severity))  # worst first
FAILING: frozenset[str] = frozenset(s for s in STATES if ROWS[s].fails_run)
REFUSED_BASELINE: frozenset[str] = frozenset(v for v in VERDICTS if not ROWS[v].baseline)
WRITES_OBTAINED: frozenset[str] = frozenset(v for v in VERDICTS if ROWS[v].obtained)


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
