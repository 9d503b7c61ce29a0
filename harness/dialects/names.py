"""Module-name spelling: checkpoint, memory (transformers 5.19) and vLLM.

- *memory*: transformers 5.19's in-memory module names (``model.language_model.layers.0...``).
- *checkpoint*: the names transformers 5.19 writes to disk (``language_model.model.layers.0...``
  for Mllama, ``model.layers.0...`` for Qwen2.5-VL).
- *vLLM*: vLLM's own module prefixes, with fused shards (``...self_attn.qkv_proj``).

``to_memory``, ``to_checkpoint``, ``to_vllm``, ``normalise_entry`` and ``vllm_rename_entry`` move
between them. Module names and tensor names both work. The per-architecture rules are data in
``harness.architectures`` (docs/design.md); this module only applies them.
"""
from __future__ import annotations

import re

from harness import architectures
from harness.architectures import Architecture


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _swap(name: str, old: str, new: str) -> str:
    return new + name[len(old):]


def _longest_first(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return sorted(dict.fromkeys(pairs), key=lambda p: -len(p[0]))


def _load_renames(spec: Architecture) -> list[tuple[str, str]]:
    """(checkpoint prefix, memory prefix) pairs that transformers renames when loading."""
    return _longest_first([(c, m) for m, c in spec.checkpoint_prefixes] + list(spec.legacy_prefixes))


def _memory_prefixes(spec: Architecture) -> tuple[str, ...]:
    return tuple(dict.fromkeys([m for m, _ in spec.checkpoint_prefixes] + [m for _, m in spec.legacy_prefixes]
                               + [m for _, m in spec.entry_prefixes]))


def to_memory(name: str, arch: str | None) -> str:
    """Checkpoint spelling -> transformers 5.19 in-memory spelling, as the loader's conversion
    mapping renames it (the inverse of the architecture's ``checkpoint_prefixes`` plus its
    ``legacy_prefixes``; Llama, Whisper and Bart: identity). A name that already starts with a
    memory prefix passes through; so transformers renames a bare Qwen2.5-VL ``model`` to
    ``model.language_model`` but leaves ``model.visual...`` alone."""
    spec = architectures.get(arch)
    if spec is None or name.startswith(tuple(m for m, _ in spec.checkpoint_prefixes)):
        return name
    for ckpt, mem in _load_renames(spec):
        if _under(name, ckpt):
            return _swap(name, ckpt, mem)
    return name


def to_checkpoint(name: str, arch: str | None) -> str:
    """transformers 5.19 in-memory spelling -> the spelling ``save_pretrained`` writes
    (``core_model_loading.revert_weight_conversion``). The inverse of ``to_memory`` on in-memory
    names."""
    spec = architectures.get(arch)
    for mem, ckpt in spec.checkpoint_prefixes if spec is not None else ():
        if _under(name, mem):
            return _swap(name, mem, ckpt)
    return name


def _regex_prefix(body: str, literal: str) -> int | None:
    """Length of ``body``'s leading regex that spells ``literal`` (dots escaped or not), ending
    at a component boundary (``\\.``, ``.``, ``$`` or the end); None if it does not."""
    for spelling in (re.escape(literal), literal):
        if body.startswith(spelling):
            rest = body[len(spelling):]
            if rest == "" or rest.startswith(("\\.", ".", "$")):
                return len(spelling)
    return None


def _normalise_regex(entry: str, spec: Architecture, pairs: list[tuple[str, str]]) -> tuple[str, ...]:
    body = entry[3:]
    anchor = ""
    if body.startswith("^"):
        anchor, body = "^", body[1:]
    if any(_regex_prefix(body, mem) is not None for mem in _memory_prefixes(spec)):
        return (entry,)
    for spelling, mem in pairs:
        n = _regex_prefix(body, spelling)
        if n is None:
            continue
        if _under(mem, spelling) and body[n:] in ("", "$"):
            return (entry,)  # the bare prefix is itself an in-memory module: ambiguous
        return ("re:" + anchor + re.escape(mem) + body[n:],)
    return (entry,)


def normalise_entry(entry: str, arch: str | None) -> tuple[str, ...]:
    """A skip entry in any spelling -> the entries that name the same modules in memory spelling.

    Accepts checkpoint spelling, memory spelling and the architecture's ``entry_prefixes``
    (unsloth's ``language_model.model.``), for plain entries and for ``re:`` entries whose regex
    begins with a literal prefix (``re:language_model\\.model\\.layers\\..*``). Usually one entry
    comes back; a checkpoint prefix that on disk also holds other prefixes gives one entry for
    each (Mllama's bare ``language_model`` also covers ``language_model.lm_head``). A bare prefix
    that is itself an in-memory module (Qwen2.5-VL's ``model``) is left as written: the spelling
    is ambiguous. Regexes that do not start with a literal prefix are returned unchanged. The
    dialect's semantics are kept: only the spelling changes.
    """
    spec = architectures.get(arch)
    if spec is None:
        return (entry,)
    pairs = _longest_first(_load_renames(spec) + list(spec.entry_prefixes))
    if entry.startswith("re:"):
        return _normalise_regex(entry, spec, pairs)
    if any(_under(entry, m) for m in _memory_prefixes(spec)) or any(
            entry == s and _under(m, s) for s, m in pairs):
        return (entry,)
    own = [m for s, m in pairs if s == entry]
    inner = [m for s, m in pairs if s.startswith(entry + ".")]
    if own and inner:
        return tuple(dict.fromkeys(own + [m for m in inner if not _under(m, own[0])]))
    for spelling, mem in spec.entry_prefixes:
        if _under(entry, spelling):
            return (_swap(entry, spelling, mem),)
    return (to_memory(entry, arch),)


def _vllm_spec(arch: str | None) -> Architecture:
    spec = architectures.get(arch)
    if spec is None or spec.vllm_packed_modules is None:
        modelled = sorted(a.name for a in architectures.ARCHITECTURES if a.vllm_packed_modules is not None)
        raise KeyError(f"vLLM 0.32 names are modelled for {modelled}, not {architectures.canonical(arch)!r}")
    return spec


def _vllm_renamed(key: str, spec: Architecture | None) -> str:
    for old, new in spec.vllm_substring_renames if spec else ():
        if old in key:
            key = key.replace(old, new, 1)
    for old, new in spec.vllm_prefix_renames if spec else ():
        if key.startswith(old):
            key = key.replace(old, new, 1)
    return key


def vllm_rename_entry(entry: str, arch: str | None) -> str:
    """What vLLM 0.32 makes of a skip entry with ``quant_config.apply_vllm_mapper(
    hf_to_vllm_mapper.get_rename_mapper())``: substring renames, then prefix renames, each
    applied in order to the bare entry. Used by ``Fp8Config`` (every ``ignored_layers`` entry) and
    ``CompressedTensorsConfig`` (only entries containing ``.`` and not starting with ``re:``);
    ``TorchAOConfig`` and the bnb plugin do not remap. Module entries carry no trailing ``.``, so
    Whisper's ``.fc1.`` rename never fires on ``...layers.0.fc1`` (vLLM names it ``...mlp.fc1``),
    nor Qwen2.5-VL's ``lm_head.`` rename on ``lm_head``."""
    return _vllm_renamed(entry, architectures.get(arch))


def to_vllm(name: str, arch: str | None) -> str:
    """An HF module name (memory or checkpoint spelling) -> the prefix of the vLLM 0.32 module that
    holds it, fused shards included (``...self_attn.q_proj`` -> ``...self_attn.qkv_proj``;
    Whisper ``encoder_attn.k_proj`` -> ``encoder_attn.kv_proj``, ``fc1`` -> ``mlp.fc1``;
    Qwen2.5-VL ``model.language_model.`` -> ``language_model.model.``, ``model.visual.`` ->
    ``visual.``, ``lm_head`` -> ``language_model.lm_head``). Mirrors ``hf_to_vllm_mapper`` applied
    to ``name + ".weight"`` plus the models' ``stacked_params_mapping``. KeyError for an
    architecture whose vLLM names are not modelled."""
    spec = _vllm_spec(arch)
    prefix = _vllm_renamed(to_memory(name, spec.name) + ".weight", spec).removesuffix(".weight")
    packed = spec.vllm_packed_modules
    parent, _, leaf = prefix.rpartition(".")
    parent_leaf = parent.rpartition(".")[2]
    if parent_leaf == "encoder_attn" and leaf in ("k_proj", "v_proj") and "kv_proj" in packed:
        return f"{parent}.kv_proj"
    if parent_leaf == "self_attn" and leaf in ("q_proj", "k_proj", "v_proj"):
        return f"{parent}.qkv_proj"
    if parent_leaf == "mlp" and leaf in ("gate_proj", "up_proj") and "gate_up_proj" in packed:
        return f"{parent}.gate_up_proj"
    return prefix
