"""Module traces inside vLLM (docs/design.md, "Localisation"; docs/README-vllm.md, "Module traces").

vLLM runs the model in its own worker; the engine child reaches it through ``LLM.apply_model``
(in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). :func:`trace` installs a pre-hook and a
hook on every module of vLLM's model (:func:`install_hooks`), scores each sequence alone as
``teacher_forced`` does (``max_tokens=1``, prompt logprobs; prefix caching is off, so every
position is computed), reads the recording back (:func:`read_back`) and turns it into
transformers' shape (:func:`prompt_trace`):

- **Names.** vLLM's module names become transformers' in-memory names by inverting
  ``harness.dialects.names.to_vllm`` over the transformers model's own module names (built on
  the meta device from the checkpoint's config), so the inverse is exact wherever ``to_vllm`` is.
  Fused modules are split back into their checkpoint shards along the output features with the
  module reader's mapping (``vllm_worker.shard_layout``: ``packed_modules_mapping`` and
  ``output_partition_sizes``): qkv_proj -> q/k/v_proj, gate_up_proj -> gate/up_proj, Whisper's
  cross-attention kv_proj -> k/v_proj. Every vLLM module without a transformers counterpart is
  left out and named in the log.
- **What vLLM computes differently under the same name** is converted or left out:
  a linear's ``(output, bias)`` tuple gives its output; a decoder layer returns
  ``(hidden_states, residual)``, whose sum is transformers' layer output; a norm called with a
  residual adds it in place first, so its input is ``x + residual`` (inputs are kept as the module
  is entered, before any in-place change); ``act_fn`` is ``act(gate) * up`` in vLLM
  (SiluAndMul...) but ``act(gate)`` in transformers: left out; per-layer ``rotary_emb`` (it
  rotates q and k) and ``attn`` (the attention kernel) have no transformers module: left out; a
  module under ``@support_torch_compile`` (Llama's ``model``) is called through its ``forward``,
  eager or not, so its hooks never fire: left out too.
- **The LM head** is never called as a module in vLLM: ``LogitsProcessor(lm_head, hidden)``
  multiplies by its weight, once for the prompt logprobs (positions 0..n-2) and once for the
  sampled token (position n-1). Its calls are recorded under the LM head's name and put back in
  position order by matching their input rows with the hidden states the model returned.
- **Compiled graphs.** A hook registered after torch.compile traced the model never runs in the
  compiled graph; one registered before is traced into it, and records what the compiled code
  computes. So a compiled configuration cell (``VllmEngine.prepare_trace``) installs the hooks as
  its model is loaded, before vLLM's warm-up compiles it, and :func:`install_hooks` keeps them.
  Should no hook fire all the same (hooks added after compilation, CUDA graphs), the trace says so
  and stops rather than return an empty trace.

``weights`` are the module reader's effective weights (``vllm_worker.read_modules``) projected on
``harness.traces.weight_probe`` as they are read; ``quantizers`` the linears whose vLLM scheme quantizes its input
activations (W8A8, W4A8 schemes, ``Fp8LinearMethod``).
"""
from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from harness.engines.vllm_worker import read_modules, shard_layout
from harness.traces import PromptTrace, weight_probe

RECORDER = "_harness_trace_recorder"  # the attribute of vLLM's model that holds the recorder
# vLLM's fused "activation and multiply" modules (act(gate) * up): transformers' act_fn is act(gate).
_FUSED_ACTIVATION = re.compile(r"AndMul")
_DECODER_LAYER = re.compile(r"(^|\.)layers\.\d+$")
# Schemes that quantize activations to 8 or 4 bits (W8A8, W4A8; not the weight-only W8A16, W4A16).
_INPUT_QUANTIZING = re.compile(r"W\d+A[48](?!\d)|Fp8LinearMethod")


# ------------------------------------------------------------------------ inside vLLM's worker


