"""JUnit XML: one <testcase> per cell, one <testsuite> per tier, so that Buildkite Test Engine
(and any CI) can read the matrix.

- ``classname``: ``<tier>.<model>.<scheme>``; ``name``: the cell id; ``file``: models.yaml.
- pass, improved, unexpected-pass: passed (unexpected-pass says so in system-out and a property).
- regressed, failed: <failure type="<verdict>">.
- error, and an expected cell without a record: <error>.
- unsupported, waived, stale-baseline, missing-baseline: <skipped> with the reason: not a pass,
  and not a failure of this change either.
"""
from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from harness.report import MISSING, state_of
from harness.report.merge import Merged

_FAILURE = {"regressed", "failed"}
_ERROR = {"error", MISSING}
_SKIPPED = {"unsupported", "waived", "stale-baseline", "missing-baseline"}
# XML 1.0 cannot carry most control characters, whatever the escaping.
_BAD_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def _clean(text: str | None, limit: int = 20000) -> str:
    text = _BAD_XML.sub("?", text or "")
    return text if len(text) <= limit else text[:limit] + "…"


def _split(cell_id: str) -> tuple[str, str]:
    parts = cell_id.split(".")
    return (".".join(parts[:-2]), parts[-2]) if len(parts) >= 3 else (cell_id, "?")


def render(merged: Merged, *, matrix=None) -> str:
    tiers = {c.id: c.tier for c in matrix.cells()} if matrix is not None else {}
    cases: dict[str, list[ET.Element]] = {}
    stats: dict[str, dict[str, float]] = {}

    def add(tier: str, case: ET.Element, kind: str, seconds: float) -> None:
        cases.setdefault(tier, []).append(case)
        s = stats.setdefault(tier, {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "time": 0.0})
        s["tests"] += 1
        s["time"] += seconds
        if kind:
            s[kind] += 1

    for cell_id, entry in sorted(merged.current.items()):
        r = entry.record
        state = state_of(r)
        case = ET.Element("testcase", classname=_clean(f"{r.tier}.{r.model}.{r.scheme}"), name=_clean(r.cell),
                          file="models.yaml", time=f"{r.duration_s:.3f}")
        props = ET.SubElement(case, "properties")
        for k, v in (("verdict", state), ("engine", r.engine), ("engine_version", r.engine_info.version or ""),
                     ("platform", r.engine_info.platform or "")):
            ET.SubElement(props, "property", name=k, value=_clean(v))
        reason = _clean(r.verdict_reason or state)
        kind = ""
        if state in _FAILURE:
            el = ET.SubElement(case, "failure", type=state, message=_clean(reason, 1000))
            el.text = "\n".join(_clean(f"{c.name}: {c.detail}") for c in r.checks if not c.ok) or reason
            kind = "failures"
        elif state in _ERROR:
            el = ET.SubElement(case, "error", type=state, message=_clean(reason, 1000))
            if r.error is not None:
                el.text = _clean(f"{r.error.type}: {r.error.message}\n\n{r.error.log_tail}")
            kind = "errors"
        elif state in _SKIPPED:
            ET.SubElement(case, "skipped", message=_clean(f"{state}: {reason}", 1000))
            kind = "skipped"
        out = ET.SubElement(case, "system-out")
        out.text = _clean(f"verdict: {state}\n{reason}")
        add(r.tier, case, kind, r.duration_s)

    for cell_id in merged.missing:
        model, scheme = _split(cell_id)
        tier = tiers.get(cell_id, "unknown")
        case = ET.Element("testcase", classname=_clean(f"{tier}.{model}.{scheme}"), name=_clean(cell_id),
                          file="models.yaml", time="0")
        ET.SubElement(case, "error", type=MISSING,
                      message="no result record came back for this expected cell (crash, timeout at the agent, "
                              "lost agent or cancel)")
        add(tier, case, "errors", 0.0)

    root = ET.Element("testsuites", name="harness")
    total = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "time": 0.0}
    for tier in sorted(cases):
        s = stats[tier]
        suite = ET.SubElement(root, "testsuite", name=f"harness {tier}", tests=str(int(s["tests"])),
                              failures=str(int(s["failures"])), errors=str(int(s["errors"])),
                              skipped=str(int(s["skipped"])), time=f"{s['time']:.3f}")
        suite.extend(cases[tier])
        for k in total:
            total[k] += s[k]
    for k in ("tests", "failures", "errors", "skipped"):
        root.set(k, str(int(total[k])))
    root.set("time", f"{total['time']:.3f}")
    for p in merged.problems:
        suite = root.find("testsuite[@name='harness unreadable']")
        if suite is None:
            suite = ET.SubElement(root, "testsuite", name="harness unreadable", tests="0", failures="0", errors="0",
                                  skipped="0", time="0")
        case = ET.SubElement(suite, "testcase", classname="unreadable", name=_clean(str(p.path)), time="0")
        ET.SubElement(case, "error", type="unreadable-record", message=_clean(p.message, 1000))
        for el in (suite, root):
            el.set("tests", str(int(el.get("tests")) + 1))
            el.set("errors", str(int(el.get("errors")) + 1))
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
