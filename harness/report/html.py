"""The HTML report: one self-contained page (inline CSS, JS and SVG; no network).

Layout: a banner with the worst state, a filter bar that is also the legend (one button per
verdict, with its count), a "needs attention" list, then one grid per tier: a row per scheme, a
column per model, and inside each grid cell one chip per engine, colored by verdict. Clicking a
grid cell opens its details below the row: per engine the verdict and its reason, the
teacher-forced |Δlogprob| per position (inline SVG), the first greedy divergence with both tokens
and both top-k side by side, the module diff, load time against the baseline and its trend across
result sets, the checks, provenance and the log tail.

Everything is rendered here, in Python; the page's script only toggles visibility. Every piece of
text that came from a record, a config or a log goes through ``esc`` (a token ``<script>`` shows
as text).
"""
from __future__ import annotations

import html as _html
import math
import re
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from harness.matrix import TIERS
from harness.records import Record
from harness.report import MISSING, SEVERITY, STATES, STYLE, counts_of, state_of, worst
from harness.report.merge import Entry, Merged

LOG_LINES = 60  # lines of an engine log shown
MAX_PROMPTS = 6  # charts per check


def esc(value: Any) -> str:
    return _html.escape("" if value is None else str(value), quote=True)


def _num(x: Any, digits: int = 3) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        if math.isnan(x):
            return "NaN"
        if math.isinf(x):
            return "∞" if x > 0 else "-∞"
        return f"{x:.{digits}g}"
    return esc(x)


