"""The HTML report: one self-contained page (inline CSS, JS and SVG; no network), rendered from
Jinja2 templates (``templates/*.j2``, package data) with autoescaping: every piece of text that came
from a record, a config, a baseline or a log is escaped by the template engine (a token
``<script>`` shows as text).

Layout: a banner with the worst state (a candidate build's cells included), a filter bar that is
also the legend (one button per state of harness.verdicts' table, in its colours), a "needs
attention" list, then one grid per tier: a row per scheme, a column per model, and inside each grid
cell one chip per engine, coloured by verdict. Clicking a grid cell opens its details below the
row: per engine the verdict and its reason, the teacher-forced |Δlogprob| per position (inline SVG,
the family bound dashed), the first greedy divergence with both tokens and both top-k side by side,
the module diff, load time against the baseline and its trend across result sets, the checks,
provenance (the run's and the baseline's CPU included) and the log tail.

``portable-pass`` (a cell on other kernels than its baseline's whose logprobs against it are shown,
not judged) is a state of its own everywhere: its chip and filter, and its own count in the banner,
never summed into ``pass``. A check computed but not judged (harness.report.states.check_state,
``shown``) wears a grey "shown, not judged" badge wherever checks are listed, in place of a tick;
its chart still draws, the family bound as a reference line and the bars above it marked apart,
not red.

With a candidate build (``harness run --candidate``), its headline under the banner and a "Base and
candidate" table: each of its cells with the base build's verdict and the candidate's.

This module builds the page's data (harness.report.charts computes the charts' geometry); the
templates only lay it out; the page's script only toggles visibility.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, StrictUndefined

from harness.matrix import TIERS
from harness.records import Record
from harness.registry import ENGINE_NAMES
from harness.report import charts
from harness.report.states import check_state, counts_of, engine_of, passing, passing_apart, state_of
from harness.report.merge import Entry, Merged
from harness.verdicts import ROWS, SEVERITY, STATES, needs_attention, row, worst
from harness.report import accuracy, candidates, localisation, sensitivity

LOG_LINES = 60  # lines of an engine log shown
MAX_PROMPTS = 6  # charts per check
TEMPLATES = Path(__file__).parent / "templates"

_ENV = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=True, undefined=StrictUndefined,
                   trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
_ENV.filters["num"] = charts.fmt


def _n(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


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
            entry.record.model, entry.record.scheme, engine_of(entry.record))
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
    engines = list(ENGINE_NAMES)
    for s in sorted(slots, key=lambda s: s.id):
        for seen, value in ((models, s.model), (schemes, s.scheme), (engines, s.engine)):
            if value not in seen:
                seen.append(value)
    return models, schemes, engines


# -------------------------------------------------------------------------------------- details


def _checks_of(rec: Record, kind: str):
    """(check, against) for each check of ``kind`` that carries data, e.g. ``teacher-forced``."""
    for c in rec.checks:
        if c.kind == kind and c.data:
            yield c, c.against


def _dict(data: dict, key: str) -> dict:
    value = data.get(key)
    return value if isinstance(value, dict) else {}


def _teacher_forced(rec: Record) -> list[dict]:
    out = []
    for c, against in _checks_of(rec, "teacher-forced"):
        per, bound = _dict(c.data, "per_position"), _dict(c.data, "bound").get("logprob")
        bound = bound if isinstance(bound, (int, float)) else None
        state = check_state(c)
        figures = []
        for prompt, values in list(per.items())[:MAX_PROMPTS]:
            if isinstance(values, list):
                figures.append(_figure(c.data, str(prompt), charts.numbers(values), bound, against, state != "shown"))
        out.append({"against": against, "state": state, "detail": c.detail, "figures": figures,
                    "more": max(0, len(per) - MAX_PROMPTS)})
    return out


def _figure(data: dict, prompt: str, values: list, bound: float | None, against: str, judged: bool) -> dict:
    pl = _dict(data, "prompt_len").get(prompt)
    chart = charts.delta(values, topk=charts.numbers(_dict(data, "topk_per_position").get(prompt)), bound=bound,
                         prompt_len=pl if isinstance(pl, int) else None, judged=judged,
                         caption=f"|Δlogprob| per position, prompt {prompt}, against {against}")
    return {"prompt": prompt, "chart": chart}


def _greedy(rec: Record) -> list[dict]:
    out = []
    for c, against in _checks_of(rec, "greedy"):
        divs = [d for d in (c.data.get("divergences") or []) if isinstance(d, dict)]
        item: dict[str, Any] = {"against": against, "state": check_state(c), "detail": c.detail, "divergence": None}
        if divs:
            d = next((d for d in divs if not d.get("ok", True)), divs[0])
            ta, tb = d.get(against), d.get("obtained")
            item["divergence"] = {"prompt": d.get("prompt"), "step": d.get("step"), "a": ta, "b": tb,
                                  "ok": bool(d.get("ok")), "count": len(divs),
                                  "rows": _topk_rows(d.get(f"{against}_topk") or [], d.get("obtained_topk") or [], ta, tb)}
        out.append(item)
    return out


def _topk_rows(a: list, b: list, tok_a: Any, tok_b: Any) -> list[list[dict | None]]:
    rows = []
    for i in range(max(len(a), len(b))):
        row = []
        for lst in (a, b):
            if i < len(lst) and isinstance(lst[i], (list, tuple)) and len(lst[i]) == 2:
                t, lp = lst[i]
                row.append({"token": t, "lp": charts.fmt(lp, 4), "cls": "tok-a" if t == tok_a else "tok-b" if t == tok_b else ""})
            else:
                row.append(None)
        rows.append(row)
    return rows


def _load(rec: Record, history: Sequence[Entry]) -> dict | None:
    if rec.load is None:
        return None
    lc = next((c for c in rec.checks if c.kind == "load-time" and c.data), None)
    base = ratio = bound = None
    if lc is not None:
        base, ratio, bound = lc.data.get("baseline_seconds"), lc.data.get("ratio"), lc.data.get("bound")
    text = (f"ratio {charts.fmt(ratio)} against the baseline, bound {charts.fmt(bound)}, "
            f"{'gated on this tier' if lc.data.get('gated') else 'measured, not gated on this tier'}" if lc is not None
            else "no baseline load time to compare with")
    points = [(e.source, e.record.load.seconds, state_of(e.record), e.record.started_at)
              for e in history if e.record.load is not None]
    return {"bars": charts.load_bars(rec.load.seconds, base if isinstance(base, (int, float)) else None, ratio, bound),
            "text": text, "phases": list(rec.load.phases.items()), "trend": charts.trend(points)}


def _cpu(owner: Any) -> dict | None:
    """The optional ``cpu`` block of an engine_info or a baseline's provenance (absent in older
    records): {vendor, model, flags, capability, kernel_env}."""
    cpu = getattr(owner, "cpu", None) if owner is not None else None
    if cpu is not None and hasattr(cpu, "model_dump"):
        cpu = cpu.model_dump()
    if not isinstance(cpu, dict):
        return None
    flags = cpu.get("flags")
    return {"name": " ".join(str(cpu[k]) for k in ("vendor", "model") if cpu.get(k)) or "?",
            "capability": cpu.get("capability"), "flags": [str(f) for f in flags] if isinstance(flags, list) else [],
            "kernel_env": sorted((str(k), str(v)) for k, v in (cpu.get("kernel_env") or {}).items())}


def _provenance(entry: Entry, baseline) -> dict:
    r, ei = entry.record, entry.record.engine_info
    rows = [("cell", r.cell, True), ("tier", r.tier, False), ("engine", f"{ei.name} {ei.version or '?'}", False),
            ("environment", ei.environment or "–", False), ("torch", ei.torch or "–", False),
            ("platform", ei.platform or "–", False)]
    if r.fixture:
        rows.append(("fixture", f"{r.fixture.name} {r.fixture.identity[:16]}", False))
    if r.source:
        rows.append(("checkpoint", r.source.hub and f"{r.source.hub}@{r.source.revision or '?'}" or r.source.path, False))
    rows += [("started", r.started_at, False), ("duration", f"{charts.fmt(r.duration_s)} s", False),
             ("record", str(entry.path), True), ("result set", entry.source, False)]
    prov = getattr(baseline, "provenance", None)
    base = None
    if prov is not None:
        base = {"text": f"{prov.engine} {prov.engine_version} on {prov.platform}, {prov.date}"
                        + (f", commit {prov.commit[:12]}" if prov.commit else ""), "cpu": _cpu(prov)}
    return {"rows": rows, "cpu": _cpu(ei), "baseline": base}


def _log_tail(entry: Entry) -> dict | None:
    r = entry.record
    out: dict[str, Any] = {"error": r.error, "file": None, "unreadable": None}
    if r.status != "ok" or row(state_of(r)).shows_log:
        if entry.log is not None:
            try:
                lines = entry.log.read_text(errors="replace").splitlines()[-LOG_LINES:]
                out["file"] = {"name": entry.log.name, "count": len(lines), "text": "\n".join(lines)}
            except OSError as e:
                out["unreadable"] = f"cannot read {entry.log}: {e}"
    return out if out["error"] is not None or out["file"] or out["unreadable"] else None


def _link(url: str | None) -> str | None:
    return url if url and re.match(r"^https?://", url) else None


def _panel(slot: _Slot, merged: Merged, baselines) -> dict:
    if slot.entry is None:
        return {"state": slot.state, "id": slot.id, "missing": True}
    r = slot.entry.record
    return {
        "state": slot.state, "id": slot.id, "missing": False, "reason": r.verdict_reason,
        "unsupported": r.unsupported_reason if r.unsupported_reason != r.verdict_reason else None,
        "known": r.known_failure, "known_link": _link(r.known_failure.link) if r.known_failure else None,
        "module_diff": r.module_diff,
        "tf": _teacher_forced(r), "greedy": _greedy(r), "load": _load(r, merged.history.get(r.cell, [])),
        "log": _log_tail(slot.entry), "accuracy": accuracy.rows(r),
        "checks": [{"name": c.name, "detail": c.detail, "state": check_state(c)} for c in r.checks],
        "localisation": localisation.rows(r), "sensitivity": sensitivity.rows(r),
        "provenance": _provenance(slot.entry, baselines.get(r) if baselines else None),
    }


# ------------------------------------------------------------------------------------------ page


class _Baselines:
    """The stored baseline each record was judged against (harness.resolver), read once per cell;
    None where there is none or it cannot be read."""

    def __init__(self, root):
        self.root = Path(root)
        self._cache: dict[str, Any] = {}

    def get(self, record: Record):
        # lazy: pydantic, +50 ms (scripts/import-graph --costs)
        from harness import baselines as B, resolver

        if record.cell not in self._cache:
            try:
                self._cache[record.cell] = resolver.resolve(self.root, record).baseline
            except B.BaselineError:
                self._cache[record.cell] = None
        return self._cache[record.cell]


def _tier(tier: str, tslots: list[_Slot], orders, merged: Merged, baselines, ids: dict) -> dict:
    models, schemes, engines = orders
    tmodels = [m for m in models if any(s.model == m for s in tslots)]
    tschemes = [sc for sc in schemes if any(s.scheme == sc for s in tslots)]
    grid: dict[tuple[str, str], list[_Slot]] = {}
    for s in tslots:
        grid.setdefault((s.scheme, s.model), []).append(s)
    rows = []
    for sc in tschemes:
        cells = []
        for m in tmodels:
            members = sorted(grid.get((sc, m), []), key=lambda s: engines.index(s.engine))
            if not members:
                cells.append(None)
                continue
            n = len(ids) + 1
            ids[(tier, sc, m)] = f"c{n}"
            cells.append({"id": f"c{n}", "detail": f"d{n}", "model": m, "chips": members,
                          "panels": [_panel(s, merged, baselines) for s in members]})
        rows.append({"scheme": sc, "cells": cells})
    return {"name": tier, "cells": _n(len(tslots), "cell"), "models": tmodels,
            "size": f"{_n(len(tmodels), 'model')} × {_n(len(tschemes), 'scheme')}", "rows": rows}


def _attention(slots: Sequence[_Slot], ids: dict) -> list[dict]:
    items = []
    for s in sorted((s for s in slots if needs_attention(s.state)), key=lambda s: (SEVERITY.index(s.state), s.id)):
        why = "no result record came back" if s.entry is None else s.entry.record.verdict_reason or ""
        items.append({"state": s.state, "id": s.id, "target": ids.get((s.tier, s.scheme, s.model), ""),
                      "why": why if len(why) <= 240 else why[:240] + "…"})
    return items


def _side(entry: Entry | None) -> dict | None:
    """One build of a cell in the "Base and candidate" table."""
    if entry is None:
        return None
    r = entry.record
    why = r.verdict_reason or ""
    return {"build": f"{r.engine} {r.engine_info.version or '?'}", "spec": r.candidate, "state": state_of(r),
            "why": why if len(why) <= 240 else why[:240] + "…"}


def _candidates(merged: Merged, matrix) -> dict | None:
    """The candidate build's headline and its cells beside the base's; None without candidate records."""
    line = candidates.headline(merged.records(), merged.candidate_records())
    if line is None:
        return None
    return {"headline": line.splitlines(),
            "rows": [{"id": cid, "base": _side(b), "candidate": _side(c)} for cid, b, c in candidates.pairs(merged, matrix)]}


def _summary(counts: dict[str, int]) -> str:
    """The banner's counts: the states that need attention, worst first, then those that pass
    otherwise than plainly (portable-pass, improved, fixed), each counted apart from ``pass``."""
    attention = [f"{counts[s]} {s}" for s in SEVERITY if counts.get(s) and needs_attention(s)]
    if attention:
        return ", ".join(attention + passing_apart(counts))
    return ", ".join(passing(counts)) if any(counts.values()) else "no cells"


def render(merged: Merged, *, matrix=None, title: str | None = None, now: datetime | None = None,
           baselines_root: str | Path | None = None) -> str:
    slots = _slots(merged, matrix)
    orders = _orders(matrix, slots)
    counts = counts_of(s.state for s in slots)
    by_tier: dict[str, list[_Slot]] = {}
    for s in slots:
        by_tier.setdefault(s.tier, []).append(s)
    baselines = _Baselines(baselines_root) if baselines_root is not None else None
    ids: dict[tuple[str, str, str], str] = {}
    tiers = [_tier(t, by_tier[t], orders, merged, baselines, ids)
             for t in [t for t in TIERS if t in by_tier] + sorted(t for t in by_tier if t not in TIERS)]
    return _ENV.get_template("report.html.j2").render(
        title=title or "Quantized model loading: regression matrix",
        generated=(now or datetime.now(timezone.utc)).strftime("%Y-%m-%d %H:%M UTC"),
        slots=len(slots), models=len({s.model for s in slots}), sets=merged.sets,
        # a candidate's failing cell colours the banner as the run's exit status counts it
        worst=worst([*(s.state for s in slots), *(state_of(r) for r in merged.candidate_records())]) or "unsupported",
        summary=_summary(counts),
        states=STATES, rows=ROWS, counts=counts, tiers=tiers, attention=_attention(slots, ids),
        problems=merged.problems, notes=merged.notes, candidates=_candidates(merged, matrix),
    )
