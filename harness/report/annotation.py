"""The Buildkite annotation: a markdown summary of the matrix.

A headline with the counts, one table per tier (rows: schemes, columns: models, each cell its
engines with a verdict emoji), the cells that need attention with their reasons, a legend, and a
link to the full report artifact. With a candidate build (``harness run --candidate``), its
headline under the counts and its cells that are not a plain pass beside the base's verdicts.
``harness.report.annotation_style`` gives the style (error, warning, info, success) by the worst
verdict.

Text from records is escaped for markdown and HTML, one line each, and cut short; Buildkite
caps an annotation at 1 MiB, and this stays far below it.
"""
from __future__ import annotations

import html
import re
from typing import NamedTuple

from harness.matrix import TIERS
from harness.registry import ENGINES
from harness.report.states import counts_of, engine_of, passing, passing_apart, state_of
from harness.report.merge import Entry, Merged
from harness.report import accuracy, candidates
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


class Slot(NamedTuple):
    """One cell of the matrix as the annotation shows it; ``state`` is a verdict or ``missing``."""

    id: str
    tier: str
    model: str
    scheme: str
    engine: str
    state: str
    reason: str


def _missing_slot(cid: str, tier: str) -> Slot:
    parts = cid.split(".")
    model, scheme, engine = (".".join(parts[:-2]), parts[-2], parts[-1]) if len(parts) >= 3 else (cid, "?", "?")
    return Slot(cid, tier, model, scheme, engine, MISSING,
                "no result record came back (crash, timeout at the agent, lost agent or cancel)")


def _slots_of(merged: Merged, matrix=None) -> list[Slot]:
    """Every cell with a record, then every expected cell without one."""
    tiers_of = {c.id: c.tier for c in matrix.cells()} if matrix is not None else {}
    slots = [Slot(cid, e.record.tier, e.record.model, e.record.scheme, engine_of(e.record), state_of(e.record),
                  e.record.verdict_reason or "") for cid, e in merged.current.items()]
    return slots + [_missing_slot(cid, tiers_of.get(cid, "unknown")) for cid in merged.missing]


def _in_order(known_order: list[str], present: set[str]) -> list[str]:
    """``present`` in the matrix's order, those the matrix does not know sorted after."""
    return [x for x in known_order if x in present] + sorted(present - set(known_order))


def _headline(merged: Merged, slots: list[Slot], counts: dict[str, int]) -> list[str]:
    bad = [s for s in SEVERITY if counts.get(s) and needs_attention(s)]
    if not slots:
        head = "#### Quantized loading matrix: no cells selected"
    elif bad:
        head = f"#### Quantized loading matrix: {sum(counts[s] for s in bad)} of {len(slots)} cells need attention"
    elif passing_apart(counts):
        head = f"#### Quantized loading matrix: none of {len(slots)} cells needs attention: {', '.join(passing(counts))}"
    else:
        head = f"#### Quantized loading matrix: all {len(slots)} cells pass"
    lines = [head, "", " · ".join(f"{_emoji(s)} {s} **{counts[s]}**" for s in STATES if counts.get(s)) or "nothing ran"]
    if merged.problems:
        lines += ["", f"💥 **{len(merged.problems)} unreadable result file(s):** "
                  + "; ".join(f"`{md(p.path, 120)}`: {md(p.message, 160)}" for p in merged.problems[:10])]
    return lines


def _tier_table(tier: str, slots: list[Slot], models_order: list[str], scheme_order: list[str]) -> list[str]:
    """The collapsible table of one tier: rows schemes, columns models, each cell its engines."""
    models = _in_order(models_order, {s.model for s in slots})
    schemes = _in_order(scheme_order, {s.scheme for s in slots})
    tier_bad = sum(1 for s in slots if needs_attention(s.state))
    counts = counts_of(s.state for s in slots)
    said = ([f"{tier_bad} need{'s' if tier_bad == 1 else ''} attention", *passing_apart(counts)] if tier_bad
            else passing(counts))
    lines = ["", f"<details{' open' if tier_bad else ''}><summary><b>{html.escape(tier)}</b>: {_n(len(slots), 'cell')}"
             f"{''.join(', ' + x for x in said)}</summary>", ""]
    lines.append("| scheme \\\\ model | " + " | ".join(md(m, 60) for m in models) + " |")
    lines.append("|---" * (len(models) + 1) + "|")
    for sc in schemes:
        cells = []
        for m in models:
            members = sorted((s for s in slots if s.model == m and s.scheme == sc), key=lambda s: s.engine)
            cells.append(" ".join(f"{_emoji(s.state)}{md(ENGINES[s.engine].short if s.engine in ENGINES else s.engine, 20)}" for s in members) or " ")
        lines.append(f"| {md(sc, 60)} | " + " | ".join(cells) + " |")
    return lines + ["", "</details>"]


