"""The architecture registry: everything the harness knows about each supported model class, once.

One ``Architecture`` per model class in ``ARCHITECTURES``. Adding an architecture means adding one
entry here (and, for a tiny fixture, a recipe in ``harness/fixtures/models.py`` under the entry's
``fixture`` name). Everything else reads this module:

- ``harness.matrix``: the ``arch`` values models.yaml accepts (``HF_CLASSES``);
- ``harness.dialects.names``: checkpoint <-> memory <-> vLLM spelling (``checkpoint_prefixes``,
  ``legacy_prefixes``, ``entry_prefixes``, ``vllm_prefix_renames``, ``vllm_substring_renames``);
- the skip dialects: vLLM's fused modules (``vllm_packed_modules``);
- the reference loader: fusion groups (``GROUP_RULES``), cross-attention (``cross_attention``),
  attention without a KV cache (``uncached_attention``);
- the fixtures: the recipe name, the transformers class, the checkpoint prefixes;
- the vLLM engine (``modality``, ``vllm_needs``) and the pipeline generator (``vllm_sources``,
  ``transformers_sources``).

Nothing here imports torch at import time: models.yaml validation reads this module. See
docs/design.md for why each kind of knowledge has one home.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Pairs = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class GroupRule:
    """Sibling projections that an engine fuses into one matmul."""

    kind: str
    shards: tuple[str, ...]
    cross_attention: bool | None = None  # None: any parent


# The fusion groups, for every architecture (they are found by attribute name, not per model):
# self-attention q/k/v, cross-attention k/v (q comes from the decoder states and k, v from the
# encoder states: only k and v can fuse), MLP gate/up.
GROUP_RULES = (
    GroupRule("qkv", ("q_proj", "k_proj", "v_proj"), cross_attention=False),
    GroupRule("cross-kv", ("k_proj", "v_proj"), cross_attention=True),
    GroupRule("gate-up", ("gate_proj", "up_proj")),
)


@dataclass(frozen=True)
class CrossAttentionStyle:
    """How one architecture's cross-attention differs from the others (harness.reference.cross_attention)."""

    encoder_kwarg: str  # the forward keyword that carries the encoder states
    output: str  # the output projection's attribute
    prescale_query: bool = False  # Whisper scales q before attention and passes scaling=1.0
    norms: bool = False  # Mllama normalises q and k per head
    kv_heads_attr: str = "num_heads"
    encoder_decoder_cache: bool = True  # EncoderDecoderCache (Whisper, Bart) or a plain cache (Mllama)


@dataclass(frozen=True)
class CrossAttention:
    attr: str  # the attribute under which a decoder layer keeps its cross-attention
    module_class: str  # the transformers class of that module
    style: CrossAttentionStyle


@dataclass(frozen=True)
class Architecture:
    """One supported model class.

    Spellings of module names (docs/design.md): *memory* is transformers 5.19's in-memory name,
    *checkpoint* what its ``save_pretrained`` writes, *vLLM* vLLM 0.32's module prefix.

    - ``checkpoint_prefixes``: (memory prefix, checkpoint prefix) pairs, as ``save_pretrained``
      reverts the conversion mapping; empty when the two spellings are the same.
    - ``legacy_prefixes``: (checkpoint prefix, memory prefix) pairs that transformers' conversion
      mapping also renames when loading, beyond the inverse of ``checkpoint_prefixes``.
    - ``entry_prefixes``: (spelling, memory prefix) pairs seen only in skip entries (unsloth, which
      wrote with transformers < 4.52, or vLLM's own spelling).
    - ``vllm_packed_modules``: vLLM 0.32's ``packed_modules_mapping`` of the class; None when vLLM's
      names are not modelled (the class is not in vLLM 0.32).
    - ``vllm_prefix_renames`` / ``vllm_substring_renames``: the rename-only part of the class's
      ``hf_to_vllm_mapper`` (``WeightsMapper.get_rename_mapper()``), in order.
    """

    name: str  # canonical short name: the model_type, and the fixture recipe's model name
    hf_class: str  # the transformers class (models.yaml ``arch``, config.json ``architectures``)
    aliases: tuple[str, ...] = ()  # further spellings ``canonical`` accepts (lower case)
    modality: str = "text"  # "text", "audio" or "image": what the prompts carry besides text
    fixture: str | None = None  # the recipe name in harness/fixtures/models.py (None: no fixture)
    checkpoint_prefixes: Pairs = ()
    legacy_prefixes: Pairs = ()
    entry_prefixes: Pairs = ()
    cross_attention: CrossAttention | None = None
    uncached_attention: tuple[str, ...] = ()  # memory prefixes of attention run without a KV cache
    vllm_packed_modules: Mapping[str, list[str]] | None = None
    vllm_prefix_renames: Pairs = ()
    vllm_substring_renames: Pairs = ()
    vllm_needs: tuple[str, ...] = ()  # Python modules vLLM needs for it beyond its own requirements
    vllm_sources: tuple[str, ...] = ()  # module stems under vllm/model_executor/models/
    transformers_sources: tuple[str, ...] = ()  # dirs under src/transformers/models/


