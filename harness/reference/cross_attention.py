"""The reference cross-attention: q from the decoder states, k and v from the encoder states.

`CrossAttentionQKV` is the projection itself. k and v run as one fused matmul when the loader
could fuse them (identical quantization settings), and separately otherwise. With no encoder
states (they are cached), only q is computed.

`ReferenceCrossAttention` replaces a model's own cross-attention module around it. The
architectures differ only in data (`Style`, one per architecture in `harness.architectures`):
which keyword carries the encoder states, whether the query is pre-scaled, whether q and k are
normalised, and how the cache is organised.
"""
import torch
from torch import nn
from transformers.cache_utils import EncoderDecoderCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from harness import architectures
from harness.architectures import CrossAttentionStyle as Style


class CrossAttentionQKV(nn.Module):
    def __init__(self, q: nn.Module, k: nn.Module, v: nn.Module, kv: nn.Module | None = None):
        super().__init__()
        # Plain attributes: the projections stay registered where the checkpoint names them.
        object.__setattr__(self, "projections", (q, k, v, kv))

    @property
    def fused(self) -> bool:
        return self.projections[3] is not None

    def forward(self, hidden_states: torch.Tensor, encoder_states: torch.Tensor | None):
        q, k, v, kv = self.projections
        query = q(hidden_states)
        if encoder_states is None:
            return query, None, None
        if kv is not None:
            key, value = kv(encoder_states).split(kv.sizes, dim=-1)
            return query, key, value
        return query, k(encoder_states), v(encoder_states)


# How each architecture's cross-attention differs: data in the architecture registry (docs/design.md).
STYLES = architectures.CROSS_ATTENTION_STYLES


class ReferenceCrossAttention(nn.Module):
    def __init__(self, original: nn.Module, style: Style, kv: nn.Module | None):
        super().__init__()
        self.style = style
        self.config = original.config
        self.layer_idx = original.layer_idx
        self.head_dim = original.head_dim
        self.scaling = original.scaling
        self.is_causal = False
        self.num_kv_heads = getattr(original, style.kv_heads_attr)
        # sdpa repeats K/V for grouped-query attention by this attribute.
        self.num_key_value_groups = getattr(original, "num_key_value_groups", 1)
        for name, child in original.named_children():
            self.add_module(name, child)
        self.qkv = CrossAttentionQKV(self.q_proj, self.k_proj, self.v_proj, kv)

    def _cache(self, past_key_values, encoder_states):
        """(the cross-attention cache or None, whether its K/V can be reused as they are)."""
        if past_key_values is None:
            return None, False
        if self.style.encoder_decoder_cache:
            if not isinstance(past_key_values, EncoderDecoderCache):
                return None, False
            reuse = bool(past_key_values.is_updated.get(self.layer_idx))
            past_key_values.is_updated[self.layer_idx] = True
            return past_key_values.cross_attention_cache, reuse
        return past_key_values, encoder_states is None

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, past_key_values=None, **kwargs):
        style = self.style
        encoder_states = kwargs.pop(style.encoder_kwarg, None)
        kwargs.pop("use_cache", None)
        cache, reuse = self._cache(past_key_values, encoder_states)
        query, key, value = self.qkv(hidden_states, None if reuse else encoder_states)

        batch, length = hidden_states.shape[:2]
        if style.prescale_query:
            query = query * self.scaling
        query = query.view(batch, length, -1, self.head_dim).transpose(1, 2)
        if style.norms:
            query = self.q_norm(query)
        if key is None:
            if cache is None:
                raise ValueError(f"cross-attention layer {self.layer_idx}: no encoder states and nothing cached")
            key, value = cache.layers[self.layer_idx].keys, cache.layers[self.layer_idx].values
        else:
            key = key.view(batch, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
            value = value.view(batch, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
            if style.norms:
                key = self.k_norm(key)
            if cache is not None:
                key, value = cache.update(key, value, self.layer_idx)

        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)
        output, weights = attention(self, query, key, value, attention_mask, dropout=0.0,
                                    scaling=1.0 if style.prescale_query else self.scaling, **kwargs)
        output = output.reshape(batch, length, -1).contiguous()
        return getattr(self, style.output)(output), weights


def install(model: nn.Module, fqn: str, kv: nn.Module | None) -> None:
    """Replace the cross-attention module at `fqn` with the reference one."""
    original = model.get_submodule(fqn)
    style = STYLES.get(type(original).__name__)
    if style is None:
        raise NotImplementedError(f"{fqn}: no reference cross-attention for {type(original).__name__}")
    parent, _, leaf = fqn.rpartition(".")
    setattr(model.get_submodule(parent), leaf, ReferenceCrossAttention(original, style, kv))