def _n(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _chip(state: str, text: str = "", title: str = "", extra: str = "") -> str:
    label = esc(text or state)
    return (f'<span class="chip v-{esc(state)}" data-verdict="{esc(state)}" title="{esc(title)}"{extra}>'
            f"{label}</span>")


# ------------------------------------------------------------------------------------- layout


def _split_id(cell_id: str) -> tuple[str, str, str]:
    parts = cell_id.split(".")
    if len(parts) >= 3:
        return ".".join(parts[:-2]), parts[-2], parts[-1]
    return cell_id, "?", "?"


class _Slot:
    """One engine of one grid cell: a record, or a missing expected cell."""

    def __init__(self, cell_id: str, entry: Entry | None, tier: str):
        self.id = cell_id
        self.entry = entry
        self.model, self.scheme, self.engine = _split_id(cell_id) if entry is None else (
            entry.record.model, entry.record.scheme, entry.record.engine)
        self.tier = tier
        self.state = state_of(entry.record if entry else None)


def _slots(merged: Merged, matrix) -> list[_Slot]:
    tiers = {c.id: c.tier for c in matrix.cells()} if matrix is not None else {}
    out = [_Slot(cid, e, e.record.tier) for cid, e in merged.current.items()]
    out += [_Slot(cid, None, tiers.get(cid, "unknown tier")) for cid in merged.missing]
    return out


def _orders(matrix, slots: Sequence[_Slot]) -> tuple[list[str], list[str], list[str]]:
    models: list[str] = list(matrix.models) if matrix is not None else []
    schemes: list[str] = []
    if matrix is not None:
        for m in matrix.models.values():
            schemes += [s for s in m.schemes if s not in schemes]
    engines = ["reference", "transformers", "vllm"]
    for s in sorted(slots, key=lambda s: s.id):
        if s.model not in models:
            models.append(s.model)
        if s.scheme not in schemes:
            schemes.append(s.scheme)
        if s.engine not in engines:
            engines.append(s.engine)
    return models, schemes, engines


# --------------------------------------------------------------------------------------- charts


def _delta_chart(values: Sequence[float | None], topk: Sequence[float | None] | None, bound: float | None,
                 prompt_len: int | None, caption: str) -> str:
    """|Δlogprob| per position on a log scale: a bar per scored position (red above the bound),
    a dot for the shared top-k, the bound dashed, and the prompt/generated boundary."""
    n = len(values)
    w, h, left, right, top, bottom = 640, 160, 46, 58, 12, 30
    pw, ph = w - left - right, h - top - bottom
    finite = [v for v in [*values, *(topk or [])] if v is not None and math.isfinite(v) and v > 0]
    lo = 1e-8
    hi = max([1.0, (bound or 0) * 10, *(v * 2 for v in finite)])
    llo, lhi = math.log10(lo), math.log10(hi)

    def y(v: float) -> float:
        v = min(max(v, lo), hi)
        return top + ph - (math.log10(v) - llo) / (lhi - llo) * ph

    band = pw / max(n, 1)
    parts = [f'<svg class="chart" viewBox="0 0 {w} {h}" width="{w}" height="{h}" role="img" '
             f'aria-label="{esc(caption)}"><title>{esc(caption)}</title>',
             f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" class="plot"/>']
    for e in range(int(math.floor(llo)), int(math.floor(lhi)) + 1):
        if e % 2:
            continue
        yy = y(10.0 ** e)
        parts.append(f'<line x1="{left}" x2="{left + pw}" y1="{yy:.1f}" y2="{yy:.1f}" class="grid"/>'
                     f'<text x="{left - 4}" y="{yy + 3:.1f}" class="ax" text-anchor="end">1e{e}</text>')
    if prompt_len is not None and 0 < prompt_len - 1 < n:
        # logprobs[i] scores position i + 1; positions >= prompt_len are generated tokens
        xx = left + (prompt_len - 1) * band
        parts.append(f'<line x1="{xx:.1f}" x2="{xx:.1f}" y1="{top}" y2="{top + ph}" class="split"/>'
                     f'<text x="{xx + 3:.1f}" y="{top + 10}" class="ax">generated →</text>'
                     f'<text x="{xx - 3:.1f}" y="{top + 10}" class="ax" text-anchor="end">← prompt</text>')
    for i, v in enumerate(values):
        x0 = left + i * band + band * 0.15
        bw = max(band * 0.7, 1.0)
        pos = i + 1
        if v is None or not math.isfinite(v):
            parts.append(f'<rect x="{x0:.1f}" y="{top}" width="{bw:.1f}" height="{ph}" class="bar inf">'
                         f"<title>position {pos}: |Δ| not finite</title></rect>")
            continue
        over = bound is not None and v > bound
        yy = y(v) if v > 0 else top + ph - 1
        parts.append(f'<rect x="{x0:.1f}" y="{yy:.1f}" width="{bw:.1f}" height="{top + ph - yy:.1f}" '
                     f'class="bar{" over" if over else ""}"><title>position {pos}: |Δlogprob| {_num(v)}'
                     f'{" (above the bound)" if over else ""}</title></rect>')
    for i, v in enumerate(topk or []):
        if v is None or not math.isfinite(v) or v <= 0:
            continue
        cx = left + i * band + band / 2
        parts.append(f'<circle cx="{cx:.1f}" cy="{y(v):.1f}" r="2.5" class="dot">'
                     f"<title>position {i + 1}: shared top-k max |Δ| {_num(v)}</title></circle>")
    if bound:
        yy = y(bound)
        parts.append(f'<line x1="{left}" x2="{left + pw}" y1="{yy:.1f}" y2="{yy:.1f}" class="bound"/>'
                     f'<text x="{left + pw + 4}" y="{yy + 3:.1f}" class="ax bound-t">bound</text>'
                     f'<text x="{left + pw + 4}" y="{yy + 14:.1f}" class="ax bound-t">{_num(bound)}</text>')
    step = max(1, math.ceil(n / 12))
    for i in range(0, n, step):
        xx = left + i * band + band / 2
        parts.append(f'<text x="{xx:.1f}" y="{top + ph + 12}" class="ax" text-anchor="middle">{i + 1}</text>')
    parts.append(f'<text x="{left + pw / 2}" y="{h - 3}" class="ax" text-anchor="middle">position (bars: scored token; '
                 f'dots: shared top-k)</text></svg>')
    return "".join(parts)


def _load_bars(seconds: float, baseline: float | None, ratio: float | None, bound: float | None, gated: bool) -> str:
    w, left, bar_h = 420, 90, 16
    rows = [("this run", seconds)] + ([("baseline", baseline)] if baseline is not None else [])
    top = max(v for _, v in rows) or 1.0
    h = 12 + len(rows) * (bar_h + 8)
    parts = [f'<svg class="chart" viewBox="0 0 {w} {h}" width="{w}" height="{h}" role="img" aria-label="load time">']
    for i, (name, v) in enumerate(rows):
        y0 = 6 + i * (bar_h + 8)
        bw = max((w - left - 80) * (v / top), 1)
        cls = "lt-run" if i == 0 else "lt-base"
        if i == 0 and ratio is not None and bound is not None and ratio > bound:
            cls += " over"
        parts.append(f'<text x="{left - 6}" y="{y0 + 12}" class="ax" text-anchor="end">{name}</text>'
                     f'<rect x="{left}" y="{y0}" width="{bw:.1f}" height="{bar_h}" class="{cls}"/>'
                     f'<text x="{left + bw + 5:.1f}" y="{y0 + 12}" class="ax">{_num(v)} s</text>')
    parts.append("</svg>")
    return "".join(parts)


def _trend(entries: Sequence[Entry]) -> str:
    pts = [(e, e.record.load.seconds) for e in entries if e.record.load is not None]
    if len(pts) < 2:
        return ""
    w, h, left, right, top, bottom = 460, 120, 50, 50, 12, 34
    pw, ph = w - left - right, h - top - bottom
    hi = max(v for _, v in pts) * 1.15 or 1.0
    step = pw / (len(pts) - 1)
    coords = [(left + i * step, top + ph - v / hi * ph) for i, (_, v) in enumerate(pts)]
    parts = [f'<svg class="chart" viewBox="0 0 {w} {h}" width="{w}" height="{h}" role="img" aria-label="load time trend">',
             f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" class="plot"/>',
             f'<text x="{left - 4}" y="{top + 4}" class="ax" text-anchor="end">{_num(hi, 2)} s</text>',
             f'<text x="{left - 4}" y="{top + ph}" class="ax" text-anchor="end">0</text>',
             '<polyline class="trend" points="' + " ".join(f"{x:.1f},{y:.1f}" for x, y in coords) + '"/>']
    for (e, v), (x, y) in zip(pts, coords):
        st = state_of(e.record)
        name = e.source.rstrip("/").rsplit("/", 1)[-1] or e.source
        label = name if len(name) <= 14 else "…" + name[-13:]
        parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4.5" class="pt v-{esc(st)}"><title>{esc(e.source)}: '
                     f"{_num(v)} s, {esc(st)}, {esc(e.record.started_at)}</title></circle>"
                     f'<text x="{x:.1f}" y="{top + ph + 13}" class="ax" text-anchor="middle">{esc(label)}</text>'
                     f'<text x="{x:.1f}" y="{top + ph + 25}" class="ax" text-anchor="middle">{_num(v, 2)} s</text>')
    parts.append("</svg>")
    return "".join(parts)


# -------------------------------------------------------------------------------------- details


def _against(name: str) -> tuple[str, str]:
    kind, _, against = name.partition(":")
    return kind, against


def _teacher_forced(rec: Record) -> str:
    out = []
    for c in rec.checks:
        kind, against = _against(c.name)
        if kind != "teacher-forced" or not c.data:
            continue
        per = c.data.get("per_position") or {}
        topk = c.data.get("topk_per_position") or {}
        plen = c.data.get("prompt_len") or {}
        bound = (c.data.get("bound") or {}).get("logprob")
        head = (f'<h4>Teacher-forced |Δlogprob| against {esc(against)} {"✓" if c.ok else "✗ beyond the bound"}</h4>'
                f'<p class="detail-line">{esc(c.detail)}</p>')
        charts = []
        for i, (prompt, values) in enumerate(per.items()):
            if i == MAX_PROMPTS:
                charts.append(f'<p class="muted">{len(per) - MAX_PROMPTS} more prompt(s) not drawn.</p>')
                break
            if not isinstance(values, list):
                continue
            vals = [v if isinstance(v, (int, float)) else None for v in values]
            tk = topk.get(prompt) if isinstance(topk, dict) else None
            tk = [v if isinstance(v, (int, float)) else None for v in tk] if isinstance(tk, list) else None
            pl = plen.get(prompt) if isinstance(plen, dict) else None
            charts.append(f'<figure><figcaption>prompt <code>{esc(prompt)}</code></figcaption>'
                          f"{_delta_chart(vals, tk, bound if isinstance(bound, (int, float)) else None, pl if isinstance(pl, int) else None, f'|Δlogprob| per position, prompt {prompt}, against {against}')}"
                          "</figure>")
        out.append(head + "".join(charts))
    if not out:
        return ""
    return '<section class="tf">' + "".join(out) + "</section>"


def _topk_rows(a: list, b: list, tok_a: Any, tok_b: Any) -> str:
    rows = []
    for i in range(max(len(a), len(b))):
        cells = []
        for lst in (a, b):
            if i < len(lst) and isinstance(lst[i], (list, tuple)) and len(lst[i]) == 2:
                t, lp = lst[i]
                cls = " tok-a" if t == tok_a else " tok-b" if t == tok_b else ""
                cells.append(f'<td class="tok{cls}"><code>{esc(t)}</code></td><td class="lp">{_num(lp, 4)}</td>')
            else:
                cells.append('<td></td><td></td>')
        rows.append(f"<tr><td class=\"rank\">{i + 1}</td>{cells[0]}{cells[1]}</tr>")
    return "".join(rows)


def _greedy(rec: Record) -> str:
    out = []
    for c in rec.checks:
        kind, against = _against(c.name)
        if kind != "greedy" or not c.data:
            continue
        divs = [d for d in (c.data.get("divergences") or []) if isinstance(d, dict)]
        if not divs:
            out.append(f'<h4>Greedy against {esc(against)}</h4><p class="detail-line">{esc(c.detail)}</p>')
            continue
        d = next((d for d in divs if not d.get("ok", True)), divs[0])
        ta, tb = d.get(against), d.get("obtained")
        ka, kb = d.get(f"{against}_topk") or [], d.get("obtained_topk") or []
        verdict = "each token is in the other run's top-k" if d.get("ok") else "a token is missing from the other run's top-k"
        out.append(
            f'<h4>First greedy divergence against {esc(against)} {"✓" if c.ok else "✗"}</h4>'
            f'<p class="detail-line">prompt <code>{esc(d.get("prompt"))}</code>, step {esc(d.get("step"))}: '
            f'{esc(against)} <code class="tok-a">{esc(ta)}</code> vs obtained <code class="tok-b">{esc(tb)}</code>: '
            f"{verdict}{f' ({len(divs)} prompt(s) diverge)' if len(divs) > 1 else ''}</p>"
            f'<table class="topk"><thead><tr><th>#</th><th colspan="2">{esc(against)} top-k</th>'
            f'<th colspan="2">obtained top-k</th></tr></thead><tbody>{_topk_rows(ka, kb, ta, tb)}</tbody></table>')
    return '<section class="greedy">' + "".join(out) + "</section>" if out else ""


def _load(rec: Record, history: Sequence[Entry]) -> str:
    if rec.load is None:
        return ""
    lc = next((c for c in rec.checks if c.name.startswith("load-time") and c.data), None)
    base = ratio = bound = None
    gated = False
    if lc is not None:
        base, ratio, bound = lc.data.get("baseline_seconds"), lc.data.get("ratio"), lc.data.get("bound")
        gated = bool(lc.data.get("gated"))
    phases = " · ".join(f"{esc(k)} {_num(v)} s" for k, v in rec.load.phases.items())
    text = (f"ratio {_num(ratio)} against the baseline, bound {_num(bound)}, "
            f"{'gated on this tier' if gated else 'measured, not gated on this tier'}" if lc is not None
            else "no baseline load time to compare with")
    trend = _trend(history)
    return ('<section class="load"><h4>Load time</h4><div class="row">'
            f'<div>{_load_bars(rec.load.seconds, base if isinstance(base, (int, float)) else None, ratio, bound, gated)}'
            f'<p class="detail-line">{text}</p>{f"<p class=muted>phases: {phases}</p>" if phases else ""}</div>'
            + (f'<div><div class="sub-h">trend across result sets</div>{trend}</div>' if trend else "")
            + "</div></section>")


def _checks(rec: Record) -> str:
    if not rec.checks:
        return ""
    rows = "".join(f'<tr class="{"ok" if c.ok else "bad"}"><td>{"✓" if c.ok else "✗"}</td><td><code>{esc(c.name)}</code>'
                   f"</td><td>{esc(c.detail)}</td></tr>" for c in rec.checks)
    return f'<section><h4>Checks</h4><table class="checks"><tbody>{rows}</tbody></table></section>'


def _link(url: str | None) -> str:
    if not url:
        return ""
    if re.match(r"^https?://", url):
        return f' <a href="{esc(url)}" rel="noopener noreferrer">{esc(url)}</a>'
    return f" {esc(url)}"


def _provenance(entry: Entry) -> str:
    r = entry.record
    ei = r.engine_info
    rows = [
        ("cell", f"<code>{esc(r.cell)}</code>"), ("tier", esc(r.tier)),
        ("engine", f"{esc(ei.name)} {esc(ei.version or '?')}"), ("environment", esc(ei.environment or "–")),
        ("torch", esc(ei.torch or "–")), ("platform", esc(ei.platform or "–")),
    ]
    if r.fixture:
        rows.append(("fixture", f"{esc(r.fixture.name)} <code>{esc(r.fixture.identity[:16])}</code>"))
    if r.source:
        src = r.source.hub and f"{r.source.hub}@{r.source.revision or '?'}" or r.source.path
        rows.append(("checkpoint", esc(src)))
    rows += [("started", esc(r.started_at)), ("duration", f"{_num(r.duration_s)} s"),
             ("record", f"<code>{esc(entry.path)}</code>"), ("result set", esc(entry.source))]
    body = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows)
    return f'<section><h4>Provenance</h4><table class="prov"><tbody>{body}</tbody></table></section>'


