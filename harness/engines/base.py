"""The engine interface: one class per engine, behind which every engine is driven alike.

Modelled on vLLM's tests/conftest.py, where ``HfRunner`` and ``VllmRunner`` offer the same methods
(``generate_greedy_logprobs``, prompt logprobs) and are compared through one result shape. Here
every engine implements the same five steps and the driver (harness.engines.execute) makes one
:class:`harness.records.Record` of them, whatever the engine:

1. ``probe(checkpoint)``: the capability probe, made BEFORE anything is loaded. It returns the
   reason the engine cannot run this cell on this machine (a GPU the cell needs, a kernel this
   CPU lacks, a format this engine version cannot read), or None. A reason makes the record
   ``status: unsupported``; that is the only way an engine produces ``unsupported``.
2. ``load(checkpoint) -> LoadInfo``: load the checkpoint and time it, with the engine's own phases
   (reference: its load report's timings; transformers: ``from_pretrained``; vLLM: the weight
   loading time it logs, without restarting the engine for repeats).
3. ``greedy(prompts, max_tokens, top_k, stop=None) -> [Greedy]``: free-running greedy decoding,
   generated tokens and the top-k at every step (HfRunner/VllmRunner ``generate_greedy_logprobs``).
   EOS does not stop decoding: every engine generates exactly ``max_tokens`` tokens (vLLM:
   ``ignore_eos=True``), unless a :class:`Stop` is given (the accuracy tasks' ``generate_until``):
   then decoding ends after the step whose token is one of ``stop.token_ids`` or whose decoded
   text contains one of ``stop.strings`` (vLLM: ``SamplingParams(stop=, stop_token_ids=)``).
4. ``teacher_forced(prompts, sequences, top_k) -> [Scored]``: score given token sequences, the
   logprob of every token after the first and the top-k of the same distribution (one forward
   pass in-process; vLLM: ``prompt_logprobs`` with ``max_tokens=1``).
5. ``module_diff(checkpoint) -> ModuleDiff | None``: module-level conformance, optional (vLLM reads
   its modules through ``LLM.apply_model`` and diffs them against the reference; in-process
   engines return None).

``close()`` frees the engine. Each engine's registry entry (harness.registry) declares ``fuses_shards``: whether they execute q/k/v (and
gate/up) as one fused projection, the way an inference engine does. That matters only for FP8 with
per-tensor scales, where fusing requantizes the shards to the group's largest scale; the runner
compares an engine that does not fuse (transformers) with the reference executed unfused, and an
engine that fuses (vLLM) with the reference as it fuses (docs/design.md, "Fusion rule": "model the engine you compare
against").

Engines run in a child process (harness.engines.worker), one cell per process, under the cell's
timeout. Nothing here imports torch at module level.
"""
from __future__ import annotations

import abc
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from harness import architectures, cpu, files, hub, loaded_state, probes
from harness import records as R
from harness.quant import schema
from harness.registry import ENGINES, resolve, unknown_engine

if TYPE_CHECKING:
    from harness.matrix import Cell
    from harness.traces import PromptTrace


class EngineUnavailable(Exception):
    """The engine cannot even be constructed here (not installed, not implemented yet)."""


@dataclass
class Checkpoint:
    """A checkpoint directory, resolved from the cell's source."""

    path: Path
    fixture: str | None = None  # the fixture name, for fixture sources
    identity: str | None = None  # the fixture identity (from its manifest)
    manifest: dict | None = None  # the fixture's manifest.json

    @property
    def config(self) -> dict:
        """config.json, its architectures and quantization config checked by type
        (harness.quant.schema.config_hints); {} when there is none or it is not JSON: the load
        itself says what is wrong then."""
        # lazy: harness.quant imports torch, which this module leaves to the engines that need it
        from harness.quant import schema

        file = self.path / "config.json"
        try:
            data = json.loads(files.read_text(file))
        except (files.Unreadable, json.JSONDecodeError):
            return {}
        return schema.config_hints(data, str(file))

    @property
    def quantization_config(self) -> dict | None:
        return self.config.get("quantization_config")


