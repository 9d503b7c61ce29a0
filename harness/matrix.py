"""The models.yaml schema and its expansion into cells.

``load(path)`` parses and validates models.yaml. Any problem (a YAML syntax error, an unknown
key, a bad value, a dangling reference) raises ``MatrixError`` whose text is ONE line naming the
file and the key path, e.g.::

    models.yaml: models.llama.schemes.bnb-nf4.bounds.logprob: must be > 0

``expand(matrix, tier=None, engines=None)`` turns the matrix into a sorted list of ``Cell``s, one
per model x scheme x engine, with every setting resolved (scheme > model > defaults); the
on-demand tier cpu-load only when named.
Which cells a ``-k`` expression selects is harness.selection.

Nothing here imports torch; loading models.yaml is cheap.
"""
from __future__ import annotations

import re
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StringConstraints, ValidationError, field_validator, model_validator

from harness import architectures, files, yamldoc
from harness.accuracy.spec import AccuracyTask, CellAccuracyTask
from harness.registry import ENGINE_NAMES

ENGINES: tuple[str, ...] = ENGINE_NAMES
TIERS: tuple[str, ...] = ("cpu-tiny", "cpu-load", "gpu-tiny", "gpu-full")
# Tiers on which load time is gated (docs/design.md, "Load time": never on cpu-tiny, where Python
# overhead dominates; cpu-load holds the benchmark checkpoints that are large enough to time).
GATED_TIERS: frozenset[str] = frozenset({"cpu-load", "gpu-tiny", "gpu-full"})
# CPU tiers (no GPU); and the tiers run only when selected by name (never by default nor in CI):
# cpu-load's checkpoints are built on demand (harness.fixtures.benchmark) and take minutes.
CPU_TIERS: frozenset[str] = frozenset({"cpu-tiny", "cpu-load"})
ON_DEMAND_TIERS: frozenset[str] = frozenset({"cpu-load"})
DEFAULT_PATH = Path(__file__).resolve().parent.parent / "models.yaml"
UNPINNED = "unpinned"

Engine = Literal["reference", "transformers", "vllm"]
Tier = Literal["cpu-tiny", "cpu-load", "gpu-tiny", "gpu-full"]
# The transformers classes of harness.architectures (docs/design.md: one list of architectures).
Arch = Literal[architectures.HF_CLASSES]  # type: ignore[valid-type]
# Names that become part of a cell id: no dots (ids are dot-separated), no spaces, no shell.
_NAME_RE = r"^[a-z0-9][a-z0-9_+-]*$"
Name = Annotated[str, StringConstraints(pattern=_NAME_RE)]
# Environment names never enter a cell id, so they may carry versions with dots.
_ENV_NAME_RE = r"^[a-z0-9][a-z0-9_.+-]*$"
EnvName = Annotated[str, StringConstraints(pattern=_ENV_NAME_RE)]
_HEX40 = re.compile(r"^[0-9a-f]{40}$")


# What a name that fails each pattern should have been, for the one-line error.
_PATTERN_NAMES = {
    _NAME_RE: "is not a valid name (lower case letters, digits, '-', '_', '+'; no dots)",
    _ENV_NAME_RE: "is not a valid environment name (lower case letters, digits, '-', '_', '+', '.')",
}


