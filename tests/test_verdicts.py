"""The verdict table (harness.verdicts) and every output that follows it: `harness run`'s exit
status, `harness report --strict`, the pytest plugin, JUnit XML, the Buildkite annotation and the
HTML report agree with it for every verdict (and the report's state "missing")."""
from __future__ import annotations

import ast
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path

import markupsafe
import pytest
import report_scenario as rs
from _pytest.outcomes import Failed, Skipped, XFailed

from harness import records as R
from harness import verdicts as V
from harness.pytest_plugin import check
from harness.report import annotation_style, write_reports
from harness.runner import CellResult

T = datetime(2026, 1, 2, tzinfo=timezone.utc)
CELL_OF = {kind: cid for cid, kind in rs.ALL_KINDS.items()}
CELL_OF["fixed"] = "llama.unquantized.vllm"  # a candidate build's verdict (judging.judge_against_base)


def _record_of(verdict: str) -> R.Record:
    """A judged record with this verdict; ``fixed``, which only a candidate build gets, is a
    passing record relabelled, since what is tested here is how every output reads the table."""
    if verdict == "fixed":
        rec = rs.build(CELL_OF[verdict], "pass", started=T)
        return rec.model_copy(update={"verdict": "fixed", "verdict_reason": "base vllm 0.32.0 is waived by known failure"})
    return rs.build(CELL_OF[verdict], verdict, started=T)


def test_the_table_is_the_one_list_of_verdicts():
    assert R.VERDICTS == V.VERDICTS and set(V.ROWS) == {*V.VERDICTS, V.MISSING}
    assert [r.verdict for r in V.ROWS.values()].count(False) == 1 and not V.ROWS[V.MISSING].verdict
    assert sorted(r.severity for r in V.ROWS.values()) == list(range(len(V.ROWS)))  # a strict order
    assert V.SEVERITY[0] == "error" and V.SEVERITY[-1] == "pass"
    # baselines.py reads these two sets: it refuses and writes obtained files as the table says
    # (fixed: a candidate build's, which never writes a baseline)
    assert V.REFUSED_BASELINE == {"failed", "error", "unsupported", "fixed"}


def test_no_module_keeps_its_own_list_of_verdicts():
    """Adding a verdict means one row of harness/verdicts.py: no other module holds a literal
    tuple, list or set of two or more verdict names (a policy column of the table decides; a
    ``Literal[...]`` of record statuses, which share two of the names, is not such a list)."""
    names = set(V.STATES)
    found = []
    for path in sorted(Path(V.__file__).parent.rglob("*.py")):
        if path.name == "verdicts.py":
            continue
        tree = ast.parse(path.read_text())
        type_arguments = {id(n.slice) for n in ast.walk(tree) if isinstance(n, ast.Subscript)}  # Literal[...]
        for node in ast.walk(tree):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and id(node) not in type_arguments:
                listed = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in names]
                if len(listed) >= 2:
                    found.append(f"{path.name}:{node.lineno}: {listed}")
    assert found == []


def test_the_policy():
    """A missing or stale baseline and an unexpected pass cannot pass CI, and neither can anything wrong."""
    assert V.FAILING == {"regressed", "failed", "error", "unexpected-pass", "stale-baseline", "missing-baseline",
                         V.MISSING}
    for name, row in V.ROWS.items():
        assert row.fails_run == (row.junit in ("failure", "error")), name
        assert row.pytest is None or row.fails_run == (row.pytest == "failed"), name
        assert not (row.fails_run and row.annotation in ("success", "info")), name
    assert V.pytest_outcome("unsupported") == "skipped" and V.pytest_outcome("unsupported", known_failure=True) == "xfailed"
    assert V.pytest_outcome("waived") == "xfailed" and V.pytest_outcome("no-such-verdict") == "failed"


def test_summary_and_exit_code():
    s = V.summarize(["pass", "pass", "unsupported", "waived", "improved"])
    assert s.counts["pass"] == 2 and s.total == 5 and s.exit_code == 0
    assert list(s.counts) == list(R.VERDICTS)
    for bad in ("regressed", "failed", "error", "stale-baseline", "missing-baseline", "unexpected-pass"):
        assert V.summarize(["pass", bad]).exit_code == 1
    assert V.summarize([rs.build("llama.unquantized.reference", "pass", started=T), None]).counts["error"] == 1
    assert V.summarize([R.Record.model_construct(verdict=None)]).counts["error"] == 1  # never judged counts as error
    assert "pass" in s.table() and "total" in s.table()
    assert V.exit_code_for(["pass"]) == 0 and V.exit_code_for({"failed": 1}) == 1 and V.exit_code_for({"waived": 3}) == 0


def _pytest_outcome(result: CellResult) -> str:
    try:
        check(result)
    except XFailed:  # a subclass of Failed
        return "xfailed"
    except Failed:
        return "failed"
    except Skipped:
        return "skipped"
    return "passed"


@pytest.mark.parametrize("verdict", V.VERDICTS)
def test_every_output_follows_the_table(verdict, tmp_path):
    row = V.ROWS[verdict]
    cid = CELL_OF[verdict]
    rec = _record_of(verdict)
    assert rec.verdict == verdict
    result = CellResult(rs.CELLS[cid], rec)
    # harness run's exit status, and the pytest plugin's outcome
    assert V.summarize([result.record]).exit_code == int(row.fails_run)
    assert _pytest_outcome(result) == V.pytest_outcome(verdict, rec.known_failure is not None)
    assert (_pytest_outcome(result) == "failed") == row.fails_run
    # harness report: --strict, JUnit, the annotation, the HTML page
    R.save(tmp_path / "results" / f"{cid}.json", rec)
    w = write_reports([tmp_path / "results"], tmp_path / "out", matrix=rs.MATRIX)
    assert w.bad == row.fails_run
    (case,) = ET.parse(w.junit).getroot().iter("testcase")
    kind = next((ch.tag for ch in case if ch.tag in ("failure", "error", "skipped")), "passed")
    assert kind == row.junit and (kind in ("failure", "error")) == row.fails_run
    assert w.style == annotation_style([verdict]) == row.annotation
    text = w.annotation.read_text()
    assert f"{row.emoji} {verdict} **1**" in text
    assert ("**Needs attention**" in text) == V.needs_attention(verdict)
    page = w.html.read_text()
    assert f".v-{verdict}{{background:{row.colour};color:{row.text};" in page
    # the meaning as the template's autoescaping writes it (portable-pass's has an apostrophe)
    assert f'data-verdict="{verdict}" title="{markupsafe.escape(row.meaning)}">{verdict}<span class="n">1</span>' in page
    assert (f"<code>{cid}</code> <span class=\"why\">" in page) == V.needs_attention(verdict)


def test_a_missing_cell_follows_the_table(tmp_path):
    row = V.ROWS[V.MISSING]
    (tmp_path / "results").mkdir()
    w = write_reports([tmp_path / "results"], tmp_path / "out", expected=[rs.MISSING_CELL], matrix=rs.MATRIX)
    assert w.bad and w.style == row.annotation == "error"
    (case,) = ET.parse(w.junit).getroot().iter("testcase")
    assert [ch.tag for ch in case if ch.tag in ("failure", "error", "skipped")] == [row.junit]
    assert f"{row.emoji} `{rs.MISSING_CELL}` **missing**" in w.annotation.read_text()
