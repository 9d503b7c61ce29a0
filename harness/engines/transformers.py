"""The transformers engine: ``<Architecture>.from_pretrained(dir, device_map="cpu", dtype=float32)``,
exactly what a user of transformers gets, run in-process in the child.

Load time: the wall time of ``from_pretrained`` (its only phase), after the modules it imports
lazily are imported (:func:`warm_imports`: the model's modeling module, the quantizer and its
library; an import is no load time, in every isolation mode). On a gated tier it is timed
several times between two calibrations (harness.loadtime). How it is driven:

- Forward passes use ``use_cache=False``. harness.scoring re-runs the whole sequence at every
  greedy step, so a cache buys nothing; without one no cache code path can make two engines
  differ. (With a cache, compressed-tensors 0.17's quantized KV cache breaks Whisper:
  ``'EncoderDecoderCache' object has no attribute 'layer_class_to_replicate'``.)
- bitsandbytes 0.50 on a CPU with AVX512-BF16 repacks 4-bit weights on the first forward and
  multiplies in bfloat16, whatever ``bnb_4bit_compute_dtype`` says (|Δlogprob| ~0.1 on the tiny
  fixtures, and only on such CPUs). The engine turns that path off (``support_avx512bf16_for_cpu =
  False`` on every Linear4bit), so the matmul runs in the checkpoint's compute dtype (float32) and
  results do not depend on the CPU's ISA.
- transformers executes every projection unfused (its registry entry's ``fuses_shards``): the runner compares it
  with the reference executed unfused.

On ``HARNESS_DEVICE=cuda`` (harness.engines.base.device; models.yaml's ``cuda-check``
environment) ``device_map`` is that device: bitsandbytes then runs its CUDA kernels.

Online schemes (``online-*``): ``from_pretrained(unquantized, quantization_config=<the scheme's
config>)``, the library quantizing while loading; the load time then includes quantization.

Capability probe: the architecture must exist in this transformers; without a GPU, torchao int4
(no CPU kernel in torchao 0.18) and online FP8 (transformers' FineGrainedFP8Config needs a GPU)
are unsupported; plus the cell's hardware needs.
"""
from __future__ import annotations

import time

from harness import loadtime, registry
from harness import records as R
from harness.engines import reference
from harness.engines.base import Checkpoint, InProcessEngine, device, online_quantization
from harness.quant import schema


class _NoCache:
    """Calls the model with use_cache=False (see the module docstring)."""

    def __init__(self, model):
        self.model = model

    def __call__(self, **kwargs):
        return self.model(**kwargs, use_cache=False)


def bnb_float_compute(model) -> int:
    """Turn off bitsandbytes' AVX512-BF16 CPU path on every Linear4bit; returns how many."""
    n = 0
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
            n += 1
    return n


class TransformersEngine(InProcessEngine):
    name = "transformers"

    def compute_dtype(self, checkpoint: Checkpoint) -> str:
        """A bnb 4-bit checkpoint's ``bnb_4bit_compute_dtype`` (the matmul's dtype, once the
        AVX512-BF16 path is off), else float32, the dtype it loads in."""
        qc = online_quantization(self.cell) or checkpoint.quantization_config or {}
        dtype = qc.get("bnb_4bit_compute_dtype") if qc.get("quant_method") == "bitsandbytes" else None
        return str(dtype).removeprefix("torch.") if dtype else "float32"

    def version(self) -> str:
        import transformers

        return transformers.__version__

    def _arch(self, checkpoint: Checkpoint) -> str:
        return (checkpoint.config.get("architectures") or [self.cell.arch])[0]

    def probe(self, checkpoint: Checkpoint) -> str | None:
        reason = super().probe(checkpoint)
        if reason:
            return reason
        import transformers

        arch = self._arch(checkpoint)
        if not hasattr(transformers, arch):
            return f"transformers {transformers.__version__} has no {arch}"
        import torch

        online = online_quantization(self.cell)
        qc = online or checkpoint.quantization_config or {}
        if not torch.cuda.is_available():
            if qc.get("quant_method") == "torchao" and (problem := schema.cpu_problem_of_torchao(qc)):
                return problem
            if online is not None and qc.get("quant_method") == "fp8":
                return (f"transformers {transformers.__version__} has no online FP8 quantization that runs on a CPU "
                        "(FineGrainedFP8Config needs a GPU)")
        return None

    def load(self, checkpoint: Checkpoint) -> R.LoadInfo:
        kwargs = {}
        online = online_quantization(self.cell)
        if online is not None:  # online scheme: the library quantizes the float checkpoint while loading
            from transformers.quantizers.auto import AutoQuantizationConfig

            kwargs["quantization_config"] = AutoQuantizationConfig.from_dict(online)
        warm_imports(checkpoint, online)
        return loadtime.timed_load(lambda: self._load_once(checkpoint, kwargs), gated=self.cell.gate_load_time,
                                   checkpoint_dir=checkpoint.path, workload=self.calibration_workload(checkpoint))

    def _load_once(self, checkpoint: Checkpoint, kwargs: dict) -> tuple[float, dict[str, float]]:
        import torch
        import transformers

        cls = getattr(transformers, self._arch(checkpoint))
        self.model = None  # a repeat: the previous model is freed first
        t0 = time.perf_counter()
        model = cls.from_pretrained(checkpoint.path, device_map=device(), dtype=torch.float32, **kwargs)
        seconds = time.perf_counter() - t0
        model.eval()
        bnb_float_compute(model)
        self.model = self.on_device(_NoCache(model))
        return seconds, {"from_pretrained": seconds}


# What from_pretrained imports lazily while loading a quantization method, beyond its quantizer
# (measured: the modules new in sys.modules after a first load; harness.registry.FORMATS).
LOAD_TIME_IMPORTS = {m.name: m.load_time_imports for m in registry.methods().values() if m.load_time_imports}


def warm_imports(checkpoint: Checkpoint, online: dict | None = None) -> None:
    """The reference's warm-up (the modeling module, safetensors, the quantization library), plus
    what ``from_pretrained`` imports lazily on top: the quantizer class of the checkpoint's
    quantization config and the integration modules it loads with."""
    import importlib

    reference.warm_imports(checkpoint, online)
    qc = online or checkpoint.quantization_config
    if not qc:
        return
    for module in LOAD_TIME_IMPORTS.get(qc.get("quant_method"), ()):
        importlib.import_module(module)
    try:
        from transformers.quantizers.auto import AutoHfQuantizer, AutoQuantizationConfig

        quantizer = AutoHfQuantizer.from_config(AutoQuantizationConfig.from_dict(dict(qc)))
        quantizer.validate_environment(device_map={"": device()}, dtype=None)
    except Exception:  # the load itself raises what is wrong, timed as the engine's failure
        pass
