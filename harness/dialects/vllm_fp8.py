"""The ``vllm-fp8`` dialect: vLLM 0.32 ``Fp8Config`` / ``is_layer_skipped`` (exact names, fused
shards). Producers of ``quant_method: fp8`` checkpoints write their skip lists for it."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from harness.dialects.base import Decision, Dialect, Reading, SkipEntry, is_linear, register

NAME = "vllm-fp8"


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


def _entry_decides(prefix: str, entry: SkipEntry, fused: Mapping[str, Sequence[str]]) -> bool:
    proj = prefix.split(".")[-1]
    names = [prefix] + ([prefix.replace(proj, s) for s in fused[proj]] if proj in fused else [])
    return any(n in entry.match_as for n in names) or (
        "experts" in prefix and any(prefix in k for k in entry.match_as if "experts" in k))


class VllmFp8(Dialect):
    name = NAME
    quant_method = "fp8"
    producer = True
    vllm = True
    regex_owner = "regex"
    exact_containers = True

    def read(self, reading: Reading) -> None:
        ignored = reading.config.get("ignored_layers")
        use_mtnc = not ignored
        for k in ignored or []:
            reading.entries.append(SkipEntry(k, "ignored_layers", reading.spell(k, True)))
        for k in reading.config.get("modules_to_not_convert") or []:
            reading.entries.append(SkipEntry(k, "modules_to_not_convert", reading.spell(k, True), honoured=use_mtnc))

    def decide(self, policy, fqn: str, module_class: Any) -> Decision:
        if not is_linear(module_class, True):
            return Decision(True, (), "not a vLLM LinearBase")
        layers = [k for e in policy.honoured for k in e.match_as]
        if vllm_is_layer_skipped(fqn, layers, policy.fused_mapping):
            hits = tuple(e for e in policy.honoured if _entry_decides(fqn, e, policy.fused_mapping))
            return Decision(True, hits, "is_layer_skipped")
        return Decision(False, (), "quantized")

    def entry_hits(self, policy, entry: SkipEntry, spelling: str, name: str, module_class: Any) -> bool:
        try:
            return vllm_is_layer_skipped(name, [spelling], policy.fused_mapping)
        except ValueError:
            return True


register(VllmFp8())
