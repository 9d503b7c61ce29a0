"""Geometry of the report's inline SVG charts; templates/charts.svg.j2 draws them.

Each function returns plain data (coordinates, classes, titles), never markup: the template
escapes every string it is given.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def fmt(x: Any, digits: int = 3) -> str:
    """A number for the page: 3 significant digits, "–" for None, NaN and ±∞ spelled out."""
    if x is None:
        return "–"
    if isinstance(x, float):
        if math.isnan(x):
            return "NaN"
        if math.isinf(x):
            return "∞" if x > 0 else "-∞"
        return f"{x:.{digits}g}"
    return str(x)


def numbers(values: Any) -> list[float | None] | None:
    """A list of numbers from untrusted check data (anything else becomes None)."""
    if not isinstance(values, list):
        return None
    return [v if isinstance(v, (int, float)) and not isinstance(v, bool) else None for v in values]


class _LogScale:
    def __init__(self, values: Sequence[float | None], bound: float | None, top: float, height: float):
        finite = [v for v in values if v is not None and math.isfinite(v) and v > 0]
        self.lo = 1e-8
        self.hi = max([1.0, (bound or 0) * 10, *(v * 2 for v in finite)])
        self.top, self.height = top, height

    def __call__(self, v: float) -> float:
        v = min(max(v, self.lo), self.hi)
        span = math.log10(self.hi) - math.log10(self.lo)
        return self.top + self.height - (math.log10(v) - math.log10(self.lo)) / span * self.height


def delta(values: Sequence[float | None], *, topk: Sequence[float | None] | None = None, bound: float | None = None,
          prompt_len: int | None = None, judged: bool = True, caption: str = "") -> dict:
    """|Δlogprob| per position on a log scale: a bar per scored position (red above the bound), a
    dot for the shared top-k, the family bound dashed and the prompt/generated boundary.
    ``values[i]`` scores position i + 1. Where the check was not ``judged`` (shown only), the bound
    is drawn for reference: a bar above it is marked apart, never red."""
    n = len(values)
    w, h, left, right, top, bottom = 640, 160, 46, 58, 12, 30
    pw, ph = w - left - right, h - top - bottom
    y = _LogScale([*values, *(topk or [])], bound, top, ph)
    band = pw / max(n, 1)
    chart: dict[str, Any] = {"w": w, "h": h, "left": left, "top": top, "pw": pw, "ph": ph, "caption": caption,
                             "bars": [], "dots": [], "bound": None, "split": None}
    chart["grid"] = [{"y": y(10.0 ** e), "label": f"1e{e}"}
                     for e in range(int(math.floor(math.log10(y.lo))), int(math.floor(math.log10(y.hi))) + 1) if not e % 2]
    if prompt_len is not None and 0 < prompt_len - 1 < n:
        chart["split"] = left + (prompt_len - 1) * band  # positions >= prompt_len are generated tokens
    for i, v in enumerate(values):
        chart["bars"].append(_bar(i, v, y, bound, judged, band, left, top, ph))
    for i, v in enumerate(topk or []):
        if v is not None and math.isfinite(v) and v > 0:
            chart["dots"].append({"x": left + i * band + band / 2, "y": y(v),
                                  "title": f"position {i + 1}: shared top-k max |Δ| {fmt(v)}"})
    if bound:
        chart["bound"] = {"y": y(bound), "label": fmt(bound), "text": "bound" if judged else "reference",
                          "cls": "" if judged else " ref"}
    step = max(1, math.ceil(n / 12))
    chart["xticks"] = [{"x": left + i * band + band / 2, "label": i + 1} for i in range(0, n, step)]
    return chart


def _bar(i: int, v: float | None, y: _LogScale, bound: float | None, judged: bool, band: float, left: float,
         top: float, ph: float) -> dict:
    """One position's bar: red above the bound where it was judged, ``above`` where it was only shown."""
    pos, x0, bw = i + 1, left + i * band + band * 0.15, max(band * 0.7, 1.0)
    if v is None or not math.isfinite(v):
        return {"x": x0, "y": top, "w": bw, "h": ph, "cls": "bar inf", "title": f"position {pos}: |Δ| not finite"}
    over = bound is not None and v > bound
    yy = y(v) if v > 0 else top + ph - 1
    title = f"position {pos}: |Δlogprob| {fmt(v)}"
    if over:
        title += " (above the bound)" if judged else " (above the family bound, shown for reference: not judged)"
    cls = "bar" + ((" over" if judged else " above") if over else "")
    return {"x": x0, "y": yy, "w": bw, "h": top + ph - yy, "cls": cls, "title": title}


def load_bars(seconds: float, baseline: float | None, ratio: float | None, bound: float | None) -> dict:
    """This run's load time against the baseline's, as two horizontal bars."""
    w, left, bar_h = 420, 90, 16
    rows = [("this run", seconds)] + ([("baseline", baseline)] if baseline is not None else [])
    top = max(v for _, v in rows) or 1.0
    bars = []
    for i, (name, v) in enumerate(rows):
        cls = "lt-run" if i == 0 else "lt-base"
        if i == 0 and ratio is not None and bound is not None and ratio > bound:
            cls += " over"
        bars.append({"name": name, "y": 6 + i * (bar_h + 8), "w": max((w - left - 80) * (v / top), 1),
                     "cls": cls, "label": f"{fmt(v)} s"})
    return {"w": w, "h": 12 + len(rows) * (bar_h + 8), "left": left, "bar_h": bar_h, "bars": bars}


def trend(points: Sequence[tuple[str, float, str, str]]) -> dict | None:
    """Load time across result sets: (result set, seconds, state, started_at) per point, oldest first."""
    if len(points) < 2:
        return None
    w, h, left, right, top, bottom = 460, 120, 50, 50, 12, 34
    pw, ph = w - left - right, h - top - bottom
    hi = max(v for _, v, _, _ in points) * 1.15 or 1.0
    step = pw / (len(points) - 1)
    pts = []
    for i, (source, v, state, started) in enumerate(points):
        name = source.rstrip("/").rsplit("/", 1)[-1] or source
        pts.append({"x": left + i * step, "y": top + ph - v / hi * ph, "state": state, "seconds": fmt(v, 2),
                    "label": name if len(name) <= 14 else "…" + name[-13:],
                    "title": f"{source}: {fmt(v)} s, {state}, {started}"})
    return {"w": w, "h": h, "left": left, "top": top, "pw": pw, "ph": ph, "hi": fmt(hi, 2), "points": pts,
            "polyline": " ".join(f"{p['x']:.1f},{p['y']:.1f}" for p in pts)}