class MatrixError(Exception):
    """A models.yaml problem, or a bad selection. ``str()`` is one line: ``<file>: <key path>: <what>``."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ------------------------------------------------------------------------------------- blocks


class Environment(_Strict):
    """A named, pinned install of one or more engines."""

    description: str | None = None
    # engine -> the version string its results carry (and baselines are keyed by)
    engines: dict[Engine, Annotated[str, StringConstraints(min_length=1)]] = Field(min_length=1)
    pip: list[str] = []  # pip arguments, one requirement or option per item
    wheel: str | None = None  # a wheel URL or path, instead of or beside pip
    plugins: list[str] = []  # extra pip arguments installed after, e.g. "vllm-bnb-plugin==0.0.3 --no-deps"
    image: str | None = None  # container image for agents
    env: dict[str, str] = {}  # environment variables the engine needs


class Bounds(_Strict):
    """Comparison bounds, fully resolved."""

    logprob: float = Field(gt=0, allow_inf_nan=False)  # max |Δlogprob| of the scored tokens, teacher-forced
    topk: float = Field(gt=0, allow_inf_nan=False)  # max |Δlogprob| over the top-k ids both runs share
    load_time: float = Field(gt=1, allow_inf_nan=False)  # load-time ratio bound on gated tiers: > bound regressed, < 1/bound improved


class BoundsOverride(_Strict):
    logprob: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    topk: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    load_time: float | None = Field(default=None, gt=1, allow_inf_nan=False)


# Upper bounds of the run settings: beyond them a value is a typo, and an engine would generate or
# wait until the cell's timeout (docs/design.md, "Bad input and faults").
MAX_TOKENS = 4096
MAX_TOP_K = 1000
MAX_TIMEOUT_S = 24 * 3600.0


class Defaults(_Strict):
    max_tokens: int = Field(gt=0, le=MAX_TOKENS)
    top_k: int = Field(gt=0, le=MAX_TOP_K)
    timeout_s: float = Field(gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False)
    bounds: dict[Name, Bounds] = Field(min_length=1)  # scheme family -> bounds


class Hardware(_Strict):
    gpus: int | None = Field(default=None, ge=0)
    gpu_memory_gb: float | None = Field(default=None, gt=0)
    compute_capability: str | None = None  # minimum, "8.9"

    @field_validator("compute_capability")
    @classmethod
    def _cc(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"\d+\.\d+", v):
            raise ValueError(f"{v!r} is not a compute capability like '8.9'")
        return v


class KnownFailure(_Strict):
    """An engine version range that is known to fail a cell, and how to recognise the failure."""

    engine: Engine
    versions: str  # PEP 440 specifier, e.g. "<0.33,>=0.32"
    pattern: str  # regex searched in the error (type: message, then log tail) or a failing check's text
    reason: Annotated[str, StringConstraints(min_length=1)]
    link: str | None = None
    evidence: str | None = None

    @field_validator("versions")
    @classmethod
    def _versions(cls, v: str) -> str:
        try:
            SpecifierSet(v)
        except InvalidSpecifier:
            raise ValueError(f"{v!r} is not a PEP 440 version specifier") from None
        return v

    @field_validator("pattern")
    @classmethod
    def _pattern(cls, v: str) -> str:
        try:
            re.compile(v)
        except re.error as e:
            raise ValueError(f"{v!r} is not a valid regex ({e})") from None
        return v

    def applies_to(self, engine: str, version: str | None) -> bool:
        """True when this entry covers ``engine`` at ``version`` (local labels like +cpu ignored)."""
        if engine != self.engine or not version:
            return False
        try:
            public = Version(version).public
        except InvalidVersion:
            return False
        return SpecifierSet(self.versions).contains(public, prereleases=True)

    def matches(self, text: str) -> bool:
        return re.search(self.pattern, text) is not None


class Prompt(_Strict):
    """One prompt. Image and audio are paths relative to the repo root, or ``synthetic:<name>``
    for an input the engine generates deterministically."""

    id: Name
    text: str | None = None
    image: str | None = None
    audio: str | None = None

    @model_validator(mode="after")
    def _some_input(self) -> Prompt:
        if self.text is None and self.image is None and self.audio is None:
            raise ValueError("a prompt needs text, image or audio")
        if self.image is not None and self.audio is not None:
            raise ValueError("a prompt takes an image or an audio input, not both")
        return self

    @property
    def kind(self) -> str:
        return "image" if self.image is not None else "audio" if self.audio is not None else "text"


class Hub(_Strict):
    id: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$")]
    revision: str  # a 40-hex commit, or the literal "unpinned" (warned about)

    @field_validator("revision")
    @classmethod
    def _revision(cls, v: str) -> str:
        if v != UNPINNED and not _HEX40.match(v):
            raise ValueError(f"{v!r} must be a 40-hex commit id (or the literal '{UNPINNED}')")
        return v


class _CellSettings(_Strict):
    """Settings shared by a model (as defaults for its schemes) and by each scheme."""

    tier: Tier | None = None
    engines: dict[Engine, EnvName] | None = None  # engine -> environment name
    max_tokens: int | None = Field(default=None, gt=0, le=MAX_TOKENS)
    top_k: int | None = Field(default=None, gt=0, le=MAX_TOP_K)
    timeout_s: float | None = Field(default=None, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False)
    bounds: BoundsOverride | None = None
    hardware: Hardware | None = None
    accuracy: list[Name] | None = None  # names under accuracy_tasks; a scheme's list replaces its model's
    accuracy_engines: list[Engine] | None = None  # the engines that run them (default: all the cell's)


class Scheme(_CellSettings):
    description: str | None = None
    family: Name | None = None  # bounds family; default: from the scheme name
    fixture_scheme: Name | None = None  # the fixture this cell loads, when not <fixture>-<scheme>
    known_failures: list[KnownFailure] = []


class Model(_CellSettings):
    description: str | None = None
    arch: Arch
    fixture: Name | None = None  # recipe model name in harness.fixtures
    path: str | None = None  # local checkpoint directory, relative to models.yaml
    hub: Hub | None = None
    prompts: Name  # "fixture" or the name of a prompt set
    schemes: dict[Name, Scheme | None] = Field(min_length=1)


class Matrix(_Strict):
    version: Literal[1]
    environments: dict[EnvName, Environment] = Field(min_length=1)
    defaults: Defaults
    prompt_sets: dict[Name, Annotated[list[Prompt], Field(min_length=1)]] = {}
    accuracy_tasks: dict[Name, AccuracyTask] = {}  # docs/design.md, "Accuracy"
    models: dict[Name, Model] = Field(min_length=1)

    _file: str = PrivateAttr(default="models.yaml")
    _dir: Path = PrivateAttr(default=DEFAULT_PATH.parent)  # what paths in the file are relative to

    @property
    def file(self) -> str:
        return self._file

    def cells(self, tier: str | Iterable[str] | None = None, engines: Iterable[str] | None = None) -> list[Cell]:
        return expand(self, tier=tier, engines=engines)

    def warnings(self) -> list[str]:
        return warnings(expand(self))


# --------------------------------------------------------------------------------------- cells


class Cell(_Strict):
    """One model x scheme x engine, every setting resolved."""

    id: str
    model: str
    scheme: str
    engine: Engine
    tier: Tier
    arch: str
    description: str | None = None
    environment: str
    engine_version: str  # the version the environment pins; results carry the installed one
    source_kind: Literal["fixture", "path", "hub"]
    fixture: str | None = None  # recipe model name
    fixture_scheme: str | None = None
    path: str | None = None
    hub: Hub | None = None
    prompt_set: str  # "fixture" or a prompt set name
    prompts: tuple[Prompt, ...] = ()  # empty when prompt_set == "fixture"
    family: str
    max_tokens: int
    top_k: int
    timeout_s: float
    bounds: Bounds
    hardware: Hardware
    known_failures: tuple[KnownFailure, ...] = ()  # those for this engine only
    accuracy: tuple[CellAccuracyTask, ...] = ()  # accuracy tasks run in the same engine child

    @property
    def fixture_name(self) -> str | None:
        """The fixture directory name, "<model>-<scheme>", e.g. "llama-bnb-nf4-skip-ambiguous"."""
        if self.source_kind != "fixture":
            return None
        return f"{self.fixture}-{self.fixture_scheme or self.scheme}"

    @property
    def pinned(self) -> bool:
        """False only for hub sources whose revision is "unpinned"."""
        return not (self.hub is not None and self.hub.revision == UNPINNED)

    @property
    def gate_load_time(self) -> bool:
        return self.tier in GATED_TIERS

    @property
    def markers(self) -> tuple[str, ...]:
        """pytest marker names for this cell: the tier (``cpu_tiny``...), ``cpu`` or ``gpu``, and
        ``accuracy`` when it runs accuracy tasks."""
        return (self.tier.replace("-", "_"), "gpu" if (self.hardware.gpus or 0) > 0 else "cpu",
                *(("accuracy",) if self.accuracy else ()))

    @property
    def keywords(self) -> tuple[str, ...]:
        """The names ``select`` matches -k identifiers against (as pytest does: id and markers)."""
        return (self.id, *self.markers)


# ------------------------------------------------------------------------------------- loading


def load(path: str | Path = DEFAULT_PATH) -> Matrix:
    """Read and validate a models.yaml. Raises MatrixError (one line) on any problem."""
    path = Path(path)
    try:
        text = files.read_text(path)
    except files.Unreadable as e:
        raise MatrixError(f"{path}: {e.reason if e.reason.startswith(('is ', 'cannot')) else 'cannot read: ' + e.reason}") from None
    try:
        shown = str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        shown = str(path)
    return loads(text, filename=shown, base_dir=path.resolve().parent)


def loads(text: str, filename: str = "models.yaml", base_dir: str | Path | None = None) -> Matrix:
    try:
        data = yamldoc.parse(text, filename)
    except yamldoc.DocumentError as e:
        raise MatrixError(str(e)) from None
    try:
        matrix = Matrix.model_validate(data)
    except ValidationError as e:
        raise MatrixError(f"{filename}: {yamldoc.first_error(e, Matrix, _PATTERN_NAMES)}") from None
    matrix._file = filename
    matrix._dir = Path(base_dir) if base_dir is not None else DEFAULT_PATH.parent
    _check_references(matrix, filename)
    return matrix


def _family(scheme: str) -> str:
    """Bounds family from a scheme name: "online-bnb-nf4" -> "bnb", "torchao-int8wo" -> "torchao"."""
    name = scheme.removeprefix("online-")
    return name.split("-", 1)[0]


def _check_references(m: Matrix, filename: str) -> None:
    def fail(path: str, what: str) -> typing.NoReturn:
        raise MatrixError(f"{filename}: {path}: {what}")

    for pname, prompts in m.prompt_sets.items():
        seen: set[str] = set()
        for i, p in enumerate(prompts):
            if p.id in seen:
                fail(f"prompt_sets.{pname}[{i}].id", f"duplicate prompt id {p.id!r}")
            seen.add(p.id)
    for mname, model in m.models.items():
        mpath = f"models.{mname}"
        for i, tname in enumerate(model.accuracy or ()):
            if tname not in m.accuracy_tasks:
                fail(f"{mpath}.accuracy[{i}]", f"accuracy task {tname!r} is not defined under accuracy_tasks{_defined(m.accuracy_tasks)}")
        sources = [k for k in ("fixture", "path", "hub") if getattr(model, k) is not None]
        if len(sources) != 1:
            found = ", ".join(sources) if sources else "none"
            fail(mpath, f"exactly one of fixture, path, hub is required (found: {found})")
        if model.prompts == "fixture":
            if model.fixture is None:
                fail(f"{mpath}.prompts", "'fixture' prompts need a fixture source; name a prompt set instead")
        elif model.prompts not in m.prompt_sets:
            fail(f"{mpath}.prompts", f"prompt set {model.prompts!r} is not defined under prompt_sets{_defined(m.prompt_sets)}")
        if model.engines is not None:
            _check_engines(m, model.engines, f"{mpath}.engines", fail)
        for sname, scheme in model.schemes.items():
            s = scheme or Scheme()
            spath = f"{mpath}.schemes.{sname}"
            if s.engines is not None:
                _check_engines(m, s.engines, f"{spath}.engines", fail)
            tier = s.tier or model.tier
            if tier is None:
                fail(f"{spath}.tier", "required key is missing (set it on the scheme or on the model)")
            engines = s.engines if s.engines is not None else model.engines
            if not engines:
                fail(f"{spath}.engines", "required key is missing (set it on the scheme or on the model)")
            family = s.family or _family(sname)
            if family not in m.defaults.bounds:
                where = f"{spath}.family" if s.family else spath
                fail(where, f"bounds family {family!r} is not defined under defaults.bounds{_defined(m.defaults.bounds)}")
            for i, kf in enumerate(s.known_failures):
                if kf.engine not in engines:
                    fail(f"{spath}.known_failures[{i}].engine", f"{kf.engine!r} is not one of this cell's engines ({', '.join(engines)})")
            hw = _merge_hardware(model.hardware, s.hardware)
            if tier in CPU_TIERS and (hw.gpus or 0) > 0:
                fail(f"{spath}.hardware.gpus" if s.hardware and s.hardware.gpus else f"{mpath}.hardware.gpus", f"{tier} cells cannot need a GPU")
            if tier not in CPU_TIERS and hw.gpus == 0:
                fail(f"{spath}.hardware.gpus" if s.hardware and s.hardware.gpus is not None else f"{mpath}.hardware.gpus", f"{tier} cells need at least one GPU")
            if s.fixture_scheme is not None and model.fixture is None:
                fail(f"{spath}.fixture_scheme", "only fixture models load a fixture")
            for i, tname in enumerate(s.accuracy or ()):
                if tname not in m.accuracy_tasks:
                    fail(f"{spath}.accuracy[{i}]", f"accuracy task {tname!r} is not defined under accuracy_tasks{_defined(m.accuracy_tasks)}")
            for where, listed in ((spath, s.accuracy_engines), (mpath, model.accuracy_engines)):
                for i, e in enumerate(listed or ()):
                    if e not in engines:
                        fail(f"{where}.accuracy_engines[{i}]", f"{e!r} is not one of this cell's engines ({', '.join(engines)})")


def _task_yaml_problem(path: Path) -> str | None:
    """Why a task YAML in the repo cannot be an lm-eval task (None when it can): it must exist and
    be a mapping naming its ``task``."""
    try:
        data = yamldoc.parse(files.read_text(path), str(path))
    except files.Unreadable as e:
        return f"cannot read the task YAML {path}: {e.reason}"
    except yamldoc.DocumentError as e:
        return f"the task YAML is not a YAML mapping: {e}"
    if not isinstance(data.get("task"), str):
        return f"the task YAML {path} must be a mapping with a `task` name"
    return None


def _defined(d: dict) -> str:
    return f" (defined: {', '.join(d)})" if d else " (none defined)"


def _check_engines(m: Matrix, engines: dict[str, str], path: str, fail) -> None:
    for engine, env in engines.items():
        if env not in m.environments:
            fail(f"{path}.{engine}", f"environment {env!r} is not defined under environments{_defined(m.environments)}")
        if engine not in m.environments[env].engines:
            fail(f"{path}.{engine}", f"environment {env!r} does not provide engine {engine!r} (it provides: {', '.join(m.environments[env].engines)})")


def _merge_hardware(*layers: Hardware | None) -> Hardware:
    merged: dict[str, Any] = {}
    for layer in layers:
        if layer is not None:
            merged.update({k: v for k, v in layer.model_dump().items() if v is not None})
    return Hardware(**merged)


# ----------------------------------------------------------------------------------- expansion


def _as_set(value: str | Iterable[str] | None, known: tuple[str, ...], what: str) -> set[str] | None:
    if value is None:
        return None
    items = {value} if isinstance(value, str) else set(value)
    items = {x.strip() for item in items for x in item.split(",") if x.strip()}
    bad = sorted(items - set(known))
    if bad:
        raise MatrixError(f"--{what}: unknown {what} {', '.join(map(repr, bad))} (known: {', '.join(known)})")
    return items


def expand(matrix: Matrix, tier: str | Iterable[str] | None = None, engines: str | Iterable[str] | None = None) -> list[Cell]:
    """The cells of the matrix, sorted by id: of the tiers named (default: every tier but the
    on-demand ones, which only a tier named selects) and the engines named (default: all)."""
    tiers = _as_set(tier, TIERS, "tier")
    if tiers is None:
        tiers = set(TIERS) - ON_DEMAND_TIERS
    engine_set = _as_set(engines, ENGINES, "engine")
    cells: list[Cell] = []
    for mname, model in matrix.models.items():
        for sname, scheme in model.schemes.items():
            s = scheme or Scheme()
            cell_tier = s.tier or model.tier
            if cell_tier in tiers:
                cells += _scheme_cells(matrix, mname, model, sname, s, cell_tier, engine_set)
    cells.sort(key=lambda c: c.id)
    return cells


def _scheme_cells(matrix: Matrix, mname: str, model: Model, sname: str, s: Scheme, cell_tier: str,
                  engine_set: set[str] | None) -> list[Cell]:
    """One scheme's cells, one per engine it runs on (of ``engine_set``; None: all), each setting
    resolved scheme > model > defaults."""
    d = matrix.defaults
    family = s.family or _family(sname)
    bounds = _resolved_bounds(d.bounds[family], model.bounds, s.bounds)
    hw = _cell_hardware(model, s, cell_tier)
    engine_envs = s.engines if s.engines is not None else model.engines
    accuracy_engines = s.accuracy_engines if s.accuracy_engines is not None else model.accuracy_engines
    accuracy = _cell_accuracy(matrix, s.accuracy if s.accuracy is not None else model.accuracy or [])
    cells = []
    for engine, env in (engine_envs or {}).items():
        if engine_set is not None and engine not in engine_set:
            continue
        cells.append(
            Cell(
                id=f"{mname}.{sname}.{engine}",
                model=mname,
                scheme=sname,
                engine=engine,
                tier=cell_tier,
                arch=model.arch,
                description=s.description or model.description,
                environment=env,
                engine_version=matrix.environments[env].engines[engine],
                source_kind="fixture" if model.fixture else "path" if model.path else "hub",
                fixture=model.fixture,
                fixture_scheme=s.fixture_scheme,
                path=model.path,
                hub=model.hub,
                prompt_set=model.prompts,
                prompts=tuple(matrix.prompt_sets.get(model.prompts, ())) if model.prompts != "fixture" else (),
                family=family,
                max_tokens=s.max_tokens or model.max_tokens or d.max_tokens,
                top_k=s.top_k or model.top_k or d.top_k,
                timeout_s=s.timeout_s or model.timeout_s or d.timeout_s,
                bounds=Bounds(**bounds),
                hardware=hw,
                known_failures=tuple(k for k in s.known_failures if k.engine == engine),
                accuracy=accuracy if accuracy_engines is None or engine in accuracy_engines else (),
            )
        )
    return cells


def _resolved_bounds(family_bounds: Bounds, *overrides: BoundsOverride | None) -> dict[str, float]:
    """The family's bounds, each override's values on top in turn (a later one wins)."""
    bounds = family_bounds.model_dump()
    for layer in overrides:
        if layer is not None:
            bounds.update({k: v for k, v in layer.model_dump().items() if v is not None})
    return bounds


def _cell_hardware(model: Model, s: Scheme, cell_tier: str) -> Hardware:
    """The scheme's hardware over the model's; a GPU count neither sets is none on a CPU tier, one elsewhere."""
    hw = _merge_hardware(model.hardware, s.hardware)
    if hw.gpus is None:
        hw = hw.model_copy(update={"gpus": 0 if cell_tier in CPU_TIERS else 1})
    return hw


def _cell_accuracy(matrix: Matrix, task_names: Iterable[str]) -> tuple[CellAccuracyTask, ...]:
    """The named accuracy tasks as a cell carries them: a task YAML in the repo (``local``) by its
    absolute path, resolved against the matrix file's folder."""
    return tuple(
        CellAccuracyTask(**matrix.accuracy_tasks[t].model_dump(), name=t,
                         path=str((matrix._dir / matrix.accuracy_tasks[t].task).resolve())
                         if matrix.accuracy_tasks[t].local else None)
        for t in task_names)


