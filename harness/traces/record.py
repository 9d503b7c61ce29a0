"""Recording a module trace with forward hooks (reference and transformers; docs/design.md,
"Localisation").

One teacher-forced forward pass of the scored sequence (harness.scoring's, so the trace sees
exactly what scoring computed) with a pre-hook and a hook on every named module: the pre-hook
fixes the module's place in the execution order and keeps the first positional (or
``hidden_states``) input of a leaf, the hook keeps the output. A module called more than once in
the pass (a shared embedding) is recorded per call, the later calls as ``name#1``, ``name#2``.
A fused projection the model calls as one (the reference's fused cross-attention k/v) is recorded
as its checkpoint shards: its output split by the shards' sizes, under the shards' names. The
hooks are removed when the pass ends, whatever happens in it.
"""
from __future__ import annotations

from harness import scoring
from harness.traces import PromptTrace, weight_probe


def record(model, prompt_id: str, prompt: scoring.Prompt, tokens: list[int]) -> PromptTrace:
    """The trace of ``prompt`` scored on ``tokens`` by ``model`` (called as harness.scoring calls
    it: a module or a wrapper around one)."""
    module = torch_module(model)
    recorder = _Recorder(module, prompt_id)
    try:
        scoring.teacher_forced(model, prompt, list(tokens), 1)
    finally:
        recorder.close()
    return recorder.trace


def torch_module(model):
    """The torch module inside the wrappers the engines call (transformers' use_cache=False
    wrapper, harness.engines.base.OnDevice): each keeps it as ``.model``."""
    import torch

    while not isinstance(model, torch.nn.Module):
        model = model.model
    return model


class _Recorder:
    def __init__(self, model, prompt_id: str):
        self.trace = PromptTrace(prompt=prompt_id)
        self._calls: dict[str, int] = {}
        self._active: dict = {}  # id(module), or ("shard", id(fused)) -> labels of its calls in flight
        self._handles = []
        self._shards = _shard_names(model)  # id(fused module) -> its shards' names, in order
        for name, module in model.named_modules():
            leaf = next(module.children(), None) is None
            self._handles.append(module.register_forward_pre_hook(
                lambda m, args, kwargs, name=name, leaf=leaf: self._enter(id(m), name, leaf, args, kwargs),
                with_kwargs=True))
            self._handles.append(module.register_forward_hook(lambda m, _a, out: self._leave(m, out)))
            if leaf:
                self._describe_leaf(name, module)

    def _enter(self, key, name: str, leaf: bool, args, kwargs) -> None:
        for shard in self._shards.get(key, ()):
            self._enter(("shard", key), shard, leaf, args, kwargs)
        n = self._calls.get(name, 0)
        self._calls[name] = n + 1
        label = name if n == 0 else f"{name}#{n}"
        self._active.setdefault(key, []).append(label)
        self.trace.order.append(label)
        x = args[0] if args else kwargs.get("hidden_states")
        if leaf and _is_float_tensor(x):
            self.trace.inputs[label] = rows(x)

    def _leave(self, module, output) -> None:
        label = self._active[id(module)].pop()
        out = first_tensor(output)
        shards = self._shards.get(id(module))
        if shards:
            self._split(label, [self._active[("shard", id(module))].pop() for _ in shards][::-1], module.sizes, out)
        elif out is not None:
            self.trace.outputs[label] = rows(out)

    def _split(self, label: str, shards: list[str], sizes: list[int], out) -> None:
        """The fused module's output recorded as its shards' (the fused name itself is dropped)."""
        self.trace.order.remove(label)
        self.trace.inputs.pop(label, None)
        for shard, part in zip(shards, out.split(sizes, dim=-1)):
            self.trace.outputs[shard] = rows(part)

    def _describe_leaf(self, name: str, module) -> None:
        weight = effective_weight(module)
        if weight is not None and weight.dim() == 2:
            self.trace.weights[name] = weight.detach().float().cpu() @ weight_probe(weight.shape[1])
        if quantizes_input(module):
            self.trace.quantizers.add(name)
            kind, scale = input_quantization(module)
            if kind is not None and weight is not None and weight.dim() == 2:
                self.trace.input_scales[name] = scale
                self.trace.column_norms[name] = weight.detach().float().cpu().norm(dim=0)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _shard_names(model) -> dict[int, list[str]]:
    """The reference's fused projections (harness.reference.linear.FusedLinear) and the names of
    the shard modules cut from them, in shard order."""
    shards: dict[int, list[tuple[int, str]]] = {}
    for name, module in model.named_modules():
        fused = getattr(module, "fused", None)
        if fused is not None and hasattr(module, "start"):
            shards.setdefault(id(fused), []).append((module.start, name))
    return {k: [name for _, name in sorted(v)] for k, v in shards.items()}