@dataclass
class EnginePrompt:
    """One prompt in an engine-neutral form.

    ``tokens`` are the prompt's token ids (decoder ids for encoder-decoder models), the ids that
    scoring extends. ``hf_inputs`` are all the model-call kwargs of a transformers-style forward
    of the prompt (``input_ids`` or ``decoder_input_ids`` included; Whisper's ``input_features``,
    a VLM's ``pixel_values`` ...), built exactly as the fixture's margins were. ``audio`` is the raw waveform and its sampling
    rate, ``image`` a path or ``synthetic:<name>``, ``text`` the prompt text, for engines that
    take raw inputs (vLLM's multi-modal prompts).

    An image or audio prompt also carries its ``input`` (the uint8 RGB image or the waveform),
    ``input_name`` (what it is, for the record), ``input_end`` (the index in ``tokens`` of its last
    input token; 0 for audio) and ``builder`` (harness.engines.inputs.Builder), with which
    :meth:`with_input` makes the same prompt with another input: the input-sensitivity check's."""

    id: str
    kind: str  # text | audio | image
    tokens: list[int]
    hf_inputs: dict[str, Any] = field(default_factory=dict)
    text: str | None = None
    audio: tuple[Any, int] | None = None
    image: str | None = None
    input: Any = None
    input_name: str | None = None
    input_end: int = 0
    builder: Any = None

    @property
    def ref(self) -> R.PromptRef:
        return R.PromptRef(id=self.id, kind=self.kind)

    def with_input(self, data, name: str) -> EnginePrompt:
        """This prompt, the same tokens, with another input of the same shape."""
        rate = self.audio[1] if self.audio is not None else None
        return replace(self, hf_inputs=self.builder.rebuild(self.kind, self.tokens, data, rate), input=data,
                       input_name=name, audio=(data, rate) if self.audio is not None else None)


@dataclass(frozen=True)
class Stop:
    """Where greedy decoding ends early (docs/design.md, "Accuracy"): after a token of
    ``token_ids``, or once the generated tokens, decoded by ``decode``, contain one of ``strings``.
    The tokens up to and including that step are returned; the caller cuts the text at the stop
    string, the same way for every engine."""

    strings: tuple[str, ...] = ()
    token_ids: tuple[int, ...] = ()
    decode: Callable[[list[int]], str] | None = None

    def reached(self, generated: list[int]) -> bool:
        if generated and generated[-1] in self.token_ids:
            return True
        if self.strings and self.decode is not None:
            text = self.decode(generated)
            return any(s in text for s in self.strings)
        return False


