"""Skip rules: one module that knows every skip-list dialect.

The libraries do not agree on what a skip entry means. Each dialect below is written the way its
owner writes it (the owner's function is named in each docstring, with the version it was read
from), and ``tests/test_skip_dialects.py`` checks every one against the owner's own code. None of
those libraries is imported here: they are the oracles, not the implementation.

Dialects (the strings are the values of ``SkipPolicy.dialect`` and ``Disagreement.dialect``):

=========================  ======================================================================
``transformers``           transformers 5.19 ``should_convert_module`` on module names
                           (``llm_int8_skip_modules`` for bitsandbytes), with the default list of
                           ``HfQuantizer.get_modules_to_not_convert``.
``transformers-torchao``   transformers 5.19 ``TorchAoHfQuantizer``: ``should_convert_module`` on
                           the *parameter* name, then ``FqnToConfig`` as ``TorchAoQuantize.convert``
                           resolves it.
``transformers-fp8``       transformers 5.19 ``FineGrainedFP8HfQuantizer``: entries renamed through
                           the checkpoint conversion mapping, then ``should_convert_module``.
``torchao``                torchao 0.18 ``quantize_(model, FqnToConfig)``.
``compressed-tensors``     compressed-tensors 0.17 ``apply_quantization_config``.
``vllm-fp8``               vLLM 0.32 ``Fp8Config`` / ``is_layer_skipped`` (exact names, fused shards).
``vllm-torchao``           vLLM 0.32 ``TorchAOConfig`` (dot-bounded substring, ``should_skip``).
``vllm-compressed-tensors``  vLLM 0.32 ``CompressedTensorsConfig.get_scheme_dict``.
``vllm-bnb``               vllm-bnb-plugin 0.0.3 ``is_layer_skipped_bnb``.
=========================  ======================================================================

Names. Every function here takes module names in one spelling and says which:

- *memory*: transformers 5.19's in-memory module names (``model.language_model.layers.0...``).
- *checkpoint*: the names transformers 5.19 writes to disk (``language_model.model.layers.0...``
  for Mllama, ``model.layers.0...`` for Qwen2.5-VL).
- *vLLM*: vLLM's own module prefixes, with fused shards (``...self_attn.qkv_proj``).

``to_memory``, ``to_checkpoint``, ``to_vllm``, ``normalise_entry`` and ``vllm_rename_entry`` move
between them.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatch
from typing import Any

from harness.errors import CheckpointError

TRANSFORMERS = "transformers"
TRANSFORMERS_TORCHAO = "transformers-torchao"
TRANSFORMERS_FP8 = "transformers-fp8"
TORCHAO = "torchao"
COMPRESSED_TENSORS = "compressed-tensors"
VLLM_FP8 = "vllm-fp8"
VLLM_TORCHAO = "vllm-torchao"
VLLM_COMPRESSED_TENSORS = "vllm-compressed-tensors"
VLLM_BNB = "vllm-bnb"
DIALECTS = (
    TRANSFORMERS,
    TRANSFORMERS_TORCHAO,
    TRANSFORMERS_FP8,
    TORCHAO,
    COMPRESSED_TENSORS,
    VLLM_FP8,
    VLLM_TORCHAO,
    VLLM_COMPRESSED_TENSORS,
    VLLM_BNB,
)
VLLM_DIALECTS = (VLLM_FP8, VLLM_TORCHAO, VLLM_COMPRESSED_TENSORS, VLLM_BNB)

# The dialect in which each quant_method's producer wrote its skip list.
PRODUCER_DIALECT = {
    "bitsandbytes": TRANSFORMERS,
    "torchao": TRANSFORMERS_TORCHAO,
    "compressed-tensors": COMPRESSED_TENSORS,
    "fp8": VLLM_FP8,
}
# The dialect in which vLLM 0.32 (plus vllm-bnb-plugin) reads each quant_method.
VLLM_DIALECT = {
    "bitsandbytes": VLLM_BNB,
    "torchao": VLLM_TORCHAO,
    "compressed-tensors": VLLM_COMPRESSED_TENSORS,
    "fp8": VLLM_FP8,
}


# ---------------------------------------------------------------------------------------------
# transformers 5.19
# ---------------------------------------------------------------------------------------------


def transformers_key_matches(name: str, key: str) -> bool:
    """One key of transformers 5.19 ``quantizers_utils.should_convert_module``.

    ``re.match(f"{key}\\.", name) or re.match(f"{key}", name) or name.endswith(key)``: the key is a
    regex anchored at the start only (so ``model.layers.1`` matches ``model.layers.11`` and every
    ``.`` is a wildcard), or a plain suffix without a dot boundary (``proj`` matches ``q_proj``).
    The first clause is implied by the second; it is kept to mirror the source. An invalid regex
    raises ``re.error``, as it does inside transformers.
    """
    return bool(re.match(f"{key}\\.", name) or re.match(f"{key}", name) or name.endswith(key))


def transformers_should_convert(name: str, patterns: Sequence[str] | None) -> bool:
    """transformers 5.19 ``should_convert_module(full_name, patterns)``, exactly: True means quantize.

    ``patterns=None`` converts everything. Callers pass module names (bitsandbytes' and FP8's
    ``replace_with_*_linear``) or parameter names (``TorchAoHfQuantizer.param_needs_quantization``
    passes ``...q_proj.weight``, so there a suffix key ``fc1`` no longer matches).
    """
    if patterns is None:
        return True
    return not any(transformers_key_matches(name, key) for key in patterns)


def transformers_skip_keys(
    skip_modules: Sequence[str] | None,
    default_keys: Sequence[str] = ("lm_head",),
    keep_in_fp32_modules: Sequence[str] | None = None,
    add_default_skips: bool = False,
) -> list[str]:
    """transformers 5.19 ``HfQuantizer.get_modules_to_not_convert``: the keys a quantizer skips.

    A user list *replaces* the defaults unless ``add_default_skips`` (only AWQ sets it): with
    ``skip_modules=[]`` or ``["model.visual"]`` the ``lm_head`` is quantized. Only ``None`` (JSON
    ``null``) brings in ``default_keys``, which transformers computes from the model with
    ``get_keys_to_not_convert`` (see ``transformers_default_skip_keys``). ``_keep_in_fp32_modules``
    is always added. Returned sorted (transformers returns ``list(set(...))``; order never matters
    to ``should_convert_module``).
    """
    keys: list[str] = list(default_keys) if (skip_modules is None or add_default_skips) else []
    if skip_modules is not None:
        keys.extend(skip_modules)
    if keep_in_fp32_modules is not None:
        keys.extend(keep_in_fp32_modules)
    return sorted(set(keys))


def transformers_default_skip_keys(model: Any) -> list[str]:
    """transformers 5.19 ``quantizers.base.get_keys_to_not_convert(model)``, duck-typed.

    The union of the tied-weight keys (both sides of ``model.all_tied_weights_keys``), the module
    of the last parameter, and the output-embedding module, each with ``.weight`` removed.
    Returned sorted.
    """
    tied: set[str] = set()
    tied_map = getattr(model, "all_tied_weights_keys", None) or {}
    if len(tied_map) > 0:
        tied = set(tied_map.values()) | set(tied_map.keys())
    last = {list(model.named_parameters())[-1][0]}
    output_emb = model.get_output_embeddings()
    output_keys = {name for name, module in model.named_modules() if output_emb is not None and module is output_emb}
    return sorted({k.removesuffix(".weight") for k in tied | last | output_keys})


# ---------------------------------------------------------------------------------------------
# torchao 0.18 FqnToConfig, as torchao, transformers and vLLM each resolve it
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FqnResolution:
    """Which ``FqnToConfig`` entry decides one weight.

    ``key`` is the entry (``"_default"`` for the default, ``None`` when no entry applies),
    ``config`` its value. ``config is None`` means the weight stays unquantized, whether an entry
    said ``None`` (``key`` set) or nothing matched (``key`` None, ``how == "unmatched"``).
    ``how`` is ``param`` / ``module`` (exact FQN), ``param-regex`` / ``module-regex``, ``default``,
    ``unmatched``, ``untouched`` (torchao: another parameter of the module matched, so neither the
    module entries nor the default apply) or ``skip_modules`` (vLLM's dot-bounded skip list).
    ``also`` lists further keys that torchao *also* applies to the same weight (every matching
    parameter regex is applied in turn, not just the first).
    """

    key: str | None
    config: Any
    how: str
    also: tuple[str, ...] = ()

    @property
    def skipped(self) -> bool:
        return self.config is None


def _module_regex_or_default(fqn_to_config: Mapping[str, Any], module_fqn: str) -> FqnResolution:
    """The first ``re:`` key matching the whole module name, else ``_default``, else unmatched:
    the tail of the lookup that torchao and vLLM's torchao config share."""
    for pattern in fqn_to_config:
        if pattern.startswith("re:") and re.fullmatch(pattern[3:], module_fqn):
            return FqnResolution(pattern, fqn_to_config[pattern], "module-regex")
    if fqn_to_config.get("_default") is not None:
        return FqnResolution("_default", fqn_to_config["_default"], "default")
    return FqnResolution(None, None, "unmatched")


def torchao_fqn_matches(fqn: str, fqn_to_config: Mapping[str, Any]) -> bool:
    """torchao 0.18 ``quant_api.fqn_matches_fqn_config``: an exact key, or any ``re:`` key that
    ``re.fullmatch``-es ``fqn``. ``None`` entries match too; ``_default`` is an ordinary key here."""
    if fqn in fqn_to_config:
        if fqn.startswith("re:"):
            raise AssertionError(f"Error: Exact match but regex {fqn} specified.")
        return True
    return any(p.startswith("re:") and re.fullmatch(p[3:], fqn) for p in fqn_to_config)


def torchao_resolve(
    fqn_to_config: Mapping[str, Any],
    module_fqn: str,
    param: str = "weight",
    param_names: Sequence[str] = ("weight",),
    is_linear: bool = True,
) -> FqnResolution:
    """torchao 0.18 ``quantize_(model, FqnToConfig(...))`` for one parameter of one module.

    Mirrors the gate in ``quantize_`` (``fqn_matches_fqn_config`` on the module or one of its
    top-level parameters, or ``_default`` and ``_is_linear``) and then ``_fqn_to_config_handler``:

    1. exact parameter FQN (``...q_proj.weight``); a ``None`` there removes that parameter from
       the regex pass;
    2. only if no parameter matched exactly: exact module FQN;
    3. parameter regexes, ``re.fullmatch``: *every* matching key is applied in order, not the first;
    4. only if no parameter matched at all: the first module regex, in dict order, that fully matches;
    5. only if no parameter matched at all: ``_default``.

    ``param_names`` are the module's top-level parameters in ``named_parameters()`` order (a biased
    Linear has ``("weight", "bias")``). torchao's ``top_level_params.pop(i)`` uses the index over
    all parameters, so two exact ``None`` parameter entries on one module raise ``IndexError`` in
    torchao; this mirror removes the right one instead.

    Dict order matters (steps 3, 4). transformers writes ``config.json`` with ``sort_keys=True``, so
    after a save/load the order of ``re:`` keys is alphabetical, not the order the producer wrote.
    """
    cfg = fqn_to_config

    def pfqn(p: str) -> str:
        return f"{module_fqn}.{p}" if module_fqn else p

    gated = (
        torchao_fqn_matches(module_fqn, cfg)
        or any(torchao_fqn_matches(pfqn(p), cfg) for p in param_names)
        or ("_default" in cfg and is_linear)
    )
    if not gated:
        return FqnResolution(None, None, "unmatched")

    param_found = False
    applied: dict[str, list[tuple[str, str]]] = {p: [] for p in param_names}
    none_keys: dict[str, list[tuple[str, str]]] = {p: [] for p in param_names}
    remaining = list(param_names)
    for p in param_names:
        if pfqn(p) in cfg:
            param_found = True
            if cfg[pfqn(p)] is None:
                remaining.remove(p)
                none_keys[p].append((pfqn(p), "param"))
            else:
                applied[p].append((pfqn(p), "param"))

    if not param_found and module_fqn in cfg:
        return FqnResolution(module_fqn, cfg[module_fqn], "module")

    for p in remaining:
        for pattern in cfg:
            if pattern.startswith("re:") and re.fullmatch(pattern[3:], pfqn(p)):
                param_found = True
                if cfg[pattern] is not None:
                    applied[p].append((pattern, "param-regex"))
                else:
                    none_keys[p].append((pattern, "param-regex"))

    if not param_found:
        return _module_regex_or_default(cfg, module_fqn)

    if param not in applied:
        return FqnResolution(None, None, "untouched")
    if applied[param]:
        (key, how), *rest = applied[param]
        return FqnResolution(key, cfg[key], how, tuple(k for k, _ in rest))
    if none_keys[param]:
        key, how = none_keys[param][0]
        return FqnResolution(key, None, how)
    return FqnResolution(None, None, "untouched")


def transformers_torchao_resolve(fqn_to_config: Mapping[str, Any], param_fqn: str) -> FqnResolution:
    """transformers 5.19 ``integrations.torchao.TorchAoQuantize.convert`` for one parameter.

    Exact parameter FQN, else exact module FQN, else the first ``re:`` key in dict order that
    fully matches the parameter *or* the module (one pass, interleaved: unlike torchao, a module
    regex listed before a parameter regex wins), else ``_default``. ``None`` means unquantized.
    """
    module_fqn, _ = param_fqn.rsplit(".", 1)
    cfg = fqn_to_config
    if param_fqn in cfg:
        return FqnResolution(param_fqn, cfg[param_fqn], "param")
    if module_fqn in cfg:
        return FqnResolution(module_fqn, cfg[module_fqn], "module")
    for pattern in cfg:
        if not pattern.startswith("re:"):
            continue
        if re.fullmatch(pattern[3:], param_fqn):
            return FqnResolution(pattern, cfg[pattern], "param-regex")
        if re.fullmatch(pattern[3:], module_fqn):
            return FqnResolution(pattern, cfg[pattern], "module-regex")
    if "_default" in cfg:
        return FqnResolution("_default", cfg["_default"], "default")
    return FqnResolution(None, None, "unmatched")


def torchao_quant_type(quantization_config: Mapping[str, Any]) -> tuple[str | None, dict | None]:
    """The torchao config that transformers 5.19 ``TorchAoConfig.to_dict`` wrote, as
    ``(type name, fqn_to_config dict or None)``.

    ``quant_type`` is ``{"default": {"_type": ..., "_version": ..., "_data": {...}}}``; for
    ``FqnToConfig`` (alias ``ModuleFqnToConfig``) ``_data`` holds both ``fqn_to_config`` and
    ``module_fqn_to_config`` (the same dict twice), values ``null`` or serialized configs.
    """
    qt = quantization_config.get("quant_type")
    if not isinstance(qt, Mapping) or "default" not in qt:
        return None, None
    default = qt["default"]
    if not isinstance(default, Mapping):
        return None, None
    type_name = default.get("_type")
    if type_name not in ("FqnToConfig", "ModuleFqnToConfig"):
        return type_name, None
    data = default.get("_data") or {}
    fqn = data.get("fqn_to_config") or data.get("module_fqn_to_config") or {}
    return type_name, dict(fqn)


def vllm_torchao_should_skip(prefix: str, skip_modules: Sequence[str]) -> bool:
    """vLLM 0.32 ``quantization/torchao.py`` ``should_skip``: equality, or ``.{s}.`` inside
    ``.{prefix}.`` (a dot-bounded substring of vLLM's own prefix). ``layers.1`` does not hit
    ``layers.11``; ``visual`` hits ``visual.blocks.0.attn.qkv``. Entries are never regexes: a
    ``re:`` key copied in from ``module_fqn_to_config`` matches nothing here."""
    for s in skip_modules:
        if prefix == s:
            return True
        if f".{s}." in f".{prefix}.":
            return True
    return False


def vllm_torchao_skip_modules(quantization_config: Mapping[str, Any]) -> list[str]:
    """vLLM 0.32 ``TorchAOConfig.from_config``: ``modules_to_not_convert`` plus every key whose
    value is ``None`` in ``quant_type.default._data.module_fqn_to_config`` (only that spelling; a
    config with only ``fqn_to_config`` contributes nothing), verbatim, ``re:`` keys included."""
    skip = list(quantization_config.get("modules_to_not_convert", []) or [])
    qt = quantization_config.get("quant_type") or {}
    default = qt.get("default", {}) if isinstance(qt, Mapping) else {}
    data = default.get("_data", {}) if isinstance(default, Mapping) else {}
    if not isinstance(data, dict):
        data = {}
    module_fqn = data.get("module_fqn_to_config", {})
    if not isinstance(module_fqn, dict):
        module_fqn = {}
    skip.extend(layer for layer, cfg in module_fqn.items() if cfg is None)
    return skip


def vllm_torchao_resolve(prefix: str, quantization_config: Mapping[str, Any], is_linear: bool = True) -> FqnResolution:
    """vLLM 0.32 ``TorchAOConfig.get_quant_method`` for a layer named ``prefix`` (vLLM spelling,
    fused: ``...self_attn.qkv_proj``).

    Not a ``LinearBase`` (``is_linear=False``, e.g. ``ParallelLMHead``): unquantized. Then
    ``should_skip`` over ``vllm_torchao_skip_modules``; then, for ``FqnToConfig``, exact module
    key, else first fully matching ``re:`` key, else ``_default``. There is no shard expansion and
    no parameter-level key: ``...q_proj: null`` does not reach vLLM's ``...qkv_proj``.
    """
    if not is_linear:
        return FqnResolution(None, None, "unmatched")
    skip = vllm_torchao_skip_modules(quantization_config)
    for s in skip:
        if vllm_torchao_should_skip(prefix, [s]):
            return FqnResolution(s, None, "skip_modules")
    type_name, fqn = torchao_quant_type(quantization_config)
    if fqn is None:
        return FqnResolution("default", (quantization_config.get("quant_type") or {}).get("default"), "default")
    if prefix in fqn:
        return FqnResolution(prefix, fqn[prefix], "module")
    return _module_regex_or_default(fqn, prefix)


# ---------------------------------------------------------------------------------------------
# compressed-tensors 0.17
# ---------------------------------------------------------------------------------------------

def module_class_names(module_class: Any) -> tuple[str, ...]:
    """The class names compressed-tensors' ``_match_class`` looks at: every ``torch.nn.Module``
    class in the MRO. A string ``"Linear"`` stands for ``torch.nn.Linear`` (``Linear``,
    ``Module``); any other string ``X`` for ``(X, "Module")``; a sequence is taken as given; a class
    is walked."""
    if isinstance(module_class, type):
        import torch

        return tuple(c.__name__ for c in module_class.__mro__ if issubclass(c, torch.nn.Module))
    if isinstance(module_class, str):
        return (module_class,) if module_class == "Module" else (module_class, "Module")
    return tuple(module_class)


def ct_match_name(name: str, target: str, fused: Mapping[str, Sequence[str]] | None = None) -> bool:
    """compressed-tensors 0.17 ``utils.match.match_name``.

    ``re:`` targets use ``re.match`` (anchored at the start, *not* a full match: ``re:.*layers.1``
    matches ``model.layers.11.mlp``); anything else is equality. With ``fused`` (vLLM names), the
    first fused suffix that ``name`` ends with (no dot boundary, dict order) is expanded and the
    name matches if *any* shard matches.
    """
    if fused is not None:
        for fused_suffix in fused:
            if name.endswith(fused_suffix):
                stripped = name.removesuffix(fused_suffix)
                return any(ct_match_name(stripped + shard, target) for shard in fused[fused_suffix])
    if target.startswith("re:"):
        return re.match(target.removeprefix("re:"), name) is not None
    return target == name


def ct_match_class(module_class: Any, target: str) -> bool:
    """compressed-tensors 0.17 ``utils.match._match_class``: any Module class in the MRO named
    exactly ``target``, or vLLM's ``LinearBase`` for ``Linear``. ``Module`` matches every module."""
    return any(c == target or (c == "LinearBase" and target == "Linear") for c in module_class_names(module_class))


def ct_is_match(
    name: str,
    module_class: Any,
    targets: str | Iterable[str],
    ignore: str | Iterable[str] = (),
    fused: Mapping[str, Sequence[str]] | None = None,
) -> bool:
    """compressed-tensors 0.17 ``utils.match.is_match``: some target matches the name or a class,
    and no ignore entry matches the name or a class (ignore entries may be class names too)."""
    targets = [targets] if isinstance(targets, str) else list(targets)
    ignore = [ignore] if isinstance(ignore, str) else list(ignore)
    return any(ct_match_name(name, t, fused) or ct_match_class(module_class, t) for t in targets) and not any(
        ct_match_name(name, i, fused) or ct_match_class(module_class, i) for i in ignore
    )


def ct_match_targets(name: str, module_class: Any, targets: Iterable[str] | None) -> list[str]:
    """compressed-tensors 0.17 ``utils.match.match_targets``: the matching targets, most specific
    first. Targets are sorted by ``("re:" in t, t)`` (plain strings alphabetically, then regexes
    *alphabetically*, not in config order); name matches come before class matches."""
    ordered = sorted(targets or [], key=lambda x: ("re:" in x, x))
    matched = [t for t in ordered if ct_match_name(name, t)]
    for t in ordered:
        if ct_match_class(module_class, t) and t not in matched:
            matched.append(t)
    return matched


@dataclass(frozen=True)
class CtResolution:
    """The config group compressed-tensors applies to a module, and the target that chose it."""

    group: str
    target: str
    scheme: Mapping[str, Any]

    @property
    def quantizes_weight(self) -> bool:
        return self.scheme.get("weights") is not None


def ct_resolve(
    name: str,
    module_class: Any,
    config_groups: Mapping[str, Mapping[str, Any]],
    ignore: Iterable[str] | None = None,
) -> CtResolution | None:
    """compressed-tensors 0.17 ``lifecycle.apply.apply_quantization_config`` for one module.

    ``target_to_scheme`` maps every target of every group (a later group that repeats a target
    takes it over); the module is in scope when ``match_named_modules`` yields it (some target
    matches by name or class and ``ignore`` does not); the scheme is that of the first target of
    ``match_targets``. ``None`` means compressed-tensors leaves the module alone: ignored, or no
    group targets it (it then never appears in ``ignore``).
    """
    target_to_group: dict[str, str] = {}
    for group_name, group in config_groups.items():
        for target in group.get("targets") or []:
            target_to_group[target] = group_name
    ignore = list(ignore or [])
    for target in target_to_group:
        if ct_is_match(name, module_class, target):
            if ct_is_match(name, module_class, ignore):
                return None
            break
    else:
        return None
    first = ct_match_targets(name, module_class, target_to_group)[0]
    group = target_to_group[first]
    return CtResolution(group, first, config_groups[group])


# ---------------------------------------------------------------------------------------------
# vLLM 0.32
# ---------------------------------------------------------------------------------------------


def vllm_is_equal_or_regex_match(value: str, target: str, check_contains: bool = False, use_fnmatch: bool = False) -> bool:
    """vLLM 0.32 ``quantization/utils/config_utils.is_equal_or_regex_match``: ``re:`` targets with
    ``re.match`` (vLLM uses the ``regex`` package; same semantics for these patterns); else, with
    ``check_contains``, a case-insensitive substring; else equality (or ``fnmatch``)."""
    if target.startswith("re:"):
        if re.match(target[3:], value):
            return True
    elif check_contains:
        if target.lower() in value.lower():
            return True
    elif target == value or use_fnmatch and fnmatch(value, target):
        return True
    return False


def vllm_find_matching_patterns(
    layer_name: str,
    patterns: Iterable[str],
    fused_mapping: Mapping[str, Sequence[str]] = {},
    use_fnmatch: bool = False,
) -> list[set[str]]:
    """vLLM 0.32 ``config_utils.find_matching_patterns``: patterns matching the layer itself win;
    otherwise one set per shard, the shards named by ``str.replace`` of the last component
    (every occurrence in the prefix, not only the last component)."""
    patterns = list(patterns)
    matches = [p for p in patterns if vllm_is_equal_or_regex_match(layer_name, p, use_fnmatch=use_fnmatch)]
    if matches:
        return [set(matches)]
    proj = layer_name.split(".")[-1]
    if proj not in fused_mapping:
        return [set()]
    shards = [layer_name.replace(proj, s) for s in fused_mapping[proj]]
    return [{p for p in patterns if vllm_is_equal_or_regex_match(s, p, use_fnmatch=use_fnmatch)} for s in shards]


def vllm_ct_should_ignore_layer(
    layer_name: str | None,
    ignore: Iterable[str] = (),
    fused_mapping: Mapping[str, Sequence[str]] = {},
    use_fnmatch: bool = False,
) -> bool:
    """vLLM 0.32 ``compressed_tensors/utils.should_ignore_layer``: names and ``re:`` only (class
    names in ``ignore`` are *not* honoured, unlike compressed-tensors); a fused layer is ignored
    iff all its shards are; some-but-not-all raises ``ValueError`` as vLLM does."""
    if layer_name is None:
        return False
    per_shard = vllm_find_matching_patterns(layer_name, ignore, fused_mapping, use_fnmatch=use_fnmatch)
    ignored = [len(m) > 0 for m in per_shard]
    if any(ignored) and not all(ignored):
        raise ValueError(
            f"Found different quantization schemes for the shards of {layer_name}. "
            "vLLM requires all to use the same scheme."
        )
    return all(ignored)


def vllm_ct_find_matched_target(
    layer_name: str | None,
    module_class_name: str,
    targets: Iterable[str],
    fused_mapping: Mapping[str, Sequence[str]] = {},
) -> str | None:
    """vLLM 0.32 ``compressed_tensors/utils.find_matched_target``.

    The first target *in config order* that equals or ``re.match``-es the layer name; else, for a
    fused layer (first fused key the name ends with), the target of the first shard when every
    shard matches some target; else the first target that is a case-insensitive *substring* of
    vLLM's class name (``Linear`` hits ``QKVParallelLinear``; ``ParallelLMHead`` has no
    ``linear``), or whose ``re:`` matches it.
    """
    targets = list(targets)
    layer_name = layer_name or ""

    def first(value: str, check_contains: bool = False) -> str | None:
        return next((t for t in targets if vllm_is_equal_or_regex_match(value, t, check_contains=check_contains)), None)

    def fused() -> str | None:
        key = next((k for k in fused_mapping if layer_name.endswith(k)), None)
        if key is None:
            return None
        found: list[str | None] = []
        for unfused in (layer_name.replace(key, s) for s in fused_mapping[key]):
            found.append(next((t for t in targets if vllm_is_equal_or_regex_match(unfused, t)), None))
        return found[0] if all(found) else None

    return first(layer_name) or fused() or first(module_class_name, True)


def vllm_ct_target_scheme_map(quantization_config: Mapping[str, Any]) -> dict[str, str]:
    """vLLM 0.32 ``CompressedTensorsConfig.from_config``: target -> group name, in first-seen order
    (a later group that repeats a target overwrites its scheme). Groups whose only target ends in
    ``Attention`` are dropped."""
    out: dict[str, str] = {}
    for group_name, group in (quantization_config.get("config_groups") or {}).items():
        targets = group.get("targets") or []
        if len(targets) == 1 and targets[0].endswith("Attention"):
            continue
        for target in targets:
            out[target] = group_name
    return out


def vllm_ct_resolve(
    prefix: str,
    module_class_name: str,
    quantization_config: Mapping[str, Any],
    fused_mapping: Mapping[str, Sequence[str]] = {},
    ignore: Sequence[str] | None = None,
    targets: Mapping[str, str] | None = None,
) -> tuple[str, str] | None:
    """vLLM 0.32 ``CompressedTensorsConfig.get_scheme_dict`` for a linear layer: ``(group,
    target)`` or ``None`` (ignored or untargeted; mixed shards raise). ``ignore``/``targets``
    default to the config's own; pass them already renamed by ``vllm_rename_entry`` to model
    ``apply_vllm_mapper``."""
    ignore = list(quantization_config.get("ignore") or []) if ignore is None else list(ignore)
    targets = vllm_ct_target_scheme_map(quantization_config) if targets is None else dict(targets)
    if vllm_ct_should_ignore_layer(prefix, ignore, fused_mapping):
        return None
    if not targets:
        return None
    target = vllm_ct_find_matched_target(prefix, module_class_name, targets, fused_mapping)
    return None if target is None else (targets[target], target)


def vllm_fp8_ignored_layers(quantization_config: Mapping[str, Any]) -> list[str]:
    """vLLM 0.32 ``Fp8Config.from_config``: ``ignored_layers``, or ``modules_to_not_convert``
    when ``ignored_layers`` is missing or empty."""
    ignored = quantization_config.get("ignored_layers")
    if not ignored:
        ignored = quantization_config.get("modules_to_not_convert")
    return list(ignored or [])


def vllm_is_layer_skipped(
    prefix: str,
    ignored_layers: Sequence[str],
    fused_mapping: Mapping[str, Sequence[str]] = {},
    match_mode: str = "exact",
) -> bool:
    """vLLM 0.32 ``quantization/utils/quant_utils.is_layer_skipped`` (``Fp8Config`` uses
    ``match_mode="exact"``).

    A fused prefix (last component in ``fused_mapping``) is skipped if the fused name itself
    matches, else iff all shards match (``str.replace`` of the last component); mixed shards raise
    ``ValueError``. In exact mode a prefix containing ``experts`` is skipped when it is a
    *substring* of some ignored entry that contains ``experts``.
    """
    if match_mode == "exact":
        match = lambda p, layers: p in layers  # noqa: E731
    elif match_mode == "substring":
        match = lambda p, layers: any(layer in p for layer in layers)  # noqa: E731
    elif match_mode == "suffix":
        match = lambda p, layers: any(p == layer or p.endswith(f".{layer}") for layer in layers)  # noqa: E731
    else:
        raise ValueError(f"Unsupported layer skip match mode: {match_mode}")
    proj = prefix.split(".")[-1]
    if proj in fused_mapping and match(prefix, ignored_layers):
        return True
    if proj in fused_mapping:
        skipped = None
        for shard_prefix in (prefix.replace(proj, s) for s in fused_mapping[proj]):
            shard_skipped = match(shard_prefix, ignored_layers)
            if skipped is None:
                skipped = shard_skipped
            elif shard_skipped != skipped:
                raise ValueError(
                    f"Detected some but not all shards of {prefix} are quantized. "
                    "All shards of fused layers to have the same precision."
                )
        return bool(skipped)
    if "experts" in prefix and match_mode == "exact":
        return any(prefix in layer for layer in ignored_layers if "experts" in layer)
    return match(prefix, ignored_layers)


def vllm_bnb_is_layer_skipped(prefix: str, skip_modules: Sequence[str]) -> bool:
    """vllm-bnb-plugin 0.0.3 ``quantization/utils.is_layer_skipped_bnb``: an entry equal to one
    dot component of the prefix, or equal to a dot-bounded leading part of it. Reads only
    ``llm_int8_skip_modules``; never ``modules_to_not_convert``; no name remapping."""
    components = prefix.split(".")
    if any(m in components for m in skip_modules):
        return True
    leading = {".".join(components[: i + 1]) for i in range(len(components))}
    return bool(set(skip_modules) & leading)


# ---------------------------------------------------------------------------------------------
# Names: checkpoint, memory (transformers 5.19) and vLLM spellings
# ---------------------------------------------------------------------------------------------

_ARCH_ALIASES = {
    "llama": "llama",
    "llamaforcausallm": "llama",
    "whisper": "whisper",
    "whisperforconditionalgeneration": "whisper",
    "mllama": "mllama",
    "mllamaforconditionalgeneration": "mllama",
    "qwen2_5_vl": "qwen2_5_vl",
    "qwen2.5-vl": "qwen2_5_vl",
    "qwen2_5_vlforconditionalgeneration": "qwen2_5_vl",
}


def canonical_arch(arch: str | None) -> str | None:
    """``model_type`` or architecture class name -> ``llama``/``whisper``/``mllama``/``qwen2_5_vl``;
    anything else is returned lower-cased (and treated as identity spelling)."""
    if arch is None:
        return None
    return _ARCH_ALIASES.get(arch.lower(), arch.lower())


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _swap(name: str, old: str, new: str) -> str:
    return new + name[len(old):]


_QWEN_TEXT_CKPT = re.compile(r"^model(?!\.(language_model|visual))")


def to_memory(name: str, arch: str | None) -> str:
    """Checkpoint spelling -> transformers 5.19 in-memory spelling, as the loader's conversion
    mapping renames it (``conversion_mapping.py``: ``"mllama"`` plus ``"LlavaModel"`` scoped to
    ``model``; ``"Qwen2VLForConditionalGeneration"``; Llama and Whisper: identity). Already
    in-memory names pass through, except that transformers also renames a bare Qwen2.5-VL
    ``model`` to ``model.language_model``. Module names and tensor names both work.

    Mllama: ``language_model.lm_head`` -> ``lm_head``, ``language_model.model.X`` ->
    ``model.language_model.X`` (any other ``language_model`` -> ``model.language_model``),
    ``vision_model`` -> ``model.vision_model``, ``multi_modal_projector`` ->
    ``model.multi_modal_projector``. Qwen2.5-VL: ``visual`` -> ``model.visual``; ``model`` not
    followed by ``.language_model``/``.visual`` -> ``model.language_model``.
    """
    arch = canonical_arch(arch)
    if arch == "mllama":
        if _under(name, "language_model.lm_head"):
            return _swap(name, "language_model.lm_head", "lm_head")
        if _under(name, "language_model.model"):
            return _swap(name, "language_model.model", "model.language_model")
        if _under(name, "language_model"):
            return _swap(name, "language_model", "model.language_model")
        if _under(name, "vision_model"):
            return _swap(name, "vision_model", "model.vision_model")
        if _under(name, "multi_modal_projector"):
            return _swap(name, "multi_modal_projector", "model.multi_modal_projector")
        return name
    if arch == "qwen2_5_vl":
        if _under(name, "visual"):
            return _swap(name, "visual", "model.visual")
        if _under(name, "model") and _QWEN_TEXT_CKPT.match(name) is not None:
            return _swap(name, "model", "model.language_model")
        return name
    return name


def to_checkpoint(name: str, arch: str | None) -> str:
    """transformers 5.19 in-memory spelling -> the spelling ``save_pretrained`` writes
    (``core_model_loading.revert_weight_conversion``). The inverse of ``to_memory`` on in-memory
    names."""
    arch = canonical_arch(arch)
    if arch == "mllama":
        for mem, ckpt in (
            ("lm_head", "language_model.lm_head"),
            ("model.language_model", "language_model.model"),
            ("model.vision_model", "vision_model"),
            ("model.multi_modal_projector", "multi_modal_projector"),
        ):
            if _under(name, mem):
                return _swap(name, mem, ckpt)
        return name
    if arch == "qwen2_5_vl":
        if _under(name, "model.visual"):
            return _swap(name, "model.visual", "visual")
        if _under(name, "model.language_model"):
            return _swap(name, "model.language_model", "model")
        return name
    return name


# Entry spellings -> memory spelling, beyond what to_memory does. ``language_model.model.`` is how
# unsloth (written with transformers < 4.52, whose in-memory names were the checkpoint's) spells
# the text model; for Qwen2.5-VL it is also vLLM's own spelling.
_ENTRY_RENAMES: dict[str, tuple[tuple[str, str], ...]] = {
    "mllama": (
        ("language_model.lm_head", "lm_head"),
        ("language_model.model", "model.language_model"),
        ("vision_model", "model.vision_model"),
        ("multi_modal_projector", "model.multi_modal_projector"),
    ),
    "qwen2_5_vl": (
        ("language_model.lm_head", "lm_head"),
        ("language_model.model", "model.language_model"),
        ("visual", "model.visual"),
    ),
}
# Prefixes that exist only in memory spelling: an entry under one of these is left as written.
_MEMORY_ONLY = {
    "mllama": ("model.language_model", "model.vision_model", "model.multi_modal_projector", "lm_head"),
    "qwen2_5_vl": ("model.language_model", "model.visual", "lm_head"),
}


def _regex_prefix(body: str, literal: str) -> int | None:
    """Length of ``body``'s leading regex that spells ``literal`` (dots escaped or not), ending
    at a component boundary (``\\.``, ``.``, ``$`` or the end); None if it does not."""
    for spelling in (re.escape(literal), literal):
        if body.startswith(spelling):
            rest = body[len(spelling):]
            if rest == "" or rest.startswith(("\\.", ".", "$")):
                return len(spelling)
    return None


def normalise_entry(entry: str, arch: str | None) -> tuple[str, ...]:
    """A skip entry in any spelling -> the entries that name the same modules in memory spelling.

    Accepts checkpoint spelling, memory spelling and unsloth's ``language_model.model.``
    spelling, for plain entries and for ``re:`` entries whose regex begins with a literal
    prefix (``re:language_model\\.model\\.layers\\..*``). Usually one entry comes back; Mllama's
    bare ``language_model`` gives two, because on disk it also covers ``language_model.lm_head``.
    A bare ``model`` is left as written (it is a real in-memory module, so the spelling is
    ambiguous). Regexes that do not start with a literal prefix are returned unchanged. The
    dialect's semantics are kept: only the spelling changes.
    """
    arch = canonical_arch(arch)
    renames = _ENTRY_RENAMES.get(arch)
    if renames is None:
        return (entry,)
    if entry.startswith("re:"):
        body = entry[3:]
        anchor = ""
        if body.startswith("^"):
            anchor, body = "^", body[1:]
        for mem in _MEMORY_ONLY[arch]:
            if _regex_prefix(body, mem) is not None:
                return (entry,)
        for ckpt, mem in renames:
            n = _regex_prefix(body, ckpt)
            if n is not None:
                return ("re:" + anchor + re.escape(mem) + body[n:],)
        if arch == "mllama":
            n = _regex_prefix(body, "language_model")
            if n is not None:
                return ("re:" + anchor + re.escape("model.language_model") + body[n:],)
        if arch == "qwen2_5_vl":
            n = _regex_prefix(body, "model")
            if n is not None and body[n:] not in ("", "$"):
                return ("re:" + anchor + re.escape("model.language_model") + body[n:],)
        return (entry,)
    if entry == "model" or any(_under(entry, m) for m in _MEMORY_ONLY[arch]):
        return (entry,)
    if arch == "mllama" and entry == "language_model":
        return ("model.language_model", "lm_head")
    for ckpt, mem in renames:
        if _under(entry, ckpt):
            return (_swap(entry, ckpt, mem),)
    return (to_memory(entry, arch),)


# vLLM 0.32 packed_modules_mapping of each model class (LlamaForCausalLM, WhisperForConditionalGeneration,
# Qwen2_5_VLForConditionalGeneration). Mllama is not in vLLM 0.32 (last in 0.10.2) and is not modelled.
VLLM_PACKED_MODULES: dict[str, dict[str, list[str]]] = {
    "llama": {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]},
    "whisper": {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "kv_proj": ["k_proj", "v_proj"]},
    "qwen2_5_vl": {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
        "qkv": ["qkv"],
    },
}
# The rename-only part of each hf_to_vllm_mapper (WeightsMapper.get_rename_mapper(): stacked maps and
# None targets dropped), which vLLM applies to fp8 ignored_layers and compressed-tensors targets/ignore.
_VLLM_PREFIX_RENAMES: dict[str, tuple[tuple[str, str], ...]] = {
    "qwen2_5_vl": (
        ("model.language_model.", "language_model.model."),
        ("model.visual.", "visual."),
        ("lm_head.", "language_model.lm_head."),
        ("model.", "language_model.model."),
    ),
}
_VLLM_SUBSTR_RENAMES: dict[str, tuple[tuple[str, str], ...]] = {
    "whisper": ((".fc1.", ".mlp.fc1."), (".fc2.", ".mlp.fc2.")),
}


