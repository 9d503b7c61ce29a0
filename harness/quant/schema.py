"""The schemas of every structure a checkpoint holds besides its tensors' bytes, checked before use.

A checkpoint is untrusted input (docs/design.md, "Bad input and faults"). Everything the harness
reads from one is validated here first, at the boundary, and a problem is one
``CheckpointError(<file>, "<key path>: <what>")`` (worded by harness.validation):

- ``config_json(data, file)``: ``config.json``: an object, ``architectures`` a non-empty list of
  names, ``model_type`` a name, and its quantization config by ``quant_method``;
- ``quantization_config(qc, file, prefix)``: each library's quantization config, as far as the
  harness reads it (the skip lists are lists of strings, config groups are objects with targets,
  a torchao ``_type`` names a class torchao itself would deserialize...). Keys the harness does
  not read are left to their library, as the libraries do;
- ``config_hints(data, file)``: config.json as the engines read it before loading, by type only;
- ``index(data, file)``: ``model.safetensors.index.json``: ``weight_map`` maps tensor names to
  plain ``.safetensors`` file names of the directory;
- ``torchao_tensor(meta, weight)``: the per-tensor JSON torchao writes into ``__metadata__``;
- ``safetensors_header(header, file)``: a safetensors header by type: each tensor's ``dtype``
  a string, ``shape`` and ``data_offsets`` lists of integers, ``__metadata__`` strings to strings
  (the values are then safetensors' to check);
- ``harness.quant.bnb.QuantState``: the JSON quant state bitsandbytes stores beside each 4-bit
  weight (beside the constants of the format it names);
- ``unique_object(text)``: JSON parsing that refuses a key given twice in one object (safetensors
  headers, where the last one would silently win).
"""
from __future__ import annotations

import functools
import importlib
import json
from collections.abc import Mapping
from typing import Annotated, Any, Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError,
                      WrapValidator, field_validator)
from pydantic_core import PydanticCustomError

from harness import registry
from harness.errors import CheckpointError
from harness.validation import problem, short

# Every format's quant_methods (harness.registry.FORMATS), and the other spellings that mean them.
KNOWN_METHODS = tuple(sorted(registry.methods()))
ALIASES = {alias: m.name for m in registry.methods().values() for alias in m.aliases}


def ConfigProblem(file: str, key: str, detail: str) -> CheckpointError:  # noqa: N802 (an error, like a class)
    """A structure that does not fit its schema: the CheckpointError for ``file``, ``key`` the key
    path in it (empty for the whole file), ``detail`` what is wrong; both kept as attributes."""
    e = CheckpointError(file, f"{key}: {detail}" if key else detail)
    e.key, e.detail = key, detail
    return e


