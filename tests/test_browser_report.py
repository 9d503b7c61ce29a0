"""The HTML report in a real headless browser: Debian's chromium, driven by Playwright's Python
package (its own browser download cannot work here, so it is pointed at /usr/bin/chromium).

The grid renders, the filter works, a cell expands on click, text from records stays text, the
page logs no JavaScript error, and screenshots are kept under reports/ as test artifacts.

Chromium is installed by the session fixture when it is missing (apt-get, as root: CI starts from
a clean machine). It is never skipped: a machine that cannot install it fails this test.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import pytest
import report_scenario as rs
from filelock import FileLock

from harness.report import write_reports
from harness.verdicts import STATES

# every state the scenario's base records hold: `fixed` is only a candidate build's (its table:
# tests/test_report_candidates.py)
BASE_STATES = [s for s in STATES if s != "fixed"]

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "reports"
CHROMIUM = Path("/usr/bin/chromium")
pytestmark = pytest.mark.slow("each test renders a report in headless Chromium through Playwright")

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-quic",
        "--no-first-run", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="session")
def chromium() -> Path:
    with FileLock(str(Path("/tmp") / "harness-chromium-install.lock"), timeout=1200):
        if not CHROMIUM.exists():
            if os.geteuid() != 0:
                pytest.fail(f"{CHROMIUM} is missing and installing it needs root: apt-get install -y chromium")
            env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
            for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "chromium"]):
                r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
                if r.returncode != 0:
                    pytest.fail(f"{' '.join(cmd)} failed ({r.returncode}): {(r.stderr or r.stdout)[-2000:]}")
        if not CHROMIUM.exists():
            pytest.fail(f"apt-get install chromium did not provide {CHROMIUM}")
    return CHROMIUM


@pytest.fixture(scope="module")
def browser(chromium):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(chromium), args=ARGS)
        yield b
        b.close()


class Page:
    """A page that records console errors, uncaught exceptions and dialogs."""

    def __init__(self, browser, path: Path):
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        self.requests: list[str] = []
        self.page = browser.new_page(viewport={"width": 1400, "height": 900})
        self.page.on("console", lambda m: self.errors.append(f"console: {m.text}") if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        self.page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.goto(path.as_uri())
        self.page.wait_for_load_state("load")

    def cell(self, cell_id: str):
        return self.page.locator(f'td.cell:has(span.chip[title^="{cell_id}:"])')

    def detail(self, cell_id: str):
        return self.page.locator(f"#{self.cell(cell_id).get_attribute('data-detail')}")


def _report(tmp_path: Path, sets: dict[str, dict[str, str]], expected) -> Path:
    for i, (name, kinds) in enumerate(sets.items()):
        rs.write(tmp_path / name, kinds, started=datetime(2026, 1, 1 + i, tzinfo=timezone.utc), load_scale=1.0 + 0.3 * (len(sets) - i - 1))
    return write_reports([tmp_path / n for n in sets], tmp_path / "out", expected=expected, matrix=rs.MATRIX).html


def _portable_pass_is_shown_apart(pg: Page) -> None:
    """portable-pass is a filter of its own; its logprob checks against the baseline wear the grey
    "shown, not judged" badge, and its chart draws the bars above the family bound apart, never red."""
    page, chips = pg.page, pg.page.locator("td.cell .chip")
    page.locator('button.f[data-verdict="portable-pass"]').click()
    assert [c.inner_text().split() for c in chips.all() if c.is_visible()] == [["vllm", "portable-pass"]]
    page.locator("button.f.all").click()
    pg.cell(rs.PORTABLE).click()
    portable = pg.detail(rs.PORTABLE)
    assert portable.locator(".badge.shown").count() == 4  # teacher-forced and greedy: headings and checks
    badge = portable.locator(".badge.shown").first
    assert badge.is_visible() and badge.inner_text() == "shown, not judged"
    assert badge.evaluate("b => getComputedStyle(b).backgroundColor") == "rgb(234, 238, 242)"
    assert portable.locator("svg.chart rect.bar.above").count() > 0
    assert portable.locator("svg.chart rect.bar.over").count() == 0
    pg.cell(rs.PORTABLE).click()


def test_report_in_chromium(browser, tmp_path):
    html = _report(tmp_path, {"run1": rs.ALL_KINDS, "run2": rs.ALL_KINDS}, [*rs.ALL_KINDS, rs.MISSING_CELL])
    pg = Page(browser, html)
    page = pg.page

    # the grid renders: three tiers, every engine chip, a colored filter button per state
    assert page.locator("table.grid").count() == 3
    chips = page.locator("td.cell .chip")
    assert chips.count() == len(rs.ALL_KINDS) + 1
    for s in BASE_STATES:
        button = page.locator(f'button.f[data-verdict="{s}"]')
        assert button.is_visible() and button.inner_text().replace("\n", "") == f"{s}1"
    colors = {page.locator(f'button.f[data-verdict="{s}"]').evaluate("b => getComputedStyle(b).backgroundColor")
              for s in BASE_STATES}
    assert len(colors) == len(BASE_STATES)

    # filter by verdict: only the regressed chip (and its row) stays
    page.locator('button.f[data-verdict="regressed"]').click()
    assert [c.inner_text().split()[0] for c in chips.all() if c.is_visible()] == ["reference"]
    assert page.locator("tr.gridrow:visible").count() == 1
    page.locator("button.f.all").click()
    assert sum(c.is_visible() for c in chips.all()) == chips.count()

    # a cell expands on click: the regressed cell shows its |Δlogprob| chart and greedy divergence
    detail = pg.detail(rs.REGRESSED)
    assert not detail.is_visible()
    pg.cell(rs.REGRESSED).click()
    assert detail.is_visible()
    assert detail.locator("svg.chart rect.bar.over").count() > 0
    assert detail.locator("table.topk").is_visible()
    assert "First greedy divergence against baseline" in detail.inner_text()
    assert detail.locator("text=trend across result sets").is_visible()
    pg.cell(rs.REGRESSED).click()
    assert not detail.is_visible()
    _portable_pass_is_shown_apart(pg)

    # text from records and logs shows as text, never runs
    pg.cell("whisper.fp8-static-kv.transformers").click()
    err = pg.detail("whisper.fp8-static-kv.transformers")
    assert rs.EVIL in err.inner_text()
    pg.cell(rs.KNOWN_FAILURE).click()
    kf = pg.detail(rs.KNOWN_FAILURE)
    assert "Module diff against the reference" in kf.inner_text() and rs.EVIL in kf.inner_text()
    assert page.evaluate("typeof window.__pwned") == "undefined"
    assert pg.dialogs == []

    # the "needs attention" list opens a cell too
    page.locator(f'.attention li:has(code:text-is("{rs.REGRESSED}"))').click()
    assert pg.detail(rs.REGRESSED).is_visible()

    ARTIFACTS.mkdir(exist_ok=True)
    page.locator("#collapse-all").click()
    page.screenshot(path=str(ARTIFACTS / "browser-report-overview.png"), full_page=True)
    pg.cell(rs.REGRESSED).click()
    pg.detail(rs.REGRESSED).screenshot(path=str(ARTIFACTS / "browser-report-regressed-cell.png"))
    assert pg.errors == [], pg.errors
    assert all(u.startswith("file://") for u in pg.requests), pg.requests  # nothing from the network
    shutil.copy(html, ARTIFACTS / "browser-report.html")


def test_one_regressed_and_one_known_failure_in_chromium(browser, tmp_path):
    kinds = rs.full_matrix_kinds({rs.REGRESSED_GPU: "regressed", rs.KNOWN_FAILURE: "waived"})
    html = _report(tmp_path, {"results": kinds}, list(kinds))
    pg = Page(browser, html)
    page = pg.page
    assert page.locator("td.cell .chip").count() == len(kinds)
    assert page.locator(".banner").inner_text() == f"{len(kinds)} cells · 1 regressed, 1 waived"
    assert page.locator(".attention li").count() == 2
    pg.cell(rs.KNOWN_FAILURE).click()
    assert "known failure (vllm >=0.10,<0.11" in pg.detail(rs.KNOWN_FAILURE).inner_text()
    page.locator("#collapse-all").click()
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "browser-report-one-regressed.png"), full_page=True)
    assert pg.errors == [] and pg.dialogs == []
