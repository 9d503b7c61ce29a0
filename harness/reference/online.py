"""Online quantization: an unquantized checkpoint quantized by the reference at load time.

`reference.load(path, quantization=CONFIG)` reads each float weight once (mmap), asks the config's
own skip dialect whether the module is quantized, and quantizes it in plain torch
(`harness.quant.quantize`) into the same `Decoded` a pre-quantized checkpoint of that scheme
decodes to; fusion, assignment and the load report then proceed as for any checkpoint. No library
is called, and nothing full-size is allocated besides the weights the model keeps: the skeleton
is on the meta device and the quantizers bound their temporaries.

CONFIG is a quantization config in the format its library serializes to (a dict, a JSON file, or
the name of one of `PRESETS`):

=====================  ==================================================  ================  ==============
config                 what it is                                          label             skip dialect
=====================  ==================================================  ================  ==============
bitsandbytes           transformers `BitsAndBytesConfig(load_in_4bit=True, bnb-nf4 / bnb-fp4  transformers
                       bnb_4bit_quant_type=...).to_dict()`; blocksize 64
                       (bitsandbytes' `Linear4bit` default; transformers
                       cannot set it)
torchao                transformers `TorchAoConfig(Int8WeightOnlyConfig()   torchao-int8      transformers-torchao
                       | FqnToConfig({...})).to_dict()`; PerRow or
                       PerTensor; FqnToConfig values None or
                       Int8WeightOnlyConfig
fp8                    vLLM `quantization="fp8"`: `{"quant_method": "fp8",   fp8-tensor        vllm-fp8
                       "activation_scheme": "dynamic", "ignored_layers":
                       [...]}`, what vLLM's `Fp8Config` reads
compressed-tensors     a compressed-tensors `QuantizationConfig` dict with  fp8-tensor /      compressed-tensors
                       float 8-bit weights (tensor or channel) and dynamic  fp8-channel
                       per-token float 8-bit inputs (or none)
=====================  ==================================================  ================  ==============

"online-fp8" means vLLM's `quantization="fp8"`: a per-tensor weight scale amax / 448, activations
quantized dynamically per token (vLLM's cutlass path), and a fused projection (qkv, gate-up,
cross-kv) quantized as one merged weight, so its shards share the largest of their scales and are
quantized from the float values once. Unfused, each module has its own scale, which is what
compressed-tensors does in transformers (the oracle: transformers 5.19 has no online FP8 that runs
on a CPU; see suites/conformance/test_online.py).

A config whose numerics the reference does not model (bitsandbytes 8-bit or double quant, torchao
int4 or float8, static FP8 activations, block-wise FP8, ...) is refused with a `CheckpointError`
naming the key, never approximated.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from harness import architectures, dialects, files, registry
from harness.dialects import SkipPolicy, intent_disagreements
from harness.dialects.compressed_tensors import ct_resolve
from harness.dialects.names import to_vllm
from harness.dialects.torchao import torchao_quant_type
from harness.dialects.transformers import transformers_default_skip_keys
from harness.dialects.transformers_torchao import transformers_torchao_resolve
from harness.errors import CheckpointError
from harness.quant import Decoded, quantize, schema
from harness.reference.report import Disagreement, LoadReport

WHERE = "quantization"

# The configs the matrix's online schemes mean, exactly as their libraries serialize them: each
# format's presets (harness.registry.FORMATS).
PRESETS: dict[str, dict] = {name: config for spec in registry.FORMATS.values() for name, config in spec.presets.items()}

_FP8_ARGS = {"num_bits": 8, "type": "float", "symmetric": True}


def read_config(spec: Any) -> dict:
    """A quantization config from a dict, a preset name, a JSON file or a JSON string. A whole
    config.json (a dict holding `quantization_config`) gives its `quantization_config`."""
    if isinstance(spec, Mapping):
        config = dict(spec)
    elif isinstance(spec, (str, Path)) and str(spec) in PRESETS:
        config = json.loads(json.dumps(PRESETS[str(spec)]))
    elif isinstance(spec, str) and spec.lstrip().startswith("{"):
        try:
            config = json.loads(spec)
        except json.JSONDecodeError as e:
            raise CheckpointError(WHERE, f"invalid JSON: {e}") from None
    elif isinstance(spec, (str, Path)) and Path(spec).is_file():
        try:
            config = json.loads(files.read_text(spec))
        except files.Unreadable as e:
            raise CheckpointError(str(spec), e.reason) from None
        except json.JSONDecodeError as e:
            raise CheckpointError(str(spec), f"invalid JSON: {e}") from None
    else:
        raise CheckpointError(WHERE, f"{spec!r} is neither a config dict, a JSON file nor one of {sorted(PRESETS)}")
    if not isinstance(config, dict):
        raise CheckpointError(WHERE, f"the config is a {type(config).__name__}, not an object")
    if "quant_method" not in config and isinstance(config.get("quantization_config"), dict):
        config = dict(config["quantization_config"])
    return config


class OnlineQuantizer:
    """One online quantization config, checked; `apply` quantizes a loader's decoded weights."""

    def __init__(self, config: Mapping[str, Any]):
        self.config = dict(config)
        if self.config.get("quant_method") in schema.KNOWN_METHODS:  # the rest is refused below, by name
            try:
                schema.quantization_config(self.config, WHERE, "")
            except CheckpointError as e:  # harness.quant.schema.ConfigProblem: named by its key here
                raise CheckpointError(f"{WHERE}.{e.key}" if e.key else WHERE, e.detail) from None
        method = self.config.get("quant_method")
        method = getattr(method, "value", method)
        checks = {"bitsandbytes": self._check_bnb, "torchao": self._check_torchao, "fp8": self._check_fp8,
                  "compressed-tensors": self._check_ct}
        if method not in checks:
            raise CheckpointError(f"{WHERE}.quant_method", f"{method!r} cannot be quantized online here; "
                                                           f"one of {sorted(checks)}")
        self.method: str = method
        self.notes: list[str] = []
        self.activation: str | None = None  # 'dynamic' when FP8 inputs are quantized per token
        checks[method]()
        self.dialect = dialects.PRODUCER_DIALECT[method]

    @classmethod
    def from_config(cls, spec: Any, checkpoint_quantization: Mapping | None = None) -> OnlineQuantizer:
        """Check `spec` (see `read_config`) for a checkpoint whose own config.json quantization
        config is `checkpoint_quantization`: online quantization needs an unquantized checkpoint."""
        if checkpoint_quantization:
            raise CheckpointError(WHERE, "the checkpoint is already quantized (quant_method "
                                         f"{checkpoint_quantization.get('quant_method')!r}); online quantization "
                                         "takes an unquantized checkpoint")
        return cls(read_config(spec))

    # -- what each config means ---------------------------------------------------------------

    def _refuse(self, key: str, why: str):
        raise CheckpointError(f"{WHERE}.{key}", why)

    def _check_bnb(self) -> None:
        c = self.config
        if c.get("load_in_8bit") or c.get("_load_in_8bit"):
            self._refuse("load_in_8bit", "bitsandbytes 8-bit (LLM.int8) is not supported online; only 4-bit")
        if not (c.get("load_in_4bit") or c.get("_load_in_4bit")):
            self._refuse("load_in_4bit", "a bitsandbytes config must set load_in_4bit")
        self.quant_type = c.get("bnb_4bit_quant_type", "fp4")
        if self.quant_type not in ("nf4", "fp4"):
            self._refuse("bnb_4bit_quant_type", f"{self.quant_type!r} is not nf4 or fp4")
        if c.get("bnb_4bit_use_double_quant"):
            self._refuse("bnb_4bit_use_double_quant", "double quant is not modelled online (its absmax codes come "
                                                      "from bitsandbytes' C blockwise kernel)")
        compute = c.get("bnb_4bit_compute_dtype", "float32")
        if str(compute).removeprefix("torch.") != "float32":
            self.notes.append(f"bnb_4bit_compute_dtype={compute}: bitsandbytes computes in it, the reference in float32")
        self.blocksize = 64

    def _int8_granularity(self, key: str, cfg: Any) -> str:
        if not isinstance(cfg, Mapping) or cfg.get("_type") != "Int8WeightOnlyConfig":
            name = cfg.get("_type") if isinstance(cfg, Mapping) else cfg
            self._refuse(key, f"{name!r}: only Int8WeightOnlyConfig (or None) is quantized online")
        data = cfg.get("_data") or {}
        if cfg.get("_version", 2) != 2 or data.get("group_size") is not None:
            self._refuse(key, "Int8WeightOnlyConfig version 1 / group_size is not supported")
        gran = data.get("granularity") or {"_type": "PerRow", "_data": {"dim": -1}}
        kind = gran.get("_type") if isinstance(gran, Mapping) else None
        if kind == "PerRow" and (gran.get("_data") or {}).get("dim", -1) in (-1, 1):
            return "per-row"
        if kind == "PerTensor":
            return "per-tensor"
        self._refuse(key, f"granularity {gran!r}: only PerRow() and PerTensor() are supported")

    def _check_torchao(self) -> None:
        c = self.config
        if c.get("include_input_output_embeddings"):
            self._refuse("include_input_output_embeddings", "quantizing embeddings is not supported online")
        type_name, fqn = torchao_quant_type(c)
        if type_name is None:
            self._refuse("quant_type", f"{c.get('quant_type')!r}: expected {{'default': <serialized torchao config>}}")
        self.fqn_to_config = fqn
        if fqn is None:
            self.granularity = {"default": self._int8_granularity("quant_type.default", c["quant_type"]["default"])}
        else:
            self.granularity = {k: self._int8_granularity(f"quant_type.default.fqn_to_config[{k!r}]", v)
                                for k, v in fqn.items() if v is not None}

    def _check_fp8(self) -> None:
        c = self.config
        scheme = c.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            self._refuse("activation_scheme", f"{scheme!r}: online FP8 has no calibration data; only 'dynamic'")
        if c.get("weight_block_size") is not None:
            self._refuse("weight_block_size", "block-wise FP8 is not quantized online (vLLM refuses it too)")
        self.strategy = "tensor"
        self.activation = "dynamic"

    def _check_ct(self) -> None:
        c = self.config
        if c.get("kv_cache_scheme"):
            self._refuse("kv_cache_scheme", "an FP8 KV cache needs calibrated k/v scales; not online")
        groups = c.get("config_groups") or {}
        if not groups:
            self._refuse("config_groups", "no config groups: nothing would be quantized")
        inputs = set()
        self.strategies: dict[str, str] = {}
        for name, group in groups.items():
            where = f"config_groups.{name}"
            w = group.get("weights")
            if w is None:
                self._refuse(f"{where}.weights", "a group without weights is not supported online")
            if (any(w.get(k) != v for k, v in _FP8_ARGS.items()) or w.get("dynamic") or w.get("group_size")
                    or w.get("block_structure") or w.get("strategy") not in ("tensor", "channel")):
                self._refuse(f"{where}.weights", "only symmetric float 8-bit weights, per tensor or per channel")
            self.strategies[name] = w["strategy"]
            a = group.get("input_activations")
            if a is None:
                inputs.add(None)
            elif (any(a.get(k) != v for k, v in _FP8_ARGS.items()) or a.get("dynamic") is not True
                  or a.get("strategy") != "token"):
                self._refuse(f"{where}.input_activations", "only dynamic per-token float 8-bit inputs (or none)")
            else:
                inputs.add("dynamic")
            if group.get("output_activations") is not None:
                self._refuse(f"{where}.output_activations", "output activation quantization is not supported")
        if len(inputs) > 1:
            self._refuse("config_groups", "groups that differ in input quantization are not supported online")
        self.activation = inputs.pop()

    # -- deciding and quantizing --------------------------------------------------------------

    def policy(self, model: nn.Module, arch: str) -> SkipPolicy:
        """The config read in its own dialect, with transformers' default skip keys for this model
        (its tied and output-embedding modules, computed on the meta skeleton)."""
        if dialects.get(self.dialect).uses_default_keys:
            return SkipPolicy.from_quantization_config(
                self.config, arch=arch, default_keys=transformers_default_skip_keys(model),
                keep_in_fp32=list(getattr(model, "_keep_in_fp32_modules", None) or ()))
        return SkipPolicy.from_quantization_config(self.config, arch=arch)

    def plan(self, model: nn.Module, names: list[str], arch: str) -> tuple[dict[str, tuple[str, Any]], list[Disagreement], list[str]]:
        """name -> ('skip', reason) or ('quantize', what), plus disagreements and notes."""
        policy = self.policy(model, arch)
        if policy.reader.vllm and names:
            try:
                to_vllm(names[0], arch)
            except KeyError as e:
                raise CheckpointError(WHERE, f"the {self.dialect} dialect needs vLLM's module names, which are "
                                             f"not modelled here: {e.args[0]}") from None
        out_emb = model.get_output_embeddings()
        output_names = {n for n, m in model.named_modules() if out_emb is not None and m is out_emb}
        with policy.checked(WHERE):
            return self._plan(policy, model, names, arch, output_names)

    def _plan(self, policy, model, names, arch, output_names):
        plan: dict[str, tuple[str, Any]] = {}
        found: list[Disagreement] = []
        notes: list[str] = []
        for name in names:
            if policy.reader.vllm:
                decision, extra = self._decide_vllm(policy, name, arch, name in output_names)
                found.extend(extra)
            else:
                decision = policy.decide(name, "Linear")
            if decision.skipped:
                plan[name] = ("skip", f"{policy.dialect}: {decision.reason}")
                continue
            plan[name] = ("quantize", self._what(name))
            if self.method == "torchao" and self.fqn_to_config is not None:
                bias = transformers_torchao_resolve(self.fqn_to_config, f"{name}.bias")
                if bias.config is not None and getattr(model.get_submodule(name), "bias", None) is not None:
                    notes.append(f"{name}.bias: FqnToConfig {bias.how} entry {bias.key!r} makes transformers 5.19 "
                                 "quantize this bias too (an Int8Tensor bias, which breaks its forward); "
                                 "the reference keeps biases in float")
        spelled = [to_vllm(n, arch) for n in names] if policy.reader.vllm else names
        found.extend(Disagreement.from_entry(d) for d in intent_disagreements(policy, spelled))
        return plan, found, notes + [f"{policy.dialect}: {x}" for x in policy.notes]

    def _decide_vllm(self, policy, name: str, arch: str, is_output: bool):
        prefix = to_vllm(name, arch)
        cls = "ParallelLMHead" if is_output else "Linear"
        try:
            return policy.decide(prefix, cls), []
        except ValueError as e:
            # vLLM refuses a fused layer whose shards differ; the reference loads the shards unfused.
            shard = f"{prefix.rpartition('.')[0]}.{name.rpartition('.')[2]}"
            return policy.decide(shard, cls), [Disagreement(name, f"{policy.dialect}:partial-fused-group",
                                                            f"vLLM 0.32 raises: {e}; the reference decides the shard {shard!r} alone")]

    def _what(self, name: str) -> Any:
        if self.method == "bitsandbytes":
            return {"quant_type": self.quant_type, "blocksize": self.blocksize}
        if self.method == "torchao":
            if self.fqn_to_config is None:
                return {"granularity": self.granularity["default"]}
            res = transformers_torchao_resolve(self.fqn_to_config, f"{name}.weight")
            return {"granularity": self.granularity[res.key]}
        if self.method == "fp8":
            return {"strategy": "tensor"}
        res = ct_resolve(name, "Linear", self.config.get("config_groups") or {}, self.config.get("ignore"))
        return {"strategy": self.strategies[res.group]}

    def quantize(self, weight: torch.Tensor, what: Mapping[str, Any], scale: torch.Tensor | None = None) -> Decoded:
        if self.method == "bitsandbytes":
            return quantize.bnb_4bit(weight, what["quant_type"], what["blocksize"])
        if self.method == "torchao":
            return quantize.torchao_int8(weight, what["granularity"])
        return quantize.fp8_weight(weight, what["strategy"], scale)

    def apply(self, model: nn.Module, decoded: dict[str, tuple[Decoded, torch.Tensor | None]], *,
              arch: str, fuse: bool, report: LoadReport) -> None:
        """Quantize `decoded` (in-memory name -> (unquantized Decoded, bias)) in place, as the
        config says, and record labels, skip reasons and disagreements in `report`."""
        for name, (dec, _) in decoded.items():
            if dec.label != "unquantized" or dec.fp8 is not None:
                raise CheckpointError(name, f"holds {dec.label} weights; online quantization takes an unquantized checkpoint")
        plan, found, notes = self.plan(model, list(decoded), arch)
        shared = self._shared_scales(model, plan, decoded) if fuse else {}
        for name, (action, what) in plan.items():
            dec, bias = decoded[name]
            if action == "quantize":
                decoded[name] = (self.quantize(dec.weight, what, shared.get(name)), bias)
            else:
                report.notes.append(f"online: {name} left unquantized ({what})")
            report.modules[name] = decoded[name][0].label
        quantized = sum(1 for a, _ in plan.values() if a == "quantize")
        report.notes.insert(0, f"online quantization: {self.method} config read in the {self.dialect} dialect; "
                               f"{quantized} of {len(plan)} linears quantized")
        report.notes.extend(self.notes + notes)
        if shared:
            report.notes.append(f"online: {len(shared)} per-tensor FP8 shards quantized with their fused group's "
                                "largest scale, as vLLM quantizes a merged weight once")
        report.disagreements.extend(found)

    def _shared_scales(self, model, plan, decoded) -> dict[str, torch.Tensor]:
        """Per-tensor FP8 shards of a group that will fuse get the group's max scale."""
        if self.method not in ("fp8", "compressed-tensors"):
            return {}
        shared: dict[str, torch.Tensor] = {}
        for parent, rule in architectures.fusion_groups(model):
            shards = [f"{parent}.{s}" if parent else s for s in rule.shards]
            whats = [plan[s] for s in shards]
            if any(a != "quantize" or w != whats[0][1] for a, w in whats) or whats[0][1]["strategy"] != "tensor":
                continue
            scale = torch.stack([quantize.fp8_scale(decoded[s][0].weight, "tensor") for s in shards]).max()
            shared.update({s: scale for s in shards})
        return shared