def _tier_tables(slots: list[Slot], matrix=None) -> list[str]:
    models_order = list(matrix.models) if matrix is not None else []
    scheme_order: list[str] = []
    if matrix is not None:
        for m in matrix.models.values():
            scheme_order += [s for s in m.schemes if s not in scheme_order]
    lines: list[str] = []
    for tier in _in_order(list(TIERS), {s.tier for s in slots}):
        lines += _tier_table(tier, [s for s in slots if s.tier == tier], models_order, scheme_order)
    return lines


def _needs_attention(slots: list[Slot]) -> list[str]:
    need = sorted((s for s in slots if needs_attention(s.state)), key=lambda s: (SEVERITY.index(s.state), s.id))
    if not need:
        return []
    lines = ["", "**Needs attention**", ""]
    lines += [f"- {_emoji(s.state)} `{md(s.id, 120)}` **{s.state}**: {md(s.reason)}" for s in need[:MAX_ATTENTION]]
    if len(need) > MAX_ATTENTION:
        lines.append(f"- … and {len(need) - MAX_ATTENTION} more (see the report)")
    return lines


def _candidate_headline(merged: Merged) -> list[str]:
    line = candidates.headline(merged.records(), merged.candidate_records())
    return ["", *(f"🧪 {md(x)}" for x in line.splitlines())] if line is not None else []


def _candidate_side(entry: Entry | None) -> str:
    if entry is None:
        return "no record"
    state = state_of(entry.record)
    return f"{_emoji(state)} {state} ({md(entry.record.engine_info.version or '?', 40)})"


def _candidate_table(merged: Merged, matrix=None) -> list[str]:
    """The candidate's cells whose verdict is not a plain pass (a fix included: its known failure
    can go), beside the base's verdict."""
    rows = [(cid, b, c) for cid, b, c in candidates.pairs(merged, matrix) if state_of(c.record) != "pass"]
    if not rows:
        return []
    lines = ["", "**Base and candidate**", "", "| cell | base | candidate | why (candidate) |", "|---|---|---|---|"]
    lines += [f"| `{md(cid, 120)}` | {_candidate_side(b)} | {_candidate_side(c)} | {md(c.record.verdict_reason, 160)} |"
              for cid, b, c in rows[:MAX_ATTENTION]]
    if len(rows) > MAX_ATTENTION:
        lines += ["", f"… and {len(rows) - MAX_ATTENTION} more (see the report)"]
    return lines


def _footer(merged: Merged, report_path: str) -> list[str]:
    lines = (["", "**Cross-engine comparison at merge**", ""] + [f"- {md(n)}" for n in merged.notes]) if merged.notes else []
    legend = " · ".join(f"{_emoji(s)} {s}" for s in STATES)
    engines = " · ".join(f"{e.short} = {e.name}" for e in ENGINES.values())
    return lines + ["", f"<sub>{legend}. Engines: {engines}.</sub>", "",
                    f'<a href="artifact://{html.escape(report_path)}">Full report (HTML)</a> · JUnit XML: '
                    f"<code>{html.escape(report_path.rsplit('/', 1)[0])}/junit.xml</code>", ""]


def render(merged: Merged, *, matrix=None, report_path: str = "reports/report.html") -> str:
    slots = _slots_of(merged, matrix)
    lines = _headline(merged, slots, counts_of(s.state for s in slots)) + _candidate_headline(merged)
    lines += _tier_tables(slots, matrix)
    lines += accuracy.annotation_lines([e.record for e in merged.current.values()], md, "✅", "❌")
    lines += _needs_attention(slots) + _candidate_table(merged, matrix)
    return "\n".join(lines + _footer(merged, report_path))