class Engine(abc.ABC):
    """One engine. Subclasses set ``name`` (their harness.registry entry) and implement the abstract methods."""

    name: ClassVar[str]

    def __init__(self, cell: Cell, options: dict | None = None):
        self.cell = cell
        self.options = dict(options or {})

    # ---- identity ------------------------------------------------------------------------
    @abc.abstractmethod
    def version(self) -> str:
        """The installed engine version (what results and baselines are keyed by)."""

    def torch_version(self) -> str | None:
        try:
            import torch

            return torch.__version__
        except Exception:
            return None

    def platform(self) -> str:
        if device().startswith("cuda"):
            import torch

            return R.cuda_platform(*torch.cuda.get_device_capability(torch.device(device())))
        return R.cpu_platform()

    def info(self) -> R.EngineInfo:
        return R.EngineInfo(name=self.name, version=self.version(), environment=self.cell.environment,
                            torch=self.torch_version(), platform=self.platform(), cpu=R.CpuInfo(**cpu.describe()))

    def compute_dtype(self, checkpoint: Checkpoint) -> str:
        """The dtype its matmuls run in: float32, the fixtures' dtype, unless the engine says otherwise."""
        return "float32"

    def computation(self, checkpoint: Checkpoint) -> R.Computation:
        """What it computes the cell in: its matmuls' dtype and what the effective quantization (the
        checkpoint's, or the online scheme's preset) quantizes besides weights."""
        qc = online_quantization(self.cell) or checkpoint.quantization_config
        return R.Computation(dtype=self.compute_dtype(checkpoint), quantized_activations=schema.quantized_activations(qc))

    def rows_alone(self, checkpoint: Checkpoint) -> bool:
        """Whether each row of a batched forward pass is what it computes alone: no activation scale
        of the effective quantization is taken over more than one token (harness.scoring)."""
        return not schema.scales_span_tokens(online_quantization(self.cell) or checkpoint.quantization_config)

    # ---- the five steps ------------------------------------------------------------------
    def probe(self, checkpoint: Checkpoint) -> str | None:
        """Why this engine cannot run the cell here, decided before loading; None when it can.
        The default checks the cell's hardware needs against this machine, and that torch sees
        the CUDA device ``HARNESS_DEVICE`` names."""
        reason = hardware_problem(self.cell)
        if reason is None and device().startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                reason = f"{DEVICE_ENV}={device()}, but torch {torch.__version__} sees no CUDA device"
        return reason

    @abc.abstractmethod
    def load(self, checkpoint: Checkpoint) -> R.LoadInfo:
        ...

    def calibration_workload(self, checkpoint: Checkpoint) -> int | str:
        """The workload a gated load of ``checkpoint`` is calibrated by (harness.loadtime.WORKLOADS):
        the memory-and-dispatch one, unless the engine's load is mostly other work."""
        # the engines that time a load import it at module level anyway
        # lazy: harness.fixtures, +100 ms (scripts/import-graph --costs)
        from harness import loadtime

        return loadtime.CALIBRATION_WORKLOAD

    def load_timed_only(self, checkpoint: Checkpoint) -> R.LoadInfo:
        """The load as a gated cell times it, and nothing of the engine after it: what a gated cell's
        confirmation and baseline children (worker mode ``load``) and harness bench's children
        time. The engine may be unusable afterwards; only ``close`` follows. An engine whose load
        is all of it (the in-process ones) just loads."""
        return self.load(checkpoint)

    # ``batch_tokens``: how many token positions an engine that runs one forward pass per call
    # (harness.scoring) may put in one pass when every prompt is plain text; 0 is one prompt a
    # pass. The caller decides whether batching keeps each row what it would be alone
    # (harness.accuracy.lm); vLLM schedules its own batches.
    @abc.abstractmethod
    def greedy(self, prompts: Sequence[EnginePrompt], max_tokens: int, top_k: int,
               stop: Stop | None = None, batch_tokens: int = 0) -> list[R.Greedy]:
        ...

    @abc.abstractmethod
    def teacher_forced(self, prompts: Sequence[EnginePrompt], sequences: Sequence[list[int]], top_k: int,
                       batch_tokens: int = 0) -> list[R.Scored]:
        ...

    def module_diff(self, checkpoint: Checkpoint) -> R.ModuleDiff | None:
        return None

    def cross_attention_gates(self) -> dict[str, float]:
        """Mllama's cross-attention gates as the decoder applies them (parameter name -> tanh of
        its value), for the input-sensitivity check; empty where the model has none or this
        engine cannot read them."""
        return {}

    def loaded_state(self) -> dict[str, str] | None:
        """Module -> digest of what it loaded (harness.loaded_state), right after ``load`` and before
        any forward pass; None where this engine's modules cannot be read."""
        return None

    def prepare_trace(self) -> None:
        """Called before ``load`` in a trace child: what the engine must do at load to trace the
        model later (a compiled vLLM model's hooks). Nothing by default."""

    def trace(self, prompts: Sequence[EnginePrompt], sequences: Sequence[list[int]]) -> list[PromptTrace]:
        """The module trace of each prompt's scored sequence (harness.traces.PromptTrace), on
        demand only (``harness run --trace``, and a failed or regressed cell): docs/design.md,
        "Localisation"."""
        raise NotImplementedError(f"the {self.name} engine records no module traces")

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------- registry


def engine_class(name: str) -> type[Engine]:
    """The class of a registered engine (harness.registry: this project's, or an installed package's)."""
    spec = ENGINES.get(name)
    if spec is None:
        raise EngineUnavailable(f"the {name} engine is not implemented in this harness version: {unknown_engine(name)}")
    return resolve(spec.implementation)


# ------------------------------------------------------------------------------- helpers


DEVICE_ENV = "HARNESS_DEVICE"


def device() -> str:
    """Where the in-process engines (reference, transformers) run: ``cpu`` (the default) or
    ``cuda`` / ``cuda:N``, from ``HARNESS_DEVICE``, which an environment's ``env`` sets
    (models.yaml's ``cuda-check``, scripts/gpu-check)."""
    return os.environ.get(DEVICE_ENV) or "cpu"


class OnDevice:
    """Calls a model with its tensor inputs moved to ``device`` (prompts are built on the CPU)."""

    def __init__(self, model, device: str):
        self.model = model
        self.device = device

    def __call__(self, **kwargs):
        return self.model(**{k: v.to(self.device) if hasattr(v, "to") else v for k, v in kwargs.items()})


def hardware_problem(cell: Cell) -> str | None:
    """The cell's hardware needs against this machine: GPUs, GPU memory, compute capability
    (harness.probes, which reads the GPUs without importing torch)."""

    return probes.hardware_problem(cell.hardware)