class Open(BaseModel):
    """Keys not named are the library's own business; named keys must have the right type."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)


Names = Annotated[list[StrictStr], Field()]


# ----------------------------------------------------------------------------------- config.json


class ConfigJson(Open):
    architectures: list[StrictStr] = Field(min_length=1)
    model_type: StrictStr
    quantization_config: dict | None = None
    compression_config: dict | None = None


# ------------------------------------------------------------------------ quantization configs


Number = StrictFloat  # an integer or a float (never a boolean): strict floats take both


def either(*kinds, expected: str):
    """A field of several types whose mismatch is one problem at the field, saying all of them:
    pydantic reports a plain union member by member, each at a made-up key (``dynamic.bool: must
    be a boolean``)."""
    def check(value, handler):
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("either", f"Input should be {expected}") from None

    return Annotated[Union[kinds], WrapValidator(check)]  # noqa: UP007 (a tuple of types: Union[] spells it)


# The dtype names transformers' BitsAndBytesConfig turns into a torch dtype (``getattr(torch, name)``):
# the floating ones for the compute dtype, its own list for the quant storage.
COMPUTE_DTYPES = Literal["float32", "float16", "bfloat16", "float64", "float", "half", "double"]
QUANT_STORAGE_DTYPES = Literal["uint8", "int8", "float16", "bfloat16", "float32", "float64"]


class BitsandbytesConfig(Open):
    """transformers' ``BitsAndBytesConfig`` as it serializes itself, every field it writes: the bnb
    dialects read the skip lists, the reference and the engines the rest (vLLM's bnb loader the
    private ``_load_in_4bit``)."""

    quant_method: StrictStr | None = None
    load_in_4bit: StrictBool | None = None
    load_in_8bit: StrictBool | None = None
    private_load_in_4bit: StrictBool | None = Field(default=None, alias="_load_in_4bit")
    private_load_in_8bit: StrictBool | None = Field(default=None, alias="_load_in_8bit")
    llm_int8_skip_modules: Names | None = None
    modules_to_not_convert: Names | None = None
    llm_int8_threshold: Number | None = None
    llm_int8_has_fp16_weight: StrictBool | None = None
    llm_int8_enable_fp32_cpu_offload: StrictBool | None = None
    bnb_4bit_quant_type: Literal["nf4", "fp4"] | None = None
    bnb_4bit_use_double_quant: StrictBool | None = None
    bnb_4bit_compute_dtype: COMPUTE_DTYPES | None = None
    bnb_4bit_quant_storage: QUANT_STORAGE_DTYPES | None = None


class QuantArgs(Open):
    """compressed-tensors ``QuantizationArgs``, every field it serializes (the loader reads the
    first five and the group and block layout; the engines hand the rest to the library)."""

    num_bits: StrictInt | None = Field(default=None, ge=1, le=64)
    type: Literal["int", "float"] | None = None
    strategy: StrictStr | None = None
    dynamic: either(StrictBool, Literal["local"], expected="a boolean or 'local'") | None = None
    symmetric: StrictBool | None = None
    group_size: StrictInt | None = None
    block_structure: list[StrictInt] | None = None
    actorder: either(StrictBool, StrictStr, expected="a boolean or a string") | None = None
    observer: StrictStr | None = None
    observer_kwargs: dict | None = None
    scale_dtype: StrictStr | None = None  # a torch dtype's name, "float32" or "torch.float32"
    zp_dtype: StrictStr | None = None


class CtScheme(Open):
    """compressed-tensors ``QuantizationScheme``."""

    targets: Names = Field(min_length=1)
    weights: QuantArgs | None = None
    input_activations: QuantArgs | None = None
    output_activations: QuantArgs | None = None
    format: StrictStr | None = None


class CompressedTensorsConfig(Open):
    quant_method: StrictStr
    config_groups: dict[StrictStr, CtScheme] | None = None
    ignore: Names | None = None
    kv_cache_scheme: QuantArgs | None = None
    format: StrictStr | None = None
    quantization_status: StrictStr | None = None
    global_compression_ratio: Number | None = None
    sparsity_config: dict | None = None
    transform_config: dict | None = None
    version: StrictStr | None = None


class Fp8Config(Open):
    """``quant_method: fp8`` (vLLM's ``Fp8Config``, transformers' ``FineGrainedFP8Config``: every
    field either writes)."""

    quant_method: StrictStr
    activation_scheme: Literal["static", "dynamic"] | None = None
    ignored_layers: Names | None = None
    modules_to_not_convert: Names | None = None
    modules_to_convert: Names | None = None
    weight_block_size: list[StrictInt] | None = None
    dequantize: StrictBool | None = None
    scale_fmt: StrictStr | None = None


@functools.cache
def torchao_modules() -> tuple:
    """The modules torchao 0.18's ``config_from_dict`` looks a ``_type`` up in (its
    ``ALLOWED_AO_MODULES`` that import here), in the order it searches them. Imported once: a
    config names many ``_type``s."""
    from torchao.core.config import ALLOWED_AO_MODULES

    modules = []
    for module_path in sorted(ALLOWED_AO_MODULES):
        try:
            modules.append(importlib.import_module(module_path))
        except ImportError:
            continue
    return tuple(modules)


def torchao_class(name: str) -> type | None:
    """The class torchao 0.18's ``config_from_dict`` would deserialize ``_type`` ``name`` into: the
    attribute of that name in the first of :func:`torchao_modules` that has one; None when none
    has. Nothing is instantiated."""
    for module in torchao_modules():
        found = getattr(module, name, None)
        if isinstance(found, type):
            return found
    return None


def _serialized_types(value: Any, path: str):
    """(path, _type) of every serialized torchao object inside ``value``."""
    if isinstance(value, Mapping):
        if "_type" in value:
            yield path, value["_type"]
        for k, v in value.items():
            yield from _serialized_types(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _serialized_types(v, f"{path}[{i}]")


# torchao 0.18 configs whose weights only CUDA kernels compute with: every packing format of
# Int4WeightOnlyConfig fails on a CPU. IntxWeightOnlyConfig(weight_dtype=torch.int4) runs anywhere.
CUDA_ONLY_TORCHAO = frozenset({"Int4WeightOnlyConfig"})


def torchao_config_types(qc: Mapping) -> set[str]:
    """The ``_type`` of every torchao object a torchao quantization config serializes (its configs,
    granularities, formats), read by type, never as a substring of the JSON."""
    return {t for _, t in _serialized_types(qc.get("quant_type") or {}, "") if isinstance(t, str)}


def cpu_problem_of_torchao(qc: Mapping) -> str | None:
    """Why a torchao checkpoint cannot compute on a CPU (a config of CUDA_ONLY_TORCHAO); None when it can."""
    found = sorted(torchao_config_types(qc) & CUDA_ONLY_TORCHAO)
    return (f"torchao {', '.join(found)} has no CPU kernel (torchao 0.18 fails on CPU for every packing format)"
            if found else None)


class TorchaoSerialized(Open):
    """A torchao config as ``TorchAoConfig.to_dict`` serializes it (``{"_type", "_version", "_data"}``)."""

    type_: StrictStr = Field(alias="_type")
    version: StrictInt | None = Field(default=None, alias="_version")
    data: dict = Field(default_factory=dict, alias="_data")

    @field_validator("type_")
    @classmethod
    def _known(cls, v: str) -> str:
        from torchao.core.config import AOBaseConfig

        found = torchao_class(v)
        if found is None or not issubclass(found, AOBaseConfig):
            raise ValueError(f"{v!r} is not a torchao config class (torchao deserializes only AOBaseConfig "
                             "subclasses of its own modules)")
        return v


class TorchaoConfig(Open):
    quant_method: StrictStr
    quant_type: dict[StrictStr, TorchaoSerialized] | None = None
    modules_to_not_convert: Names | None = None
    include_input_output_embeddings: StrictBool | None = None
    untie_embedding_weights: StrictBool | None = None


# ------------------------------------------------------------------------------------ messages


def _key(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def validate(model: type[BaseModel], data: Any, file: str, prefix: str = "") -> BaseModel:
    """``data`` validated by ``model``; a problem is the ConfigProblem of ``file`` at ``prefix``."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigProblem(file, *problem(e, prefix)) from None