class _Recorder:
    """What the hooks keep for one scored sequence: the call order, each call's output and (for
    leaves) input, float32 copies on the CPU, and the LM head's calls."""

    def __init__(self):
        self.order: list[str] = []
        self.outputs: dict[str, object] = {}
        self.inputs: dict[str, object] = {}
        self.classes: dict[str, str] = {}
        self.logits: list[tuple[str, object, object]] = []  # (LM head name, hidden rows, logits)
        self._calls: dict[str, int] = {}
        self._active: dict[int, list[str]] = {}
        self.handles: list = []

    def clear(self) -> None:
        self.order, self.outputs, self.inputs, self.logits = [], {}, {}, []
        self._calls, self._active = {}, {}

    def enter(self, name: str, leaf: bool, module, args, kwargs) -> None:
        n = self._calls.get(name, 0)
        self._calls[name] = n + 1
        label = name if n == 0 else f"{name}#{n}"
        self._active.setdefault(id(module), []).append(label)
        self.order.append(label)
        self.classes[label] = type(module).__name__
        x = args[0] if args else kwargs.get("hidden_states")
        if leaf and _is_float(x):
            residual = args[1] if len(args) > 1 else kwargs.get("residual")
            if "Norm" in type(module).__name__ and _is_float(residual):
                x = x + residual  # the fused add-and-norm's real input (it adds in place)
            self.inputs[label] = _copy(x)

    def leave(self, name: str, module, output) -> None:
        label = self._active[id(module)].pop()
        if _DECODER_LAYER.search(name) and isinstance(output, tuple) and len(output) == 2 \
                and all(_is_float(t) for t in output) and output[0].shape == output[1].shape:
            self.outputs[label] = _copy(output[0] + output[1])  # (hidden_states, residual)
            return
        out = _first_float(output)
        if out is not None:
            self.outputs[label] = _copy(out)

    def logits_call(self, names: dict[int, str], args, kwargs, output) -> None:
        head = args[0] if args else kwargs.get("lm_head")
        hidden = args[1] if len(args) > 1 else kwargs.get("hidden_states")
        if _is_float(output) and _is_float(hidden):
            self.logits.append((names.get(id(head), "lm_head"), _copy(hidden), _copy(output)))


def _is_float(x) -> bool:
    import torch

    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _first_float(output):
    if _is_float(output):
        return output
    if isinstance(output, (tuple, list)):
        return next((t for t in output if _is_float(t)), None)
    return None


def _copy(x):
    import torch

    return x.detach().to(device="cpu", dtype=torch.float32, copy=True)


def install_hooks(model) -> int:
    """``apply_model`` function: hooks on every module of vLLM's model (a LogitsProcessor gets
    its own, which records the LM head). Returns the number of hooks. Hooks installed at load (a
    compiled model's, traced into its graph) are kept: new ones would never run there."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    installed = getattr(model, RECORDER, None)
    if installed is not None:
        return len(installed.handles)
    rec = _Recorder()
    names = {id(m): n for n, m in model.named_modules()}
    for name, module in model.named_modules():
        if isinstance(module, LogitsProcessor):
            rec.handles.append(module.register_forward_hook(
                lambda m, a, kw, out: rec.logits_call(names, a, kw, out), with_kwargs=True))
            continue
        leaf = next(module.children(), None) is None
        rec.handles.append(module.register_forward_pre_hook(
            lambda m, a, kw, name=name, leaf=leaf: rec.enter(name, leaf, m, a, kw), with_kwargs=True))
        rec.handles.append(module.register_forward_hook(lambda m, a, out, name=name: rec.leave(name, m, out)))
    object.__setattr__(model, RECORDER, rec)
    return len(rec.handles)


def clear(model) -> None:
    """``apply_model`` function: forget what was recorded (before each scored sequence)."""
    getattr(model, RECORDER).clear()


def read_back(model) -> dict:
    """``apply_model`` function: the recording, the shard layout of every linear, and the linears
    that never ran."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.logits_processor import LogitsProcessor


    rec = getattr(model, RECORDER)
    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    linears = {n: m for n, m in model.named_modules() if isinstance(m, LinearBase)}
    heads = {head for head, _, _ in rec.logits}
    return {"order": list(rec.order), "outputs": dict(rec.outputs), "inputs": dict(rec.inputs),
            "classes": dict(rec.classes), "logits": list(rec.logits),
            "shards": {n: shard_layout(n, m, packed) for n, m in linears.items()},
            "silent": [n for n in linears if n not in rec.outputs],
            "uncalled": {n: _why_uncalled(m) for n, m in model.named_modules()
                         if n not in rec.classes and n not in heads and not isinstance(m, LogitsProcessor)}}


def _why_uncalled(module) -> str:
    if hasattr(module, "do_not_compile"):  # vllm.compilation.decorators.support_torch_compile
        return "its hooks never fire: @support_torch_compile calls its forward directly, eager or not"
    return "never called in the forward pass"


