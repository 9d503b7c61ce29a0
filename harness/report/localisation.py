"""Module-trace localisations in the report (docs/design.md, "Localisation"): per localisation of a
record, the first diverging module, the numbers behind it, and the module path from the input to
the logits with that module marked."""
from __future__ import annotations

from harness.records import Localisation, Record, TraceStep

ROOT = "(model output: the logits)"
AFTER_FIRST = 8  # modules shown after the first diverging one, before the logits


def rows(rec: Record) -> list[dict]:
    """One entry per localisation, with ``path``: the modules in execution order (the model's own
    output, the logits, last), cut after ``AFTER_FIRST`` modules past the first diverging one
    (``hidden`` says how many were left out). Path rows carry ``depth`` (for indentation),
    ``first`` (the module named) and ``moved`` (beyond its noise; a non-finite |Δ| is stored as
    null)."""
    out = []
    for loc in rec.localisation:
        path, hidden = _path(loc)
        out.append({"against": loc.against, "module": loc.module, "kind": loc.kind, "prompt": loc.prompt,
                    "position": loc.position, "delta": loc.delta, "noise": loc.noise, "detail": loc.detail,
                    "path": path, "hidden": hidden, "total": len(loc.path)})
    return out


def _path(loc: Localisation) -> tuple[list[dict], int]:
    steps = [s for s in loc.path if s.module] + [s for s in loc.path if not s.module]
    body, root = steps[:-1] if steps and not steps[-1].module else steps, steps[-1:] if steps and not steps[-1].module else []
    names = [s.module for s in body]
    hidden = 0
    if loc.module in names:
        keep = names.index(loc.module) + 1 + AFTER_FIRST
        hidden = max(0, len(body) - keep)
        body = body[:keep]
    return [_row(s, loc) for s in body + root], hidden


def _row(s: TraceStep, loc: Localisation) -> dict:
    return {"module": s.module or ROOT, "depth": s.module.count(".") + 1 if s.module else 0,
            "delta": s.delta, "noise": s.noise, "first": s.module == loc.module,
            "moved": s.noise is not None and (s.delta is None or s.delta > s.noise)}
