"""What a run prints on the terminal: a judged cell's progress line (``harness run``, ``harness
bisect``), and any text squeezed onto one line. Light to import: the CLI prints with it before a
run's heavier modules are loaded."""
from __future__ import annotations

from harness import verdicts
from harness.records import Record


def one_line(text: str | None, width: int = 160) -> str:
    line = " ".join((text or "").split())
    return line if len(line) <= width else line[: width - 1] + "…"


def progress_line(i: int, n: int, rec: Record) -> str:
    """``[i/n] verdict cell (detail)``: the load and cell times of a passing cell, else its reason."""
    w = len(str(n))
    if verdicts.row(rec.verdict or "error").pytest == "passed" and rec.load is not None:
        detail = f"load {rec.load.seconds:.3f} s, cell {rec.duration_s:.1f} s"
    else:
        detail = one_line(rec.verdict_reason)
    build = f" [candidate {rec.engine_info.version}]" if rec.candidate is not None else ""
    return f"[{i:>{w}}/{n}] {rec.verdict or 'error':<16} {rec.cell}{build}  ({detail})"
