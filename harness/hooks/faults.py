"""Test-only degradations of a loaded model, which the accuracy gate must catch (docs/design.md,
"Accuracy"; docs/testing-hooks.md, "Test-only hooks"). Never used outside tests.

They are test hooks of the engine child (``HARNESS_TEST_HOOK``, harness.engines.worker), each
``fault=NAME[:ARG]``. A fault patches the reference's decoding before the load, or changes the
loaded model right after it:

| fault | what it does |
|---|---|
| ``bnb-dq-no-offset`` | double-quantized bnb absmax decoded without its ``nested_offset`` |
| ``fp8-scale-dropped:GLOB`` | the ``weight_scale`` of the FP8 weights matching GLOB read as 1.0 |
| ``fp8-requantize-dropped`` | fused per-tensor FP8 shards given the group's max scale without their codes requantized to it (vLLM's FP8 Mllama skipped ``process_weights_after_loading`` on its cross-attention) |
| ``skip-ignored`` | online quantization ignores the skip rules: every linear is quantized, ``lm_head`` included |
| ``rows:PARAM:LO-HI[,LO-HI...]:FACTOR`` | after loading, those rows of parameter PARAM multiplied by FACTOR (embedding or LM-head rows of tokens the logprob prompts never use: the logprob cells cannot see it) |
| ``tensor-scaled:GLOB:FACTOR`` | the checkpoint tensors matching GLOB (on-disk names) read multiplied by FACTOR: a wrong FP8 ``weight_scale``, a corrupted bnb ``absmax`` |
| ``scale-groups-shifted:GLOB`` | the group-wise scales matching GLOB (on-disk names: a torchao int4 ``_weight_scale``) read with each group given its neighbour's (the columns rolled by one) |
| ``tensors-swapped:A:B`` | the checkpoint tensors under prefix A read from prefix B and the other way round: a loader that swaps k and v |
| ``mask-shifted:GLOB`` | after loading, the attention modules matching GLOB (in-memory names) attend with a causal mask off by one (each position also sees the next) |
| ``output-scaled:GLOB:FACTOR`` | after loading, the output of the modules matching GLOB (in-memory names: vLLM's fused ones in vLLM) multiplied by FACTOR: a second bug inside a cell a known failure already covers |
| ``vision-constant`` | the vision tower's output, as the projector receives it, replaced by a constant (Mllama, Qwen2.5-VL) |
| ``projector-zeroed`` | the projector's output zeroed (Mllama's ``multi_modal_projector``, Qwen2.5-VL's ``visual.merger``) |
| ``cross-kv-constant`` | the cross-attention modules given constant encoder states, so their keys and values are constants detached from the encoder (Mllama, Whisper) |
| ``encoder-silence`` | Whisper's encoder fed the log-mel features of silence, whatever the audio |

The last three are the module-trace localisation's faults (docs/design.md, "Localisation"); they
change the reference's own reading (harness.quant.source.TensorSource) or its modules, never
another engine's.

``rows``, ``output-scaled`` and the last four, the input-sensitivity check's mutations
(docs/design.md, "Input sensitivity"), work on every engine: in-process on the model, in vLLM
through ``LLM.apply_model``.
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


def _fp8_requantize_dropped(arg: str | None) -> None:
    # lazy: torch, pydantic and more, +2.6 s (scripts/import-graph --costs)
    from harness.quant import fp8

    fp8._requantized_codes = lambda parts, new_scale, dq_dtype: parts.remap


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


def _scale_groups_shifted(arg: str | None) -> None:
    if not arg:
        raise ValueError("fault scale-groups-shifted: expected GLOB (the scales' on-disk names)")

    def transform(read, name):
        t = read(name)
        return t.roll(1, dims=-1) if fnmatch.fnmatchcase(name, arg) else t

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


def _on_model(engine, change: Callable) -> None:
    """Run ``change(torch module)`` on the loaded model, in-process or inside vLLM."""
    if getattr(engine, "llm", None) is not None:
        engine.llm.apply_model(change)
        return
    # lazy: torch, numpy, +3.7 s (scripts/import-graph --costs)
    from harness.traces.record import torch_module

    change(torch_module(engine.model))


def _replaced(value, make: Callable):
    """``value`` with each tensor in it (a tensor, or a tuple or list of them: vLLM's linear layers
    return (output, bias)) replaced by ``make(tensor)``."""
    import torch

    if isinstance(value, torch.Tensor):
        return make(value)
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return type(value)([make(value[0]), *value[1:]]) if isinstance(value, tuple) else [make(v) for v in value]
    return value


def _module_hook(name: str, globs: tuple[str, ...], make: Callable, inputs: tuple[str, ...] | None) -> Callable:
    """An after-load fault: the modules matching one of ``globs`` get their output replaced by
    ``make(tensor)`` or, with ``inputs``, the first of those keyword inputs they are given (else
    their first positional input)."""

    def install(model) -> int:
        hits = [m for n, m in model.named_modules() if any(fnmatch.fnmatchcase(n, g) for g in globs)]
        for m in hits:
            if inputs is None:
                m.register_forward_hook(lambda mod, args, out: _replaced(out, make))
            else:
                m.register_forward_pre_hook(lambda mod, args, kwargs: _input_replaced(args, kwargs, inputs, make),
                                            with_kwargs=True)
        return len(hits)

    def after_load(engine) -> None:
        counts = []
        _on_model(engine, lambda model: counts.append(install(model)))
        if not any(counts):
            raise ValueError(f"fault {name}: no module matches {' or '.join(globs)}")

    return after_load


def _input_replaced(args: tuple, kwargs: dict, names: tuple[str, ...], make: Callable):
    key = next((k for k in names if k in kwargs), None)
    if key is not None:
        return args, {**kwargs, key: _replaced(kwargs[key], make)}
    if args:
        return (_replaced(args[0], make), *args[1:]), kwargs
    return None


# The modules the mutations change, in transformers', the reference's and vLLM's spellings.
PROJECTORS = ("*multi_modal_projector", "*visual.merger")
CROSS_ATTENTION = ("*cross_attn", "*encoder_attn")
# The keyword that carries the encoder's states into a cross-attention: transformers' Whisper (and
# the reference's), Mllama's, vLLM's Whisper.
ENCODER_STATES = ("key_value_states", "cross_attention_states", "encoder_hidden_states")
ENCODERS = ("model.encoder",)
# Whisper's log-mel of silence: log10 of the 1e-10 floor, clamped to peak - 8 (the same), (x + 4) / 4.
SILENCE_FEATURE = -1.5


def _constant(value: float) -> Callable:
    return lambda t: t.new_full(t.shape, value)


MUTATIONS: dict[str, Callable[[], Callable]] = {
    "vision-constant": lambda: _module_hook("vision-constant", PROJECTORS, _constant(0.5), ("hidden_states",)),
    "projector-zeroed": lambda: _module_hook("projector-zeroed", PROJECTORS, _constant(0.0), None),
    "cross-kv-constant": lambda: _module_hook("cross-kv-constant", CROSS_ATTENTION, _constant(0.5), ENCODER_STATES),
    "encoder-silence": lambda: _module_hook("encoder-silence", ENCODERS, _constant(SILENCE_FEATURE), ("input_features",)),
}


def _output_scaled(arg: str | None) -> Callable:
    glob, _, factor = (arg or "").rpartition(":")
    try:
        factor = float(factor)
    except ValueError:
        glob = ""
    if not glob:
        raise ValueError(f"fault output-scaled: expected GLOB:FACTOR, got {arg!r}")
    return _module_hook("output-scaled", (glob,), lambda t: t * factor, None)


FAULTS: dict[str, Callable[[str | None], Callable | None]] = {
    "bnb-dq-no-offset": _bnb_dq_no_offset,
    "fp8-scale-dropped": _fp8_scale_dropped,
    "fp8-requantize-dropped": _fp8_requantize_dropped,
    "skip-ignored": _skip_ignored,
    "rows": _rows,
    "tensor-scaled": _tensor_scaled,
    "scale-groups-shifted": _scale_groups_shifted,
    "tensors-swapped": _tensors_swapped,
    "mask-shifted": _mask_shifted,
    "output-scaled": _output_scaled,
    **{name: (lambda arg, make=make: make()) for name, make in MUTATIONS.items()},
}


def install(spec: str) -> Callable | None:
    """Install the fault ``NAME[:ARG]``; returns what to run on the engine after loading, if anything."""
    name, _, arg = spec.partition(":")
    if name not in FAULTS:
        raise ValueError(f"unknown fault {name!r} (known: {', '.join(FAULTS)})")
    return FAULTS[name](arg or None)
