"""The reference loader: skip-aware, quantization-aware loading of a checkpoint directory.

The skeleton is built on the meta device, tensors are read through mmap, every on-disk layout is
decoded in plain torch (harness.quant), fused groups follow docs/design.md, "Fusion rule", and the result is
the architecture's own transformers module with reference linears in place of nn.Linear.
"""
import json
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from accelerate import init_empty_weights
from transformers.initialization import no_init_weights
from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

from harness import architectures, files
from harness.errors import CheckpointError
from harness.dialects import SkipPolicy, intent_disagreements, names
from harness.quant import Decoded, fp8, formats, schema
from harness.quant.source import TensorSource
from harness.reference import attention, cross_attention, finite
from harness.reference import online  # online quantization: load(..., quantization=)
from harness.reference.linear import FusedLinear, InputQuant, ReferenceLinear
from harness.reference.report import Disagreement, FusedGroup, LoadReport


@dataclass
class Loaded:
    model: nn.Module
    report: LoadReport


class _Phases:
    def __init__(self, timings: dict[str, float]):
        self.timings = timings

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[phase] = self.timings.get(phase, 0.0) + time.perf_counter() - start


def load(path, device: str = "cpu", fuse: bool = True, quantization=None) -> Loaded:
    """Load a checkpoint directory. `fuse=False` keeps every projection separate, which is how
    transformers executes it; the default fuses as an engine does (docs/design.md, "Fusion rule"). `quantization`, a
    quantization config (dict, JSON file or preset name; harness.reference.online), quantizes an
    unquantized checkpoint at load time."""
    path = Path(path)
    config_dict = _read_config(path)
    quant_config, method, online_q = _quantization(config_dict, quantization)
    report = LoadReport(str(path), config_dict["architectures"][0], method)
    phase = _Phases(report.timings)
    started = time.perf_counter()

    with phase("read"):
        src = TensorSource.open(path)
    with phase("skeleton"):
        model = _skeleton(path, config_dict, src)
    arch = model.config.model_type
    src.metadata_aliases = {_disk_name(key, arch): key for key in src.metadata}
    _check_layer_counts(model, src, arch, path / "config.json")

    # Parameters a checkpoint may store once for several names: {target: source}, in-memory names.
    tied = model.get_expanded_tied_weights_keys(all_submodels=True)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    activation = _activation_scheme(quant_config) if online_q is None else online_q.activation
    with phase("decode"):
        decoded = _decode_linears(src, linears, arch, tied, activation, report)
    if online_q is not None:
        with phase("quantize"):
            online_q.apply(model, decoded, arch=arch, fuse=fuse, report=report)

    with phase("fuse"):
        replacements, fused_kv = _fuse_groups(model, decoded, activation, fuse, report)

    with phase("assign"):
        _assign_linears(src, model, decoded, replacements, arch, tied, activation, report)
        _install_cross_attention(model, fused_kv)
        _assign_remaining(src, model, arch, tied)
        _attach_kv_scales(src, model, arch, quant_config, report)

    if online_q is None:  # online: the quantizer's own decisions; it recorded their disagreements
        report.disagreements.extend(_disagreements(quant_config, report.modules, arch, path / "config.json"))
    model.eval().to(device)
    report.timings["total"] = time.perf_counter() - started
    return Loaded(model, report)


def _quantization(config_dict: dict, quantization) -> tuple[dict | None, str | None, online.OnlineQuantizer | None]:
    """The quantization config and method the load follows, and the online quantizer when there is one."""
    quant_config = formats.quantization_config(config_dict)
    method = formats.quant_method(config_dict)
    online_q = None
    if quantization is not None:  # online quantization: the config stands in for the checkpoint's
        online_q = online.OnlineQuantizer.from_config(quantization, formats.quantization_config(config_dict))
        quant_config, method = online_q.config, online_q.method
    return quant_config, method, online_q


