"""The input-sensitivity check in the report (docs/design.md, "Input sensitivity"): per image or
audio prompt of a record, the scored-token logprobs with its input and with the second input side
by side, and for a ``synthetic:`` image a small inline picture of both. The pictures need numpy,
which the Buildkite report step's light runtime does not install: there the report has none."""
from __future__ import annotations

import base64
import struct
import zlib

from harness.records import Record

PICTURE_SIDE = 48  # pixels, at most, of the inline pictures


def rows(rec: Record) -> list[dict]:
    s = rec.input_sensitivity
    if s is None:
        return []
    check = next((c for c in rec.checks if c.kind == "input-sensitivity" and c.data), None)
    data = check.data.get("prompts", {}) if check is not None else {}
    out = []
    for p in s.prompts:
        pictures = _pictures(p.input) if p.kind == "image" else None
        out.append({"prompt": p.prompt, "kind": p.kind, "input": p.input, "contrast": p.contrast,
                    "max_delta": p.max_delta, "bound": data.get(p.prompt, {}).get("bound"),
                    "positions": [{"index": p.first + i, "logprob": a, "contrast": b, "delta": abs(a - b)}
                                  for i, (a, b) in enumerate(zip(p.logprobs, p.contrast_logprobs))],
                    "picture": pictures[0] if pictures else None,
                    "contrast_picture": pictures[1] if pictures else None})
    return out


def _pictures(name: str) -> tuple[str, str] | None:
    """Data URIs of a synthetic image and of its contrast, shrunk by an integer stride; None for
    an input the report cannot regenerate (a fixture's, a file), or where numpy is not installed."""
    try:
        # lazy: numpy, which the report step's light runtime lacks (harness.buildkite.agents.HARNESS_RUNTIME)
        from harness import synthetic
    except ImportError:
        return None
    try:
        image = synthetic.generate(synthetic.parse(name))
    except synthetic.SyntheticError:
        return None
    stride = max(1, -(-max(image.shape[:2]) // PICTURE_SIDE))
    small = image[::stride, ::stride].copy()
    return _png(small), _png(synthetic.contrast("image", small))


def _png(rgb) -> str:
    """A uint8 [h, w, 3] array as a PNG data URI (no image library needed)."""
    h, w = rgb.shape[:2]
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(png).decode()