def remove_hooks(model) -> None:
    """``apply_model`` function: remove the hooks (and the recorder)."""
    rec = getattr(model, RECORDER, None)
    if rec is not None:
        for h in rec.handles:
            h.remove()
        object.__delattr__(model, RECORDER)


# --------------------------------------------------------------------- in the engine's process


def hf_module_names(path: str) -> list[str]:
    """transformers' in-memory module names of the checkpoint's model class, from a skeleton on
    the meta device (no weights read)."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the skeleton must not be quantized
    cls = getattr(transformers, config.architectures[0])
    with torch.device("meta"):
        model = cls._from_config(config)
    return [n for n, _ in model.named_modules() if n]


def hf_names_of_vllm(hf_names: Sequence[str], arch: str) -> dict[tuple[str, str], str]:
    """(vLLM module, checkpoint shard) -> transformers module: ``names.to_vllm`` inverted over
    ``hf_names``. A shard is the transformers module's leaf name (``q_proj`` of ``qkv_proj``; an
    unfused module is its own shard). Keys two transformers modules share are left out."""
    # lazy: regex, +110 ms (scripts/import-graph --costs)
    from harness.dialects.names import to_vllm

    out: dict[tuple[str, str], str] = {}
    shared: set[tuple[str, str]] = set()
    for name in hf_names:
        key = (to_vllm(name, arch), name.rsplit(".", 1)[-1])
        if key in out:
            shared.add(key)
        out[key] = name
    return {k: v for k, v in out.items() if k not in shared}


@dataclass
class Converted:
    """One prompt's trace in transformers' names, and the vLLM modules left out (name -> why)."""

    trace: PromptTrace
    left_out: dict[str, str] = field(default_factory=dict)


def prompt_trace(raw: dict, prompt_id: str, n_positions: int, hf_of: dict[tuple[str, str], str]) -> Converted:
    """:func:`read_back`'s recording of one scored sequence -> a PromptTrace in transformers'
    module names (see the module docstring for what is converted and what is left out)."""
    _check_fired(raw, n_positions)
    result = Converted(PromptTrace(prompt=prompt_id), left_out=dict(raw["uncalled"]))
    for label in raw["order"]:
        if label == "":
            continue
        if _FUSED_ACTIVATION.search(raw["classes"][label]):
            result.left_out[label] = f"{raw['classes'][label]}: act(gate) * up, transformers' act_fn is act(gate)"
            continue
        name, _, call = label.partition("#")
        shard_names, sizes = raw["shards"].get(name) or ([name.rsplit(".", 1)[-1]], [None])
        out = raw["outputs"].get(label)
        parts = _split(out, sizes) if out is not None else [None] * len(shard_names)
        if parts is None:
            result.left_out[label] = f"cannot split its output {tuple(out.shape)} into {shard_names} ({sizes})"
            continue
        for shard, part in zip(shard_names, parts):
            hf = hf_of.get((name, shard))
            if hf is None:
                result.left_out[label] = "no transformers module"
                continue
            _put(result.trace, hf + (f"#{call}" if call else ""), part, raw["inputs"].get(label))
    _put_lm_head(result.trace, raw, hf_of)
    return result


def _check_fired(raw: dict, n_positions: int) -> None:
    if not raw["outputs"] or (raw["shards"] and len(raw["silent"]) == len(raw["shards"])):
        raise RuntimeError(
            f"no module hook fired in vLLM's model ({len(raw['silent'])} linears known to run, none recorded): "
            f"vLLM ran a compiled graph (torch.compile or CUDA graphs) whose hooks were added after it was "
            f"compiled; a compiled model's hooks are installed as it is loaded (VllmEngine.prepare_trace)")
    hidden = raw["outputs"].get("")
    calls = sum(1 for label in raw["order"] if label.partition("#")[0] == "")
    if hidden is None or calls != 1 or hidden.shape[0] != n_positions:
        raise RuntimeError(f"vLLM scored the {n_positions}-token sequence in {calls} forward passes over "
                           f"{None if hidden is None else hidden.shape[0]} positions; a trace needs one pass over all of them")


def _split(out, sizes: list[int | None]):
    """A fused module's output cut into its shards along the features; None if the sizes do not fit."""
    if len(sizes) == 1:
        return [out]
    if None in sizes or sum(sizes) != out.shape[-1]:
        return None
    return list(out.split(sizes, dim=-1))


def _put(trace: PromptTrace, name: str, output, inp) -> None:
    trace.order.append(name)
    if output is not None:
        trace.outputs[name] = _rows(output)
    if inp is not None:
        trace.inputs[name] = _rows(inp)


