"""The reference engine: this project's own loader (harness.reference), run in-process in the child.

Version: the harness package version (models.yaml pins it in the ``core`` environment). Load time:
the load report's total, with its phases (skeleton, read, decode, fuse, assign), after the modules
a load imports lazily are imported (:func:`warm_imports`: an import is no load time). On a gated
tier the load is timed several times between two calibrations (harness.loadtime;
docs/design.md, "Load time"). Fused groups
follow docs/design.md, "Fusion rule" (``fuse=True``, as an inference engine executes them); the runner may also ask for
the unfused variant, the witness that engines which do not fuse (transformers) are compared with.
Online schemes (``online-*``) pass their quantization config to ``reference.load(quantization=)``.
On ``HARNESS_DEVICE=cuda`` (harness.engines.base.device) the model is loaded onto that device.
"""
from __future__ import annotations

import time

from harness import loadtime, registry
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

    def __init__(self, cell, options=None):
        super().__init__(cell, options)
        self.fuse = bool(self.options.get("fuse", True))
        self.report = None

    def version(self) -> str:
        return harness_version()

    def load(self, checkpoint: Checkpoint) -> R.LoadInfo:
        warm_imports(checkpoint, online_quantization(self.cell))
        # The unfused witness's load time is never compared: timed once, as on an ungated tier.
        return loadtime.timed_load(lambda: self._load_once(checkpoint), gated=self.cell.gate_load_time and self.fuse,
                                   checkpoint_dir=checkpoint.path, workload=self.calibration_workload(checkpoint))

    def _load_once(self, checkpoint: Checkpoint) -> tuple[float, dict[str, float]]:
        # lazy: torch, transformers and more, +4.8 s (scripts/import-graph --costs)
        from harness import reference

        self.model = self.report = None  # a repeat: the previous model is freed first
        t0 = time.perf_counter()
        loaded = reference.load(checkpoint.path, device=device(), fuse=self.fuse,
                                quantization=online_quantization(self.cell))
        wall = time.perf_counter() - t0
        self.model, self.report = self.on_device(loaded.model), loaded.report
        phases = {k: float(v) for k, v in loaded.report.timings.items() if k != "total"}
        return float(loaded.report.timings.get("total", wall)), phases

    def close(self):
        super().close()
        self.report = None


# The libraries a load reads each quantization method with, imported lazily on first use
# (harness.registry.FORMATS).
QUANT_LIBRARIES = {m.name: m.warm_imports for m in registry.methods().values()}


def warm_imports(checkpoint: Checkpoint, online: dict | None = None) -> None:
    """Import what loading this checkpoint imports lazily (the loader itself with its format
    modules, the architecture's modeling module, the safetensors reader, the quantization library,
    the C decoders: harness.quant.native),
    so that no import is timed as load, whatever the isolation mode (a forked child inherits the
    fork server's imports, a spawned one does not)."""
    import importlib

    import safetensors.torch  # noqa: F401
    import transformers

    # lazy: importing is the warm-up's purpose: torch and the formats' libraries, before the load is timed
    import harness.reference  # noqa: F401
    # lazy: torch, +1.2 s (scripts/import-graph --costs)
    from harness.quant import native

    native.library()  # the C decoders the first forward pass calls: loaded (or built) here, untimed
    for arch in checkpoint.config.get("architectures") or ():
        getattr(transformers, arch, None)
    method = (online or checkpoint.quantization_config or {}).get("quant_method")
    warm = getattr(registry.methods().get(method), "warm", None)
    try:
        for module in QUANT_LIBRARIES.get(method, ()):
            importlib.import_module(module)
        if warm:  # e.g. torchao: a config's _type is validated against every module torchao reads from
            registry.resolve(warm)()
    except ImportError:  # the load itself says what is missing
        pass