def _require_vllm_arch(arch: str | None) -> str:
    arch = canonical_arch(arch)
    if arch not in VLLM_PACKED_MODULES:
        raise KeyError(f"vLLM 0.32 names are modelled for {sorted(VLLM_PACKED_MODULES)}, not {arch!r}")
    return arch


def vllm_rename_entry(entry: str, arch: str | None) -> str:
    """What vLLM 0.32 makes of a skip entry with ``quant_config.apply_vllm_mapper(
    hf_to_vllm_mapper.get_rename_mapper())``: substring renames, then prefix renames, each
    applied in order to the bare entry. Used by ``Fp8Config`` (every ``ignored_layers`` entry) and
    ``CompressedTensorsConfig`` (only entries containing ``.`` and not starting with ``re:``);
    ``TorchAOConfig`` and the bnb plugin do not remap. Module entries carry no trailing ``.``, so
    Whisper's ``.fc1.`` rename never fires on ``...layers.0.fc1`` (vLLM names it ``...mlp.fc1``),
    nor Qwen2.5-VL's ``lm_head.`` rename on ``lm_head``."""
    arch = canonical_arch(arch)
    key = entry
    for old, new in _VLLM_SUBSTR_RENAMES.get(arch, ()):
        if old in key:
            key = key.replace(old, new, 1)
    for old, new in _VLLM_PREFIX_RENAMES.get(arch, ()):
        if key.startswith(old):
            key = key.replace(old, new, 1)
    return key


