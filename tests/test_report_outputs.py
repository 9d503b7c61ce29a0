"""The report's outputs: the self-contained HTML page, JUnit XML, the Buildkite annotation, and
`harness report`."""
from __future__ import annotations

import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from html.parser import HTMLParser
from pathlib import Path

import markupsafe
import pytest
import report_scenario as rs

from harness import cli
from harness.records import VERDICTS, save
from harness.report import annotation_style, write_reports
from harness.report.annotation import md
from harness.verdicts import MISSING, ROWS, STATES

# every state the scenario's base records hold: `fixed` is only a candidate build's (its table:
# tests/test_report_candidates.py)
BASE_STATES = [s for s in STATES if s != "fixed"]

ROOT = Path(__file__).resolve().parent.parent
T1 = datetime(2026, 1, 1, tzinfo=timezone.utc)
T2 = datetime(2026, 1, 2, tzinfo=timezone.utc)
EXPECTED = [*rs.ALL_KINDS, rs.MISSING_CELL]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Two result sets (for the trend) covering every verdict but ``fixed``, plus one missing cell."""
    d = tmp_path_factory.mktemp("report")
    rs.write(d / "run1", rs.ALL_KINDS, started=T1, load_scale=1.4)
    rs.write(d / "run2", rs.ALL_KINDS, started=T2)
    w = write_reports([d / "run1", d / "run2"], d / "out", expected=EXPECTED, matrix=rs.MATRIX)
    return d, w


class _Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.scripts: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self._in_script = tag == "script"
        if tag == "script":
            self.scripts.append("")

    def handle_endtag(self, tag):
        if tag == "script":
            self._in_script = False

    def handle_data(self, data):
        if self._in_script:
            self.scripts[-1] += data


def test_all_states_have_distinct_colors():
    assert set(ROWS) == set(STATES) == {*VERDICTS, MISSING}
    assert len({r.colour for r in ROWS.values()}) == len(ROWS)


def test_html_is_one_self_contained_file(written):
    d, w = written
    assert sorted(p.name for p in (d / "out").iterdir()) == ["annotation-style.txt", "annotation.md", "junit.xml", "report.html"]
    page = w.html.read_text()
    p = _Tags()
    p.feed(page)
    # nothing is fetched: no external stylesheet, script, image, font or frame
    for tag, attrs in p.tags:
        assert tag not in ("link", "img", "iframe", "object", "embed"), tag
        assert "src" not in attrs, (tag, attrs)
        if tag == "a":
            assert attrs["href"].startswith("https://"), attrs  # only the known failure's link, to click
    assert "@import" not in page and "url(" not in page
    assert "default-src 'none'" in page  # and a CSP that would block it anyway


def test_text_from_records_and_logs_is_escaped(written):
    d, w = written
    page = w.html.read_text()
    p = _Tags()
    p.feed(page)
    assert len(p.scripts) == 1 and "__pwned" not in p.scripts[0]  # the page's own script only
    assert rs.EVIL not in page
    escaped = str(markupsafe.escape(rs.EVIL))  # as the templates' autoescaping writes it
    # the error message, the engine log tail, the log file and the module diff all show it as text
    assert page.count(escaped) >= 4


def test_grid_counts_filter_and_details(written):
    d, w = written
    page = w.html.read_text()
    assert w.counts == {s: int(s in BASE_STATES) for s in STATES}
    for s in BASE_STATES:
        assert f'data-verdict="{s}"' in page
        assert re.search(rf'class="f v-{s}" data-verdict="{s}"[^>]*>{s}<span class="n">1</span>', page), s
    for tier in ("cpu-tiny", "gpu-tiny", "gpu-full"):
        assert f'data-tier="{tier}"' in page
    assert page.count('<td class="cell"') == 11  # model x scheme cells holding the 12 engine chips
    # the regressed cell's details: |Δlogprob| chart, first greedy divergence with both top-k
    assert "Teacher-forced |Δlogprob| against baseline ✗ beyond the bound" in page
    assert "First greedy divergence against baseline" in page
    assert page.count('<table class="topk">') >= 1
    assert '<svg class="chart"' in page
    # vLLM's module diff, the known failure and its link
    assert "Module diff against the reference" in page and "cross_attn.kv_proj" in page
    assert 'href="https://github.com/vllm-project/vllm/issues"' in page
    # load time against the baseline and the trend across the two result sets
    assert "trend across result sets" in page and "run1" in page and "run2" in page
    # the log tail for errors, and the missing cell explained
    assert "last 3 lines of <code>whisper.fp8-static-kv.transformers.log</code>" in page
    assert "No result record came back for this expected cell" in page


def test_junit_has_one_testcase_per_cell(written):
    d, w = written
    root = ET.parse(w.junit).getroot()
    cases = root.findall(".//testcase")
    assert sorted(c.get("name") for c in cases) == sorted(EXPECTED)
    kind = {c.get("name"): next((ch.tag for ch in c if ch.tag in ("failure", "error", "skipped")), "passed") for c in cases}
    by_verdict = {rs.ALL_KINDS.get(n, MISSING): k for n, k in kind.items()}
    assert by_verdict == {  # the unified policy (harness.verdicts): what fails the run is never passed or skipped
        "pass": "passed", "portable-pass": "passed", "improved": "passed", "unexpected-pass": "failure",
        "regressed": "failure", "failed": "failure", "error": "error", MISSING: "error",
        "unsupported": "skipped", "waived": "skipped", "stale-baseline": "failure", "missing-baseline": "failure",
    }
    assert root.get("tests") == str(len(EXPECTED)) and root.get("failures") == "5" and root.get("errors") == "2"
    assert {s.get("name") for s in root.findall("testsuite")} == {"harness cpu-tiny", "harness gpu-tiny", "harness gpu-full"}
    err = next(c for c in cases if c.get("name") == "whisper.fp8-static-kv.transformers").find("error")
    assert rs.EVIL in err.text  # XML-escaped by the writer, intact for the reader
    # portable-pass passes, and says so: its verdict, and the checks it was not judged by
    portable = next(c for c in cases if c.get("name") == rs.PORTABLE)
    props = {p.get("name"): p.get("value") for p in portable.iter("property")}
    assert props["verdict"] == "portable-pass" and props["not_judged"] == "teacher-forced:baseline, greedy:baseline"
    assert "teacher-forced:baseline: not judged: the baseline is from other kernels" in portable.find("system-out").text


def test_annotation_summary_and_style(written):
    d, w = written
    text = w.annotation.read_text()
    assert (d / "out" / "annotation-style.txt").read_text() == "error\n"
    assert text.startswith("#### Quantized loading matrix: 9 of 12 cells need attention")
    for s in BASE_STATES:
        assert f"{ROWS[s].emoji} {s} **1**" in text
    assert "| scheme \\\\ model | llama | whisper |" in text
    assert "| fp8-static-kv |   | ⚪ref 💥tf |" in text  # whisper column: unsupported reference, error transformers
    assert "<script>" not in text and "&lt;script&gt;" in text
    assert 'href="artifact://out/report.html"' in text
    assert len(text.encode()) < 1024 * 1024


def test_annotation_style_follows_the_worst_state():
    assert annotation_style(["pass", "improved"]) == "success"
    assert annotation_style(["pass", "unsupported", "waived"]) == "info"
    assert annotation_style(["pass", "missing-baseline"]) == "warning"
    assert annotation_style(["pass", "stale-baseline", "waived"]) == "warning"
    assert annotation_style(["pass", "unexpected-pass"]) == "warning"
    for bad in ("regressed", "failed", "error", MISSING):
        assert annotation_style(["pass", "waived", bad]) == "error"
    assert annotation_style([]) == "info"
    assert annotation_style(["pass"], problems=1) == "error"


def test_markdown_escaping():
    assert md("a|b\n<script>`x`[l](javascript:y)") == r"a\|b &lt;script&gt;\`x\`\[l\]\(javascript:y\)"
    assert md("x" * 400).endswith("…") and len(md("x" * 400)) == 301


def test_one_regressed_and_one_vllm_known_failure(tmp_path):
    """The scenario of the issue's closing note, over the whole matrix."""
    kinds = rs.full_matrix_kinds({rs.REGRESSED_GPU: "regressed", rs.KNOWN_FAILURE: "waived"})
    rs.write(tmp_path / "results", kinds, logs=False)
    w = write_reports([tmp_path / "results"], tmp_path / "reports", expected=list(kinds), matrix=rs.MATRIX)
    n = len(kinds)
    cpu = sum(1 for cid in kinds if rs.CELLS[cid].tier == "cpu-tiny")
    assert {k: v for k, v in w.counts.items() if v} == {"pass": n - 2, "regressed": 1, "waived": 1}
    assert w.style == "error" and w.bad
    text = w.annotation.read_text()
    assert text.startswith(f"#### Quantized loading matrix: 2 of {n} cells need attention")
    assert f"- 📉 `{rs.REGRESSED_GPU}` **regressed**: teacher-forced:baseline: exceeds bound" in text
    assert f"- 🟤 `{rs.KNOWN_FAILURE}` **waived**: known failure: vLLM 0.10.2 skips" in text
    assert f"<details><summary><b>cpu-tiny</b>: {cpu} cells, all pass</summary>" in text
    # waived alone would be info
    kinds[rs.REGRESSED_GPU] = "pass"
    rs.write(tmp_path / "r2", kinds, logs=False)
    assert write_reports([tmp_path / "r2"], tmp_path / "rep2", matrix=rs.MATRIX).style == "info"


