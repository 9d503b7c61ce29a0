"""Test-only degradations of a loaded model, which the accuracy gate must catch (docs/design.md,
"Accuracy"; docs/testing-hooks.md, "Test-only hooks"). Never used outside tests.

They are test hooks of the engine child (``HARNESS_TEST_HOOK``, harness.engines.worker), each
``fault=NAME[:ARG]``. A fault patches the reference's decoding before the load, or changes the
loaded model right after it:

| fault | what it does |
|---|---|
| ``bnb-dq-no-offset`` | double-quantized bnb absmax decoded without its ``nested_offset`` |
| ``fp8-scale-dropped:GLOB`` | the ``weight_scale`` of the FP8 weights matching GLOB read as 1.0 |
| ``skip-ignored`` | online quantization ignores the skip rules: every linear is quantized, ``lm_head`` included |
| ``rows:PARAM:LO-HI[,LO-HI...]:FACTOR`` | after loading, those rows of parameter PARAM multiplied by FACTOR (embedding or LM-head rows of tokens the logprob prompts never use: the logprob cells cannot see it) |
| ``tensor-scaled:GLOB:FACTOR`` | the checkpoint tensors matching GLOB (on-disk names) read multiplied by FACTOR: a wrong FP8 ``weight_scale``, a corrupted bnb ``absmax`` |
| ``tensors-swapped:A:B`` | the checkpoint tensors under prefix A read from prefix B and the other way round: a loader that swaps k and v |
| ``mask-shifted:GLOB`` | after loading, the attention modules matching GLOB (in-memory names) attend with a causal mask off by one (each position also sees the next) |
| ``output-scaled:GLOB:FACTOR`` | after loading, the output of the modules matching GLOB (in-memory names: vLLM's fused ones in vLLM) multiplied by FACTOR: a second bug inside a cell a known failure already covers |

The last three are the module-trace localisation's faults (docs/design.md, "Localisation"); they
change the reference's own reading (harness.quant.source.TensorSource) or its modules, never
another engine's.

``rows`` and ``output-scaled`` work on every engine: in-process on the model, in vLLM through
``LLM.apply_model``.
"""
from __future__ import annotations

import fnmatch
from collections.abc import Callable


def _bnb_dq_no_offset(arg: str | None) -> None:
    # lazy: torch, pydantic and more, +2.8 s (scripts/import-graph --costs)
    from harness.quant import bnb

    original = bnb.dequantize_absmax

    def dequantize_absmax(qabsmax, nested_absmax, nested_quant_map, nested_blocksize, nested_offset):
        return original(qabsmax, nested_absmax, nested_quant_map, nested_blocksize, 0.0)

    bnb.dequantize_absmax = dequantize_absmax


def _fp8_scale_dropped(arg: str | None) -> None:
    import torch

    # lazy: torch, pydantic and more, +2.6 s (scripts/import-graph --costs)
    from harness.quant import fp8

    pattern = (arg or "*") + "_scale"
    original = fp8._read_scale

    def _read_scale(src, name):
        t = original(src, name)
        return torch.ones_like(t) if fnmatch.fnmatchcase(name, pattern) else t

    fp8._read_scale = _read_scale


def _skip_ignored(arg: str | None) -> None:
    # lazy: torch, transformers and more, +10.5 s (scripts/import-graph --costs)
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


def _tensor_read(transform: Callable) -> None:
    """Patch the reference's tensor reading: ``transform(source, name)`` returns the tensor read."""
    # lazy: torch, pydantic and more, +2.2 s (scripts/import-graph --costs)
    from harness.quant.source import TensorSource

    original = TensorSource.get

    def get(self, name):
        return transform(lambda n: original(self, n), name)

    TensorSource.get = get


def _tensor_scaled(arg: str | None) -> None:
    glob, _, factor = (arg or "").rpartition(":")
    if not glob:
        raise ValueError(f"fault tensor-scaled: expected GLOB:FACTOR, got {arg!r}")

    def transform(read, name):
        t = read(name)
        return (t * float(factor)).to(t.dtype) if fnmatch.fnmatchcase(name, glob) else t

    _tensor_read(transform)


def _tensors_swapped(arg: str | None) -> None:
    a, _, b = (arg or "").partition(":")
    if not a or not b:
        raise ValueError(f"fault tensors-swapped: expected PREFIX_A:PREFIX_B, got {arg!r}")

    def transform(read, name):
        if name.startswith(a):
            return read(b + name[len(a):])
        if name.startswith(b):
            return read(a + name[len(b):])
        return read(name)

    _tensor_read(transform)


def _mask_shifted(arg: str | None) -> Callable:
    def shift(module) -> None:
        import torch

        original = module.forward

        def forward(*args, **kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            n = hidden.shape[1]
            kwargs["attention_mask"] = torch.ones(n, n, dtype=torch.bool, device=hidden.device).tril(diagonal=1)[None, None]
            return original(*args[:2], **kwargs)  # the mask by keyword (Llama's third positional)

        module.forward = forward

    def after_load(engine) -> None:
        # lazy: torch, numpy, +3.7 s (scripts/import-graph --costs)
        from harness.traces.record import torch_module

        model = torch_module(engine.model)
        hits = [m for name, m in model.named_modules() if fnmatch.fnmatchcase(name, arg or "")]
        if not hits:
            raise ValueError(f"fault mask-shifted: no module matches {arg!r}")
        for m in hits:
            shift(m)

    return after_load


def _output_scaled(arg: str | None) -> Callable:
    glob, _, factor = (arg or "").rpartition(":")
    try:
        factor = float(factor)
    except ValueError:
        glob = ""
    if not glob:
        raise ValueError(f"fault output-scaled: expected GLOB:FACTOR, got {arg!r}")

    def scaled(module, inputs, output):
        # vLLM's parallel linears return (output, bias)
        return (output[0] * factor, *output[1:]) if isinstance(output, tuple) else output * factor

    def hook(model) -> int:
        hits = [m for name, m in model.named_modules() if fnmatch.fnmatchcase(name, glob)]
        if not hits:
            raise ValueError(f"fault output-scaled: no module matches {glob!r}")
        for m in hits:
            m.register_forward_hook(scaled)
        return len(hits)

    def after_load(engine) -> None:
        if getattr(engine, "llm", None) is not None:  # vLLM: inside the engine
            engine.llm.apply_model(hook)
            return
        # lazy: torch, numpy, +3.7 s (scripts/import-graph --costs)
        from harness.traces.record import torch_module

        hook(torch_module(engine.model))

    return after_load


FAULTS: dict[str, Callable[[str | None], Callable | None]] = {
    "bnb-dq-no-offset": _bnb_dq_no_offset,
    "fp8-scale-dropped": _fp8_scale_dropped,
    "skip-ignored": _skip_ignored,
    "rows": _rows,
    "tensor-scaled": _tensor_scaled,
    "tensors-swapped": _tensors_swapped,
    "mask-shifted": _mask_shifted,
    "output-scaled": _output_scaled,
}


def install(spec: str) -> Callable | None:
    """Install the fault ``NAME[:ARG]``; returns what to run on the engine after loading, if anything."""
    name, _, arg = spec.partition(":")
    if name not in FAULTS:
        raise ValueError(f"unknown fault {name!r} (known: {', '.join(FAULTS)})")
    return FAULTS[name](arg or None)
