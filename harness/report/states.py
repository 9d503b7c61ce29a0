"""The state each cell is shown in, and the counts and annotation style that follow from the
states (harness.verdicts): what every output of the report shares."""
from __future__ import annotations

from collections.abc import Iterable

from harness import verdicts
from harness.records import Record
from harness.verdicts import MISSING, STATES, VERDICTS


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