def _rows(x):
    """[positions, features]: vLLM's token tensors are already [num_tokens, ...]; an encoder's
    batched [1, frames, features] loses its batch dimension."""
    if x.dim() >= 3 and x.shape[0] == 1:
        x = x[0]
    return x.reshape(x.shape[0], -1) if x.dim() >= 1 else x.reshape(1, 1)


def _put_lm_head(trace: PromptTrace, raw: dict, hf_of: dict[tuple[str, str], str]) -> None:
    """The LogitsProcessor's calls, in position order: each input row is found among the hidden
    states the model returned (the processor is handed slices of them)."""
    import torch

    if not raw["logits"]:
        return
    head = raw["logits"][0][0]
    hf = hf_of.get((head, head.rsplit(".", 1)[-1]))
    if hf is None:
        return
    hidden = raw["outputs"][""]
    position = {hidden[i].numpy().tobytes(): i for i in reversed(range(hidden.shape[0]))}
    logits = torch.full((hidden.shape[0], raw["logits"][0][2].shape[-1]), float("nan"))
    inputs = torch.full_like(hidden, float("nan"))
    for _, rows_in, rows_out in raw["logits"]:
        for row_in, row_out in zip(rows_in, rows_out):
            i = position.get(row_in.numpy().tobytes())
            if i is not None:
                logits[i], inputs[i] = row_out, row_in
    _put(trace, hf, logits, inputs)


def project_weights(entry: dict) -> dict:
    """A module reader's reading (``vllm_worker.effective_shards``) with each shard's effective
    weight replaced by its projection on ``harness.traces.weight_probe``."""
    for shard in entry["shards"]:
        w = shard["weight"]
        shard["weight"] = w.float() @ weight_probe(w.shape[1]) if w is not None and w.dim() == 2 else None
    return entry


def describe_weights(read: dict, hf_of: dict[tuple[str, str], str], trace: PromptTrace) -> None:
    """Fill ``trace.weights`` and ``trace.quantizers`` from the module reader's reading with the
    weights projected (``vllm_worker.read_modules(model, reduce=project_weights)``)."""
    for vname, entry in read["modules"].items():
        quantizes = bool(_INPUT_QUANTIZING.search(f"{entry.get('scheme') or ''} {entry['quant_method']}"))
        for shard in entry["shards"]:
            hf = hf_of.get((vname, shard["shard"]))
            if hf is None:
                continue
            if shard["weight"] is not None:
                trace.weights[hf] = shard["weight"]
            if quantizes:
                trace.quantizers.add(hf)


# ---------------------------------------------------------------------------------- the driver


def trace(llm, arch: str, requests: Sequence[tuple[str, object, int]], log: Callable[[str], None]) -> list[PromptTrace]:
    """The traces of ``requests`` (prompt id, vLLM prompt, number of tokens), each scored alone.
    The hooks are removed afterwards, whatever happens."""
    from vllm import SamplingParams


    hf_of = hf_names_of_vllm(hf_module_names(llm.model_config.model), arch)
    weights = PromptTrace(prompt="")
    describe_weights(llm.apply_model(functools.partial(read_modules, reduce=project_weights))[0], hf_of, weights)
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, detokenize=False)
    hooked = llm.apply_model(install_hooks)[0]
    traces, left_out = [], {}
    try:
        for prompt_id, prompt, n in requests:
            llm.apply_model(clear)
            llm.generate([prompt], sp, use_tqdm=False)
            converted = prompt_trace(llm.apply_model(read_back)[0], prompt_id, n, hf_of)
            converted.trace.weights, converted.trace.quantizers = weights.weights, weights.quantizers
            traces.append(converted.trace)
            left_out.update(converted.left_out)
    finally:
        llm.apply_model(remove_hooks)
    log(f"vllm: trace: {hooked} hooks; {len(traces[-1].order) if traces else 0} transformers modules per prompt; "
        f"left out (no transformers counterpart): "
        + "; ".join(f"{k}: {v}" for k, v in _collapse(left_out).items()))
    return traces


def _collapse(left_out: dict[str, str]) -> dict[str, str]:
    """Left-out modules with their layer numbers folded (``model.layers.*.self_attn.attn``)."""
    out: dict[str, str] = {}
    for name, why in left_out.items():
        out.setdefault(re.sub(r"#\d+$", "", re.sub(r"\.\d+\.", ".*.", name)), why)
    return out