def _log_tail(entry: Entry) -> str:
    r = entry.record
    parts = []
    if r.error is not None:
        parts.append(f'<p class="err"><b>{esc(r.error.type)}</b>: {esc(r.error.message)}</p>')
        if r.error.log_tail:
            parts.append(f"<pre class=\"log\">{esc(r.error.log_tail)}</pre>")
    show_file = entry.log is not None and (r.status != "ok" or state_of(r) in ("error", "failed", "regressed", "waived"))
    if show_file:
        try:
            lines = entry.log.read_text(errors="replace").splitlines()[-LOG_LINES:]
            parts.append(f'<div class="sub-h">last {len(lines)} lines of <code>{esc(entry.log.name)}</code></div>'
                         f'<pre class="log">{esc(chr(10).join(lines))}</pre>')
        except OSError as e:
            parts.append(f'<p class="muted">cannot read {esc(entry.log)}: {esc(e)}</p>')
    return f'<section><h4>Error and log tail</h4>{"".join(parts)}</section>' if parts else ""


def _panel(slot: _Slot, merged: Merged) -> str:
    head = f'<h3>{_chip(slot.state)} <code>{esc(slot.id)}</code></h3>'
    if slot.entry is None:
        return (f'<div class="panel b-{MISSING}">{head}<p class="reason">No result record came back for this expected '
                "cell: its step crashed before writing one, timed out at the agent, lost its agent, or was cancelled. "
                "See the step's log on Buildkite.</p></div>")
    r = slot.entry.record
    parts = [head]
    if r.verdict_reason:
        parts.append(f'<p class="reason">{esc(r.verdict_reason)}</p>')
    if r.unsupported_reason and r.unsupported_reason != r.verdict_reason:
        parts.append(f'<p class="reason">unsupported: {esc(r.unsupported_reason)}</p>')
    if r.known_failure is not None:
        k = r.known_failure
        parts.append(f'<p class="known">known failure ({esc(k.engine)} {esc(k.versions)}, pattern '
                     f"<code>{esc(k.pattern)}</code>): {esc(k.reason)}{_link(k.link)}</p>")
    if r.module_diff is not None:
        parts.append(f'<section class="mdiff"><h4>Module diff against the reference</h4><p>first differing module '
                     f"<code>{esc(r.module_diff.first_differing_module)}</code></p>"
                     f'<pre class="log">{esc(r.module_diff.detail)}</pre></section>')
    charts = _teacher_forced(r) + _greedy(r)
    if charts:
        parts.append(f'<div class="row">{charts}</div>')
    parts.append(_load(r, merged.history.get(r.cell, [])))
    parts.append(_log_tail(slot.entry))
    parts.append(f'<div class="row">{_checks(r)}{_provenance(slot.entry)}</div>')
    return f'<div class="panel b-{esc(slot.state)}">{"".join(parts)}</div>'


