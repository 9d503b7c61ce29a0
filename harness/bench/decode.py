"""Decode: each format's dequantization of one large weight against filling its output (target 2).

The weight is the S checkpoint's ``model.layers.0.mlp.gate_proj.weight`` (5632 x 2048), read
through the reference's own decode entry point (harness.quant.formats ``decode_weight``, which
dispatches to harness.quant.bnb/fp8/torchao ``decode``). Timed in this process, one torch thread:
``decode_s``, the stored form's ``dequantize(out)`` into a preallocated float32 output (what the
reference's forward pass does with each quantized weight; an unquantized weight, which the forward
reads in place, is copied: ``decodes`` False, a row for comparison that target 2, "each format's
dequantization", does not judge), and ``fill_s``, ``out.fill_`` of the same output, the floor of any
decode that writes it; each the fastest of ``repeats`` back to back. (Timed in alternation, the
fill was 2-2.5x slower, its output no longer hot in cache: the back-to-back fill is the strict
floor.)
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

WEIGHT = "model.layers.0.mlp.gate_proj.weight"
TARGET_RATIO = 3.0  # issue 13, target 2: decode within 3x of fill


@dataclass
class DecodeResult:
    format: str
    shape: tuple[int, ...]
    decode_s: float
    fill_s: float
    decodes: bool = True

    @property
    def ratio(self) -> float:
        return self.decode_s / self.fill_s


def _fastest(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(fmt: str, path: Path, repeats: int = 9) -> DecodeResult:
    """Decode and fill of ``WEIGHT`` of the checkpoint at ``path`` (format ``fmt``)."""
    import torch

    # lazy: torch, +1.4 s (scripts/import-graph --costs)
    from harness.quant import formats
    # lazy: torch, +1.8 s (scripts/import-graph --costs)
    from harness.quant.source import TensorSource

    torch.set_num_threads(1)
    with TensorSource.open(path) as src:
        weight = formats.decode_weight(src, WEIGHT).stored  # `.weight` would be dequantized already
        out = torch.empty(tuple(weight.shape), dtype=torch.float32)
        if isinstance(weight, torch.Tensor):
            def decode():
                out.copy_(weight)
        else:
            def decode():
                weight.dequantize(out)
        decode_s = _fastest(decode, repeats)
        fill_s = _fastest(lambda: out.fill_(1.0), repeats)
    return DecodeResult(fmt, tuple(out.shape), decode_s, fill_s, decodes=not isinstance(weight, torch.Tensor))