def _decode_linears(src, linears: dict[str, nn.Linear], arch, tied, activation,
                    report: LoadReport) -> dict[str, tuple[Decoded, torch.Tensor | None]]:
    decoded: dict[str, tuple[Decoded, torch.Tensor | None]] = {}
    for name, module in linears.items():
        decoded[name] = _decode_linear(src, name, module, arch, tied, activation)
        report.modules[name] = decoded[name][0].label
    return decoded


def _fuse_groups(model, decoded, activation, fuse: bool,
                 report: LoadReport) -> tuple[dict[str, nn.Module], dict[str, FusedLinear]]:
    """Each fusion group registered as one projection where its shards allow (docs/design.md,
    "Fusion rule"), every group recorded in the report: the modules that replace the fused
    shards, and the fused kv projection of each cross-attention."""
    replacements: dict[str, nn.Module] = {}
    fused_kv: dict[str, FusedLinear] = {}  # cross-attention FQN -> its fused kv projection
    for parent, rule in architectures.fusion_groups(model):
        shards = [f"{parent}.{s}" if parent else s for s in rule.shards]
        reason = _unfusable(shards, decoded) if fuse else "fusion disabled (fuse=False)"
        if reason:
            report.groups.append(FusedGroup(parent, rule.kind, shards, False, reason))
            continue
        fused, layout = _fuse([decoded[s] for s in shards], activation)
        report.groups.append(FusedGroup(parent, rule.kind, shards, True, layout=layout))
        model.get_submodule(parent).register_module(rule.kind.replace("-", "_") + "_proj", fused)
        for index, shard in enumerate(shards):
            replacements[shard] = fused.shard(index)
            if layout == "requantized":
                report.storage[shard] = "requantized"
        if rule.kind == "cross-kv":
            fused_kv[parent] = fused
    return replacements, fused_kv


def _assign_linears(src, model, decoded, replacements: dict[str, nn.Module], arch, tied, activation,
                    report: LoadReport) -> None:
    """Every linear in place: its fused shard, else a reference linear of its own."""
    for name, (dec, bias) in decoded.items():
        module = replacements.get(name) or ReferenceLinear(
            dec.stored, bias, dec.label, _input_quant(dec, activation))
        _set_submodule(model, name, module)
        report.storage.setdefault(name, _storage(src, dec.stored))
        if dec.label == "unquantized":
            finite.check_on_first_use(module, _disk_key(src, f"{name}.weight", arch, tied))


def _install_cross_attention(model, fused_kv: dict[str, FusedLinear]) -> None:
    for name in architectures.attention_modules(model):
        if architectures.is_cross_attention(name):
            cross_attention.install(model, name, fused_kv.get(name))


def _read_config(path: Path) -> dict:
    """config.json, read through harness.files and validated by harness.quant.schema."""
    file = path / "config.json"
    if not path.is_dir():
        raise CheckpointError(str(path), "not a checkpoint directory")
    try:
        data = json.loads(files.read_text(file))
    except files.Unreadable as e:
        raise CheckpointError(str(file), e.reason) from None
    except json.JSONDecodeError as e:
        raise CheckpointError(str(file), f"invalid JSON: {e}") from None
    return schema.config_json(data, str(file))


# The skeleton may hold no more modules than this many per tensor on disk (plus MODULE_SLACK): a
# decoder layer has about 1.5 modules per tensor; a config asking for a million layers of a
# 12-layer checkpoint stops here instead of building them (docs/design.md, "Bad input and faults").
MODULES_PER_TENSOR = 4
MODULE_SLACK = 1024
# No tensor the skeleton allocates may have more elements than this many times the largest tensor
# on disk (a 4-bit weight packs two values per stored byte), nor fewer than ELEMENT_FLOOR.
ELEMENTS_PER_DISK_ELEMENT = 2
ELEMENT_FLOOR = 1 << 22