# ------------------------------------------------------------------------------------------ page

_CSS = """
*{box-sizing:border-box}
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;margin:0;color:#1b1f24;background:#f6f7f9}
header{padding:14px 22px 8px;background:#fff;border-bottom:1px solid #dde1e6}
h1{font-size:20px;margin:0 0 2px}
.sub{color:#57606a;margin:0 0 8px;font-size:13px}
.banner{display:inline-block;padding:5px 12px;border-radius:6px;font-weight:600;margin:2px 0 6px}
main{padding:10px 22px 40px}
nav.filters{display:flex;flex-wrap:wrap;gap:6px;align-items:center;margin:6px 0 4px}
nav.filters .lbl{color:#57606a;margin-right:4px}
button.f{border:2px solid transparent;border-radius:14px;padding:3px 10px;font:inherit;font-size:13px;cursor:pointer}
button.f .n{font-weight:700;margin-left:5px}
button.f.zero{opacity:.38}
button.f.on{outline:3px solid #0969da;outline-offset:1px}
button.f.all{background:#fff;border-color:#8c959f}
button.f.v-missing{border:2px dashed #616161}
button.tool{background:#fff;border:1px solid #8c959f;border-radius:6px;padding:3px 9px;font:inherit;font-size:13px;cursor:pointer}
.attention{background:#fff;border:1px solid #dde1e6;border-radius:8px;padding:8px 14px;margin:10px 0 14px}
.attention h2{font-size:15px;margin:2px 0 6px}
.attention li{margin:3px 0;cursor:pointer;list-style:none}
.attention ul{padding:0;margin:0}
.attention .why{color:#424a53}
section.tier{margin:14px 0 22px}
section.tier h2{font-size:16px;margin:6px 0}
section.tier h2 small{color:#57606a;font-weight:400}
table.grid{border-collapse:separate;border-spacing:0;background:#fff;border:1px solid #d0d7de;border-radius:8px}
table.grid th,table.grid td{border-bottom:1px solid #eaeef2;padding:5px 8px;text-align:left;vertical-align:top}
table.grid thead th{background:#f0f3f6;font-size:13px;position:sticky;top:0;z-index:1}
table.grid tbody th{font-weight:600;font-size:13px;white-space:nowrap;background:#fafbfc}
td.cell{cursor:pointer;min-width:150px;white-space:nowrap}
.scroll{overflow-x:auto;max-width:100%}
tr.detail>td{white-space:normal}
td.cell:hover{background:#f0f6ff}
td.cell.open{background:#e7f0ff;box-shadow:inset 3px 0 0 #0969da}
td.empty{background:repeating-linear-gradient(45deg,#fafbfc,#fafbfc 6px,#f3f4f6 6px,#f3f4f6 12px)}
.chip{display:inline-block;border-radius:10px;padding:1px 8px;margin:1px 2px 1px 0;font-size:12px;white-space:nowrap;border:1px solid rgba(0,0,0,.08)}
td.cell .chip{display:flex;justify-content:space-between;gap:10px;margin:2px 0;min-width:150px}
.chip .eng{font-weight:600}
.chip .vd{opacity:.92}
.chip.hidden{display:none}
tr.detail>td{background:#f6f8fa;padding:10px 12px}
.panel{background:#fff;border:1px solid #d0d7de;border-left-width:6px;border-radius:6px;padding:8px 14px;margin:0 0 10px}
.panel h3{font-size:14px;margin:2px 0 6px}
.panel h4{font-size:13px;margin:10px 0 4px}
.reason{margin:2px 0 6px;color:#24292f}
.known{background:#fdf6e3;border:1px solid #eadca6;border-radius:4px;padding:4px 8px}
.detail-line{margin:2px 0 6px;color:#424a53;font-size:13px}
.row{display:flex;flex-wrap:wrap;gap:10px 28px;align-items:flex-start}
figure{margin:0 0 6px}
section.tf{flex:0 1 660px;min-width:0}
section.greedy{flex:0 1 520px;min-width:0}
figcaption{font-size:12px;color:#57606a}
svg.chart{display:block;max-width:100%;height:auto;background:#fff}
svg .plot{fill:#fbfcfd;stroke:#d0d7de}
svg .grid{stroke:#eaeef2}
svg .ax{font-size:10px;fill:#57606a}
svg .bar{fill:#6e7781}
svg .bar.over{fill:#d32f2f}
svg .bar.inf{fill:#d32f2f;opacity:.5}
svg .dot{fill:#ef6c00}
svg .bound{stroke:#d32f2f;stroke-dasharray:5 3}
svg .bound-t{fill:#d32f2f}
svg .split{stroke:#0969da;stroke-dasharray:3 3}
svg .lt-run{fill:#0969da}
svg .lt-run.over{fill:#d32f2f}
svg .lt-base{fill:#8c959f}
svg .trend{fill:none;stroke:#0969da;stroke-width:1.5}
svg .pt{stroke:#1b1f24;stroke-width:.6}
table.topk,table.checks,table.prov{border-collapse:collapse;font-size:12.5px}
table.topk th,table.topk td,table.checks td,table.prov th,table.prov td{border:1px solid #eaeef2;padding:2px 7px;text-align:left}
table.topk td.lp{text-align:right;font-variant-numeric:tabular-nums;color:#57606a}
.tok-a{background:#fff3c4}
.tok-b{background:#ffd8d3}
code.tok-a,code.tok-b{padding:0 4px;border-radius:3px}
table.checks tr.bad td{background:#fff1f0}
table.prov th{background:#f6f8fa;font-weight:600}
pre.log{background:#1e2228;color:#e6edf3;padding:8px 10px;border-radius:6px;max-height:320px;overflow:auto;font-size:12px;white-space:pre-wrap;word-break:break-word}
.err{color:#a40e26}
.muted{color:#6e7781;font-size:12px}
.sub-h{font-size:12px;color:#57606a;margin:2px 0}
.problems{background:#fff1f0;border:1px solid #ffc1bd;border-radius:8px;padding:8px 14px;margin:10px 0}
footer{color:#6e7781;font-size:12px;padding:0 22px 20px}
"""

