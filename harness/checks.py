"""The kinds of check a record carries, one entry each, and the one logprob difference.

A check (harness.records.Check) is one comparison: its ``kind`` (an entry of ``KINDS``), what it
was compared against (``against``: ``baseline``, another engine's name, ``contrast``), and for an
accuracy check its task. Whatever the judging, the localisation and the report need to know about
a kind is a field of its entry, read through :func:`kind`, never a parse of the check's name; the
name (``teacher-forced:vllm``, ``accuracy/arc:baseline``) is only what people and known-failure
patterns read (docs/design.md, "Verdicts").

A leaf module (standard library only): the records, the engines and the comparison read it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

BASELINE = "baseline"  # ``against`` of a check against the cell's stored baseline


@dataclass(frozen=True)
class CheckKind:
    name: str
    # it compares scored sequences (which prompts, their scored tokens, logprobs, greedy tokens):
    # a known failure about another engine names one of these (judging, an absent engine)
    sequence: bool = False
    # what an engine computed (logprobs, greedy tokens, accuracy) rather than what it loaded:
    # against a baseline from other kernels it is shown, not judged, where the computation does not
    # carry (docs/design.md, "Portability across CPUs")
    computed: bool = False
    # logprobs a rounding flip between two engines on the same kernels can move (judging.rounding_flip)
    moved_by_rounding: bool = False
    # it compares two engines' results when it is not against the baseline (compare.cross_engine)
    between_engines: bool = False
    # a trace of the loaded model can place where it fails (harness.traces.jobs): the traces are
    # compared with another engine's and the baseline's fingerprint, which neither a slower load
    # nor an output that ignores its input (the same on every engine) moves
    traced: bool = True


KINDS: dict[str, CheckKind] = {k.name: k for k in (
    CheckKind("prompts", sequence=True, between_engines=True),
    CheckKind("scored-tokens", sequence=True, computed=True, between_engines=True),
    CheckKind("teacher-forced", sequence=True, computed=True, moved_by_rounding=True, between_engines=True),
    CheckKind("greedy", sequence=True, computed=True, moved_by_rounding=True, between_engines=True),
    CheckKind("accuracy", computed=True, between_engines=True),
    CheckKind("loaded-state"),
    CheckKind("module-diff"),
    CheckKind("input-sensitivity", traced=False),
    CheckKind("load-time", traced=False),
)}


def kind(name: str) -> CheckKind:
    """The entry of a check kind; a miss names the kinds there are."""
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"unknown check kind {name!r}; the kinds: {', '.join(KINDS)}") from None


def logprob_difference(a: float, b: float, *, nan: Literal["apart", "unknown"]) -> float:
    """|a - b| of two logprobs, 0 for equal infinities and infinite for one. ``nan`` says what a
    NaN means: ``"apart"`` for a comparison of outputs (a NaN against a number is infinitely far,
    NaN against NaN the same non-result reproduced: a waived cell's recorded behaviour can be NaN
    throughout); ``"unknown"`` for the input sensitivity, where a NaN on either side says nothing
    about the input (NaN: the check leaves that prompt out)."""
    if math.isnan(a) or math.isnan(b):
        if nan == "unknown":
            return math.nan
        return 0.0 if math.isnan(a) and math.isnan(b) else math.inf
    return 0.0 if a == b else abs(a - b)
