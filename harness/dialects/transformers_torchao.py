"""The ``transformers-torchao`` dialect: transformers 5.19 ``TorchAoHfQuantizer``:
``should_convert_module`` on the *parameter* name, then ``FqnToConfig`` as
``TorchAoQuantize.convert`` resolves it."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from harness.dialects import patterns, torchao
from harness.dialects.base import Decision, Reading, SkipEntry, register
from harness.dialects.torchao import FqnResolution
from harness.dialects.transformers import TransformersKeys, keys_with_defaults

NAME = "transformers-torchao"


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
        if patterns.fullmatch(pattern[3:], param_fqn):
            return FqnResolution(pattern, cfg[pattern], "param-regex")
        if patterns.fullmatch(pattern[3:], module_fqn):
            return FqnResolution(pattern, cfg[pattern], "module-regex")
    if "_default" in cfg:
        return FqnResolution("_default", cfg["_default"], "default")
    return FqnResolution(None, None, "unmatched")


class TransformersTorchao(TransformersKeys):
    name = NAME
    quant_method = "torchao"
    producer = True
    exact_containers = True
    param_suffix = ".weight"

    def read(self, reading: Reading) -> None:
        keys_with_defaults(reading, reading.config.get("modules_to_not_convert"), "modules_to_not_convert")
        if reading.config.get("include_input_output_embeddings"):
            reading.notes.append("include_input_output_embeddings: transformers drops the embedding names from its "
                                 "skip keys (not modelled)")
        torchao.read_fqn_to_config(reading)

    def decide_linear(self, policy, fqn: str) -> Decision:
        if torchao.torchao_quant_type(policy.config)[1] is not None:
            return torchao.decide_fqn(policy, transformers_torchao_resolve(torchao.fqn_map(policy), f"{fqn}.weight"))
        return Decision(False, (), "quantized")

    def entry_hits(self, policy, entry: SkipEntry, spelling: str, name: str, module_class: Any) -> bool:
        if entry.source == "fqn_to_config":
            return torchao.fqn_entry_hits(spelling, name)
        return super().entry_hits(policy, entry, spelling, name, module_class)

    def module_disagreements(self, policy, names, classes):
        return torchao.order_dependent(policy, names, param_names=True)


register(TransformersTorchao())
