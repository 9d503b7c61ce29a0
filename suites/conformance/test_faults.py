"""Deliberate faults in the cross-attention loading, each caught by a conformance check.

A check that cannot fail proves nothing: each fault below is injected into the reference loader
and the check that guards against it must report it.
"""
import pytest

from harness import fixtures, reference, scoring
from harness.quant import fp8
from harness.quant.source import TensorSource
from harness.reference import cross_attention
from oracles import transformers_model
from test_conformance import LOGPROB_BOUND, fp8_requantization_problems, max_logprob_delta


def _swap_k_and_v(monkeypatch):
    forward = cross_attention.CrossAttentionQKV.forward

    def swapped(self, hidden_states, encoder_states):
        query, key, value = forward(self, hidden_states, encoder_states)
        return query, value, key

    monkeypatch.setattr(cross_attention.CrossAttentionQKV, "forward", swapped)


@pytest.mark.parametrize("name", ["whisper-unquantized", "whisper-bnb-nf4"])
def test_swapped_cross_attention_k_and_v_is_caught(name, monkeypatch):
    path = fixtures.build(name)
    prompts = scoring.fixture_prompts(path)
    theirs = transformers_model(str(path))
    assert max_logprob_delta(reference.load(path).model, theirs, prompts) <= LOGPROB_BOUND
    _swap_k_and_v(monkeypatch)
    assert max_logprob_delta(reference.load(path).model, theirs, prompts) > LOGPROB_BOUND


@pytest.mark.parametrize("name", ["llama-fp8-static-kv", "whisper-fp8-static-kv"])
def test_dropped_fp8_requantization_is_caught(name, monkeypatch):
    path = fixtures.build(name)
    src = TensorSource.open(path)
    assert fp8_requantization_problems(reference.load(path), src, path) == []
    monkeypatch.setattr(fp8, "requantize_fused", lambda shards, *a, **k: shards)
    problems = fp8_requantization_problems(reference.load(path), src, path)
    assert problems, "keeping each shard's own scale must break the shared-scale invariant"
    if name.startswith("whisper"):
        assert any(".encoder_attn." in p for p in problems), "the cross-attention kv group must be among them"