class _SizeGuard(TorchFunctionMode):
    """While the skeleton is built: every tensor a factory function would make is first made on
    the meta device (no memory), and refused when larger than ``limit`` elements; every module
    registered is counted and refused beyond ``modules``. Sizes come from the tensors on disk, so
    a wrong size in config.json is an error before anything is allocated."""

    def __init__(self, file: Path, limit: int, modules: int, largest: str):
        super().__init__()
        self.file, self.limit, self.modules, self.largest = str(file), limit, modules, largest
        self.count = 0
        self.factories = _device_constructors()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.factories and kwargs.get("device") is None:
            self._check(func(*args, **{**kwargs, "device": "meta"}))
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            self._check(out)
        return out

    def _check(self, t: torch.Tensor) -> None:
        if t.numel() > self.limit:
            raise CheckpointError(self.file, f"the model it describes needs a tensor of shape {list(t.shape)} "
                                             f"({t.numel()} elements), more than {self.limit} "
                                             f"({ELEMENTS_PER_DISK_ELEMENT}x the largest tensor on disk, {self.largest}); "
                                             "a size in it does not fit the checkpoint")

    def registered(self, module, name, submodule) -> None:
        self.count += 1
        if self.count > self.modules:
            raise CheckpointError(self.file, f"the model it describes has more than {self.modules} modules, "
                                             f"{MODULES_PER_TENSOR} per tensor on disk; a layer count in it does not "
                                             "fit the checkpoint")


def _architecture_class(file: Path, architecture: str) -> type:
    try:
        cls = getattr(transformers, architecture, None)
    except Exception:  # transformers' lazy module may fail to import what the name points at
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise CheckpointError(str(file), f"architectures[0]: {architecture!r} is not a transformers "
                                         f"{transformers.__version__} model class")
    return cls


def _skeleton(path: Path, config_dict: dict, src: TensorSource) -> nn.Module:
    file = path / "config.json"
    cls = _architecture_class(file, config_dict["architectures"][0])
    model_type = config_dict["model_type"]
    if model_type not in transformers.CONFIG_MAPPING:
        raise CheckpointError(str(file), f"model_type: {model_type!r} is not a model type transformers "
                                         f"{transformers.__version__} knows")
    largest = max(sorted(src.keys), key=src.numel, default=None)  # the first of equals, by name
    limit = max(ELEMENT_FLOOR, ELEMENTS_PER_DISK_ELEMENT * (src.numel(largest) if largest else 0))
    guard = _SizeGuard(file, limit, MODULES_PER_TENSOR * len(src.keys) + MODULE_SLACK,
                       f"{largest} {list(src.shape(largest))}" if largest else "none")
    hook = register_module_module_registration_hook(guard.registered)
    try:
        # transformers validates the config here; what it raises is a problem of config.json
        with guard:
            config = transformers.AutoConfig.from_pretrained(path)
            # The reference decodes quantized tensors itself; transformers must not quantize anything.
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            with init_empty_weights(include_buffers=False), no_init_weights():
                model = cls._from_config(config, dtype=torch.float32)
    except CheckpointError:
        raise
    except Exception as e:
        what = " ".join(str(e).split()) or "(no message)"
        raise CheckpointError(str(file), f"transformers cannot build {cls.__name__} from it: "
                                         f"{type(e).__name__}: {what[:300]}") from None
    finally:
        hook.remove()
    model.config._attn_implementation = "sdpa"
    return model


def _check_layer_counts(model: nn.Module, src: TensorSource, arch: str, file: Path) -> None:
    """Every numbered module list of the skeleton (``model.layers``...) has as many entries as the
    checkpoint holds: a layer count in config.json below the disk's would otherwise load part of
    the checkpoint without a word."""
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or not name:
            continue
        prefix = _disk_name(name, arch) + "."
        held = {int(head) for key in src.keys if key.startswith(prefix)
                for head in [key[len(prefix):].split(".", 1)[0]] if head.isdigit()}
        if held and max(held) >= len(module):
            raise CheckpointError(str(file), f"the model it describes has {len(module)} entries in {name}, but the "
                                             f"checkpoint holds {max(held) + 1} ({prefix}0 to {prefix}{max(held)})")