def check_paths(matrix: Matrix, cells: Iterable[Cell]) -> None:
    """MatrixError for the first cell whose local checkpoint (``path:``, relative to the matrix
    file) is not a directory, or whose accuracy task YAML in the repo cannot be read as a task: a
    models.yaml error of the run, exit 2 (checked for the cells a run selects, so a checkout
    without some local checkpoints can still list and plan cells)."""
    for c in cells:
        if c.source_kind == "path" and not (matrix._dir / c.path).is_dir():
            raise MatrixError(f"{matrix.file}: models.{c.model}.path: {c.path!r} is not a directory "
                              f"(resolved against {matrix._dir})")
        for t in c.accuracy:  # a task YAML in the repo, likewise (docs/design.md, "Accuracy")
            problem = _task_yaml_problem(Path(t.path)) if t.path is not None else None
            if problem:
                raise MatrixError(f"{matrix.file}: accuracy_tasks.{t.name}.task: {problem}")


def warnings(cells: Iterable[Cell]) -> list[str]:
    """Human-readable warnings about cells, one per line: unpinned hub revisions on gpu-full."""
    out = []
    for c in cells:
        if not c.pinned and c.tier == "gpu-full":
            out.append(f"warning: {c.id}: hub revision of {c.hub.id} is unpinned; pin a 40-hex commit in models.yaml")
    return out
