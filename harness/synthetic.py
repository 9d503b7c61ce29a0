"""``synthetic:<name>`` inputs: images and audio that the harness generates, so that no binary is
committed and every engine is given the same bytes (docs/design.md, "Synthetic inputs").

A name is ``<kind>-<shape>``:

- images, ``<kind>-<side>`` or ``<kind>-<width>x<height>``: ``gradient`` (red along x, green along
  y, blue along the diagonal), ``checkerboard`` (eight squares a side, two colours), ``shapes`` (a
  disc and a bar on a plain ground); e.g. ``synthetic:gradient-448``, ``synthetic:checkerboard-224``;
- audio, ``<kind>-<rate>k-<seconds>s``: ``chirp`` (a sweep from 200 Hz to 4 kHz), ``tone``
  (440 Hz), ``noise`` (white, PCG64 seed 0); e.g. ``synthetic:chirp-16k-5s``.

Every sample is computed in integer arithmetic (a phase accumulator and a parabolic sine), and
audio is the int16 value divided by 2**15, an exact float32: the same name gives the same bytes on
every machine, whatever its libm or SIMD kernels. :func:`contrast` derives the second input the
input-sensitivity check scores (harness.engines.execute): an image's colour inverse, and for audio
a falling sweep of the same rate and length, unlike every audio kind above and the fixtures' sines.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

PREFIX = "synthetic:"
_IMAGE_SHAPE = re.compile(r"^(\d+)(?:x(\d+))?$")
_AUDIO_SHAPE = re.compile(r"^(\d+)k-(\d+)s$")
MAX_SIDE = 4096
MAX_SECONDS = 60
_PHASE_BITS = 16  # one period = 2**16 phase steps
_FULL = 1 << 15  # int16 full scale


class SyntheticError(ValueError):
    """A name the generator does not know. ``str()`` is one line."""


@dataclass(frozen=True)
class Spec:
    """A parsed name: ``kind`` and its shape (image: ``width`` x ``height``; audio: ``rate`` Hz for
    ``seconds``)."""

    name: str
    kind: str
    modality: str  # image | audio
    width: int = 0
    height: int = 0
    rate: int = 0
    seconds: int = 0

    @property
    def samples(self) -> int:
        return self.rate * self.seconds


# ------------------------------------------------------------------------------------- images


def _grid(spec: Spec) -> tuple[np.ndarray, np.ndarray]:
    y, x = np.mgrid[0 : spec.height, 0 : spec.width].astype(np.int64)
    return y, x


def _gradient(spec: Spec) -> np.ndarray:
    y, x = _grid(spec)
    r = x * 255 // max(spec.width - 1, 1)
    g = y * 255 // max(spec.height - 1, 1)
    b = (x + y) * 255 // max(spec.width + spec.height - 2, 1)
    return np.stack([r, g, b], axis=-1)


def _checkerboard(spec: Spec) -> np.ndarray:
    y, x = _grid(spec)
    odd = ((x * 8 // spec.width) + (y * 8 // spec.height)) % 2 == 1
    return np.where(odd[..., None], np.array([230, 200, 40]), np.array([30, 60, 160]))


def _shapes(spec: Spec) -> np.ndarray:
    y, x = _grid(spec)
    w, h = spec.width, spec.height
    out = np.empty((h, w, 3), dtype=np.int64)
    out[...] = (235, 235, 220)
    r = min(w, h) // 4
    disc = (4 * x - w) ** 2 + (4 * y - 2 * h) ** 2 <= (4 * r) ** 2  # centre (w/4, h/2)
    bar = (x >= w // 2 + w // 8) & (x < w - w // 8) & (y >= h // 4) & (y < 3 * h // 4)
    out[disc] = (200, 30, 30)
    out[bar] = (20, 120, 40)
    return out


# -------------------------------------------------------------------------------------- audio


def _sine(phase: np.ndarray) -> np.ndarray:
    """A parabolic sine of integer phases (2**16 a period), int64 in [-2**15, 2**15]."""
    half = 1 << (_PHASE_BITS - 1)
    p = phase % (1 << _PHASE_BITS)
    u = p % half
    magnitude = 4 * u * (half - u) * _FULL // (half * half)
    return np.where(p < half, magnitude, -magnitude)


def _sweep(n: int, rate: int, f0: int, f1: int) -> np.ndarray:
    """Integer phases of a linear sweep from f0 to f1 Hz over n samples: cycles(t) = f0 t / rate +
    (f1 - f0) t**2 / (2 n rate), its fractional part in 2**16 steps, exactly."""
    t = np.arange(n, dtype=np.int64)
    numerator = 2 * n * f0 * t + (f1 - f0) * t * t
    denominator = 2 * n * rate
    return (numerator % denominator) * (1 << _PHASE_BITS) // denominator


def _waveform(pcm: np.ndarray, halve: bool = True) -> np.ndarray:
    """int16 samples as float32 in [-1, 1], at half scale: exact divisions by powers of two."""
    return (np.clip(pcm, -_FULL + 1, _FULL - 1).astype(np.float32) / np.float32(_FULL * (2 if halve else 1)))


def _chirp(spec: Spec) -> np.ndarray:
    return _waveform(_sine(_sweep(spec.samples, spec.rate, 200, 4000)))


def _tone(spec: Spec) -> np.ndarray:
    t = np.arange(spec.samples, dtype=np.int64)
    return _waveform(_sine(t * 440 * (1 << _PHASE_BITS) // spec.rate))


def _noise(spec: Spec) -> np.ndarray:
    rng = np.random.Generator(np.random.PCG64(0))
    return _waveform(rng.integers(-_FULL + 1, _FULL, size=spec.samples, dtype=np.int64))


# ----------------------------------------------------------------------------------- registry


KINDS: dict[str, tuple[str, Callable[[Spec], np.ndarray]]] = {
    "gradient": ("image", _gradient),
    "checkerboard": ("image", _checkerboard),
    "shapes": ("image", _shapes),
    "chirp": ("audio", _chirp),
    "tone": ("audio", _tone),
    "noise": ("audio", _noise),
}


def is_synthetic(value: str) -> bool:
    return value.startswith(PREFIX)


def _choices() -> str:
    images = [k for k, (m, _) in KINDS.items() if m == "image"]
    audio = [k for k, (m, _) in KINDS.items() if m == "audio"]
    return (f"images {'|'.join(images)}-<side> or -<width>x<height> (e.g. gradient-448), "
            f"audio {'|'.join(audio)}-<rate>k-<seconds>s (e.g. chirp-16k-5s)")


def parse(value: str) -> Spec:
    """The spec of ``synthetic:<name>``; :class:`SyntheticError` (one line, listing the choices)
    for a name the generator does not know."""
    name = value[len(PREFIX):] if is_synthetic(value) else value
    kind, _, shape = name.partition("-")
    if kind not in KINDS:
        raise SyntheticError(f"unknown synthetic input {value!r}: the kinds are {_choices()}")
    modality = KINDS[kind][0]
    m = (_IMAGE_SHAPE if modality == "image" else _AUDIO_SHAPE).match(shape)
    if m is None:
        raise SyntheticError(f"synthetic input {value!r}: an {modality} kind takes a shape: {_choices()}")
    if modality == "image":
        width = int(m.group(1))
        height = int(m.group(2) or width)
        if not (2 <= width <= MAX_SIDE and 2 <= height <= MAX_SIDE):
            raise SyntheticError(f"synthetic input {value!r}: sides must be 2 to {MAX_SIDE} pixels")
        return Spec(name=value, kind=kind, modality=modality, width=width, height=height)
    rate, seconds = int(m.group(1)) * 1000, int(m.group(2))
    if not (1000 <= rate <= 96000 and 1 <= seconds <= MAX_SECONDS):
        raise SyntheticError(f"synthetic input {value!r}: rates are 1k to 96k, lengths 1 to {MAX_SECONDS} s")
    return Spec(name=value, kind=kind, modality=modality, rate=rate, seconds=seconds)


def generate(spec: Spec) -> np.ndarray:
    """The input of a spec: uint8 [height, width, 3] RGB, or a float32 waveform at ``spec.rate``."""
    data = KINDS[spec.kind][1](spec)
    return np.clip(data, 0, 255).astype(np.uint8) if spec.modality == "image" else data


def contrast(modality: str, data: np.ndarray, rate: int | None = None) -> np.ndarray:
    """The second input of the input-sensitivity check, of the same shape as ``data`` (so the
    prompt's tokens stay the same): an image's colour inverse; for audio, a sweep falling from
    4 kHz to 200 Hz at full scale."""
    if modality == "image":
        return 255 - np.asarray(data, dtype=np.uint8)
    return _waveform(_sine(_sweep(len(data), int(rate), 4000, 200)), halve=False)