def _disk_name(name: str, arch: str) -> str:
    return names.to_checkpoint(name, arch)


def _disk_key(src, name: str, arch: str, tied: dict[str, str]) -> str:
    """The checkpoint key of an in-memory parameter; a tied one absent from disk reads its source."""
    key = _disk_name(name, arch)
    if key not in src.keys and name in tied:
        return _disk_name(tied[name], arch)
    return key


def _decode_linear(src, name, module, arch, tied, activation) -> tuple[Decoded, torch.Tensor | None]:
    disk = _disk_name(name, arch)
    weight_key = _disk_key(src, f"{name}.weight", arch, tied)
    dec = formats.decode_weight(src, weight_key)
    if dec.fp8 is not None and dec.fp8.input_scale is None and activation == "static":
        raise CheckpointError(f"{weight_key.rsplit('.', 1)[0]}.input_scale",
                              "missing tensor: the static activation scheme needs an input_scale")
    expected = (module.out_features, module.in_features)
    if dec.shape != expected:
        raise CheckpointError(weight_key, f"decodes to shape {dec.shape}, the model expects {expected}")
    bias = None
    if module.bias is not None:
        bias = src.get(f"{disk}.bias").float()
        if tuple(bias.shape) != (module.out_features,):
            raise CheckpointError(f"{disk}.bias", f"shape {tuple(bias.shape)}, expected {(module.out_features,)}")
    return dec, bias


def _unfusable(shards: list[str], decoded) -> str:
    """Why these shards cannot share one weight, or '' when they can."""
    labels = {s: decoded[s][0].label for s in shards}
    if len(set(labels.values())) > 1:
        return "different schemes: " + ", ".join(f"{s.rsplit('.', 1)[-1]}={l}" for s, l in labels.items())
    settings = [decoded[s][0].settings for s in shards]
    if any(x != settings[0] for x in settings):
        return "different settings: " + "; ".join(
            f"{s.rsplit('.', 1)[-1]}={x}" for s, x in zip(shards, settings))
    return ""


def _fuse(parts: list[tuple[Decoded, torch.Tensor | None]], activation: str | None) -> tuple[FusedLinear, str]:
    """The fused projection of these shards, and its layout (FusedGroup.layout): per-tensor FP8
    shards are requantized to the group's max scale; every shard keeps its stored weight."""
    decs = [d for d, _ in parts]
    layout = "per-shard"
    if decs[0].fp8 is not None:
        decs = fp8.requantize_fused(decs)
        layout = "per-shard" if decs[0].fp8.per_channel else "requantized"
    biases = [b for _, b in parts]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b if b is not None else torch.zeros(d.shape[0]) for d, b in zip(decs, biases)])
    return FusedLinear([d.stored for d in decs], bias, decs[0].label, _input_quant(decs[0], activation)), layout


def _storage(src: TensorSource, held) -> str:
    """How a linear's weight is held (report.STORAGE)."""
    if not isinstance(held, torch.Tensor):
        return "stored"
    return "mapped" if src.is_mapped(held) else "in-memory"


def _activation_scheme(quant_config: dict | None) -> str | None:
    """'static', 'dynamic' or None: how the checkpoint's producer quantizes FP8 linear inputs."""
    if not quant_config:
        return None
    if quant_config.get("quant_method") == "fp8":
        return quant_config.get("activation_scheme", "dynamic")
    for group in (quant_config.get("config_groups") or {}).values():
        acts = (group or {}).get("input_activations")
        if acts:
            return "dynamic" if acts.get("dynamic") else "static"
    return None