def online_quantization(cell: Cell) -> dict | None:
    """The quantization config an online scheme applies at load time, or None for a pre-quantized
    (or unquantized) checkpoint: the preset named like the scheme (harness.reference.online.PRESETS:
    ``online-bnb-nf4``, ``online-torchao-int8wo``, ``online-fp8``), in the format its library
    serializes to (a copy: engines may modify it)."""
    if not cell.scheme.startswith("online-"):
        return None
    # lazy: torch, transformers and more, +5.6 s (scripts/import-graph --costs)
    from harness.reference.online import PRESETS

    spec = PRESETS.get(cell.scheme)
    return json.loads(json.dumps(spec)) if spec is not None else None


def resolve_checkpoint(cell: Cell, path: str | None = None) -> Checkpoint:
    """The checkpoint of a cell: a fixture (built or cached), a local directory (``path``, already
    resolved against models.yaml by the runner) or a pinned hub snapshot (the one ``harness
    prefetch`` left in this machine's hub cache, else snapshot_download's)."""
    if cell.source_kind == "fixture":
        # lazy: numpy, regex, +90 ms (scripts/import-graph --costs)
        from harness import fixtures

        p = fixtures.build(cell.fixture_name)
        manifest = fixtures.manifest(p)
        return Checkpoint(p, fixture=cell.fixture_name, identity=manifest.get("identity"), manifest=manifest)
    if cell.source_kind == "path":
        return Checkpoint(Path(path or cell.path))

    snapshot = hub.prefetched(cell.hub.id, cell.hub.revision)  # a prefetch on this agent: no hub call
    if snapshot is not None:
        return Checkpoint(snapshot)
    from huggingface_hub import snapshot_download

    revision = None if cell.hub.revision == "unpinned" else cell.hub.revision
    return Checkpoint(Path(snapshot_download(cell.hub.id, revision=revision)))


def prompts_for(cell: Cell, checkpoint: Checkpoint) -> list[EnginePrompt]:
    """The prompts of a cell. Fixtures bring their own (manifest ``prompts``, ids ``p0``, ``p1``,
    ...; Whisper's audio and the VLMs' images are rebuilt from the manifest); models.yaml prompt
    sets are built with the checkpoint's tokenizer and processor (harness.engines.inputs), their
    ``synthetic:`` inputs generated by harness.synthetic."""
    # lazy: numpy, regex, +420 ms (scripts/import-graph --costs)
    from harness.engines import inputs

    arch = architectures.get(cell.arch)
    builder = inputs.Builder(arch.name, checkpoint.path) if arch is not None and arch.modality != "text" else None
    if cell.prompt_set == "fixture":
        return _fixture_prompts(checkpoint.manifest, builder)
    return [_prompt_set_prompt(cell, p, checkpoint, builder) for p in cell.prompts]


def _fixture_prompts(m: dict, builder) -> list[EnginePrompt]:
    # lazy: numpy, regex, +90 ms (scripts/import-graph --costs)
    from harness import fixtures
    # lazy: numpy, regex, +100 ms (scripts/import-graph --costs)
    from harness.fixtures import inputs as fixture_inputs

    key = "audio" if m.get("audio") else "images" if m.get("images") else None
    rate = int(m["audio"]["sampling_rate"]) if key == "audio" else None
    data = fixture_inputs.synth_audio(m[key]) if key == "audio" else fixture_inputs.synth_images(m[key]) if key else None
    out = []
    for i, kwargs in enumerate(fixtures.prompt_inputs(m)):
        ids = [int(t) for t in kwargs.get("decoder_input_ids", kwargs.get("input_ids"))[0].tolist()]
        kind = "image" if "pixel_values" in kwargs else "audio" if "input_features" in kwargs else "text"
        prompt = EnginePrompt(id=f"p{i}", kind=kind, tokens=ids, hf_inputs=dict(kwargs))
        if kind != "text":
            prompt = replace(prompt, input=data[i], input_name=f"fixture {kind} {i} ({m[key]['kind']})",
                             input_end=builder.input_end(kind, ids), builder=builder,
                             audio=(data[i], rate) if kind == "audio" else None)
        out.append(prompt)
    return out


