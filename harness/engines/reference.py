"""The reference engine: this project's own loader (harness.reference), run in-process in the child.

Version: the harness package version (models.yaml pins it in the ``core`` environment). Load time:
the load report's total, with its phases (skeleton, read, decode, fuse, assign). Fused groups
follow docs/design.md, "Fusion rule" (``fuse=True``, as an inference engine executes them); the runner may also ask for
the unfused variant, the witness that engines which do not fuse (transformers) are compared with.
Online schemes (``online-*``) pass their quantization config to ``reference.load(quantization=)``.
On ``HARNESS_DEVICE=cuda`` (harness.engines.base.device) the model is loaded onto that device.
"""
from __future__ import annotations

import time

from harness import records as R
from harness.engines.base import Checkpoint, InProcessEngine, device, online_quantization


def harness_version() -> str:
    try:
        from importlib.metadata import version

        return version("harness")
    except Exception:
        import tomllib
        from pathlib import Path

        data = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
        return data["project"]["version"]


class ReferenceEngine(InProcessEngine):
    name = "reference"
    fuses_shards = True

    def __init__(self, cell, options=None):
        super().__init__(cell, options)
        self.fuse = bool(self.options.get("fuse", True))
        self.report = None

    def version(self) -> str:
        return harness_version()

    def load(self, checkpoint: Checkpoint) -> R.LoadInfo:
        from harness import reference

        t0 = time.perf_counter()
        loaded = reference.load(checkpoint.path, device=device(), fuse=self.fuse,
                                quantization=online_quantization(self.cell))
        wall = time.perf_counter() - t0
        self.model, self.report = self.on_device(loaded.model), loaded.report
        phases = {k: float(v) for k, v in loaded.report.timings.items() if k != "total"}
        return R.LoadInfo(seconds=float(loaded.report.timings.get("total", wall)), phases=phases)

    def close(self):
        super().close()
        self.report = None
