"""Untrusted regular expressions: skip entries matched in their owner's regex dialect, with a time limit.

A skip entry comes from the checkpoint's own config.json, and a checkpoint is untrusted input:
an entry like ``(.+)+X`` backtracks for ever on a long module name (docs/design.md, "Bad input
and faults"). Every dialect matches its entries through this module, never through ``re`` itself:

- ``owner="re"``: Python's ``re``, the engine of transformers, compressed-tensors and torchao. The
  pattern is compiled by ``re`` (so what ``re`` refuses is refused, with ``re``'s message), then
  matched by the ``regex`` package in its ``re``-compatible mode (``regex.V0``), which can stop.
- ``owner="regex"``: the ``regex`` package (``V0``, its default), which vLLM imports as ``re``.

An engine without backtracking would stop too, but it would change what the dialect mirrors match
(backreferences, lookarounds). A match that runs past ``TIMEOUT_S`` raises
:class:`PatternTimeout`; a pattern the owner cannot compile raises :class:`InvalidPattern`, a
``re.error`` (the dialects handle it where the owner's own ``re.error`` would surface). Both carry
the pattern; the loader names the config entry it came from.
"""
from __future__ import annotations

import functools
import re

import regex

OWNERS = ("re", "regex")
TIMEOUT_S = 0.25  # one match of one entry against one module name


class InvalidPattern(re.error):
    """A pattern its owner's engine refuses to compile."""

    def __init__(self, pattern: str, owner: str, why: str):
        super().__init__(f"not a valid regular expression for {owner} ({why})")
        self.pattern = pattern
        self.reason = f"not a valid regular expression for {'Python' if owner == 're' else 'the regex package'} ({why})"


class PatternTimeout(Exception):
    """A match that ran past the time limit (catastrophic backtracking)."""

    def __init__(self, pattern: str, string: str):
        self.pattern = pattern
        self.reason = (f"matching it against {string!r} took longer than {TIMEOUT_S:g} s "
                       "(catastrophic backtracking); the owning library would hang on it")
        super().__init__(self.reason)


@functools.lru_cache(maxsize=4096)
def _compiled(pattern: str, owner: str):
    if owner == "re":
        try:
            re.compile(pattern)
        except re.error as e:
            raise InvalidPattern(pattern, owner, str(e)) from None
    elif owner != "regex":
        raise ValueError(f"regex owner {owner!r}: one of {OWNERS}")
    try:
        return regex.compile(pattern, regex.V0)
    except regex.error as e:
        raise InvalidPattern(pattern, owner, str(e)) from None


def _run(how: str, pattern: str, string: str, owner: str):
    rx = _compiled(pattern, owner)
    try:
        return getattr(rx, how)(string, timeout=TIMEOUT_S)
    except TimeoutError:
        raise PatternTimeout(pattern, string) from None


def match(pattern: str, string: str, owner: str = "re"):
    """``re.match`` (anchored at the start) in the owner's dialect, under the time limit."""
    return _run("match", pattern, string, owner)


def fullmatch(pattern: str, string: str, owner: str = "re"):
    """``re.fullmatch`` in the owner's dialect, under the time limit."""
    return _run("fullmatch", pattern, string, owner)


def check(pattern: str, owner: str = "re") -> None:
    """Raise InvalidPattern when the owner cannot compile ``pattern``."""
    _compiled(pattern, owner)