def _is_float_tensor(x) -> bool:
    import torch

    return isinstance(x, torch.Tensor) and x.is_floating_point()


def first_tensor(output):
    """The first floating tensor of a module's output (a tensor, a tuple, a ModelOutput), or None."""
    import torch

    if isinstance(output, torch.Tensor):
        return output if output.is_floating_point() else None
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    return next((v for v in values if _is_float_tensor(v)), None)


def rows(x):
    """float32 [positions, features] on the CPU: the batch dimension (of size 1) dropped, the rest
    flattened after the first remaining axis."""
    x = x.detach().float().cpu()
    if x.dim() >= 2 and x.shape[0] == 1:
        x = x[0]
    return x.reshape(x.shape[0], -1) if x.dim() >= 1 else x.reshape(1, 1)


def effective_weight(module):
    """The float weight a linear-like leaf multiplies by, decoded from what each library keeps:
    the reference's float32 weight, bitsandbytes' Params4bit, torchao's tensor subclasses,
    compressed-tensors' FP8 weight with its ``weight_scale``. None where there is no such weight
    (norms keep a vector, embeddings are not linear) or it cannot be read."""
    import torch

    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or isinstance(module, torch.nn.Embedding):
        return None
    state = getattr(weight, "quant_state", None)
    if state is not None:
        import bitsandbytes.functional as bnbf

        return bnbf.dequantize_4bit(weight.data, state)
    if hasattr(weight, "dequantize") and type(weight) not in (torch.Tensor, torch.nn.Parameter):
        return weight.dequantize()
    scale = getattr(module, "weight_scale", None)
    if scale is not None and weight.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return weight.float() * scale.float()
    return weight if weight.is_floating_point() else None


def input_quantization(module) -> tuple[str | None, float | None]:
    """How a quantizing leaf scales its input: ("static", scale), ("token", None) for a dynamic
    scale per token, or (None, None) for any other scheme."""
    owner = getattr(module, "fused", module)
    quant = getattr(owner, "input_quant", None)
    if quant is not None:  # the reference's InputQuant
        return ("static", float(quant.static_scale)) if quant.static_scale is not None else ("token", None)
    ia = getattr(getattr(module, "quantization_scheme", None), "input_activations", None)
    if ia is None:
        return None, None
    if not ia.dynamic and getattr(module, "input_scale", None) is not None:
        return "static", float(module.input_scale.detach().float().reshape(-1)[0])
    strategy = getattr(ia.strategy, "value", ia.strategy)
    return ("token", None) if ia.dynamic and strategy == "token" else (None, None)


def quantizes_input(module) -> bool:
    """Whether a leaf quantizes its input activations: the reference's ``input_quant`` (its own or
    its fused group's), compressed-tensors' ``quantization_scheme.input_activations``."""
    owner = getattr(module, "fused", module)
    if getattr(owner, "input_quant", None) is not None:
        return True
    scheme = getattr(module, "quantization_scheme", None)
    return getattr(scheme, "input_activations", None) is not None
