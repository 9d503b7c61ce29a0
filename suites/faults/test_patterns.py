"""Untrusted skip entries are matched with a time limit without changing what they match.

harness.dialects.patterns runs Python-``re`` entries (transformers, compressed-tensors, torchao)
through the ``regex`` package in its ``re``-compatible mode, because only that one can stop. That
must keep ``re``'s answers: a property over entries built from regex syntax and module names,
with a fixed seed, compares every answer with ``re``'s own (and vLLM's entries with ``regex``'s).
"""
from __future__ import annotations

import re
import time

import pytest
import regex
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.dialects import patterns

NAMES = ["model.layers.0.self_attn.q_proj", "model.layers.11.mlp.up_proj", "lm_head", "model.embed_tokens",
         "model.visual.blocks.0.attn.qkv", "language_model.model.layers.1.cross_attn.k_proj", "model.norm", ""]
TOKENS = [".", "\\.", "*", "+", "?", "*?", "(", ")", "(?:", "|", "[a-z]", "[0-9]+", "\\d", "\\w+", "^", "$", "{1,2}",
          "layers", "model", "q_proj", "proj", "1", "11", "_", "(?=m)", "(?!x)", "(?<=s)", "\\1", "(?P<g>m)", "[^.]",
          "re:", "\\", "[", "]", "{", "}", "(?i)"]

entries = st.lists(st.sampled_from(TOKENS), min_size=1, max_size=8).map("".join)


ENGINES = {"re": re, "regex": regex}  # the owner's own engine, what the answers must equal


@pytest.mark.parametrize("owner", patterns.OWNERS)
def test_entries_keep_their_owners_semantics(owner):
    engine = ENGINES[owner]

    @settings(max_examples=300, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(entries, st.sampled_from(NAMES))
    def prop(pattern, name):
        try:
            engine.compile(pattern)
        except engine.error:
            with pytest.raises(re.error):  # InvalidPattern is a re.error, whichever engine refused
                patterns.match(pattern, name, owner)
            return
        for how in ("match", "fullmatch"):
            got, want = getattr(patterns, how)(pattern, name, owner), getattr(engine, how)(pattern, name)
            assert (got is None) == (want is None), (pattern, name, how)
            if want is not None:
                assert got.span() == want.span() and got.groups() == want.groups(), (pattern, name, how)

    prop()


@pytest.mark.parametrize("owner", patterns.OWNERS)
def test_a_backtracking_entry_stops_and_is_named(owner):
    slow = "(.|.)*(?<!j)$"
    t0 = time.monotonic()
    with pytest.raises(patterns.PatternTimeout) as e:
        patterns.match(slow, NAMES[0], owner=owner)
    assert time.monotonic() - t0 < 5
    assert e.value.pattern == slow
    assert e.value.reason == (f"matching it against {NAMES[0]!r} took longer than 0.25 s (catastrophic backtracking); "
                              "the owning library would hang on it")
