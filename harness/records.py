"""The result record: the one format every step of the harness exchanges.

An engine writes one record per cell run; compare fills in ``verdict``, ``verdict_reason``,
``known_failure`` and ``checks``; baselines are written from records; the report and the
Buildkite merge step read them. The format is JSON with ``schema_version: 1`` and is documented
field by field in docs/records-and-baselines.md ("The result record").

Non-finite floats (a NaN logprob from a broken decode) are written as JSON ``NaN`` /
``Infinity`` / ``-Infinity``, as Python's json module does; everything else is plain JSON.

Nothing here imports torch.
"""
from __future__ import annotations

import json
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from harness import checks, files
from harness.files import atomic_write_text, is_version, render_json
from harness.cpu import platform as cpu_platform  # noqa: F401  (the engines' platform string)
from harness.registry import known_engine
from harness.validation import one_line, strict_json
from harness.verdicts import VERDICTS

if TYPE_CHECKING:
    from harness.matrix import Cell

SCHEMA_VERSION = 1
# The verdicts, from the one verdict table (harness/verdicts.py).
Verdict = Literal[VERDICTS]  # type: ignore[valid-type]
Status = Literal["ok", "error", "unsupported"]
PromptKind = Literal["text", "image", "audio"]
# A registered engine (harness.registry.ENGINES, an installed package's included), checked when a
# record is validated, not fixed when this module is imported.
EngineName = Annotated[str, AfterValidator(known_engine)]
# A top-k entry: (token id, logprob), written as a two-element JSON list.
TopK = list[tuple[int, float]]


