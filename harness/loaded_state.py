"""Digests of what an engine loaded, per module (docs/design.md, "Loaded state").

A module's digest covers the values it computes with, as they are held after the load and before
any forward pass: its parameters and buffers (tensor subclasses by their inner tensors, a
bitsandbytes weight with its quant state), the scales attached to it (input scales, an attention's
k_scale and v_scale), its class and its quantization label. A module that declares its own state
(``loaded_state()``, as the reference's linears do: effective weight, stored form, fused layout,
input quantization) is digested by that instead.

Loading copies and decodes elementwise, so the digests are the same on every CPU and under every
kernel condition: they are compared bit for bit against the baseline's, whatever machine wrote it.
Bytes only, never a float reduction.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

DIGEST_CHARS = 16  # 64 bits of sha256 per module: a review-sized line, no chance collision
# Attributes that hold a quantization's scales outside the module's parameters and buffers.
SCALE_ATTRIBUTES = ("k_scale", "v_scale", "q_scale", "input_scale", "weight_scale")


def digest(model) -> dict[str, str]:
    """Module name -> digest of its loaded state, in the model's module order; modules holding
    nothing of their own are left out."""
    out = {}
    for name, module in model.named_modules():
        entries = module_state(module)
        if entries:
            out[name] = digest_entries(entries)
    return out


def module_state(module, buffers: bool = True) -> dict[str, Any]:
    """What ``module`` itself holds, by name (its submodules not included). ``buffers=False``
    leaves its buffers out: vLLM's are computed at start (rotary caches, through kernels), not
    loaded (harness.engines.vllm_state.loaded_state)."""
    declared = getattr(module, "loaded_state", None)
    if callable(declared):
        return {"class": type(module).__name__, **declared()}
    entries: dict[str, Any] = {}
    held = [*module.named_parameters(recurse=False), *(module.named_buffers(recurse=False) if buffers else [])]
    for name, t in held:
        if t is not None:
            entries[name] = t
    for name in SCALE_ATTRIBUTES:
        value = module.__dict__.get(name)
        if value is not None and name not in entries:
            entries[name] = value
    if not entries:
        return {}
    scheme = getattr(module, "quantization_scheme", None)
    entries["class"] = type(module).__name__
    if scheme is not None:
        entries["quantization_scheme"] = repr(scheme)
    return entries


def digest_entries(entries: dict[str, Any]) -> str:
    """The digest of one module's entries (name -> tensor, dict, list or a value digested by its
    repr): :data:`DIGEST_CHARS` hex digits of sha256 over the names and bytes, in name order."""
    h = hashlib.sha256()
    for key in sorted(entries):
        h.update(key.encode() + b"\0")
        for chunk in _chunks(entries[key]):
            h.update(chunk)
    return h.hexdigest()[:DIGEST_CHARS]


def _chunks(value) -> Iterable[bytes]:
    import torch

    if isinstance(value, torch.Tensor):
        yield from _tensor_chunks(value)
    elif isinstance(value, dict):
        for k in sorted(value, key=str):
            yield str(k).encode() + b"="
            yield from _chunks(value[k])
    elif isinstance(value, (list, tuple)):
        yield f"[{len(value)}]".encode()
        for v in value:
            yield from _chunks(v)
    else:
        yield repr(value).encode() + b";"


def _tensor_chunks(t) -> Iterable[bytes]:
    """A tensor's kind, dtype, shape and raw bytes; a tensor subclass (torchao) by its inner
    tensors and context, a bitsandbytes 4-bit weight with its quant state."""
    import torch

    yield f"{type(t).__name__}:{t.dtype}:{tuple(t.shape)}:".encode()
    flatten = getattr(t, "__tensor_flatten__", None)
    if callable(flatten) and type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        names, context = flatten()
        yield repr(context).encode()
        for n in names:
            yield n.encode()
            yield from _tensor_chunks(getattr(t, n))
        return
    data = t.detach()
    if data.device.type == "meta":
        yield b"meta"
    else:
        yield data.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
    quant_state = getattr(t, "quant_state", None)
    if quant_state is not None:
        yield b"quant_state"
        yield from _chunks(quant_state.as_dict(packed=False))