def _input_quant(dec: Decoded, activation: str | None) -> InputQuant | None:
    if dec.fp8 is None or activation is None:
        return None
    return InputQuant(dec.fp8.input_scale)  # None: dynamic (a static scheme without one is refused on decode)


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def _assign_remaining(src, model, arch, tied) -> None:
    """Everything that is not a linear weight: embeddings, norms, convolutions, positions, and
    persistent buffers the checkpoint holds (Bart's final_logits_bias)."""
    for name, param in list(model.named_parameters()):
        if param.is_meta:
            _put(model, name, nn.Parameter(_read(src, name, arch, tied, param.shape), requires_grad=False))
    for module_name, module in list(model.named_modules()):
        for leaf, buffer in list(module._buffers.items()):
            name = f"{module_name}.{leaf}" if module_name else leaf
            if buffer is not None and leaf not in module._non_persistent_buffers_set \
                    and _disk_name(name, arch) in src.keys:
                module._buffers[leaf] = _read(src, name, arch, tied, buffer.shape)
    leftover = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if leftover:
        raise CheckpointError(leftover[0], "not found in the checkpoint")


def _read(src, name, arch, tied, shape) -> torch.Tensor:
    key = _disk_key(src, name, arch, tied)
    tensor = src.get(key)
    if tuple(tensor.shape) != tuple(shape):
        raise CheckpointError(key, f"shape {tuple(tensor.shape)}, the model expects {tuple(shape)}")
    return tensor.float() if tensor.is_floating_point() else tensor


def _put(model, name: str, param: nn.Parameter) -> None:
    parent, _, leaf = name.rpartition(".")
    model.get_submodule(parent)._parameters[leaf] = param


def _attach_kv_scales(src, model, arch, quant_config, report: LoadReport) -> None:
    wants_fp8_kv = bool((quant_config or {}).get("kv_cache_scheme"))
    for name in architectures.attention_modules(model):
        k_scale, v_scale, notes = fp8.kv_scales(src, _disk_name(name, arch))
        report.notes.extend(notes)
        if k_scale is None and v_scale is None:
            if wants_fp8_kv and architectures.uses_kv_cache(name):
                # vLLM's behaviour: without scales on disk the fp8 cache uses 1.0.
                k_scale = v_scale = torch.tensor(1.0)
                report.notes.append(f"{name}: kv_cache_scheme set but no k/v scales on disk; using 1.0 as vLLM does")
            else:
                continue
        module = model.get_submodule(name)
        module.register_buffer("k_scale", k_scale.float().reshape(()), persistent=False)
        module.register_buffer("v_scale", v_scale.float().reshape(()), persistent=False)
        report.kv_scales[name] = {"k_scale": float(k_scale), "v_scale": float(v_scale)}
    if report.kv_scales and wants_fp8_kv:
        attention.enable(model)
        report.kv_fake_quant = True
    elif report.kv_scales:
        report.notes.append("k/v scales on disk but no kv_cache_scheme: the KV cache stays unquantized")


def _disagreements(quant_config: dict | None, labels: dict[str, str], arch: str, file: Path) -> list[Disagreement]:
    """Where the producer's skip rules, read in its own dialect, and the disk disagree, and where an
    entry's dialect and its evident intent disagree (harness.dialects.intent)."""
    if not quant_config:
        return []
    policy = SkipPolicy.from_quantization_config(quant_config, arch=arch)
    with policy.checked(str(file)):
        return _policy_disagreements(policy, labels)


def _policy_disagreements(policy: SkipPolicy, labels: dict[str, str]) -> list[Disagreement]:
    found = []
    for name, label in labels.items():
        decision = policy.decide(name)
        if decision.skipped and label != "unquantized":
            found.append(Disagreement(name, "config-vs-disk", f"{policy.dialect}: {decision.reason}, "
                                                              f"but the disk holds {label}"))
        elif not decision.skipped and label == "unquantized":
            found.append(Disagreement(name, "config-vs-disk", f"{policy.dialect}: {decision.reason}, "
                                                              "but the disk holds it unquantized"))
    found.extend(Disagreement.from_entry(d) for d in intent_disagreements(policy, list(labels)))
    return found