def to_vllm(name: str, arch: str | None) -> str:
    """An HF module name (memory or checkpoint spelling) -> the prefix of the vLLM 0.32 module that
    holds it, fused shards included (``...self_attn.q_proj`` -> ``...self_attn.qkv_proj``;
    Whisper ``encoder_attn.k_proj`` -> ``encoder_attn.kv_proj``, ``fc1`` -> ``mlp.fc1``;
    Qwen2.5-VL ``model.language_model.`` -> ``language_model.model.``, ``model.visual.`` ->
    ``visual.``, ``lm_head`` -> ``language_model.lm_head``). Mirrors ``hf_to_vllm_mapper`` applied
    to ``name + ".weight"`` plus the models' ``stacked_params_mapping``."""
    arch = _require_vllm_arch(arch)
    key = to_memory(name, arch) + ".weight"
    for old, new in _VLLM_SUBSTR_RENAMES.get(arch, ()):
        if old in key:
            key = key.replace(old, new, 1)
    for old, new in _VLLM_PREFIX_RENAMES.get(arch, ()):
        if key.startswith(old):
            key = key.replace(old, new, 1)
    prefix = key.removesuffix(".weight")
    parent, _, leaf = prefix.rpartition(".")
    parent_leaf = parent.rpartition(".")[2]
    if parent_leaf == "encoder_attn" and leaf in ("k_proj", "v_proj") and "kv_proj" in VLLM_PACKED_MODULES[arch]:
        return f"{parent}.kv_proj"
    if parent_leaf == "self_attn" and leaf in ("q_proj", "k_proj", "v_proj"):
        return f"{parent}.qkv_proj"
    if parent_leaf == "mlp" and leaf in ("gate_proj", "up_proj") and "gate_up_proj" in VLLM_PACKED_MODULES[arch]:
        return f"{parent}.gate_up_proj"
    return prefix


