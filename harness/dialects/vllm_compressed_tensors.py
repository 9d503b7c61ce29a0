"""The ``vllm-compressed-tensors`` dialect: vLLM 0.32 ``CompressedTensorsConfig.get_scheme_dict``."""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from fnmatch import fnmatch
from typing import Any

from harness.dialects import compressed_tensors as ct
from harness.dialects import patterns
from harness.dialects.base import Decision, Dialect, Reading, SkipEntry, class_names, register

NAME = ct.VLLM_NAME


def _is_equal_or_regex_match(value: str, target: str, check_contains: bool = False, use_fnmatch: bool = False) -> bool:
    """vLLM 0.32 ``quantization/utils/config_utils.is_equal_or_regex_match``: ``re:`` targets with
    ``re.match`` (vLLM uses the ``regex`` package; same semantics for these patterns); else, with
    ``check_contains``, a case-insensitive substring; else equality (or ``fnmatch``)."""
    if target.startswith("re:"):
        if patterns.match(target[3:], value, owner="regex"):
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
    matches = [p for p in patterns if _is_equal_or_regex_match(layer_name, p, use_fnmatch=use_fnmatch)]
    if matches:
        return [set(matches)]
    proj = layer_name.split(".")[-1]
    if proj not in fused_mapping:
        return [set()]
    shards = [layer_name.replace(proj, s) for s in fused_mapping[proj]]
    return [{p for p in patterns if _is_equal_or_regex_match(s, p, use_fnmatch=use_fnmatch)} for s in shards]


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
        return next((t for t in targets if _is_equal_or_regex_match(value, t, check_contains=check_contains)), None)

    def fused() -> str | None:
        key = next((k for k in fused_mapping if layer_name.endswith(k)), None)
        if key is None:
            return None
        found: list[str | None] = []
        for unfused in (layer_name.replace(key, s) for s in fused_mapping[key]):
            found.append(next((t for t in targets if _is_equal_or_regex_match(unfused, t)), None))
        return found[0] if all(found) else None

    return first(layer_name) or fused() or first(module_class_name, True)


def _target_scheme_map(quantization_config: Mapping[str, Any]) -> dict[str, str]:
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
    targets = _target_scheme_map(quantization_config) if targets is None else dict(targets)
    if vllm_ct_should_ignore_layer(prefix, ignore, fused_mapping):
        return None
    if not targets:
        return None
    target = vllm_ct_find_matched_target(prefix, module_class_name, targets, fused_mapping)
    return None if target is None else (targets[target], target)


class VllmCompressedTensors(Dialect):
    name = NAME
    quant_method = "compressed-tensors"
    vllm = True
    regex_owner = "regex"
    class_targets = True
    exact_containers = True

    def read(self, reading: Reading) -> None:
        # vLLM's target_scheme_map also drops Attention-only groups.
        ct.read_ignore_and_targets(reading, _target_scheme_map(reading.config))

    def decide(self, policy, fqn: str, module_class: Any) -> Decision:
        qc = ct.renamed_config(policy)
        res = vllm_ct_resolve(fqn, class_names(module_class)[0], qc, policy.fused_mapping)
        if res is None:
            ign = tuple(e for e in policy.honoured
                        if e.source == "ignore" and vllm_ct_should_ignore_layer(fqn, e.match_as, policy.fused_mapping))
            return Decision(True, ign, "ignored" if ign else "no target matches")
        group, target = res
        weights = (qc.get("config_groups") or {}).get(group, {}).get("weights")
        tgt = tuple(e for e in policy.honoured if e.role == "target" and target in e.match_as and e.value == group)
        if weights is None:
            return Decision(True, tgt, f"group {group} has no weight scheme")
        return Decision(False, tgt, f"group {group} via {target!r}")

    def entry_hits(self, policy, entry: SkipEntry, spelling: str, name: str, module_class: Any) -> bool:
        if entry.role == "target":
            return vllm_ct_find_matched_target(name, class_names(module_class)[0], [spelling], policy.fused_mapping) is not None
        try:
            return vllm_ct_should_ignore_layer(name, [spelling], policy.fused_mapping)
        except ValueError:
            return True

    def module_disagreements(self, policy, names, classes):
        return ct.group_precedence(policy, names, classes)

    @staticmethod
    def resolve(prefix: str, module_class_name: str, quantization_config: Mapping[str, Any]) -> tuple[str, str] | None:
        return vllm_ct_resolve(prefix, module_class_name, quantization_config)


register(VllmCompressedTensors())