class RecordError(Exception):
    """A record that cannot be read. ``str()`` is one line naming the file."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptRef(_Strict):
    id: str
    kind: PromptKind


class Scored(_Strict):
    """Teacher-forced scoring of ``tokens``: ``logprobs[i]`` is log p(tokens[i+1] | tokens[:i+1]),
    ``topk[i]`` the top-k at that same position (the distribution that predicts tokens[i+1])."""

    tokens: list[int] = Field(min_length=1)
    logprobs: list[float]
    topk: list[TopK]

    @model_validator(mode="after")
    def _lengths(self) -> Scored:
        n = len(self.tokens) - 1
        if len(self.logprobs) != n:
            raise ValueError(f"scored: {len(self.logprobs)} logprobs for {len(self.tokens)} tokens (need len(tokens) - 1)")
        if len(self.topk) != n:
            raise ValueError(f"scored: {len(self.topk)} top-k lists for {len(self.tokens)} tokens (need len(tokens) - 1)")
        return self


class Greedy(_Strict):
    """Free-running greedy decoding: the generated tokens only, and the top-k at each step."""

    tokens: list[int]
    topk: list[TopK]

    @model_validator(mode="after")
    def _lengths(self) -> Greedy:
        if len(self.topk) != len(self.tokens):
            raise ValueError(f"greedy: {len(self.topk)} top-k lists for {len(self.tokens)} tokens (need one per step)")
        return self


class SequenceResult(_Strict):
    prompt: PromptRef
    prompt_tokens: list[int]
    scored: Scored
    greedy: Greedy

    @model_validator(mode="after")
    def _prefix(self) -> SequenceResult:
        n = len(self.prompt_tokens)
        if self.scored.tokens[:n] != self.prompt_tokens:
            raise ValueError(f"sequence {self.prompt.id}: scored.tokens must begin with prompt_tokens")
        return self


class FixtureRef(_Strict):
    name: str
    identity: str


class SourceRef(_Strict):
    """Where a non-fixture checkpoint came from."""

    hub: str | None = None
    revision: str | None = None
    path: str | None = None


class CpuInfo(_Strict):
    """The CPU a result was computed on (harness.cpu.describe): what selects its kernels."""

    vendor: str
    model: str
    flags: list[str]
    capability: str | None = None  # torch's effective ATEN CPU capability: default, avx2, avx512
    kernel_env: dict[str, str] = {}  # variables that restrict the libraries' kernels (harness.cpu.KERNEL_ENV)


class EngineInfo(_Strict):
    name: EngineName
    version: str | None = None
    environment: str | None = None
    torch: str | None = None
    platform: str | None = None  # "cpu-x86_64-avx2", "cuda-sm90"
    cpu: CpuInfo | None = None


class Computation(_Strict):
    """What an engine computed a cell in (harness.engines.base.Engine.computation), which decides
    whether its logprobs carry to other kernels (docs/design.md, "Portability across CPUs"): a
    float32 computation that quantizes no activation sums differently on other kernels by a few
    ulps; one that rounds activations to FP8, or computes in bfloat16, can move by far more."""

    dtype: str  # the dtype its matmuls run in: "float32", "bfloat16"
    # what it quantizes besides weights (harness.quant.schema.quantized_activations): "input", "kv-cache"
    quantized_activations: list[str] = []

    @property
    def carries(self) -> bool:
        return self.dtype == "float32" and not self.quantized_activations


class ErrorInfo(_Strict):
    type: str
    message: str
    log_tail: str = ""


class ChildLoad(_Strict):
    """One engine child's timing of a gated cell's load: its load seconds and its calibration."""

    seconds: float = Field(ge=0)
    calibration: float | None = None


class LoadInfo(_Strict):
    """``seconds``: the load time (on a gated tier, the statistic of ``samples`` that
    harness.loadtime names). ``phases``: named phase timings (the engine's own: read,
    decode, fuse, ...; ``calibration``: the in-run calibration workload, docs/design.md, "Load time").
    ``children``: where a gated load was timed in more than one child (a confirmation, or a
    baseline's median), every child's timing; ``seconds`` and ``phases`` are those of the child the
    rule reports (a candidate build's paired load: without ``calibration``, compared uncalibrated,
    harness.loadtime.paired). ``calibration_workload``: the version of the workload the ``calibration`` phase
    timed (harness.loadtime: the memory-and-dispatch workload's version number, or the name of
    another workload); null where none was timed, or in a record written before the version was
    kept (the first workload). ``allocation``: the variables that change what the loads' fresh
    memory cost, set where a gated load was timed (harness.loadtime.ALLOCATION_ENV)."""

    seconds: float = Field(ge=0)
    phases: dict[str, float] = {}
    samples: list[float] = []
    children: list[ChildLoad] = []
    calibration_workload: int | str | None = None
    allocation: dict[str, str] = {}


def allocation_named(allocation: dict[str, str]) -> str:
    """A ``LoadInfo.allocation`` as a line names it."""
    return " ".join(f"{k}={v}" for k, v in sorted(allocation.items())) or "the defaults"


class ModuleDiff(_Strict):
    first_differing_module: str
    detail: str


class TraceStep(_Strict):
    """One module of a localisation's path: its largest |Δ| on the localising prompt and the noise
    it was compared with (null where one side did not record it)."""

    module: str
    delta: float | None = None
    noise: float | None = None


LocalisationKind = Literal["weights", "quantizer", "kernel", "attention", "input", "code", "module"]


class FlipAt(_Strict):
    """One prompt's first diverging module, an activation quantizer, and what a rounding flip there
    can explain (harness.traces.flips)."""

    prompt: str
    module: str
    fragile: int  # elements of its input within kernel noise of an FP8 rounding boundary
    moved: float  # how far its output moved: a row's L2 against the other engine's
    bound: float  # the most that flipping MAX_FLIPS of the fragile elements can move it
    steps: float  # moved, in units of the largest single flip's move


class RoundingFlip(_Strict):
    """Whether a difference against another engine's traces on the same kernels is FP8 rounding
    flips: on every prompt that differs, the first diverging module quantizes its input,
    that input agrees within kernel noise, and its output moved no more than a few one-step flips
    of its fragile elements can."""

    explained: bool
    detail: str
    at: list[FlipAt] = []


class Localisation(_Strict):
    """Where two executions of a cell first diverge, module by module (harness.traces;
    docs/design.md, "Localisation"). ``against`` is the other engine, or ``baseline`` (the
    baseline's trace fingerprint). ``module`` is the first diverging module (None: none differs
    beyond its noise), ``kind`` what the rule makes of it, ``prompt`` / ``position`` / ``delta`` /
    ``noise`` the numbers behind it (``position`` None where the comparison has no positions,
    the fingerprint's), ``path`` every compared module of that prompt from input to logits."""

    against: str
    module: str | None = None
    kind: LocalisationKind | None = None
    prompt: str | None = None
    position: int | None = None
    delta: float | None = None
    noise: float | None = None
    detail: str
    path: list[TraceStep] = []
    rounding_flip: RoundingFlip | None = None  # against another engine: whether rounding flips explain it


class Accuracy(_Strict):
    """One accuracy task run through lm-eval on the cell's engine (harness.accuracy; docs/design.md,
    "Accuracy"). ``value`` is lm-eval's ``<metric>,<filter>`` result (None when lm-eval gave none),
    ``stderr`` its standard error, ``samples`` the number of samples evaluated, ``task_hash`` a
    sha256 of what lm-eval evaluated (the task's resolved config, few-shot count, limit, and a
    local task's data), ``gate`` the rule as models.yaml declares it, ``items`` the metric per
    sample in lm-eval's doc order (for a paired look at which samples moved; null for corpus-level
    metrics such as perplexities)."""

    task: str  # the name under models.yaml's accuracy_tasks
    lm_eval_task: str  # lm-eval's own task name
    metric: str
    filter: str
    value: float | None
    stderr: float | None = None
    samples: int = Field(ge=0)
    task_hash: str
    num_fewshot: int | None = None
    limit: int | None = None
    higher_is_better: bool | None = None
    gate: dict[str, Any]
    items: list[float] | None = None
    seconds: float = Field(ge=0)


class PromptSensitivity(_Strict):
    """One image or audio prompt scored again with a second input (docs/design.md, "Input
    sensitivity"): the scored-token logprobs of both at the first positions after the input."""

    prompt: str
    kind: PromptKind
    input: str  # what the prompt's input is (``synthetic:<name>``, ``fixture image 0 (pcg64-blocks)``)
    contrast: str  # the second input (harness.synthetic.contrast)
    first: int  # logprob index of the first position compared (the prompt's last input token)
    logprobs: list[float]  # with the prompt's input
    contrast_logprobs: list[float]  # with the second input
    max_delta: float  # max |difference| over those positions


class InputSensitivity(_Strict):
    """What the input-sensitivity check measured on a multimodal cell, with no baseline needed:
    per prompt, and Mllama's cross-attention gates (tanh of each, as the decoder applies them)."""

    prompts: list[PromptSensitivity]
    gates: dict[str, float] = {}
    seconds: float = Field(ge=0)  # the second scoring's wall time


class Check(_Strict):
    """One comparison: its ``kind`` (an entry of harness.checks.KINDS), what it was compared
    ``against`` (``baseline``, another engine, ``contrast``), an accuracy check's ``task``;
    ``data`` carries numbers for the report (JSON-safe)."""

    kind: str
    against: str
    ok: bool
    detail: str
    data: dict[str, Any] | None = None
    task: str | None = None

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, value: str) -> str:
        checks.kind(value)
        return value

    spec = property(lambda self: checks.kind(self.kind))  # its entry of harness.checks.KINDS

    @property
    def name(self) -> str:
        """``<kind>:<against>`` (``accuracy/<task>:<against>``): what people and known-failure
        patterns read; code reads the fields."""
        return f"{self.kind}{'/' + self.task if self.task else ''}:{self.against}"

    @property
    def against_baseline(self) -> bool:
        return self.against == checks.BASELINE

    @property
    def cross_engine(self) -> bool:
        """A comparison with another engine of the run (compare.cross_engine)."""
        return self.spec.between_engines and not self.against_baseline


class Evidence(_Strict):
    """What a verdict reads besides the checks, gathered with them before anything is judged
    (harness.evidence.gather): the one judgement (harness.judging.decide) reads only the record."""

    baseline: bool  # a baseline was there to judge against
    stale: list[str] = []  # why it is not this record's to compare with (engine version, platform, fixture, task)
    accuracy_missing: list[str] = []  # accuracy tasks its accuracy baseline holds no value for
    not_judged: str | None = None  # what is shown but not judged against a baseline from other kernels, and why
    rounding_flips: str | None = None  # the flips that explain failing checks against other engines (judging.explain_flips)


class KnownFailureRef(_Strict):
    engine: str
    versions: str
    pattern: str
    reason: str
    link: str | None = None

    def matches(self, text: str) -> bool:
        """Whether the pattern is found in ``text``, as the matrix's known failure finds it."""
        return re.search(self.pattern, text) is not None


class Record(_Strict):
    schema_version: Literal[1] = SCHEMA_VERSION
    cell: str
    model: str
    scheme: str
    engine: EngineName
    tier: Literal["cpu-tiny", "cpu-load", "cpu-config", "gpu-tiny", "gpu-full"]
    fixture: FixtureRef | None = None
    source: SourceRef | None = None
    engine_info: EngineInfo
    # the candidate build's spec (harness run --candidate ENGINE=SPEC, harness.candidates); None for
    # the environment's pinned build. The same cell's two records are told apart by it.
    candidate: str | None = None
    # the engine configuration of a configuration cell (models.yaml configurations; harness.configurations)
    configuration: str | None = None
    status: Status
    error: ErrorInfo | None = None
    unsupported_reason: str | None = None
    sequences: list[SequenceResult] = []
    load: LoadInfo | None = None
    computation: Computation | None = None  # None for an engine that did not run, or an older record
    module_diff: ModuleDiff | None = None
    # module -> digest of what the engine loaded there (harness.loaded_state), taken after the load
    # and before any forward pass; None where the engine cannot read its modules
    loaded_state: dict[str, str] | None = None
    accuracy: list[Accuracy] = []  # the cell's accuracy tasks, run in the same engine child
    localisation: list[Localisation] = []  # module-trace localisations (harness.traces), on demand
    input_sensitivity: InputSensitivity | None = None  # multimodal cells: the output against a second input
    started_at: str
    duration_s: float = Field(ge=0)
    verdict: Verdict | None = None
    verdict_reason: str | None = None
    known_failure: KnownFailureRef | None = None
    checks: list[Check] = []
    evidence: Evidence | None = None  # None until gathered (harness.evidence)

    @field_validator("started_at")
    @classmethod
    def _utc(cls, v: str) -> str:
        try:
            t = datetime.fromisoformat(v)
        except ValueError:
            raise ValueError(f"{v!r} is not an ISO 8601 time") from None
        if t.tzinfo is None or t.utcoffset().total_seconds() != 0:
            raise ValueError(f"{v!r} must be UTC (end in Z or +00:00)")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> Record:
        plain = f"{self.model}.{self.scheme}.{self.engine}"
        if self.cell != (f"{plain}-{self.configuration}" if self.configuration else plain):
            raise ValueError(f"cell {self.cell!r} is not <model>.<scheme>.<engine>[-<configuration>] ({plain}"
                             f"{'-' + self.configuration if self.configuration else ''})")
        if self.engine_info.name != self.engine:
            raise ValueError(f"engine_info.name {self.engine_info.name!r} differs from engine {self.engine!r}")
        if self.status == "ok":
            if not self.sequences:
                raise ValueError("status ok needs at least one sequence")
            if self.load is None:
                raise ValueError("status ok needs load")
            if not self.engine_info.version or not self.engine_info.platform:
                raise ValueError("status ok needs engine_info.version and engine_info.platform")
        if self.status == "error" and self.error is None:
            raise ValueError("status error needs error")
        if self.status == "unsupported" and not self.unsupported_reason:
            raise ValueError("status unsupported needs unsupported_reason")
        ids = [s.prompt.id for s in self.sequences]
        if len(ids) != len(set(ids)):
            raise ValueError("sequences: prompt ids must be unique")
        return self

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def for_cell(cls, cell: Cell, *, engine_info: EngineInfo, status: Status = "ok",
                 fixture_identity: str | None = None, **fields: Any) -> Record:
        """A record with the cell's names, tier and source filled in."""
        fixture = None
        source = None
        if cell.source_kind == "fixture":
            fixture = FixtureRef(name=cell.fixture_name, identity=fixture_identity or "")
        elif cell.source_kind == "hub":
            source = SourceRef(hub=cell.hub.id, revision=cell.hub.revision)
        else:
            source = SourceRef(path=cell.path)
        fields.setdefault("started_at", utc_now())
        fields.setdefault("duration_s", 0.0)
        return cls(cell=cell.id, model=cell.model, scheme=cell.scheme, engine=cell.engine, tier=cell.tier,
                   configuration=cell.configuration, fixture=fixture, source=source, engine_info=engine_info,
                   status=status, **fields)

    # ---- (de)serialisation --------------------------------------------------------------

    def to_json(self) -> str:
        return render_json(self.model_dump())

    @classmethod
    def from_json(cls, text: str, source: str = "<record>") -> Record:
        """A record read from a file (``source`` names it): every field validated by its JSON type
        (harness.validation.strict_json); a problem is one RecordError line naming the field."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise RecordError(f"{source}: not JSON: {e.msg} at line {e.lineno}") from None
        if not isinstance(data, dict) or "schema_version" not in data:
            raise RecordError(f"{source}: not a result record (no schema_version)")
        v = data["schema_version"]
        if not is_version(v, SCHEMA_VERSION):
            raise RecordError(f"{source}: schema_version {v!r} is not supported (this harness reads {SCHEMA_VERSION}); "
                              "rerun the cell or use the harness version that wrote it")
        try:
            return strict_json(cls, text)
        except ValidationError as e:
            raise RecordError(f"{source}: {one_line(e)}") from None


def load(path: str | Path) -> Record:
    path = Path(path)
    try:
        text = files.read_text(path)
    except files.Unreadable as e:
        raise RecordError(f"{path}: {e.reason}") from None
    return Record.from_json(text, str(path))


def save(path: str | Path, record: Record) -> Path:
    """Write a record atomically (a reader never sees half a file)."""
    path = Path(path)
    atomic_write_text(path, record.to_json())
    return path


# ---- helpers engines use --------------------------------------------------------------------


def utc_now() -> str:
    """Now, ISO 8601 UTC with a Z, to the millisecond."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def cuda_platform(major: int, minor: int) -> str:
    """``cuda-sm<major><minor>``, e.g. ``cuda-sm90`` (from torch.cuda.get_device_capability())."""
    return f"cuda-sm{major}{minor}"


def platform_key(platform: str | None) -> str | None:
    """The part of a platform string baselines are keyed by. CPU results differ between ISAs
    only in their last bits and are compared within bounds (docs/design.md, "Baselines and their keys"), so the ISA is dropped:
    ``cpu-x86_64-avx2`` -> ``cpu-x86_64``. GPU platforms are kept whole (``cuda-sm90``)."""
    if platform is None:
        return None
    parts = platform.split("-")
    if parts[0] == "cpu" and len(parts) > 2:
        return "-".join(parts[:2])
    return platform