# ---------------------------------------------------------------------------------------------
# SkipPolicy: a checkpoint's quantization_config, read in one dialect
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SkipEntry:
    """One raw entry of a skip list, and where it came from.

    ``source`` is the config key (``llm_int8_skip_modules``, ``modules_to_not_convert``,
    ``ignored_layers``, ``fqn_to_config``, ``ignore``, ``config_groups.<g>.targets``) or
    ``default`` / ``keep_in_fp32`` for what transformers adds. ``value`` is the ``FqnToConfig``
    value (``None`` = leave unquantized) or the group name of a target. ``match_as`` are the
    spellings the dialect actually matches (after ``normalise_entry`` or ``vllm_rename_entry``).
    ``honoured`` is False when the dialect's loader never reads this source (bitsandbytes'
    ``modules_to_not_convert``; fp8 ``modules_to_not_convert`` beside a non-empty
    ``ignored_layers``). ``role`` is ``skip`` or ``target`` (compressed-tensors targets, torchao
    keys with a non-None config).
    """

    raw: str
    source: str
    match_as: tuple[str, ...]
    value: Any = None
    honoured: bool = True
    role: str = "skip"


@dataclass(frozen=True)
class Decision:
    """Whether a module stays unquantized under a policy, the entries that decided it, and why."""

    skipped: bool
    entries: tuple[SkipEntry, ...]
    reason: str


