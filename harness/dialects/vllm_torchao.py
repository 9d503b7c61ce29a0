"""The ``vllm-torchao`` dialect: vLLM 0.32 ``TorchAOConfig`` (dot-bounded substring,
``should_skip``)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from harness.dialects import patterns, torchao
from harness.dialects.base import Decision, Dialect, Reading, SkipEntry, is_linear, register
from harness.dialects.torchao import FqnResolution

NAME = "vllm-torchao"


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
    type_name, fqn = torchao.torchao_quant_type(quantization_config)
    if fqn is None:
        return FqnResolution("default", (quantization_config.get("quant_type") or {}).get("default"), "default")
    if prefix in fqn:
        return FqnResolution(prefix, fqn[prefix], "module")
    return torchao.regex_or_default(fqn, prefix, owner="regex")


class VllmTorchao(Dialect):
    name = NAME
    quant_method = "torchao"
    vllm = True
    regex_owner = "regex"

    def read(self, reading: Reading) -> None:
        torchao.read_unmapped(reading, reads_mtnc=True)  # TorchAOConfig never remaps names

    def decide(self, policy, fqn: str, module_class: Any) -> Decision:
        res = vllm_torchao_resolve(fqn, torchao.renamed_config(policy), is_linear=is_linear(module_class, True))
        if res.how == "skip_modules":
            hits = tuple(e for e in policy.honoured
                         if e.source in ("modules_to_not_convert", "fqn_to_config") and res.key in e.match_as)
            return Decision(True, hits, f"should_skip: {res.key!r} is a dot-bounded part of {fqn!r}")
        if res.how == "unmatched" and not is_linear(module_class, True):
            return Decision(True, (), "not a vLLM LinearBase")
        return torchao.decide_fqn(policy, res)

    def entry_hits(self, policy, entry: SkipEntry, spelling: str, name: str, module_class: Any) -> bool:
        if entry.source == "fqn_to_config":
            exact_or_full = spelling == name or (spelling.startswith("re:") and patterns.fullmatch(spelling[3:], name, owner="regex") is not None)
            return exact_or_full or (entry.value is None and vllm_torchao_should_skip(name, [spelling]))
        return vllm_torchao_should_skip(name, [spelling])

    def module_disagreements(self, policy, names, classes):
        return torchao.order_dependent(policy, names, param_names=False)


register(VllmTorchao())
