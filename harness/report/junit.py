"""JUnit XML, written with junitparser: one <testcase> per cell, one <testsuite> per tier, so that
Buildkite Test Engine (and any CI) can read the matrix.

- ``classname``: ``<tier>.<model>.<scheme>``; ``name``: the cell id; ``file``: models.yaml.
- The result element is the ``junit`` column of harness.verdicts' table: passed (none), <failure>,
  <error> or <skipped>, with ``type`` the verdict and the reason as its message. A cell fails the
  run exactly when it is a failure or an error here (every verdict that fails ``harness run``;
  an expected cell without a record is an error).
- Each case carries the verdict, engine, engine version and platform as properties, and the
  verdict and its reason in system-out. ``portable-pass`` is a passed case whose ``verdict``
  property says so; the checks computed but not judged (harness.report.states.check_state) are
  named in a ``not_judged`` property and listed, with their details, in system-out.
- An unreadable record file is an error case in the suite ``harness unreadable``.
- A candidate build's record (``harness run --candidate``) is a case of its own after the base
  build's, named ``<cell id> [candidate <engine> <version> vs base <version>]``, its result the
  candidate's verdict, with the candidate's spec as a property.
"""
from __future__ import annotations

import io
import re
from collections.abc import Sequence

from junitparser import Attr, Error, Failure, JUnitXml, Properties, Property, Skipped, TestCase, TestSuite

from harness.report import candidates
from harness.report.states import check_state, state_of
from harness.report.merge import Merged
from harness.verdicts import MISSING, row

# XML 1.0 cannot carry most control characters, whatever the escaping.
_BAD_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")
_RESULTS = {"failure": Failure, "error": Error}
NO_RECORD = ("no result record came back for this expected cell (crash, timeout at the agent, lost agent "
             "or cancel)")


class _Case(TestCase):
    file = Attr()


def _clean(text: str | None, limit: int = 20000) -> str:
    text = _BAD_XML.sub("?", text or "")
    return text if len(text) <= limit else text[:limit] + "…"


def _split(cell_id: str) -> tuple[str, str]:
    parts = cell_id.split(".")
    return (".".join(parts[:-2]), parts[-2]) if len(parts) >= 3 else (cell_id, "?")


def _case(cell_id: str, classname: str, seconds: float, state: str, reason: str, detail: str | None,
          properties: dict[str, str], shown: Sequence[str] = ()) -> _Case:
    case = _Case(_clean(cell_id), _clean(classname), round(seconds, 3))
    case.file = "models.yaml"
    if properties:
        props = Properties()
        for k, v in properties.items():
            props.add_property(Property(k, _clean(v)))
        case.append(props)
    kind = row(state).junit
    if kind == "skipped":
        case.result = [Skipped(_clean(f"{state}: {reason}", 1000))]
    elif kind in _RESULTS:
        result = _RESULTS[kind](_clean(reason, 1000), state)
        if detail:
            result.text = _clean(detail)
        case.result = [result]
    if properties:
        case.system_out = _clean("\n".join([f"verdict: {state}", reason, *shown]))
    return case


def _record_case(r, name: str | None = None) -> _Case:
    state = state_of(r)
    reason = r.verdict_reason or state
    if row(state).junit == "error" and r.error is not None:
        detail = f"{r.error.type}: {r.error.message}\n\n{r.error.log_tail}"
    else:
        detail = "\n".join(f"{c.name}: {c.detail}" for c in r.checks if not c.ok) or reason
    props = {"verdict": state, "engine": r.engine, "engine_version": r.engine_info.version or "",
             "platform": r.engine_info.platform or ""}
    if r.candidate is not None:
        props["candidate"] = r.candidate
    shown = [c for c in r.checks if check_state(c) == "shown"]
    if shown:
        props["not_judged"] = ", ".join(c.name for c in shown)
    return _case(name or r.cell, f"{r.tier}.{r.model}.{r.scheme}", r.duration_s, state, reason, detail, props,
                 [f"{c.name}: {c.detail}" for c in shown])


def render(merged: Merged, *, matrix=None) -> str:
    tiers = {c.id: c.tier for c in matrix.cells()} if matrix is not None else {}
    cases: dict[str, list[_Case]] = {}
    for cell_id in sorted({*merged.current, *merged.candidates}):
        base, candidate = merged.current.get(cell_id), merged.candidates.get(cell_id)
        if base is not None:
            cases.setdefault(base.record.tier, []).append(_record_case(base.record))
        if candidate is not None:  # the same cell on the candidate build, named with both builds
            c = candidate.record
            name = f"{cell_id} [{candidates.label(c, base.record if base else None)}]"
            cases.setdefault(c.tier, []).append(_record_case(c, name))
    for cell_id in merged.missing:
        model, scheme = _split(cell_id)
        tier = tiers.get(cell_id, "unknown")
        cases.setdefault(tier, []).append(_case(cell_id, f"{tier}.{model}.{scheme}", 0.0, MISSING, NO_RECORD, None, {}))
    xml = JUnitXml("harness")
    for tier in sorted(cases):
        suite = TestSuite(f"harness {tier}")
        suite.add_testcases(cases[tier])
        xml.add_testsuite(suite)
    if merged.problems:
        suite = TestSuite("harness unreadable")
        suite.add_testcases([_unreadable(p) for p in merged.problems])
        xml.add_testsuite(suite)
    xml.update_statistics()
    buf = io.BytesIO()
    xml.write(buf, pretty=True)
    return buf.getvalue().decode("utf-8")


def _unreadable(problem) -> TestCase:
    case = TestCase(_clean(str(problem.path)), "unreadable", 0.0)
    case.result = [Error(_clean(problem.message, 1000), "unreadable-record")]
    return case