def test_harness_report_cli(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    rs.write(tmp_path / "results", {"llama.unquantized.reference": "pass"}, started=T1)
    out = tmp_path / "reports"
    assert cli.main(["report", str(tmp_path / "results"), "-o", str(out)]) == 0
    assert "pass     1" in capsys.readouterr()[0]
    # --strict: a missing expected cell fails the step that renders the report
    assert cli.main(["report", str(tmp_path / "results"), "-o", str(out), "--strict",
                     "--expect", "llama.unquantized.reference llama.bnb-nf4.reference"]) == 1
    o = capsys.readouterr()[0]
    assert "missing: 1 expected cell(s) have no record: llama.bnb-nf4.reference" in o
    assert cli.main(["report", str(tmp_path / "results"), "-o", str(out), "--strict"]) == 0
    assert cli.main(["report", str(tmp_path / "results"), "-o", str(out), "--matrix", str(tmp_path / "nope.yaml")]) == 2
    # a results directory that is not there is one line and exit 2, never an empty report
    capsys.readouterr()
    assert cli.main(["report", str(tmp_path / "nowhere"), "-o", str(out)]) == 2
    assert capsys.readouterr()[1].strip() == f"error: {tmp_path / 'nowhere'}: no such directory (RESULTS are result directories of `harness run`)"
    # python -m harness.report is the same command (the Buildkite report step uses it)
    r = subprocess.run([sys.executable, "-m", "harness.report", str(tmp_path / "results"), "-o", str(out), "--strict"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (out / "report.html").is_file()


def _one_set(tmp_path, name: str, kinds: dict[str, str]):
    """The outputs of one result set of ``kinds`` (cell id -> kind)."""
    rs.write(tmp_path / name, kinds, started=T1, logs=False)
    return write_reports([tmp_path / name], tmp_path / f"{name}-out", matrix=rs.MATRIX)


def test_portable_pass_is_counted_apart_from_pass(tmp_path):
    """A portable-pass passes the run, needs no attention, and every output counts it on its own:
    never summed into pass, and "all pass" is said only when every cell is a plain pass."""
    w = _one_set(tmp_path, "both", {"llama.unquantized.reference": "pass", rs.PORTABLE: "portable-pass"})
    assert {s: n for s, n in w.counts.items() if n} == {"pass": 1, "portable-pass": 1}
    assert not w.bad and w.style == "success"
    page = w.html.read_text()
    assert '<div class="banner v-portable-pass">2 cells · 1 pass, 1 portable-pass</div>' in page
    assert 'data-verdict="pass" title="matches the baseline within the bounds">pass<span class="n">1</span>' in page
    assert f'<span class="chip v-portable-pass" data-verdict="portable-pass" title="{rs.PORTABLE}: portable-pass">' in page
    assert "Needs attention" not in page
    text = w.annotation.read_text()
    assert text.startswith("#### Quantized loading matrix: none of 2 cells needs attention: 1 pass, 1 portable-pass")
    assert "✅ pass **1** · ☑️ portable-pass **1**" in text
    assert "<b>cpu-tiny</b>: 2 cells, 1 pass, 1 portable-pass</summary>" in text and "all pass" not in text
    assert "☑️vllm" in text and "**Needs attention**" not in text
    # beside a cell that needs attention it is still counted apart, after it
    w = _one_set(tmp_path, "bad", {rs.REGRESSED: "regressed", rs.PORTABLE: "portable-pass"})
    assert '<div class="banner v-regressed">2 cells · 1 regressed, 1 portable-pass</div>' in w.html.read_text()
    assert "<b>cpu-tiny</b>: 2 cells, 1 needs attention, 1 portable-pass</summary>" in w.annotation.read_text()
    # and a plain pass alone is all pass
    w = _one_set(tmp_path, "plain", {"llama.unquantized.reference": "pass"})
    assert '<div class="banner v-pass">1 cells · all pass</div>' in w.html.read_text()
    assert w.annotation.read_text().startswith("#### Quantized loading matrix: all 1 cells pass")


def test_a_check_not_judged_is_shown_as_such(tmp_path):
    """A check computed but not judged (portable-pass's logprobs against a baseline from other
    kernels) wears a grey "shown, not judged" badge wherever checks are listed, never a tick or a
    cross; its chart still draws, the family bound a reference line, the bars above it not red."""
    page = _one_set(tmp_path, "portable", {rs.PORTABLE: "portable-pass"}).html.read_text()
    badge = '<span class="badge shown" title="computed and shown for reference, not judged: neither a pass nor a failure">shown, not judged</span>'
    assert f"<h4>Teacher-forced |Δlogprob| against baseline {badge}</h4>" in page
    assert f"<h4>Greedy against baseline {badge}</h4>" in page
    for name in ("teacher-forced:baseline", "greedy:baseline"):
        assert f'<tr class="shown"><td>{badge}</td><td><code>{name}</code></td><td>not judged: ' in page, name
    assert '<tr class="ok"><td>✓</td><td><code>load-time:baseline</code>' in page  # a judged check keeps its tick
    assert "✗ beyond the bound" not in page and "<td>✗</td>" not in page
    # the chart: the moved positions above the family bound, drawn apart, the bound for reference
    assert '<svg class="chart"' in page and 'class="bar above"' in page and 'class="bar over"' not in page
    assert 'class="bound ref"/>' in page and ">reference</text>" in page
    assert "shown for reference: not judged" in page
    # judged, the same deltas are beyond the bound: red, and a cross
    judged = _one_set(tmp_path, "judged", {rs.REGRESSED: "regressed"}).html.read_text()
    assert 'class="bar over"' in judged and 'class="bar above"' not in judged and "badge shown" not in judged
    assert "Teacher-forced |Δlogprob| against baseline ✗ beyond the bound" in judged


def test_a_record_of_the_noise_aware_harness_is_judged_as_it_was(tmp_path):
    """An older record's teacher-forced check carries ``judged`` as positions by bound ("family" or
    "noise"): that is no "not judged" mark, and the keys it no longer writes are not shown."""
    cid = "llama.unquantized.reference"
    rec = rs.build(cid, "pass", started=T1)
    old = [c.model_copy(update={"data": {**c.data, "judged": {p: ["family"] * len(v) for p, v in c.data["per_position"].items()},
                                         "family_share": 1.0, "onsets": {}, "noise_bound": {}}})
           if c.name == "teacher-forced:baseline" else c for c in rec.checks]
    save(tmp_path / "old" / f"{cid}.json", rec.model_copy(update={"checks": old}))
    page = write_reports([tmp_path / "old"], tmp_path / "out", matrix=rs.MATRIX).html.read_text()
    assert "Teacher-forced |Δlogprob| against baseline ✓</h4>" in page and "badge shown" not in page
    assert '<tr class="ok"><td>✓</td><td><code>teacher-forced:baseline</code>' in page
    assert "family bound protects" not in page and "onset" not in page


def test_provenance_shows_the_run_and_the_baseline_cpu():
    from types import SimpleNamespace

    from harness.report import html

    cid = "llama.unquantized.reference"
    rec = rs.build(cid, "pass", started=T1)
    entry = SimpleNamespace(record=rec, path=Path("r.json"), source="results")
    prov = SimpleNamespace(engine="reference", engine_version="0.1.0", platform="cpu-x86_64-avx2",
                           date="2026-01-01T00:00:00Z", commit="c0ffee", cpu=rs.CPU)
    p = html._provenance(entry, SimpleNamespace(provenance=prov))
    assert p["cpu"] is None or p["cpu"]["name"]  # this record may predate the cpu block
    assert p["baseline"]["cpu"] == {"name": "GenuineIntel Intel(R) Xeon(R) Platinum 8488C", "capability": "avx512",
                                    "flags": ["avx2", "avx512f", "amx_tile"], "kernel_env": []}
    assert p["baseline"]["text"] == "reference 0.1.0 on cpu-x86_64-avx2, 2026-01-01T00:00:00Z, commit c0ffee"
    assert html._cpu(SimpleNamespace(cpu=rs.CPU))["capability"] == "avx512" and html._cpu(SimpleNamespace()) is None
    page = html._ENV.get_template("panel.html.j2").module.provenance(p)
    assert "baseline CPU" in page and "ATen CPU capability <code>avx512</code>" in page and "3 flags" in page
    assert html._provenance(entry, None)["baseline"] is None