_QKV = ["q_proj", "k_proj", "v_proj"]
_GATE_UP = ["gate_proj", "up_proj"]

ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture(
        name="llama",
        hf_class="LlamaForCausalLM",
        fixture="llama",
        vllm_packed_modules={"qkv_proj": _QKV, "gate_up_proj": _GATE_UP},
        vllm_sources=("llama",),
        transformers_sources=("llama",),
    ),
    Architecture(
        name="whisper",
        hf_class="WhisperForConditionalGeneration",
        modality="audio",
        fixture="whisper",
        cross_attention=CrossAttention(
            "encoder_attn", "WhisperAttention", CrossAttentionStyle("key_value_states", "out_proj", prescale_query=True)),
        uncached_attention=("model.encoder.",),
        vllm_packed_modules={"qkv_proj": _QKV, "kv_proj": ["k_proj", "v_proj"]},
        vllm_substring_renames=((".fc1.", ".mlp.fc1."), (".fc2.", ".mlp.fc2.")),
        vllm_sources=("whisper",),
        transformers_sources=("whisper",),
    ),
    Architecture(
        name="mllama",
        hf_class="MllamaForConditionalGeneration",
        modality="image",
        fixture="mllama",
        # conversion_mapping.py: "mllama", plus "LlavaModel" scoped to ``model``.
        checkpoint_prefixes=(
            ("model.language_model", "language_model.model"),
            ("lm_head", "language_model.lm_head"),
            ("model.vision_model", "vision_model"),
            ("model.multi_modal_projector", "multi_modal_projector"),
        ),
        legacy_prefixes=(("language_model", "model.language_model"),),
        cross_attention=CrossAttention("cross_attn", "MllamaTextCrossAttention", CrossAttentionStyle(
            "cross_attention_states", "o_proj", norms=True, kv_heads_attr="num_key_value_heads",
            encoder_decoder_cache=False)),
        uncached_attention=("model.vision_model.",),
        # Mllama is not in vLLM 0.32 (last in 0.10.2): its vLLM names are not modelled.
        vllm_sources=("mllama",),
        transformers_sources=("mllama",),
    ),
    Architecture(
        name="qwen2_5_vl",
        hf_class="Qwen2_5_VLForConditionalGeneration",
        aliases=("qwen2.5-vl",),
        modality="image",
        fixture="qwen2_5_vl",
        # conversion_mapping.py: "Qwen2VLForConditionalGeneration".
        checkpoint_prefixes=(("model.language_model", "model"), ("model.visual", "visual")),
        entry_prefixes=(("language_model.lm_head", "lm_head"), ("language_model.model", "model.language_model")),
        uncached_attention=("model.visual.",),
        vllm_packed_modules={"qkv_proj": _QKV, "gate_up_proj": _GATE_UP, "qkv": ["qkv"]},
        vllm_prefix_renames=(
            ("model.language_model.", "language_model.model."),
            ("model.visual.", "visual."),
            ("lm_head.", "language_model.lm_head."),
            ("model.", "language_model.model."),
        ),
        vllm_needs=("torchvision",),  # its Qwen2-VL processing imports transformers' image processor
        vllm_sources=("qwen2_5_vl", "qwen2_vl", "qwen2"),
        transformers_sources=("qwen2_5_vl", "qwen2_vl"),
    ),
    Architecture(
        name="bart",
        hf_class="BartForConditionalGeneration",
        fixture="bart",
        cross_attention=CrossAttention("encoder_attn", "BartAttention", CrossAttentionStyle("key_value_states", "out_proj")),
        uncached_attention=("model.encoder.",),
        vllm_sources=("bart",),
        transformers_sources=("bart",),
    ),
)