# --------------------------------------------------------------------------------- entry points


def method_of(qc: Mapping, file: str, prefix: str = "quantization_config") -> str:
    """The quant_method of a quantization config, normalised (``bitsandbytes_4bit`` ->
    ``bitsandbytes``), one of KNOWN_METHODS."""
    method = qc.get("quant_method")
    if method is None:
        if qc.get("load_in_4bit") is True or qc.get("load_in_8bit") is True:
            return "bitsandbytes"  # configs written before transformers recorded quant_method
        raise ConfigProblem(file, _key(prefix, "quant_method"), "required key is missing")
    if not isinstance(method, str):
        raise ConfigProblem(file, _key(prefix, "quant_method"), f"must be a string (got {short(method)})")
    normal = ALIASES.get(method.lower(), method.lower())
    if normal not in KNOWN_METHODS:
        raise ConfigProblem(file, _key(prefix, "quant_method"), f"unknown quant_method {method!r} "
                                                               f"(known: {', '.join(KNOWN_METHODS)})")
    return normal


def quantized_activations(qc: Mapping | None) -> list[str]:
    """What an (already validated) quantization config quantizes besides weights: ``input`` (FP8
    input scales, static or dynamic per token: compressed-tensors ``input_activations``, the fp8
    method's activation scheme, which is dynamic when unsaid, torchao's dynamic-activation configs)
    and ``kv-cache`` (a ``kv_cache_scheme``). Empty for weight-only schemes and for None."""
    if not qc:
        return []
    method = method_of(qc, "config.json")
    groups = (qc.get("config_groups") or {}).values() if method == "compressed-tensors" else ()
    quant_types = json.dumps(qc.get("quant_type")) if method == "torchao" else ""
    inputs = (method == "fp8" or any(g.get("input_activations") for g in groups)
              or "DynamicActivation" in quant_types)
    return ["input"] * bool(inputs) + ["kv-cache"] * bool(qc.get("kv_cache_scheme"))


