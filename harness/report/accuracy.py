"""Accuracy results in the report and the annotation (docs/design.md, "Accuracy"): per task of a
record, its value, stderr and sample count, and how each accuracy check (against the baseline and
the other engines) came out."""
from __future__ import annotations

from harness.records import Record
from harness.report.states import check_state


def rows(rec: Record) -> list[dict]:
    """One row per accuracy task of ``rec``: the result and its checks (``against`` -> ok, its
    state (harness.report.states.check_state: ``shown`` when not judged), detail)."""
    out = []
    for a in rec.accuracy:
        checks = []
        for c in rec.checks:
            if c.kind == "accuracy" and c.task == a.task:
                checks.append({"against": c.against, "ok": c.ok, "state": check_state(c), "detail": c.detail,
                               "expected": (c.data or {}).get(c.against)})
        out.append({"task": a.task, "lm_eval_task": a.lm_eval_task, "metric": f"{a.metric},{a.filter}",
                    "value": a.value, "stderr": a.stderr, "samples": a.samples, "seconds": a.seconds,
                    "gate": ", ".join(f"{k} {v}" for k, v in a.gate.items()), "checks": checks})
    return out


def value_text(row: dict) -> str:
    if row["value"] is None:
        return "none"
    text = f"{row['value']:.4g}"
    if row["stderr"] is not None:
        text += f" ± {row['stderr']:.2g}"
    return f"{text} (n={row['samples']})"


def annotation_lines(records: list[Record], md, ok_emoji: str, bad_emoji: str, shown_emoji: str = "➖") -> list[str]:
    """A collapsed markdown table of every accuracy result, for the Buildkite annotation; a check
    shown but not judged is marked ``shown_emoji`` and said so."""
    body = []
    failing = 0
    for rec in sorted(records, key=lambda r: r.cell):
        for row in rows(rec):
            marks = []
            for c in row["checks"]:
                mark = bad_emoji if not c["ok"] else ok_emoji if c["state"] == "ok" else shown_emoji
                marks.append(f"{mark} {md(c['against'], 20)}" + (" (not judged)" if c["state"] == "shown" else ""))
                failing += not c["ok"]
            body.append(f"| `{md(rec.cell, 120)}` | {md(row['task'], 60)} | {md(row['metric'], 60)} | "
                        f"{md(value_text(row), 60)} | {' '.join(marks) or 'no check'} |")
    if not body:
        return []
    head = f"<details{' open' if failing else ''}><summary><b>accuracy</b>: {len(body)} task result(s)" \
           f"{f', {failing} check(s) outside the gate' if failing else ''}</summary>"
    return ["", head, "", "| cell | task | metric | value ± stderr (n) | checks |", "|---|---|---|---|---|",
            *body, "", "</details>"]
