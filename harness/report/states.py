"""The state each cell is shown in, the counts and annotation style that follow from the states
(harness.verdicts), and how a check is shown (judged or not): what every output of the report
shares."""
from __future__ import annotations

from collections.abc import Iterable

from harness import verdicts
from harness.records import Check, Record
from harness.verdicts import MISSING, STATES, VERDICTS, needs_attention


def engine_of(record: Record) -> str:
    """The engine as the outputs name a record's column: ``vllm``, or a configuration cell's
    ``vllm-tp2`` (harness.configurations), which sits beside its plain cell."""
    return f"{record.engine}-{record.configuration}" if record.configuration else record.engine


def state_of(record: Record | None) -> str:
    """The state shown for a record: its verdict; ``error`` when it was never judged; ``missing``
    for no record."""
    if record is None:
        return MISSING
    return record.verdict if record.verdict in VERDICTS else "error"


def annotation_style(states: Iterable[str], problems: int = 0) -> str:
    """Buildkite annotation style for a set of states: the worst state's (harness.verdicts), error
    when a record file is unreadable, info when there is nothing."""
    w = verdicts.worst(states)
    if problems:
        return "error"
    return verdicts.row(w).annotation if w is not None else "info"


def counts_of(states: Iterable[str]) -> dict[str, int]:
    counts = {s: 0 for s in STATES}
    for s in states:
        counts[s] = counts.get(s, 0) + 1
    return counts


def check_state(check: Check) -> str:
    """How the report shows a check: ``ok``, ``bad``, or ``shown`` for one computed but not judged
    (ok, ``data["judged"]`` false, its detail "not judged: ..."): its numbers are shown, and it
    counts as neither a pass nor a failure. An older record's ``judged`` (a dict of positions) is
    no such mark."""
    if not check.ok:
        return "bad"
    return "shown" if (check.data or {}).get("judged") is False else "ok"


def passing_apart(counts: dict[str, int]) -> list[str]:
    """The count of each state that passes otherwise than plainly (portable-pass, improved, fixed),
    in the table's order ("3 portable-pass"): said apart from ``pass``, never summed into it."""
    return [f"{counts[s]} {s}" for s in VERDICTS if counts.get(s) and s != "pass" and not needs_attention(s)]


def passing(counts: dict[str, int]) -> list[str]:
    """Where nothing needs attention: ["all pass"] when every cell is a plain pass, else the count
    of each passing state, ``pass`` first."""
    apart = passing_apart(counts)
    return [f"{counts['pass']} pass"] * bool(counts.get("pass")) + apart if apart else ["all pass"]
