"""The vLLM loaded state: a digest per module of what vLLM loaded, taken inside vLLM's engine as
``BaseModelLoader.load_model`` returns (weights loaded and processed, before any forward pass) and
kept on the model for the engine's ``loaded_state()`` (harness.engines.vllm; docs/README-vllm.md,
"The loaded state").

What it covers: a linear's effective weights and biases, as the module reader reads them
(harness.engines.vllm_worker.effective_shards), its scales, quantization settings and fused layout;
an attention layer's scales and KV-cache dtype; any other module's parameters (norms, embeddings,
convolutions). All as logical values, computed elementwise from the stored tensors and scales,
never the kernels' own (repacked) buffers, so the digest is the same under every kernel condition
and on every CPU whose vLLM picks the same quant methods.

:func:`install` has vllm_worker's load capture take the digest (harness.engines.vllm_worker.AFTER_LOAD);
:func:`held_loaded_state` is the ``LLM.apply_model`` function that reads it back.
"""
from __future__ import annotations

from typing import Any

from harness import loaded_state as state
from harness.engines.vllm_worker import (
    AFTER_LOAD,
    _is_linear,
    _packed,
    effective_shards,
    shard_layout,
    tp_layout,
    tp_rank_and_size,
)

# What a linear's quant method, scheme or config says about its quantization, by attribute name:
# static or dynamic activations (compressed-tensors' scheme, the fp8 config's activation_scheme),
# the weight's and the activations' quantization keys, the bitsandbytes and torchao settings.
QUANT_ATTRIBUTES = ("strategy", "is_static_input_scheme", "activation_quant_key", "weight_quant_key",
                    "activation_scheme", "act_q_static", "weight_block_size", "torchao_config",
                    "load_in_4bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant", "bnb_4bit_compute_dtype")
# Held by an attention layer (vLLM's Attention and CrossAttention, an encoder's MMEncoderAttention).
ATTENTION_MARKERS = ("kv_cache_dtype", "_k_scale", "_fp8_dynamic_scale")
ATTENTION_SETTINGS = ("kv_cache_dtype", "attn_type", "num_heads", "num_kv_heads", "head_size")
LOADED_STATE_ATTR = "_harness_loaded_state"  # where the digest taken at load waits on vLLM's model


def loaded_state(model) -> dict[str, str]:
    """:func:`state_entries`, each module's digested (harness.loaded_state.digest_entries)."""
    return {name: state.digest_entries(entries) for name, (_, entries) in state_entries(model).items()}


def state_entries(model) -> dict[str, tuple[Any, dict[str, Any]]]:
    """Module -> (the module, what vLLM loaded there), in vLLM's module names and order: taken
    right after ``BaseModelLoader.load_model`` (weights loaded and processed, before the engine runs
    any forward pass) and read back by ``LLM.apply_model``, digested (:func:`loaded_state`) or, on
    one of several tensor-parallel ranks, held for the reassembly (harness.engines.vllm_ranks).

    Logical values only, never the kernels' own buffers, so the digest is the same under every
    kernel condition and on every CPU whose vLLM picks the same quant methods: a linear by its
    effective weights as the module reader reads them (:func:`linear_state`), an attention layer by
    its scales and KV-cache dtype (:func:`attention_state`), any other module by its parameters
    (norms, embeddings, convolutions; buffers are computed at start, not loaded)."""
    packed = _packed(model)
    out = {}
    for name, module in model.named_modules():
        if _is_linear(module):
            entries = linear_state(name, module, packed)
        else:
            entries = attention_state(module) or _plain_state(module)
        if entries:
            out[name] = (module, entries)
    return out


def linear_state(name: str, layer, packed: dict[str, list[str]]) -> dict[str, Any]:
    """A linear's loaded state: its quant method and scheme, their quantization settings
    (:data:`QUANT_ATTRIBUTES`), its fused layout (shard names and output sizes), per shard the
    label and the effective weight and bias as float32 values (:func:`effective_shards`: computed
    elementwise from the stored tensors and scales; vLLM's repacked GEMM buffers are never read;
    a bias's dtype is left out, as the AMX GEMM converts it), and ``weight_scale`` and
    ``input_scale`` as the layer holds them."""
    entry = effective_shards(name, layer, packed)
    names, sizes = shard_layout(name, layer, packed)
    shards = [{"shard": r["shard"], "label": r["label"], "note": r["note"], "dtype": r["dtype"],
               "weight": _float(r["weight"]), "bias": _float(r["bias"])} for r in entry["shards"]]
    scales = {k: _float(getattr(layer, k, None)) for k in ("weight_scale", "input_scale")}
    return {"class": entry["class"], "quant_method": entry["quant_method"], "scheme": entry["scheme"],
            "note": entry["note"], "quantization": _quantization(layer), "layout": {"shards": names, "sizes": sizes},
            "shards": shards, **scales}


