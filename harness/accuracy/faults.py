"""Test-only degradations of a loaded model, which the accuracy gate must catch (docs/design.md,
"Accuracy"; README, "Test-only hooks"). Never used outside tests.

They are test hooks of the engine child (``HARNESS_TEST_HOOK``, harness.engines.worker), each
``fault=NAME[:ARG]``. A fault patches the reference's decoding before the load, or changes the
loaded model right after it:

| fault | what it does |
|---|---|
| ``bnb-dq-no-offset`` | double-quantized bnb absmax decoded without its ``nested_offset`` |
| ``fp8-scale-dropped:GLOB`` | the ``weight_scale`` of the FP8 weights matching GLOB read as 1.0 |
| ``skip-ignored`` | online quantization ignores the skip rules: every linear is quantized, ``lm_head`` included |
| ``rows:PARAM:LO-HI[,LO-HI...]:FACTOR`` | after loading, those rows of parameter PARAM multiplied by FACTOR (embedding or LM-head rows of tokens the logprob prompts never use: the logprob cells cannot see it) |

``rows`` works on every engine: in-process on the model, in vLLM through ``LLM.apply_model``.
"""
from __future__ import annotations

import fnmatch
from collections.abc import Callable


def _bnb_dq_no_offset(arg: str | None) -> None:
    from harness.quant import bnb

    original = bnb.dequantize_absmax

    def dequantize_absmax(qabsmax, nested_absmax, nested_quant_map, nested_blocksize, nested_offset):
        return original(qabsmax, nested_absmax, nested_quant_map, nested_blocksize, 0.0)

    bnb.dequantize_absmax = dequantize_absmax


def _fp8_scale_dropped(arg: str | None) -> None:
    import torch

    from harness.quant import fp8

    pattern = (arg or "*") + "_scale"
    original = fp8._read_scale

    def _read_scale(src, name):
        t = original(src, name)
        return torch.ones_like(t) if fnmatch.fnmatchcase(name, pattern) else t

    fp8._read_scale = _read_scale


def _skip_ignored(arg: str | None) -> None:
    from harness.reference import online

    original = online.OnlineQuantizer.plan

    def plan(self, model, names, arch):
        decisions, disagreements, notes = original(self, model, names, arch)
        return ({n: ("quantize", self._what(n)) if d[0] == "skip" else d for n, d in decisions.items()},
                disagreements, notes)

    online.OnlineQuantizer.plan = plan


def _rows(arg: str | None) -> Callable:
    try:
        param, spans, factor = (arg or "").rsplit(":", 2)
        ranges = [tuple(int(x) for x in span.split("-")) if "-" in span else (int(span), int(span))
                  for span in spans.split(",")]
        factor = float(factor)
    except ValueError:
        raise ValueError(f"fault rows: expected PARAM:LO-HI[,LO-HI...]:FACTOR, got {arg!r}") from None

    def scale_rows(module):
        import torch

        with torch.no_grad():
            weight = module.get_parameter(param)
            for lo, hi in ranges:
                weight[lo:hi + 1] *= factor
        return param

    def after_load(engine) -> None:
        import torch

        if getattr(engine, "llm", None) is not None:  # vLLM: inside the engine
            engine.llm.apply_model(scale_rows)
            return
        model = engine.model
        scale_rows(model if isinstance(model, torch.nn.Module) else model.model)  # transformers' _NoCache wrapper

    return after_load


FAULTS: dict[str, Callable[[str | None], Callable | None]] = {
    "bnb-dq-no-offset": _bnb_dq_no_offset,
    "fp8-scale-dropped": _fp8_scale_dropped,
    "skip-ignored": _skip_ignored,
    "rows": _rows,
}


def install(spec: str) -> Callable | None:
    """Install the fault ``NAME[:ARG]``; returns what to run on the engine after loading, if anything."""
    name, _, arg = spec.partition(":")
    if name not in FAULTS:
        raise ValueError(f"unknown fault {name!r} (known: {', '.join(FAULTS)})")
    return FAULTS[name](arg or None)
