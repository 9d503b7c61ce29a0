"""The reference cross-attention module: q from decoder states, k/v from encoder states."""
import torch
from torch import nn

from harness import fixtures, reference, scoring
from harness.reference.cross_attention import CrossAttentionQKV, ReferenceCrossAttention
from harness.reference.linear import FusedLinear


class _Counting(nn.Linear):
    calls = 0

    def forward(self, x):
        type(self).calls += 1
        return super().forward(x)


def test_only_q_is_computed_without_encoder_states():
    q, k, v = (_Counting(8, 8) for _ in range(3))
    hidden = torch.randn(1, 3, 8)
    _Counting.calls = 0
    query, key, value = CrossAttentionQKV(q, k, v)(hidden, None)
    assert key is None and value is None and _Counting.calls == 1
    assert torch.equal(query, nn.Linear.forward(q, hidden))


def test_fused_kv_equals_separate_projections():
    k, v = nn.Linear(8, 4), nn.Linear(8, 6)
    kv = FusedLinear(torch.cat([k.weight, v.weight]).detach(), torch.cat([k.bias, v.bias]).detach(),
                     "unquantized", None, [4, 6])
    encoder = torch.randn(2, 5, 8)
    _, key, value = CrossAttentionQKV(nn.Linear(8, 8), k, v, kv)(torch.randn(2, 3, 8), encoder)
    assert torch.allclose(key, k(encoder), atol=1e-6) and torch.allclose(value, v(encoder), atol=1e-6)


def test_whisper_uses_reference_cross_attention_fused_as_reported():
    loaded = reference.load(fixtures.build("whisper-bnb-nf4"))
    kv_groups = {g.parent: g.fused for g in loaded.report.groups if g.kind == "cross-kv"}
    assert kv_groups and all(kv_groups.values())
    for parent in kv_groups:
        module = loaded.model.get_submodule(parent)
        assert isinstance(module, ReferenceCrossAttention) and module.qkv.fused


def test_cached_decoding_reuses_encoder_kv_and_matches_uncached(monkeypatch):
    """Decoding with the cache computes the encoder K/V once, then only q; scoring.greedy re-runs
    everything without a cache. Same tokens either way."""
    path = fixtures.build("whisper-unquantized")
    model = reference.load(path).model
    prompt = scoring.fixture_prompts(path)[0]
    uncached = scoring.greedy(model, prompt, 6, k=1).tokens

    encoder_passes = []
    forward = CrossAttentionQKV.forward
    monkeypatch.setattr(CrossAttentionQKV, "forward", lambda self, h, e: (
        encoder_passes.append(e is not None), forward(self, h, e))[1])
    ids, past, cached = torch.tensor([prompt.tokens]), None, []
    with torch.inference_mode():
        for _ in range(6):
            out = model(**prompt.inputs, decoder_input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            ids = out.logits[:, -1:].argmax(-1)
            cached.append(int(ids))
    assert cached == uncached
    layers = model.config.decoder_layers
    assert encoder_passes == [True] * layers + [False] * layers * 5