def attention_state(module) -> dict[str, Any] | None:
    """An attention layer's loaded state (None for any other module): its class, its KV-cache
    method, KV-cache dtype and shape settings, and every scale it holds (``_k_scale``,
    ``_v_scale``, ``_q_scale``, ``_prob_scale`` and their ``_float`` copies, ``k_scale`` /
    ``v_scale`` where vLLM has not processed them, an encoder attention's FP8 settings)."""
    import torch

    held = {**vars(module), **module._parameters, **module._buffers}
    if not any(k in held for k in ATTENTION_MARKERS):
        return None
    entries: dict[str, Any] = {"class": type(module).__name__,
                               "quant_method": type(getattr(module, "quant_method", None)).__name__}
    for key, value in held.items():
        plain = value is None or isinstance(value, (bool, int, float, str))
        if isinstance(value, torch.Tensor) and "scale" in key:
            entries[key] = _float(value)
        elif plain and ("scale" in key or key in ATTENTION_SETTINGS):
            entries[key] = value
    return entries


def _plain_state(module) -> dict[str, Any]:
    entries = state.module_state(module, buffers=False)
    if entries and getattr(module, "quant_method", None) is not None:
        entries["quant_method"] = type(module.quant_method).__name__
    return entries


def _float(t):
    """A tensor's values as float32 (exact for every dtype vLLM holds them in); anything else (None,
    a plain number) as it is."""
    import torch

    return t.detach().float() if isinstance(t, torch.Tensor) else t


def _quantization(layer) -> dict[str, str]:
    """:data:`QUANT_ATTRIBUTES` found on the layer's scheme, quant method and its config, as text
    (an object's default repr, which holds its address, by its class name)."""
    qm = layer.quant_method
    found: dict[str, str] = {}
    for owner in (getattr(layer, "scheme", None), qm, getattr(qm, "quant_config", None)):
        for attr in QUANT_ATTRIBUTES if owner is not None else ():
            value = getattr(owner, attr, None)
            if value is not None and attr not in found:
                text = str(value)
                found[attr] = type(value).__name__ if " at 0x" in text else text
    return found


def rank_state(model) -> dict[str, Any]:
    """This tensor-parallel rank's loaded state, for the engine to reassemble with the other
    ranks' (harness.engines.vllm_ranks.gather_state): its rank and rank count, and per module
    (:func:`state_entries`) its entries (on the CPU) and how this rank holds them
    (vllm_worker.tp_layout)."""
    rank, size = tp_rank_and_size()
    modules = {name: {**tp_layout(module), "entries": _on_cpu_entries(entries)}
               for name, (module, entries) in state_entries(model).items()}
    return {"rank": rank, "size": size, "modules": modules}


def _on_cpu_entries(value):
    import torch

    if isinstance(value, torch.nn.Parameter):  # a parameter stays one: the digest names the kind
        return torch.nn.Parameter(value.detach().cpu(), requires_grad=False)
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _on_cpu_entries(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu_entries(v) for v in value)
    return value


def _hold_loaded_state(model) -> None:
    """Digest the model as vLLM loaded it (:func:`loaded_state`) and keep the digest on it for the
    engine to read (:func:`held_loaded_state`): on one of several tensor-parallel ranks, this
    rank's entries instead, which the engine reassembles and digests (harness.engines.vllm_ranks);
    where the digest fails, why, rather than a failed load."""
    try:
        held: dict | str = rank_state(model) if tp_rank_and_size()[1] > 1 else loaded_state(model)
    except Exception as e:  # a gap of the reader, reported by the engine
        held = f"{type(e).__name__}: {e}"
    setattr(model, LOADED_STATE_ATTR, held)


def held_loaded_state(model) -> dict | str | None:
    """The ``LLM.apply_model`` function that returns the digest taken at load (or why none was)."""
    return getattr(model, LOADED_STATE_ATTR, None)


def install() -> None:
    """Digest vLLM's model as its loading returns (:func:`_hold_loaded_state`, run by the load capture
    of harness.engines.vllm_worker.install): once per process, before ``LLM`` is built."""
    if _hold_loaded_state not in AFTER_LOAD:
        AFTER_LOAD.append(_hold_loaded_state)
