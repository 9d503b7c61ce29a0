"""The benchmark checkpoints: Llama models large enough to time, built on demand and cached.

Sizes S, M and L share TinyLlama's layer shape (hidden 2048, MLP 5632, 32 heads, 4 KV heads) and
differ in depth; the vocabulary is the fixtures' tokenizer's. Each size is built in every benchmark
format by the fixtures' own producers (harness.fixtures.producers: seeded weights, the libraries'
quantizers, the same manifests), with the Llama recipe's dimensions replaced for the build.

Cache: ``.cache/bench/`` (``$HARNESS_BENCH_CACHE``), through harness.fixtures.cache: one directory
per ``<name>-<key16>``, the key a hash of the name (which spells the dimensions), the fixtures'
source and the library versions, built under a file lock. A stable link ``<name>`` points at the
current build: models.yaml's load-time cells name it (tier ``cpu-load``), and ``harness run``
builds a missing one before checking paths (:func:`ensure_for_cells`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from pathlib import Path

from harness.bench.calibration import cache_root

LAYER = {"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 32, "num_key_value_heads": 4}
# depth per size: S ~46M, M ~178M, L ~575M parameters
LAYERS = {"S": 1, "M": 4, "L": 13}
SIZES = tuple(LAYERS)
FORMATS = ("unquantized", "bnb-nf4", "fp8-dynamic", "torchao-int8wo")
MANIFEST = "manifest.json"
HEARTBEAT_S = 15.0


def dims(size: str) -> dict:
    if size not in LAYERS:
        raise ValueError(f"unknown benchmark size {size!r} (known: {', '.join(SIZES)})")
    return {**LAYER, "num_hidden_layers": LAYERS[size]}


def name(size: str, fmt: str) -> str:
    """The checkpoint's stable name, e.g. ``llama-M-bnb-nf4`` (the link models.yaml names)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown benchmark format {fmt!r} (known: {', '.join(FORMATS)})")
    return f"llama-{size}-{fmt}"


def _keyed_name(size: str, fmt: str) -> str:
    d = dims(size)
    shape = f"h{d['hidden_size']}-i{d['intermediate_size']}-l{d['num_hidden_layers']}"
    return f"llama-{size}-{shape}-{fmt}"


@contextmanager
def _llama_dims(size: str):
    """The fixtures' Llama recipe with this size's dimensions, for one build."""
    from harness.fixtures import models as M

    saved = dict(M.LLAMA)
    M.LLAMA.update(dims(size))
    try:
        yield
    finally:
        M.LLAMA.clear()
        M.LLAMA.update(saved)


@contextmanager
def _heartbeat(what: str, echo: Callable[[str], None]):
    """Prints ``what ... N s`` every HEARTBEAT_S seconds while the block runs."""
    done = threading.Event()
    t0 = time.perf_counter()

    def beat():
        while not done.wait(HEARTBEAT_S):
            echo(f"  {what} ... {time.perf_counter() - t0:.0f} s")

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _build_into(size: str, fmt: str, out: Path, scratch: Path) -> None:
    from harness import fixtures
    from harness.fixtures.identity import identity
    from harness.fixtures.producers import produce

    spec = dataclasses.replace(fixtures.spec(f"llama-{fmt}"), name=name(size, fmt))
    with _llama_dims(size):
        res = produce(spec, out, scratch)
    manifest = {"name": name(size, fmt), "size": size, "format": fmt, "dims": dims(size),
                "identity": identity(out), "producer": res["producer"], "margins": res["margins"]}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def build(size: str, fmt: str, echo: Callable[[str], None] = print) -> Path:
    """The checkpoint's directory (the stable link), built on a cache miss with progress lines."""
    from harness.fixtures import cache

    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    what = f"building benchmark checkpoint {name(size, fmt)}"
    t0 = time.perf_counter()
    with _heartbeat(what, echo):
        target, built = cache.ensure(_keyed_name(size, fmt), lambda out, scratch: _build_into(size, fmt, out, scratch),
                                     root=root)
    if built:
        echo(f"  {what}: {megabytes(target):.0f} MB in {time.perf_counter() - t0:.0f} s")
    link = root / name(size, fmt)
    if not (link.is_symlink() and os.readlink(link) == target.name):
        tmp = root / f".{link.name}.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(target.name)
        os.replace(tmp, link)
    return link


def megabytes(path: Path) -> float:
    """The size of a checkpoint's weight files, in MB (10^6 bytes)."""
    return sum(p.stat().st_size for p in weight_files(path)) / 1e6


def weight_files(path: Path) -> list[Path]:
    return sorted(p for p in Path(path).iterdir() if p.suffix in (".safetensors", ".bin"))


def parameters(size: str, vocab: int) -> int:
    """The parameter count of a size (untied embeddings and lm_head, RMSNorm weights)."""
    d = dims(size)
    h, i, layers = d["hidden_size"], d["intermediate_size"], d["num_hidden_layers"]
    kv = h // d["num_attention_heads"] * d["num_key_value_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    return layers * per_layer + 2 * vocab * h + h


def ensure_for_cells(matrix, cells: Iterable, echo: Callable[[str], None] = print) -> None:
    """Build the benchmark checkpoints that selected cells name as their ``path`` and lack."""
    root = cache_root().resolve()
    for cell in cells:
        if cell.source_kind != "path":
            continue
        path = (matrix._dir / cell.path).resolve() if not Path(cell.path).is_absolute() else Path(cell.path)
        if path.parent != root or path.is_dir():
            continue
        size, fmt = _parse_name(path.name)
        if size is not None:
            echo(f"{cell.id}: {path.name} is not built yet")
            build(size, fmt, echo)


def _parse_name(text: str) -> tuple[str | None, str | None]:
    for size in SIZES:
        for fmt in FORMATS:
            if text == name(size, fmt):
                return size, fmt
    return None, None


if __name__ == "__main__":  # python -m harness.bench.checkpoints SIZE [FORMAT ...]
    for f in sys.argv[2:] or FORMATS:
        print(build(sys.argv[1], f))