def scales_span_tokens(qc: Mapping | None) -> bool:
    """Whether an (already validated) quantization config takes an activation scale at run time
    over more than one token, which makes the rows of one forward pass depend on each other
    (harness.scoring): a dynamic compressed-tensors scale of any strategy but ``token`` (inputs
    or KV cache), or a torchao dynamic-activation config not per row. Static scales and the fp8
    method's dynamic ones (per token, or per token group) keep every token to itself."""
    if not qc:
        return False
    method = method_of(qc, "config.json")
    if method == "compressed-tensors":
        args = [g.get("input_activations") or {} for g in (qc.get("config_groups") or {}).values()]
        return any(a.get("dynamic") not in (None, False) and a.get("strategy") != "token"
                   for a in [*args, qc.get("kv_cache_scheme") or {}])
    if method == "torchao":
        quant_types = json.dumps(qc.get("quant_type"))
        return "DynamicActivation" in quant_types and "PerRow" not in quant_types
    return False


def quantization_config(qc: Any, file: str, prefix: str = "quantization_config") -> str:
    """Validate one quantization config; its normalised quant_method."""
    if not isinstance(qc, Mapping):
        raise ConfigProblem(file, prefix, f"must be an object (got {short(qc)})")
    method = method_of(qc, file, prefix)
    check = registry.resolve(registry.methods()[method].schema)  # a model, or a function validating it
    if isinstance(check, type) and issubclass(check, BaseModel):
        validate(check, qc, file, prefix)
    else:
        check(qc, file, prefix)
    return method


def validate_torchao(qc: Mapping, file: str, prefix: str) -> None:
    """A torchao config: TorchaoConfig, and every serialized object inside it a class torchao deserializes."""
    cfg = validate(TorchaoConfig, qc, file, prefix)
    for name, ser in (cfg.quant_type or {}).items():
        where = _key(prefix, f"quant_type.{name}._data")
        fqn = {k: ser.data[k] for k in ("fqn_to_config", "module_fqn_to_config") if k in ser.data}
        for key, table in fqn.items():
            if not isinstance(table, Mapping):
                raise ConfigProblem(file, f"{where}.{key}", f"must be an object (got {short(table)})")
            for fq, value in table.items():
                if value is not None:
                    validate(TorchaoSerialized, value, file, f"{where}.{key}.{fq}")
        for path, type_name in _serialized_types(ser.data, where):
            if type_name == "torch.dtype":
                continue
            if not isinstance(type_name, str) or torchao_class(type_name) is None:
                raise ConfigProblem(file, f"{path}._type", f"{short(type_name)} is not a class torchao deserializes")


def config_json(data: Any, file: str) -> dict:
    """Validate a parsed config.json (and its quantization config); the dict itself."""
    if not isinstance(data, dict):
        raise ConfigProblem(file, "", f"must be a JSON object (got {short(data)})")
    cfg = validate(ConfigJson, data, file, "")
    for key in ("quantization_config", "compression_config"):
        qc = getattr(cfg, key)
        if qc is not None:
            quantization_config(qc, file, key)
            break
    return data


