"""The ``transformers`` dialect: transformers 5.19 ``should_convert_module`` on module names
(``llm_int8_skip_modules`` for bitsandbytes), with the default list of
``HfQuantizer.get_modules_to_not_convert``.

Also the key matching and default keys that the ``transformers-torchao`` and ``transformers-fp8``
dialects share (``TransformersKeys``).
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from harness.dialects import patterns
from harness.dialects.base import Decision, Dialect, Reading, SkipEntry, is_linear, register

NAME = "transformers"


def _key_matches(name: str, key: str) -> bool:
    """One key of transformers 5.19 ``quantizers_utils.should_convert_module``.

    ``re.match(f"{key}\\.", name) or re.match(f"{key}", name) or name.endswith(key)``: the key is a
    regex anchored at the start only (so ``model.layers.1`` matches ``model.layers.11`` and every
    ``.`` is a wildcard), or a plain suffix without a dot boundary (``proj`` matches ``q_proj``).
    The first clause is implied by the second; it is kept to mirror the source. An invalid regex
    raises ``re.error``, as it does inside transformers.
    """
    return bool(patterns.match(f"{key}\\.", name) or patterns.match(f"{key}", name) or name.endswith(key))


def transformers_should_convert(name: str, patterns: Sequence[str] | None) -> bool:
    """transformers 5.19 ``should_convert_module(full_name, patterns)``, exactly: True means quantize.

    ``patterns=None`` converts everything. Callers pass module names (bitsandbytes' and FP8's
    ``replace_with_*_linear``) or parameter names (``TorchAoHfQuantizer.param_needs_quantization``
    passes ``...q_proj.weight``, so there a suffix key ``fc1`` no longer matches).
    """
    if patterns is None:
        return True
    return not any(_key_matches(name, key) for key in patterns)


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


def keys_with_defaults(reading: Reading, user: Sequence[str] | None, source: str) -> None:
    """The user's keys, or transformers' default keys when the list is null; then
    ``_keep_in_fp32_modules``. Notes a user list that drops the ``lm_head`` default."""
    if user is None:
        reading.entries.extend(SkipEntry(k, "default", (k,)) for k in reading.default_keys)
        reading.notes.append(f"{source} is null: transformers adds its default keys {list(reading.default_keys)}")
    else:
        reading.entries.extend(SkipEntry(k, source, reading.spell(k)) for k in user)
        try:
            covers = any(_key_matches("lm_head", k) for k in user)
        except (re.error, patterns.PatternTimeout):  # the decision itself will say so
            covers = True
        if "lm_head" in reading.default_keys and not covers:
            reading.notes.append(f"{source} replaces transformers' defaults and does not cover lm_head")
    reading.entries.extend(SkipEntry(k, "keep_in_fp32", (k,)) for k in reading.keep_in_fp32)


class TransformersKeys(Dialect):
    """``should_convert_module`` over the skip keys, on the module name (``param_suffix`` adds
    ``.weight`` for the dialects that match parameter names), then ``nn.Linear`` only."""

    keys_are_regexes = True
    uses_default_keys = True  # a null skip list means get_keys_to_not_convert(model)
    param_suffix = ""

    def decide(self, policy, fqn: str, module_class: Any) -> Decision:
        name = fqn + self.param_suffix
        keys = [e for e in policy.honoured if e.role == "skip" and e.source != "fqn_to_config"]
        hits = tuple(e for e in keys if any(_key_matches(name, k) for k in e.match_as))
        if hits:
            return Decision(True, hits, f"should_convert_module({name!r}) is False")
        if not is_linear(module_class, False):
            return Decision(True, (), "not an nn.Linear")
        return self.decide_linear(policy, fqn)

    def decide_linear(self, policy, fqn: str) -> Decision:
        return Decision(False, (), "quantized")

    def entry_hits(self, policy, entry: SkipEntry, spelling: str, name: str, module_class: Any) -> bool:
        return _key_matches(name + self.param_suffix, spelling)


class Transformers(TransformersKeys):
    name = NAME
    quant_method = "bitsandbytes"
    producer = True

    def read(self, reading: Reading) -> None:
        keys_with_defaults(reading, reading.config.get("llm_int8_skip_modules"), "llm_int8_skip_modules")
        for k in reading.config.get("modules_to_not_convert") or []:
            reading.entries.append(SkipEntry(k, "modules_to_not_convert", reading.spell(k), honoured=False))


register(Transformers())