def _prompt_set_prompt(cell: Cell, p, checkpoint: Checkpoint, builder) -> EnginePrompt:
    """One prompt of a models.yaml prompt set, on the cell's checkpoint."""
    # lazy: numpy, regex, +420 ms (scripts/import-graph --costs)
    from harness.engines import inputs

    value = p.image or p.audio
    if value is None:
        if builder is not None:
            return EnginePrompt(id=p.id, kind="text", tokens=builder.text_ids(p.text), text=p.text)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(checkpoint.path)
        return EnginePrompt(id=p.id, kind="text", tokens=list(tok(p.text)["input_ids"]), text=p.text)
    where = f"prompt set {cell.prompt_set}, prompt {p.id}"
    if builder is None:
        raise ValueError(f"{where}: a {p.kind} prompt, but {cell.arch} takes text only")
    data, rate = inputs.load(value, where)
    ids = builder.prompt_ids(p.kind, p.text, data)
    return EnginePrompt(id=p.id, kind=p.kind, tokens=ids, hf_inputs=builder.rebuild(p.kind, ids, data, rate),
                        text=p.text, audio=(data, rate) if p.kind == "audio" else None, image=p.image,
                        input=data, input_name=value, input_end=builder.input_end(p.kind, ids), builder=builder)


# Mllama's gates on the cross-attention output and on the MLP after it (tanh-applied).
GATE_SUFFIXES = ("cross_attn_attn_gate", "cross_attn_mlp_gate")


def topk_lists(x) -> list:
    return [list(t) for t in x]


def _plain_text(p: EnginePrompt) -> bool:
    """A prompt that is its tokens alone (no image, audio, encoder input or mask)."""
    return p.kind == "text" and set(p.hf_inputs) <= {"input_ids"}


class InProcessEngine(Engine):
    """An engine whose model is a torch module called like transformers' (reference, transformers):
    greedy decoding and teacher-forced scoring go through harness.scoring, so a difference between
    two such engines is a difference in loading, never in how they were driven."""

    model: Any = None

    def on_device(self, model):
        """The model as harness.scoring calls it. On CUDA: inputs moved to the device, and TF32
        off, so that float32 means float32 on a GPU too."""
        if device() == "cpu":
            return model
        import torch

        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        return OnDevice(model, device())

    def _prompt(self, p: EnginePrompt):
        # lazy: torch, numpy, +1.4 s (scripts/import-graph --costs)
        from harness import scoring

        kwargs = dict(p.hf_inputs)
        if not any(k in kwargs for k in ("input_ids", "decoder_input_ids")):  # a text prompt of a prompt set
            import torch

            kwargs["input_ids"] = torch.tensor([p.tokens])
        return scoring.Prompt.from_model_inputs(p.id, kwargs)

    def greedy(self, prompts, max_tokens, top_k, stop=None, batch_tokens=0):
        # lazy: torch, numpy, +1.4 s (scripts/import-graph --costs)
        from harness import scoring

        reached = stop.reached if stop is not None else None
        if batch_tokens and all(_plain_text(p) for p in prompts):
            done = scoring.greedy_text(self.model, [list(p.tokens) for p in prompts], max_tokens, top_k,
                                       batch_tokens, stop=reached)
        else:
            done = [scoring.greedy(self.model, self._prompt(p), max_tokens, top_k, stop=reached) for p in prompts]
        return [R.Greedy(tokens=g.tokens, topk=topk_lists(g.topk)) for g in done]

    def teacher_forced(self, prompts, sequences, top_k, batch_tokens=0):
        # lazy: torch, numpy, +1.4 s (scripts/import-graph --costs)
        from harness import scoring

        if batch_tokens and all(_plain_text(p) for p in prompts):
            done = scoring.teacher_forced_text(self.model, [list(s) for s in sequences], top_k, batch_tokens)
        else:
            done = [scoring.teacher_forced(self.model, self._prompt(p), list(seq), top_k)
                    for p, seq in zip(prompts, sequences)]
        return [R.Scored(tokens=s.tokens, logprobs=s.logprobs, topk=topk_lists(s.topk)) for s in done]

    def loaded_state(self):
        # lazy: torch, numpy, +1.6 s (scripts/import-graph --costs)
        from harness.traces.record import torch_module

        return loaded_state.digest(torch_module(self.model))

    def cross_attention_gates(self):
        # lazy: torch, numpy, +1.6 s (scripts/import-graph --costs)
        from harness.traces.record import torch_module

        return {name: float(p.detach().tanh().abs().min()) for name, p in torch_module(self.model).named_parameters()
                if name.endswith(GATE_SUFFIXES)}

    def trace(self, prompts, sequences):
        # lazy: torch, numpy, +1.6 s (scripts/import-graph --costs)
        from harness.traces import record

        return [record.record(self.model, p.id, self._prompt(p), list(seq)) for p, seq in zip(prompts, sequences)]

    def close(self):
        self.model = None
