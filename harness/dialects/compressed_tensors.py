"""The ``compressed-tensors`` dialect: compressed-tensors 0.17 ``apply_quantization_config``.

Also what the ``vllm-compressed-tensors`` dialect shares with it: reading ``ignore`` and the
config groups' targets, the renamed config, and the group-precedence check between the two.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from harness.dialects import patterns
from harness.dialects.base import REGISTRY, Decision, Dialect, EntryDisagreement, Reading, SkipEntry, class_names, register

NAME = "compressed-tensors"
VLLM_NAME = "vllm-compressed-tensors"  # vLLM's reading of this format (harness.dialects.vllm_compressed_tensors)


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
        return patterns.match(target.removeprefix("re:"), name) is not None
    return target == name


def ct_match_class(module_class: Any, target: str) -> bool:
    """compressed-tensors 0.17 ``utils.match._match_class``: any Module class in the MRO named
    exactly ``target``, or vLLM's ``LinearBase`` for ``Linear``. ``Module`` matches every module."""
    return any(c == target or (c == "LinearBase" and target == "Linear") for c in class_names(module_class))


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
# What the two compressed-tensors readers share
# ---------------------------------------------------------------------------------------------


def read_ignore_and_targets(reading: Reading, owner: Mapping[str, str]) -> None:
    """``ignore`` entries, then every group's targets; ``owner`` maps a target to the group that
    takes it (a target repeated in a later group is taken over by it), so a target honoured in
    one group is unread in the others. vLLM renames entries that contain a dot and are not regexes."""
    qc = reading.config

    def spell(t: str) -> tuple[str, ...]:
        return reading.spell(t, reading.vllm and "." in t and not t.startswith("re:"))

    for k in qc.get("ignore") or []:
        reading.entries.append(SkipEntry(k, "ignore", spell(k)))
    for group_name, group in (qc.get("config_groups") or {}).items():
        for t in group.get("targets") or []:
            reading.entries.append(SkipEntry(
                t, f"config_groups.{group_name}.targets", spell(t), group_name, owner.get(t) == group_name, "target"))


def renamed_config(policy) -> dict[str, Any]:
    """The config with every entry in its ``match_as`` spelling (order kept)."""
    qc = dict(policy.config)
    qc["ignore"] = [k for e in policy.entries if e.source == "ignore" for k in e.match_as]
    groups = {}
    for g, grp in (policy.config.get("config_groups") or {}).items():
        ts = [k for e in policy.entries if e.role == "target" and e.value == g for k in e.match_as]
        groups[g] = {**grp, "targets": ts}
    qc["config_groups"] = groups
    return qc


def group_precedence(policy, names: list[str], classes: Mapping[str, Any]) -> list[EntryDisagreement]:
    """Modules to which compressed-tensors (most specific target first) and vLLM (first target in
    config order) apply different config groups. vLLM's rule is its dialect's ``resolve``, found in
    the registry: that dialect reads its config through this module."""
    vllm_resolve = REGISTRY[VLLM_NAME].resolve
    out = []
    groups = policy.config.get("config_groups") or {}
    for n in names:
        cls = classes.get(n, "Linear")
        try:
            ct = ct_resolve(n, cls, groups, policy.config.get("ignore"))
            vl = vllm_resolve(n, class_names(cls)[0], policy.config)
        except (ValueError, re.error):
            continue
        if ct is not None and vl is not None and ct.group != vl[0]:
            out.append(EntryDisagreement(
                vl[1], n, policy.dialect, "group-precedence",
                f"compressed-tensors applies group {ct.group} (target {ct.target!r}, most specific first) "
                f"but vLLM applies {vl[0]} (first target in config order)"))
    return out


class CompressedTensors(Dialect):
    name = NAME
    quant_method = "compressed-tensors"
    producer = True
    class_targets = True
    exact_containers = True

    def read(self, reading: Reading) -> None:
        owner = {t: g for g, grp in (reading.config.get("config_groups") or {}).items() for t in grp.get("targets") or []}
        read_ignore_and_targets(reading, owner)

    def decide(self, policy, fqn: str, module_class: Any) -> Decision:
        qc = renamed_config(policy)
        res = ct_resolve(fqn, module_class, qc.get("config_groups") or {}, qc.get("ignore"))
        if res is None:
            ign = tuple(e for e in policy.honoured if e.source == "ignore" and any(
                ct_match_name(fqn, k) or ct_match_class(module_class, k) for k in e.match_as))
            return Decision(True, ign, "ignored" if ign else "no config group targets it")
        tgt = tuple(e for e in policy.honoured if e.role == "target" and res.target in e.match_as and e.value == res.group)
        if not res.quantizes_weight:
            return Decision(True, tgt, f"group {res.group} has no weight scheme")
        return Decision(False, tgt, f"group {res.group} via {res.target!r}")

    def entry_hits(self, policy, entry: SkipEntry, spelling: str, name: str, module_class: Any) -> bool:
        return ct_match_name(name, spelling) or ct_match_class(module_class, spelling)

    def module_disagreements(self, policy, names, classes):
        return group_precedence(policy, names, classes)


register(CompressedTensors())