_JS = """
(function(){
  'use strict';
  function setOpen(td, open){
    var d = document.getElementById(td.getAttribute('data-detail'));
    if(!d){return;}
    d.hidden = !open;
    td.classList.toggle('open', open);
    td.setAttribute('aria-expanded', open ? 'true' : 'false');
  }
  function toggle(td){ setOpen(td, td.getAttribute('aria-expanded') !== 'true'); }
  var cells = document.querySelectorAll('td.cell[data-detail]');
  cells.forEach(function(td){
    td.addEventListener('click', function(ev){ if(ev.target.closest('a')){return;} toggle(td); });
    td.addEventListener('keydown', function(ev){
      if(ev.key === 'Enter' || ev.key === ' '){ ev.preventDefault(); toggle(td); }
    });
  });
  var active = new Set();
  var buttons = document.querySelectorAll('button.f[data-verdict]');
  function apply(){
    document.querySelectorAll('td.cell .chip[data-verdict]').forEach(function(ch){
      ch.classList.toggle('hidden', active.size > 0 && !active.has(ch.getAttribute('data-verdict')));
    });
    document.querySelectorAll('tr.gridrow').forEach(function(tr){
      var visible = tr.querySelectorAll('td.cell .chip:not(.hidden)').length > 0;
      tr.hidden = !visible;
      tr.querySelectorAll('td.cell[data-detail]').forEach(function(td){ if(!visible){ setOpen(td, false); } });
    });
    document.querySelectorAll('section.tier').forEach(function(sec){
      sec.hidden = sec.querySelectorAll('tr.gridrow:not([hidden])').length === 0;
    });
    document.querySelectorAll('.attention li[data-verdict]').forEach(function(li){
      li.hidden = active.size > 0 && !active.has(li.getAttribute('data-verdict'));
    });
    buttons.forEach(function(b){ b.classList.toggle('on', active.has(b.getAttribute('data-verdict'))); });
    var all = document.querySelector('button.f.all');
    if(all){ all.classList.toggle('on', active.size === 0); }
  }
  buttons.forEach(function(b){
    b.addEventListener('click', function(){
      var v = b.getAttribute('data-verdict');
      if(active.has(v)){ active.delete(v); } else { active.add(v); }
      apply();
    });
  });
  var all = document.querySelector('button.f.all');
  if(all){ all.addEventListener('click', function(){ active.clear(); apply(); }); }
  var ex = document.getElementById('expand-all'), co = document.getElementById('collapse-all');
  if(ex){ ex.addEventListener('click', function(){ cells.forEach(function(td){
    if(!td.closest('tr').hidden){ setOpen(td, true); } }); }); }
  if(co){ co.addEventListener('click', function(){ cells.forEach(function(td){ setOpen(td, false); }); }); }
  document.querySelectorAll('.attention li[data-target]').forEach(function(li){
    li.addEventListener('click', function(){
      var td = document.getElementById(li.getAttribute('data-target'));
      if(!td){return;}
      setOpen(td, true);
      td.scrollIntoView({block: 'center'});
    });
  });
  apply();
})();
"""


