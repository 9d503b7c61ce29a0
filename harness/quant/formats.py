"""Which on-disk format a weight is in, and the one entry point that decodes any of them.

The tensors on disk are the truth: `decode_weight` asks each format whether it owns the weight's
tensors, whatever config.json says. `quant_method` only reads what the producer declared.
"""
from __future__ import annotations

import importlib

from harness import registry
from harness.errors import CheckpointError
from harness.quant import Decoded, schema
from harness.quant.source import TensorSource

# (name, module) in the order they are asked (harness.registry.FORMATS); their layouts do not overlap
FORMATS = tuple((spec.name, importlib.import_module(spec.module)) for spec in registry.FORMATS.values())


def quantization_config(config: dict) -> dict | None:
    """config.json's quantization config (`quantization_config`, or compressed-tensors' older
    `compression_config`), or None."""
    qc = config.get("quantization_config")
    if qc is None:
        qc = config.get("compression_config")
    return qc


def quant_method(config: dict) -> str | None:
    """The declared quant method of a config.json dict: one of schema.KNOWN_METHODS, or None if unquantized."""
    qc = quantization_config(config)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise CheckpointError("config.json", f"quantization_config is a {type(qc).__name__}, not an object")
    return schema.method_of(qc, "config.json")


def owner(src: TensorSource, weight: str) -> str | None:
    """The name of the format whose layout the tensors of `weight` are in, or None."""
    for name, mod in FORMATS:
        if mod.owns(src, weight):
            return name
    return None


def _unsupported_layout(src: TensorSource, weight: str) -> str | None:
    module = weight.rsplit(".", 1)[0] if "." in weight else ""
    k = src.keys
    if f"{weight}_packed" in k:
        return "compressed-tensors pack-quantized layout (weight_packed) is not supported"
    if f"{module}.qweight" in k:
        return "GPTQ/AWQ layout (qweight) is not supported"
    if f"{module}.SCB" in k or f"{weight}.SCB" in k:
        return "bitsandbytes 8-bit layout (SCB) is not supported"
    if weight in k and f"{weight}_scale" in k:
        dt = src.dtype(weight)
        if dt.is_floating_point:
            return (f"{dt} weight stored beside a weight_scale (a quantized checkpoint saved uncompressed?) "
                    "is not supported")
        return f"{dt} weight with a weight_scale (integer-quantized) is not supported"
    return None


def decode_weight(src: TensorSource, weight: str) -> Decoded:
    """Decode `weight` (`<module fqn on disk>.weight`) from whichever layout holds it."""
    for _, mod in FORMATS:
        if mod.owns(src, weight):
            return mod.decode(src, weight)
    why = _unsupported_layout(src, weight)
    if why:
        raise CheckpointError(weight, why)
    if weight not in src.keys:
        raise CheckpointError(weight, "missing tensor")
    dt = src.dtype(weight)
    if not dt.is_floating_point:
        raise CheckpointError(weight, f"dtype {dt} is neither a float weight nor a known quantized layout")
    # Not scanned for NaN here: the reference looks at it when first used (harness.reference.finite).
    return Decoded("unquantized", src.get(weight).float())  # float32 on disk: the memory-mapped tensor itself