class ConfigHints(Open):
    """What the engines read of config.json before they load (harness.engines.base.Checkpoint):
    the architectures and the quantization config, by type only (an engine may know quant_methods
    the harness does not); the load validates the whole (config_json)."""

    architectures: list[StrictStr] | None = None
    quantization_config: dict | None = None


def config_hints(data: Any, file: str) -> dict:
    """Validate a parsed config.json as far as ConfigHints; the dict itself."""
    if not isinstance(data, dict):
        raise ConfigProblem(file, "", f"must be a JSON object (got {short(data)})")
    validate(ConfigHints, data, file)
    return data


class Index(Open):
    weight_map: dict[StrictStr, Annotated[StrictStr, Field(pattern=r"^[^/\\]+\.safetensors$")]]
    metadata: dict | None = None


def index(data: Any, file: str) -> dict[str, str]:
    """Validate a safetensors index; its weight_map (tensor name -> file name in the directory)."""
    if not isinstance(data, dict):
        raise ConfigProblem(file, "", f"must be a JSON object (got {short(data)})")
    for shard in (data.get("weight_map") or {}).values() if isinstance(data.get("weight_map"), dict) else ():
        if shard in (".", "..") or (isinstance(shard, str) and ("/" in shard or "\\" in shard)):
            raise ConfigProblem(file, "weight_map", f"shard {shard!r} is not a file name in the checkpoint directory")
    return dict(validate(Index, data, file, "").weight_map)


class TorchaoDtype(Open):
    type_: Literal["torch.dtype"] = Field(alias="_type")
    data: StrictStr = Field(alias="_data")


class TorchaoTensorData(Open):
    block_size: list[Annotated[StrictInt, Field(gt=0)]] | None = None
    dtype: TorchaoDtype | StrictStr | None = None


class TorchaoTensor(Open):
    type_: StrictStr = Field(alias="_type")
    data: TorchaoTensorData = Field(default_factory=TorchaoTensorData, alias="_data")
    tensor_data_names: list[StrictStr] | None = Field(default=None, alias="_tensor_data_names")


def torchao_tensor(meta: Any, weight: str) -> dict:
    """Validate the torchao metadata of one weight; the dict itself."""
    if not isinstance(meta, dict):
        raise ConfigProblem(weight, "torchao metadata", f"must be a JSON object (got {short(meta)})")
    validate(TorchaoTensor, meta, weight, "torchao metadata")
    return meta


class HeaderEntry(Open):
    """One tensor of a safetensors header (its values are then checked by safetensors itself)."""

    dtype: StrictStr
    shape: list[StrictInt]
    data_offsets: Annotated[list[StrictInt], Field(min_length=2, max_length=2)]


class SafetensorsHeader(BaseModel):
    """A safetensors header: ``__metadata__`` maps strings to strings, every other key is a tensor.
    (Not Open: a tensor may be named ``metadata``.)"""

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, HeaderEntry] = Field(init=False)
    metadata: dict[StrictStr, StrictStr] | None = Field(default=None, alias="__metadata__")


def safetensors_header(header: Any, file: str) -> dict:
    """Validate a parsed safetensors header by type; the dict itself."""
    if not isinstance(header, dict):
        raise ConfigProblem(file, "", "not a readable safetensors file: header is not a JSON object")
    validate(SafetensorsHeader, header, file)
    return header


class DuplicateKey(ValueError):
    """A JSON object that gives one key twice (``key``)."""

    def __init__(self, key: str):
        super().__init__(f"the key {key!r} appears twice")
        self.key = key


def unique_object(text: str) -> Any:
    """``json.loads`` that raises DuplicateKey for a key given twice in one object."""
    def pairs(items):
        seen: dict = {}
        for k, v in items:
            if k in seen:
                raise DuplicateKey(k)
            seen[k] = v
        return seen

    return json.loads(text, object_pairs_hook=pairs)
