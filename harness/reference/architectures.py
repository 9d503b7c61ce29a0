"""What the reference needs to know about each architecture: its transformers class, which
projections form fused groups, and which attention modules are cross-attention."""
from dataclasses import dataclass

from torch import nn

# Attribute names under which the supported models keep their cross-attention.
CROSS_ATTENTION = ("encoder_attn", "cross_attn")


@dataclass(frozen=True)
class GroupRule:
    kind: str
    shards: tuple[str, ...]
    cross_attention: bool | None = None  # None: any parent


GROUP_RULES = (
    GroupRule("qkv", ("q_proj", "k_proj", "v_proj"), cross_attention=False),
    # q comes from the decoder states and k, v from the encoder states: only k and v can fuse.
    GroupRule("cross-kv", ("k_proj", "v_proj"), cross_attention=True),
    GroupRule("gate-up", ("gate_proj", "up_proj")),
)


def is_cross_attention(fqn: str) -> bool:
    return fqn.rsplit(".", 1)[-1] in CROSS_ATTENTION


def fusion_groups(model: nn.Module) -> list[tuple[str, GroupRule]]:
    """(parent FQN, rule) for every module whose children form a fusable group."""
    found = []
    for name, module in model.named_modules():
        children = dict(module.named_children())
        for rule in GROUP_RULES:
            if rule.cross_attention is not None and rule.cross_attention != is_cross_attention(name):
                continue
            if all(isinstance(children.get(s), nn.Linear) for s in rule.shards):
                found.append((name, rule))
    return found


def attention_modules(model: nn.Module) -> list[str]:
    """FQNs of modules that hold q/k/v projections: where KV-cache scales attach."""
    return [name for name, module in model.named_modules()
            if all(hasattr(module, p) for p in ("q_proj", "k_proj", "v_proj"))]


# Attention modules that run without a KV cache in an engine: encoder and vision-tower attention.
# An fp8 KV-cache scheme does not reach them, so a missing scale there falls back to nothing.
UNCACHED_ATTENTION = ("model.encoder.", "model.vision_model.", "model.visual.")


def uses_kv_cache(fqn: str) -> bool:
    return not fqn.startswith(UNCACHED_ATTENTION)