def _is_linear(module_class: Any, vllm: bool) -> bool:
    names = module_class_names(module_class)
    if vllm:
        return any(n == "Linear" or n == "LinearBase" or n.endswith("Linear") for n in names)
    return names[0] in ("Linear", "Conv1D")


class SkipPolicy:
    """A checkpoint's ``quantization_config`` read in one dialect.

    ``skips(fqn, module_class)`` answers "does this dialect's library leave the module
    unquantized". ``fqn`` is in memory spelling for the transformers / torchao /
    compressed-tensors dialects and in vLLM spelling (``to_vllm``) for the ``vllm-*`` dialects.

    Build it with ``SkipPolicy.from_quantization_config(qc)``:

    - ``dialect``: default is the producer's (``PRODUCER_DIALECT``); ``VLLM_DIALECT`` gives vLLM's.
    - ``arch``: for ``normalise=True`` (entries rewritten with ``normalise_entry``, i.e. what the
      producer meant in whatever spelling it wrote) and for the vLLM dialects (fp8 and
      compressed-tensors entries renamed with ``vllm_rename_entry``, packed modules from
      ``VLLM_PACKED_MODULES``).
    - ``normalise=False`` matches raw entries: what transformers 5.19 itself does with them.
    - ``default_keys``: what ``get_keys_to_not_convert(model)`` gives for this model (use
      ``transformers_default_skip_keys(model)``); ``keep_in_fp32``: ``model._keep_in_fp32_modules``.
    """

    def __init__(
        self,
        quant_method: str,
        dialect: str,
        entries: Sequence[SkipEntry],
        config: Mapping[str, Any],
        arch: str | None = None,
        fused_mapping: Mapping[str, Sequence[str]] | None = None,
        notes: Sequence[str] = (),
    ):
        if dialect not in DIALECTS:
            raise ValueError(f"unknown skip dialect {dialect!r}; one of {DIALECTS}")
        self.quant_method = quant_method
        self.dialect = dialect
        self.entries = tuple(entries)
        self.config = config
        self.arch = canonical_arch(arch)
        self.fused_mapping = dict(fused_mapping or {})
        self.notes = tuple(notes)

    def __repr__(self) -> str:
        return f"SkipPolicy({self.quant_method!r}, {self.dialect!r}, {len(self.entries)} entries)"

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_quantization_config(
        cls,
        quantization_config: Mapping[str, Any],
        *,
        dialect: str | None = None,
        arch: str | None = None,
        normalise: bool = False,
        default_keys: Sequence[str] = ("lm_head",),
        keep_in_fp32: Sequence[str] = (),
        fused_mapping: Mapping[str, Sequence[str]] | None = None,
    ) -> SkipPolicy:
        qc = quantization_config
        method = qc.get("quant_method")
        method = getattr(method, "value", method)
        if method not in PRODUCER_DIALECT:
            raise CheckpointError("quantization_config", f"quant_method {method!r} has no skip dialect here")
        dialect = dialect or PRODUCER_DIALECT[method]
        arch = canonical_arch(arch)
        vllm = dialect in VLLM_DIALECTS
        if vllm and fused_mapping is None and arch in VLLM_PACKED_MODULES:
            fused_mapping = VLLM_PACKED_MODULES[arch]

        def spell(raw: str, vllm_rename: bool = False) -> tuple[str, ...]:
            if vllm:
                return (vllm_rename_entry(raw, arch),) if (vllm_rename and arch) else (raw,)
            return normalise_entry(raw, arch) if (normalise and arch) else (raw,)

        entries: list[SkipEntry] = []
        notes: list[str] = []

        def keys_with_defaults(user: Sequence[str] | None, source: str) -> None:
            if user is None:
                entries.extend(SkipEntry(k, "default", (k,)) for k in default_keys)
                notes.append(f"{source} is null: transformers adds its default keys {list(default_keys)}")
            else:
                entries.extend(SkipEntry(k, source, spell(k)) for k in user)
                try:
                    covers = any(transformers_key_matches("lm_head", k) for k in user)
                except re.error:
                    covers = True
                if "lm_head" in default_keys and not covers:
                    notes.append(f"{source} replaces transformers' defaults and does not cover lm_head")
            entries.extend(SkipEntry(k, "keep_in_fp32", (k,)) for k in keep_in_fp32)

        if method == "bitsandbytes":
            user = qc.get("llm_int8_skip_modules")
            if dialect == TRANSFORMERS:
                keys_with_defaults(user, "llm_int8_skip_modules")
            elif dialect == VLLM_BNB:
                entries.extend(SkipEntry(k, "llm_int8_skip_modules", spell(k)) for k in user or [])
            else:
                raise ValueError(f"bitsandbytes configs are read in {TRANSFORMERS} or {VLLM_BNB}, not {dialect}")
            for k in qc.get("modules_to_not_convert") or []:
                entries.append(SkipEntry(k, "modules_to_not_convert", spell(k), honoured=False))
        elif method == "torchao":
            type_name, fqn = torchao_quant_type(qc)
            mtnc = qc.get("modules_to_not_convert")
            if dialect == TRANSFORMERS_TORCHAO:
                keys_with_defaults(mtnc, "modules_to_not_convert")
                if qc.get("include_input_output_embeddings"):
                    notes.append("include_input_output_embeddings: transformers drops the embedding names from its skip keys (not modelled)")
            elif dialect == VLLM_TORCHAO:
                entries.extend(SkipEntry(k, "modules_to_not_convert", spell(k)) for k in mtnc or [])
            elif dialect == TORCHAO:
                entries.extend(SkipEntry(k, "modules_to_not_convert", (k,), honoured=False) for k in mtnc or [])
            else:
                raise ValueError(f"torchao configs are not read in {dialect}")
            for key, value in (fqn or {}).items():
                match_as = (key,) if key == "_default" else spell(key)
                entries.append(SkipEntry(key, "fqn_to_config", match_as, value, role="skip" if value is None else "target"))
            if type_name is None:
                notes.append("quant_type.default is missing: nothing is known to be quantized")
        elif method == "compressed-tensors":
            if dialect not in (COMPRESSED_TENSORS, VLLM_COMPRESSED_TENSORS):
                raise ValueError(f"compressed-tensors configs are not read in {dialect}")
            ct_rename = lambda t: vllm and "." in t and not t.startswith("re:")  # noqa: E731
            for k in qc.get("ignore") or []:
                entries.append(SkipEntry(k, "ignore", spell(k, ct_rename(k))))
            # A target repeated in a later group is taken over by it (compressed-tensors'
            # target_to_scheme, vLLM's target_scheme_map); vLLM also drops Attention-only groups.
            if vllm:
                owner = vllm_ct_target_scheme_map(qc)
            else:
                owner = {t: g for g, grp in (qc.get("config_groups") or {}).items() for t in grp.get("targets") or []}
            for group_name, group in (qc.get("config_groups") or {}).items():
                for t in group.get("targets") or []:
                    entries.append(SkipEntry(
                        t, f"config_groups.{group_name}.targets", spell(t, ct_rename(t)), group_name,
                        owner.get(t) == group_name, "target"))
        elif method == "fp8":
            ignored = qc.get("ignored_layers")
            mtnc = qc.get("modules_to_not_convert")
            if dialect == VLLM_FP8:
                use_mtnc = not ignored
                for k in ignored or []:
                    entries.append(SkipEntry(k, "ignored_layers", spell(k, True)))
                for k in mtnc or []:
                    entries.append(SkipEntry(k, "modules_to_not_convert", spell(k, True), honoured=use_mtnc))
            elif dialect == TRANSFORMERS_FP8:
                # FineGrainedFP8Config: ignored_layers is an alias only when modules_to_not_convert is absent;
                # _normalize_modules_to_not_convert renames entries through the checkpoint conversion mapping.
                user = mtnc if mtnc is not None else ignored
                source = "modules_to_not_convert" if mtnc is not None else "ignored_layers"
                if user is None:
                    keys_with_defaults(None, source)
                else:
                    entries.extend(SkipEntry(k, source, (to_memory(k, arch),)) for k in user)
                    entries.extend(SkipEntry(k, "keep_in_fp32", (k,)) for k in keep_in_fp32)
                if mtnc is not None and ignored:
                    entries.extend(SkipEntry(k, "ignored_layers", (k,), honoured=False) for k in ignored)
            else:
                raise ValueError(f"fp8 configs are not read in {dialect}")
        return cls(method, dialect, entries, qc, arch, fused_mapping, notes)

    # -- queries ------------------------------------------------------------------------------

    def from_source(self, source: str) -> list[SkipEntry]:
        """The entries that came from one config key (``source`` prefix match for config groups)."""
        return [e for e in self.entries if e.source == source or e.source.startswith(source + ".")]

    @property
    def honoured(self) -> tuple[SkipEntry, ...]:
        return tuple(e for e in self.entries if e.honoured)

    def skips(self, fqn: str, module_class: Any = "Linear") -> bool:
        """True when this dialect's library leaves ``fqn`` unquantized. May raise what the owner
        raises (``re.error`` on a bad transformers key, ``ValueError`` on mixed fused shards in vLLM)."""
        return self.decide(fqn, module_class).skipped

    def decide(self, fqn: str, module_class: Any = "Linear") -> Decision:
        d = self.dialect
        vllm = d in VLLM_DIALECTS
        honoured = self.honoured

        if d in (TRANSFORMERS, TRANSFORMERS_FP8, TRANSFORMERS_TORCHAO):
            name = f"{fqn}.weight" if d == TRANSFORMERS_TORCHAO else fqn
            keys = [e for e in honoured if e.role == "skip" and e.source != "fqn_to_config"]
            hits = tuple(e for e in keys if any(transformers_key_matches(name, k) for k in e.match_as))
            if hits:
                return Decision(True, hits, f"should_convert_module({name!r}) is False")
            if not _is_linear(module_class, False):
                return Decision(True, (), "not an nn.Linear")
            if d == TRANSFORMERS_TORCHAO and torchao_quant_type(self.config)[1] is not None:
                return self._decide_fqn(transformers_torchao_resolve(self._fqn_map(), f"{fqn}.weight"))
            return Decision(False, (), "quantized")

        if d == TORCHAO:
            linear = _is_linear(module_class, False)
            if torchao_quant_type(self.config)[1] is None:
                return Decision(not linear, (), "plain torchao config: every nn.Linear" if linear else "not an nn.Linear")
            return self._decide_fqn(torchao_resolve(self._fqn_map(), fqn, is_linear=linear))

        if d == VLLM_TORCHAO:
            res = vllm_torchao_resolve(fqn, self._renamed_config(), is_linear=_is_linear(module_class, True))
            if res.how == "skip_modules":
                hits = tuple(e for e in honoured if e.source in ("modules_to_not_convert", "fqn_to_config") and res.key in e.match_as)
                return Decision(True, hits, f"should_skip: {res.key!r} is a dot-bounded part of {fqn!r}")
            if res.how == "unmatched" and not _is_linear(module_class, True):
                return Decision(True, (), "not a vLLM LinearBase")
            return self._decide_fqn(res)

        if d == COMPRESSED_TENSORS:
            qc = self._renamed_config()
            res = ct_resolve(fqn, module_class, qc.get("config_groups") or {}, qc.get("ignore"))
            if res is None:
                ign = tuple(e for e in honoured if e.source == "ignore" and any(
                    ct_match_name(fqn, k) or ct_match_class(module_class, k) for k in e.match_as))
                return Decision(True, ign, "ignored" if ign else "no config group targets it")
            tgt = tuple(e for e in honoured if e.role == "target" and res.target in e.match_as and e.value == res.group)
            if not res.quantizes_weight:
                return Decision(True, tgt, f"group {res.group} has no weight scheme")
            return Decision(False, tgt, f"group {res.group} via {res.target!r}")

        if d == VLLM_COMPRESSED_TENSORS:
            qc = self._renamed_config()
            res = vllm_ct_resolve(fqn, module_class_names(module_class)[0], qc, self.fused_mapping)
            if res is None:
                ign = tuple(e for e in honoured if e.source == "ignore" and vllm_ct_should_ignore_layer(fqn, e.match_as, self.fused_mapping))
                return Decision(True, ign, "ignored" if ign else "no target matches")
            group, target = res
            weights = (qc.get("config_groups") or {}).get(group, {}).get("weights")
            tgt = tuple(e for e in honoured if e.role == "target" and target in e.match_as and e.value == group)
            if weights is None:
                return Decision(True, tgt, f"group {group} has no weight scheme")
            return Decision(False, tgt, f"group {group} via {target!r}")

        if d == VLLM_FP8:
            if not _is_linear(module_class, True):
                return Decision(True, (), "not a vLLM LinearBase")
            layers = [k for e in honoured for k in e.match_as]
            if vllm_is_layer_skipped(fqn, layers, self.fused_mapping):
                hits = tuple(e for e in honoured if _fp8_entry_hits(fqn, e, self.fused_mapping))
                return Decision(True, hits, "is_layer_skipped")
            return Decision(False, (), "quantized")

        if d == VLLM_BNB:
            if not _is_linear(module_class, True):
                return Decision(True, (), "not a vLLM LinearBase")
            hits = tuple(e for e in honoured if vllm_bnb_is_layer_skipped(fqn, e.match_as))
            if hits:
                return Decision(True, hits, "is_layer_skipped_bnb")
            return Decision(False, (), "quantized")

        raise AssertionError(d)

    # -- helpers ------------------------------------------------------------------------------

    def _fqn_map(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for e in self.entries:
            if e.source == "fqn_to_config":
                for k in e.match_as:
                    out.setdefault(k, e.value)
        return out

    def _renamed_config(self) -> dict[str, Any]:
        """The config with every entry in its ``match_as`` spelling (order kept)."""
        qc = dict(self.config)
        if self.quant_method == "compressed-tensors":
            qc["ignore"] = [k for e in self.entries if e.source == "ignore" for k in e.match_as]
            groups = {}
            for g, grp in (self.config.get("config_groups") or {}).items():
                ts = [k for e in self.entries if e.role == "target" and e.value == g for k in e.match_as]
                groups[g] = {**grp, "targets": ts}
            qc["config_groups"] = groups
        elif self.quant_method == "torchao":
            qc["modules_to_not_convert"] = [k for e in self.entries if e.source == "modules_to_not_convert" for k in e.match_as]
            qt = self.config.get("quant_type")
            if isinstance(qt, Mapping) and isinstance(qt.get("default"), Mapping) and torchao_quant_type(self.config)[1] is not None:
                default = dict(qt["default"])
                data = dict(default.get("_data") or {})
                fmap = self._fqn_map()
                for key in ("fqn_to_config", "module_fqn_to_config"):
                    if key in data:
                        data[key] = fmap
                default["_data"] = data
                qc["quant_type"] = {"default": default}
        return qc

    def _decide_fqn(self, res: FqnResolution) -> Decision:
        ents = tuple(e for e in self.entries if e.source == "fqn_to_config" and res.key in e.match_as)
        type_name, fqn = torchao_quant_type(self.config)
        if fqn is None:
            if type_name is None:
                return Decision(True, (), "no torchao config")
            return Decision(False, (), f"{type_name} applies to every linear")
        if res.skipped:
            if res.key is None:
                return Decision(True, (), f"no FqnToConfig entry applies ({res.how}) and no _default")
            return Decision(True, ents, f"FqnToConfig {res.how} entry {res.key!r} is None")
        return Decision(False, ents, f"FqnToConfig {res.how} entry {res.key!r}")


def _fp8_entry_hits(prefix: str, entry: SkipEntry, fused: Mapping[str, Sequence[str]]) -> bool:
    proj = prefix.split(".")[-1]
    names = [prefix] + ([prefix.replace(proj, s) for s in fused[proj]] if proj in fused else [])
    return any(n in entry.match_as for n in names) or ("experts" in prefix and any(prefix in k for k in entry.match_as if "experts" in k))


# ---------------------------------------------------------------------------------------------
# Where the dialect and the evident intent of an entry disagree
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Disagreement:
    """One place where what a dialect does with an entry differs from what its author evidently
    meant. ``kind``: ``overreach`` (matches a module the entry does not name: ``layers.1`` ->
    ``layers.11``), ``wildcard-dot`` (matches only because a ``.`` matched another character),
    ``underreach`` (names the module, dot-bounded, but the dialect does not match it: a
    transformers key ``vision_model`` vs ``model.vision_model.*``, a torchao key naming a container),
    ``unmatched`` (matches no module), ``spelling`` (matches nothing as written, but does in
    memory spelling), ``order-dependent`` (several regex keys decide one module differently, so
    dict order, alphabetical after a transformers save, decides), ``partial-fused-group`` (some
    but not all shards of a group that engines fuse are skipped), ``group-precedence``
    (compressed-tensors and vLLM choose different config groups), ``unread-source`` (the loader
    never reads this key), ``invalid-regex``."""

    entry: str
    module: str | None
    dialect: str
    kind: str
    explanation: str


_QUANT = "*+?{"


def literal_dots(pattern: str) -> str:
    """A regex with each unescaped ``.`` outside a character class that is not followed by a
    quantifier made literal (``\\.``): the regex its author evidently meant when the dots were
    path separators. ``.*``, ``.+`` and escaped dots are kept."""
    out: list[str] = []
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            out.append(pattern[i : i + 2])
            i += 2
            continue
        if c == "[":
            in_class = True
        elif c == "]":
            in_class = False
        if c == "." and not in_class and not (i + 1 < len(pattern) and pattern[i + 1] in _QUANT):
            out.append("\\.")
        else:
            out.append(c)
        i += 1
    return "".join(out)


_REGEX_META = set("^$*+?{}[]\\|()")


def _prefixes(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _intent_core(body: str) -> tuple[str, str] | None:
    r"""Split a regex into (lead, core) as its author evidently meant it: a leading ``.*`` means
    "starting at some component", a trailing ``.*``, ``$`` or ``\.`` means "this module and what is
    under it". ``None`` when nothing is left (``.*`` names everything)."""
    core = body.removeprefix("^")
    lead = ""
    for wild in (".*", ".+"):
        if core.startswith(wild):
            core, lead = core[2:], r"(?:.*\.)?"
            core = core.removeprefix("\\.")
            break
    changed = True
    while changed and core:
        changed = False
        for tail in ("$", ".*", ".+", "\\.", "."):
            if core.endswith(tail) and not (tail in (".*", ".+", ".") and core.endswith("\\" + tail)):
                core = core[: -len(tail)]
                changed = True
                break
    if not core:
        return None
    return lead, core


def _intent(entry: str, name: str) -> bool:
    """What an entry evidently names: a plain entry names a dot-bounded run of components
    (``layers.1`` names ``model.layers.1.mlp``, not ``model.layers.11``; a trailing ``.`` is a
    boundary); a regex, read with literal dots and with a leading/trailing ``.*`` taken as
    "any components", names every module with a dot-bounded prefix it fully matches."""
    is_regex = entry.startswith("re:") or any(c in _REGEX_META for c in entry)
    if not is_regex:
        e = entry.rstrip(".")
        return bool(e) and (name == e or f".{e}." in f".{name}.")
    body = entry[3:] if entry.startswith("re:") else entry
    split = _intent_core(body)
    if split is None:
        return True
    lead, core = split
    try:
        rx = re.compile(lead + literal_dots(core))
    except re.error:
        return False
    if entry.startswith("re:") or lead or body.startswith("^"):
        return any(rx.fullmatch(p) for p in _prefixes(name))
    # a transformers key with regex syntax: anchored at the start, or a suffix run (endswith)
    parts = name.split(".")
    return any(rx.fullmatch(".".join(parts[i:j])) for i in range(len(parts)) for j in range(i + 1, len(parts) + 1)
               if i == 0 or j == len(parts))


def _entry_hits(policy: SkipPolicy, entry: SkipEntry, spelling: str, name: str, module_class: Any) -> bool:
    """Does one spelling of one entry, on its own, reach ``name`` under the policy's dialect
    (skip it, or for a target / non-None FqnToConfig key, select it)."""
    d = policy.dialect
    if entry.source == "fqn_to_config":
        if d == VLLM_TORCHAO:
            exact_or_full = spelling == name or (spelling.startswith("re:") and re.fullmatch(spelling[3:], name) is not None)
            return exact_or_full or (entry.value is None and vllm_torchao_should_skip(name, [spelling]))
        return torchao_fqn_matches(name, {spelling: 0}) or torchao_fqn_matches(f"{name}.weight", {spelling: 0})
    if d in (TRANSFORMERS, TRANSFORMERS_FP8):
        return transformers_key_matches(name, spelling)
    if d == TRANSFORMERS_TORCHAO:
        return transformers_key_matches(f"{name}.weight", spelling)
    if d == TORCHAO:
        return False  # torchao never reads modules_to_not_convert
    if d == COMPRESSED_TENSORS:
        return ct_match_name(name, spelling) or ct_match_class(module_class, spelling)
    if d == VLLM_COMPRESSED_TENSORS:
        if entry.role == "target":
            return vllm_ct_find_matched_target(name, module_class_names(module_class)[0], [spelling], policy.fused_mapping) is not None
        try:
            return vllm_ct_should_ignore_layer(name, [spelling], policy.fused_mapping)
        except ValueError:
            return True
    if d == VLLM_FP8:
        try:
            return vllm_is_layer_skipped(name, [spelling], policy.fused_mapping)
        except ValueError:
            return True
    if d == VLLM_TORCHAO:
        return vllm_torchao_should_skip(name, [spelling])
    if d == VLLM_BNB:
        return vllm_bnb_is_layer_skipped(name, [spelling])
    raise AssertionError(d)


def _hits_with_literal_dots(policy: SkipPolicy, entry: SkipEntry, spelling: str, name: str, module_class: Any) -> bool:
    if spelling.startswith("re:"):
        lit = "re:" + literal_dots(spelling[3:])
    elif policy.dialect in (TRANSFORMERS, TRANSFORMERS_FP8, TRANSFORMERS_TORCHAO) and entry.source != "fqn_to_config":
        lit = literal_dots(spelling)
    else:
        return True
    try:
        return _entry_hits(policy, entry, lit, name, module_class)
    except re.error:
        return True


def _fused_groups(names: Sequence[str]) -> list[tuple[str, ...]]:
    """Groups of sibling shards that engines fuse: q/k/v under a self-attention, k/v under a
    cross-attention (``encoder_attn``, ``cross_attn``), gate/up under an MLP."""
    by_parent: dict[str, set[str]] = {}
    for n in names:
        parent, _, leaf = n.rpartition(".")
        by_parent.setdefault(parent, set()).add(leaf)
    groups = []
    for parent, leaves in sorted(by_parent.items()):
        kind = parent.rpartition(".")[2]
        cands = [("k_proj", "v_proj")] if kind in ("encoder_attn", "cross_attn") else [("q_proj", "k_proj", "v_proj")]
        cands.append(("gate_proj", "up_proj"))
        for shards in cands:
            if all(s in leaves for s in shards):
                groups.append(tuple(f"{parent}.{s}" if parent else s for s in shards))
    return groups


def intent_disagreements(
    policy: SkipPolicy,
    module_names: Iterable[str],
    module_classes: Mapping[str, Any] | None = None,
) -> list[Disagreement]:
    """Where the policy's dialect and the evident intent of its entries disagree, over the given
    modules (the policy's spelling: memory names, or vLLM prefixes for ``vllm-*``; pass the
    quantizable leaves). ``module_classes`` maps names to classes (default ``Linear``).

    Per entry and module: the dialect matches but the dot-bounded intent does not
    (``overreach``, or ``wildcard-dot`` when literal dots would not match), or the reverse
    (``underreach``); per entry: ``unmatched`` / ``spelling`` / ``unread-source`` /
    ``invalid-regex``; per module: ``order-dependent`` and ``group-precedence``; per fused group:
    ``partial-fused-group``. Class-name targets (compressed-tensors ``Linear``) and ``_default``
    carry no name intent and are only checked for matching nothing.
    """
    names = list(dict.fromkeys(module_names))
    classes = module_classes or {}
    d = policy.dialect
    out: list[Disagreement] = []

    for e in policy.entries:
        if e.raw == "_default":
            continue
        if not e.honoured:
            out.append(Disagreement(e.raw, None, d, "unread-source", f"{d} never reads {e.source} here; the entry has no effect"))
            continue
        if e.source in ("default", "keep_in_fp32"):
            continue
        any_hit = False
        verb = "quantizes" if e.role == "target" else "skips"
        for spelling in e.match_as:
            is_class = (
                d in (COMPRESSED_TENSORS, VLLM_COMPRESSED_TENSORS)
                and "." not in spelling
                and not spelling.startswith("re:")
                and spelling[:1].isupper()
            )
            container = any(n.startswith(spelling + ".") for n in names)
            for n in names:
                cls = classes.get(n, "Linear")
                try:
                    hit = _entry_hits(policy, e, spelling, n, cls)
                except re.error as exc:
                    out.append(Disagreement(e.raw, None, d, "invalid-regex", f"{spelling!r} is not a valid regex ({exc}); the owner raises"))
                    any_hit = True
                    break
                any_hit = any_hit or hit
                if is_class:
                    continue
                meant = _intent(spelling, n)
                if d in VLLM_DIALECTS and policy.fused_mapping and not meant:
                    proj = n.split(".")[-1]
                    if proj in policy.fused_mapping:
                        meant = all(_intent(spelling, n.replace(proj, s)) for s in policy.fused_mapping[proj])
                if hit and not meant:
                    if not _hits_with_literal_dots(policy, e, spelling, n, cls):
                        out.append(Disagreement(e.raw, n, d, "wildcard-dot", f"{verb} {n} only because a '.' in {spelling!r} is a regex wildcard"))
                    else:
                        out.append(Disagreement(e.raw, n, d, "overreach", f"{verb} {n}, which {spelling!r} does not name (not dot-bounded)"))
                elif meant and not hit and e.role == "skip":
                    why = ""
                    if container and n.startswith(spelling + ".") and d in (TORCHAO, TRANSFORMERS_TORCHAO, VLLM_FP8, COMPRESSED_TENSORS, VLLM_COMPRESSED_TENSORS):
                        why = " (the entry names a container; this dialect applies it to that exact module only)"
                    out.append(Disagreement(e.raw, n, d, "underreach", f"{spelling!r} names {n} but {d} does not skip it{why}"))
        if not any_hit and names:
            hint = ""
            if policy.arch and not e.raw.startswith("re:") and d not in VLLM_DIALECTS:
                alt = [a for a in normalise_entry(e.raw, policy.arch) if a not in e.match_as]
                alt_hits = [a for a in alt if any(_entry_hits(policy, e, a, n, classes.get(n, "Linear")) for n in names)]
                if alt_hits:
                    out.append(Disagreement(e.raw, None, d, "spelling", f"matches nothing as written; in memory spelling it is {alt_hits[0]!r}"))
                    continue
            if d in VLLM_DIALECTS and policy.fused_mapping:
                leaf = e.raw.rsplit(".", 1)[-1]
                fused = [k for k, v in policy.fused_mapping.items() if leaf in v and k != leaf]
                if fused:
                    hint = f"; vLLM fuses {leaf} into {fused[0]}"
            out.append(Disagreement(e.raw, None, d, "unmatched", f"matches no module{hint}"))

    # order-dependent FqnToConfig regexes
    if d in (TORCHAO, TRANSFORMERS_TORCHAO, VLLM_TORCHAO):
        regex = [e for e in policy.entries if e.source == "fqn_to_config" and e.raw.startswith("re:")]
        for n in names:
            hits = [e for e in regex if any(
                re.fullmatch(k[3:], n) or (d != VLLM_TORCHAO and re.fullmatch(k[3:], f"{n}.weight")) for k in e.match_as)]
            if len({h.value is None for h in hits}) > 1:
                out.append(Disagreement(
                    hits[0].raw, n, d, "order-dependent",
                    f"{len(hits)} regex keys match with different outcomes ({', '.join(h.raw for h in hits)}); "
                    "dict order decides, and transformers saves config.json with sorted keys"))

    # compressed-tensors vs vLLM group choice
    if d in (COMPRESSED_TENSORS, VLLM_COMPRESSED_TENSORS):
        groups = policy.config.get("config_groups") or {}
        for n in names:
            cls = classes.get(n, "Linear")
            try:
                ct = ct_resolve(n, cls, groups, policy.config.get("ignore"))
                vl = vllm_ct_resolve(n, module_class_names(cls)[0], policy.config)
            except (ValueError, re.error):
                continue
            if ct is not None and vl is not None and ct.group != vl[0]:
                out.append(Disagreement(
                    vl[1], n, d, "group-precedence",
                    f"compressed-tensors applies group {ct.group} (target {ct.target!r}, most specific first) "
                    f"but vLLM applies {vl[0]} (first target in config order)"))

    # fused groups covered in part (vLLM names are fused already, so only unfused spellings have groups)
    for group in _fused_groups(names):
        states = {}
        for n in group:
            try:
                states[n] = policy.skips(n, classes.get(n, "Linear"))
            except (ValueError, re.error):
                states = {}
                break
        if states and len(set(states.values())) > 1:
            skipped = [n.rpartition(".")[2] for n, s in states.items() if s]
            kept = [n.rpartition(".")[2] for n, s in states.items() if not s]
            parent = group[0].rpartition(".")[0]
            out.append(Disagreement(
                ", ".join(skipped), parent, d, "partial-fused-group",
                f"{'/'.join(skipped)} skipped but {'/'.join(kept)} quantized under {parent}: "
                "engines that fuse them must load unfused (vLLM raises)"))
    return out