HF_CLASSES: tuple[str, ...] = tuple(a.hf_class for a in ARCHITECTURES)
BY_NAME: dict[str, Architecture] = {a.name: a for a in ARCHITECTURES}
_ALIASES: dict[str, Architecture] = {
    alias: a for a in ARCHITECTURES for alias in (a.name, a.hf_class.lower(), *a.aliases)
}


def _unique(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


# Attribute names under which the supported models keep their cross-attention.
CROSS_ATTENTION: tuple[str, ...] = _unique(a.cross_attention.attr for a in ARCHITECTURES if a.cross_attention)
# Cross-attention modules the reference replaces, by transformers class name.
CROSS_ATTENTION_STYLES: dict[str, CrossAttentionStyle] = {
    a.cross_attention.module_class: a.cross_attention.style for a in ARCHITECTURES if a.cross_attention
}
# Attention modules that run without a KV cache in an engine: encoder and vision-tower attention.
# An fp8 KV-cache scheme does not reach them, so a missing scale there falls back to nothing.
UNCACHED_ATTENTION: tuple[str, ...] = _unique(p for a in ARCHITECTURES for p in a.uncached_attention)


def get(arch: str | None) -> Architecture | None:
    """The entry for a model_type, a transformers class name or an alias (any case); None if unknown."""
    return None if arch is None else _ALIASES.get(arch.lower())


def canonical(arch: str | None) -> str | None:
    """``model_type`` or class name -> the registry's short name; anything else lower-cased."""
    if arch is None:
        return None
    found = get(arch)
    return found.name if found is not None else arch.lower()


# ---------------------------------------------------------------------------------------------
# The module tree: fusion groups and attention modules (torch imported only when called)
# ---------------------------------------------------------------------------------------------


def is_cross_attention(fqn: str) -> bool:
    return fqn.rsplit(".", 1)[-1] in CROSS_ATTENTION


def _rules_for(parent: str, leaves: Iterable[str]) -> list[GroupRule]:
    leaves = set(leaves)
    cross = is_cross_attention(parent)
    return [rule for rule in GROUP_RULES
            if (rule.cross_attention is None or rule.cross_attention == cross) and all(s in leaves for s in rule.shards)]


def fusion_groups(model: Any) -> list[tuple[str, GroupRule]]:
    """(parent FQN, rule) for every module whose ``nn.Linear`` children form a fusable group."""
    from torch import nn

    found = []
    for name, module in model.named_modules():
        linears = [child for child, m in module.named_children() if isinstance(m, nn.Linear)]
        found.extend((name, rule) for rule in _rules_for(name, linears))
    return found


def fusion_groups_by_name(names: Sequence[str]) -> list[tuple[str, ...]]:
    """The same groups over module names (quantizable leaves), as tuples of shard names, parents sorted."""
    by_parent: dict[str, set[str]] = {}
    for n in names:
        parent, _, leaf = n.rpartition(".")
        by_parent.setdefault(parent, set()).add(leaf)
    return [tuple(f"{parent}.{s}" if parent else s for s in rule.shards)
            for parent, leaves in sorted(by_parent.items()) for rule in _rules_for(parent, leaves)]


def attention_modules(model: Any) -> list[str]:
    """FQNs of modules that hold q/k/v projections: where KV-cache scales attach."""
    return [name for name, module in model.named_modules()
            if all(hasattr(module, p) for p in ("q_proj", "k_proj", "v_proj"))]


def uses_kv_cache(fqn: str) -> bool:
    return not fqn.startswith(UNCACHED_ATTENTION)
