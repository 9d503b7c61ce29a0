"""The Buildkite annotation: a markdown summary of the matrix.

A headline with the counts, one table per tier (rows: schemes, columns: models, each cell its
engines with a verdict emoji), the cells that need attention with their reasons, a legend, and a
link to the full report artifact. ``harness.report.annotation_style`` gives the style (error,
warning, info, success) by the worst verdict.

Text from records is escaped for markdown and HTML, one line each, and cut short; Buildkite
caps an annotation at 1 MiB, and this stays far below it.
"""
from __future__ import annotations

import html
import re

from harness.matrix import TIERS
from harness.registry import ENGINES
from harness.report.states import counts_of, state_of
from harness.report.merge import Merged
from harness.report import accuracy
from harness.verdicts import MISSING, SEVERITY, STATES, needs_attention, row

MAX_ATTENTION = 40
MAX_REASON = 300
_MD_SPECIAL = re.compile(r"([\\`*_{}\[\]()#+!|~])")


def md(text: object, limit: int = MAX_REASON) -> str:
    """One line of untrusted text, safe inside markdown (tables included) and HTML."""
    s = " ".join(str(text if text is not None else "").split())
    if len(s) > limit:
        s = s[:limit] + "…"
    return _MD_SPECIAL.sub(r"\\\1", html.escape(s, quote=False))


def _n(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _emoji(state: str) -> str:
    return row(state).emoji


def render(merged: Merged, *, matrix=None, report_path: str = "reports/report.html") -> str:
    tiers_of = {c.id: c.tier for c in matrix.cells()} if matrix is not None else {}
    slots: list[tuple[str, str, str, str, str, str]] = []  # id, tier, model, scheme, engine, state
    reasons: dict[str, str] = {}
    for cid, e in merged.current.items():
        r = e.record
        slots.append((cid, r.tier, r.model, r.scheme, r.engine, state_of(r)))
        reasons[cid] = r.verdict_reason or ""
    for cid in merged.missing:
        parts = cid.split(".")
        model, scheme, engine = (".".join(parts[:-2]), parts[-2], parts[-1]) if len(parts) >= 3 else (cid, "?", "?")
        slots.append((cid, tiers_of.get(cid, "unknown"), model, scheme, engine, MISSING))
        reasons[cid] = "no result record came back (crash, timeout at the agent, lost agent or cancel)"
    counts = counts_of(s[5] for s in slots)
    bad = [s for s in SEVERITY if counts.get(s) and needs_attention(s)]

    lines: list[str] = []
    if not slots:
        lines.append("#### Quantized loading matrix: no cells selected")
    elif bad:
        attention = sum(counts[s] for s in bad)
        lines.append(f"#### Quantized loading matrix: {attention} of {len(slots)} cells need attention")
    else:
        lines.append(f"#### Quantized loading matrix: all {len(slots)} cells pass")
    lines.append("")
    lines.append(" · ".join(f"{_emoji(s)} {s} **{counts[s]}**" for s in STATES if counts.get(s)) or "nothing ran")
    if merged.problems:
        lines.append("")
        lines.append(f"💥 **{len(merged.problems)} unreadable result file(s):** "
                     + "; ".join(f"`{md(p.path, 120)}`: {md(p.message, 160)}" for p in merged.problems[:10]))

    models_order = list(matrix.models) if matrix is not None else []
    scheme_order: list[str] = []
    if matrix is not None:
        for m in matrix.models.values():
            scheme_order += [s for s in m.schemes if s not in scheme_order]
    tiers = [t for t in TIERS if any(s[1] == t for s in slots)] + sorted({s[1] for s in slots} - set(TIERS))
    for tier in tiers:
        ts = [s for s in slots if s[1] == tier]
        models = [m for m in models_order if any(s[2] == m for s in ts)] + sorted({s[2] for s in ts} - set(models_order))
        schemes = [x for x in scheme_order if any(s[3] == x for s in ts)] + sorted({s[3] for s in ts} - set(scheme_order))
        tier_bad = sum(1 for s in ts if needs_attention(s[5]))
        lines += ["", f"<details{' open' if tier_bad else ''}><summary><b>{html.escape(tier)}</b>: {_n(len(ts), 'cell')}"
                  f"{f', {tier_bad} need' + ('s' if tier_bad == 1 else '') + ' attention' if tier_bad else ', all pass'}</summary>", ""]
        lines.append("| scheme \\\\ model | " + " | ".join(md(m, 60) for m in models) + " |")
        lines.append("|---" * (len(models) + 1) + "|")
        for sc in schemes:
            row = []
            for m in models:
                members = sorted((s for s in ts if s[2] == m and s[3] == sc), key=lambda s: s[4])
                row.append(" ".join(f"{_emoji(s[5])}{md(ENGINES[s[4]].short if s[4] in ENGINES else s[4], 20)}" for s in members) or " ")
            lines.append(f"| {md(sc, 60)} | " + " | ".join(row) + " |")
        lines += ["", "</details>"]

    lines += accuracy.annotation_lines([e.record for e in merged.current.values()], md, "✅", "❌")

    need = sorted((s for s in slots if needs_attention(s[5])), key=lambda s: (SEVERITY.index(s[5]), s[0]))
    if need:
        lines += ["", "**Needs attention**", ""]
        for s in need[:MAX_ATTENTION]:
            lines.append(f"- {_emoji(s[5])} `{md(s[0], 120)}` **{s[5]}**: {md(reasons.get(s[0]))}")
        if len(need) > MAX_ATTENTION:
            lines.append(f"- … and {len(need) - MAX_ATTENTION} more (see the report)")
    if merged.notes:
        lines += ["", "**Cross-engine comparison at merge**", ""] + [f"- {md(n)}" for n in merged.notes]
    legend = " · ".join(f"{_emoji(s)} {s}" for s in STATES)
    engines = " · ".join(f"{e.short} = {e.name}" for e in ENGINES.values())
    lines += ["", f"<sub>{legend}. Engines: {engines}.</sub>", "",
              f'<a href="artifact://{html.escape(report_path)}">Full report (HTML)</a> · JUnit XML: '
              f"<code>{html.escape(report_path.rsplit('/', 1)[0])}/junit.xml</code>", ""]
    return "\n".join(lines)
