"""The ``vllm-bnb`` dialect: vllm-bnb-plugin 0.0.3 ``is_layer_skipped_bnb``."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from harness.dialects.base import Decision, Dialect, Reading, SkipEntry, is_linear, register

NAME = "vllm-bnb"


def vllm_bnb_is_layer_skipped(prefix: str, skip_modules: Sequence[str]) -> bool:
    """vllm-bnb-plugin 0.0.3 ``quantization/utils.is_layer_skipped_bnb``: an entry equal to one
    dot component of the prefix, or equal to a dot-bounded leading part of it. Reads only
    ``llm_int8_skip_modules``; never ``modules_to_not_convert``; no name remapping."""
    components = prefix.split(".")
    if any(m in components for m in skip_modules):
        return True
    leading = {".".join(components[: i + 1]) for i in range(len(components))}
    return bool(set(skip_modules) & leading)


class VllmBnb(Dialect):
    name = NAME
    quant_method = "bitsandbytes"
    vllm = True
    regex_owner = "regex"

    def read(self, reading: Reading) -> None:
        for k in reading.config.get("llm_int8_skip_modules") or []:
            reading.entries.append(SkipEntry(k, "llm_int8_skip_modules", reading.spell(k)))
        for k in reading.config.get("modules_to_not_convert") or []:
            reading.entries.append(SkipEntry(k, "modules_to_not_convert", reading.spell(k), honoured=False))

    def decide(self, policy, fqn: str, module_class: Any) -> Decision:
        if not is_linear(module_class, True):
            return Decision(True, (), "not a vLLM LinearBase")
        hits = tuple(e for e in policy.honoured if vllm_bnb_is_layer_skipped(fqn, e.match_as))
        if hits:
            return Decision(True, hits, "is_layer_skipped_bnb")
        return Decision(False, (), "quantized")

    def entry_hits(self, policy, entry: SkipEntry, spelling: str, name: str, module_class: Any) -> bool:
        return vllm_bnb_is_layer_skipped(name, [spelling])


register(VllmBnb())