def _verdict_css() -> str:
    rules = []
    for s, (bg, fg, _, _) in STYLE.items():
        border = "border:1px dashed #616161;" if s == MISSING else ""
        rules.append(f".v-{s}{{background:{bg};color:{fg};{border}}}")
        rules.append(f".b-{s}{{border-left-color:{bg if s != MISSING else '#616161'}}}")
        rules.append(f"svg .pt.v-{s}{{fill:{bg}}}")
    return "\n".join(rules)


def render(merged: Merged, *, matrix=None, title: str | None = None, now: datetime | None = None) -> str:
    title = title or "Quantized model loading: regression matrix"
    now = now or datetime.now(timezone.utc)
    slots = _slots(merged, matrix)
    models, schemes, engines = _orders(matrix, slots)
    states = [s.state for s in slots]
    counts = counts_of(states)
    w = worst(states)

    # banner
    bad = [(s, counts[s]) for s in SEVERITY if counts.get(s) and s != "pass"]
    summary = ", ".join(f"{n} {s}" for s, n in bad) or ("all pass" if slots else "no cells")
    banner = (f'<div class="banner v-{esc(w or "unsupported")}">{len(slots)} cells · {esc(summary)}</div>')
    sets = ", ".join(f"<code>{esc(s)}</code>" for s in merged.sets)

    # filter bar (also the legend)
    buttons = [f'<span class="lbl">Filter:</span><button type="button" class="f all on">all <span class="n">{len(slots)}</span></button>']
    for s in STATES:
        bg, fg, meaning, _ = STYLE[s]
        buttons.append(f'<button type="button" class="f v-{s}{"" if counts.get(s) else " zero"}" data-verdict="{s}" '
                       f'title="{esc(meaning)}">{s}<span class="n">{counts.get(s, 0)}</span></button>')
    buttons.append('<span style="flex:1"></span><button type="button" class="tool" id="expand-all">expand all</button>'
                   '<button type="button" class="tool" id="collapse-all">collapse all</button>')

    # grids
    by_tier: dict[str, list[_Slot]] = {}
    for s in slots:
        by_tier.setdefault(s.tier, []).append(s)
    tier_order = [t for t in TIERS if t in by_tier] + sorted(t for t in by_tier if t not in TIERS)
    sections = []
    cell_ids: dict[tuple[str, str, str], str] = {}
    n = 0
    for tier in tier_order:
        tslots = by_tier[tier]
        tmodels = [m for m in models if any(s.model == m for s in tslots)]
        tschemes = [sc for sc in schemes if any(s.scheme == sc for s in tslots)]
        grid: dict[tuple[str, str], list[_Slot]] = {}
        for s in tslots:
            grid.setdefault((s.scheme, s.model), []).append(s)
        head = "".join(f"<th>{esc(m)}</th>" for m in tmodels)
        rows = []
        for sc in tschemes:
            tds, details = [], []
            for m in tmodels:
                members = sorted(grid.get((sc, m), []), key=lambda s: engines.index(s.engine))
                if not members:
                    tds.append('<td class="empty"></td>')
                    continue
                n += 1
                did, tid = f"d{n}", f"c{n}"
                cell_ids[(tier, sc, m)] = tid
                chips = "".join(
                    f'<span class="chip v-{esc(s.state)}" data-verdict="{esc(s.state)}" '
                    f'title="{esc(s.id)}: {esc(s.state)}"><span class="eng">{esc(s.engine)}</span>'
                    f'<span class="vd">{esc(s.state)}</span></span>' for s in members)
                tds.append(f'<td class="cell" id="{tid}" data-detail="{did}" tabindex="0" role="button" '
                           f'aria-expanded="false" title="{esc(m)} · {esc(sc)}: click for details">{chips}</td>')
                panels = "".join(_panel(s, merged) for s in members)
                details.append(f'<tr class="detail" id="{did}" hidden><td colspan="{len(tmodels) + 1}">'
                               f'<div class="sub-h">{esc(m)} · {esc(sc)} ({esc(tier)})</div>{panels}</td></tr>')
            rows.append(f'<tr class="gridrow"><th scope="row">{esc(sc)}</th>{"".join(tds)}</tr>' + "".join(details))
        sections.append(f'<section class="tier" data-tier="{esc(tier)}"><h2>{esc(tier)} <small>{_n(len(tslots), "cell")}, '
                        f'{_n(len(tmodels), "model")} × {_n(len(tschemes), "scheme")}</small></h2>'
                        f'<div class="scroll"><table class="grid"><thead><tr><th>scheme \\ model</th>{head}</tr></thead>'
                        f'<tbody>{"".join(rows)}</tbody></table></div></section>')

    # needs attention: everything that is not a plain pass, worst first
    attention = sorted((s for s in slots if s.state not in ("pass", "improved")),
                       key=lambda s: (SEVERITY.index(s.state), s.id))
    items = []
    for s in attention:
        why = ("no result record came back" if s.entry is None else s.entry.record.verdict_reason or "")
        if len(why) > 240:
            why = why[:240] + "…"
        target = cell_ids.get((s.tier, s.scheme, s.model), "")
        items.append(f'<li data-verdict="{esc(s.state)}" data-target="{esc(target)}">{_chip(s.state)} '
                     f'<code>{esc(s.id)}</code> <span class="why">{esc(why)}</span></li>')
    attention_html = (f'<section class="attention"><h2>Needs attention ({len(items)})</h2><ul>{"".join(items)}</ul></section>'
                      if items else "")
    problems = ""
    if merged.problems:
        lis = "".join(f"<li><code>{esc(p.path)}</code>: {esc(p.message)}</li>" for p in merged.problems)
        problems = f'<section class="problems"><h2>Unreadable result files ({len(merged.problems)})</h2><ul>{lis}</ul></section>'
    notes = ""
    if merged.notes:
        notes = ('<section class="attention"><h2>Cross-engine comparison at merge</h2><ul>'
                 + "".join(f"<li>{esc(x)}</li>" for x in merged.notes) + "</ul></section>")

    return (
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; "
        "script-src 'unsafe-inline'; img-src data:\">"
        f"<title>{esc(title)}</title><style>{_CSS}{_verdict_css()}</style></head><body>"
        f"<header><h1>{esc(title)}</h1>"
        f'<p class="sub">{len(slots)} cells · {len({s.model for s in slots})} models · result set(s): {sets} · '
        f"generated {esc(now.strftime('%Y-%m-%d %H:%M UTC'))}</p>{banner}"
        f'<nav class="filters" aria-label="filter by verdict">{"".join(buttons)}</nav></header>'
        f"<main>{problems}{attention_html}{notes}{''.join(sections) or '<p>No result records.</p>'}</main>"
        "<footer>Rows are schemes, columns are models, one chip per engine. Click a cell for its details. "
        "Result records: schema_version 1 (README, \"The result record\").</footer>"
        f"<script>{_JS}</script></body></html>\n"
    )
