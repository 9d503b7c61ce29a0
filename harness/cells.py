"""The matrix (a models.yaml document, as harness.matrix loads it) and its cells: ``expand(matrix,
tier=None, engines=None)`` turns the matrix into a sorted list of ``Cell``s, one per model x scheme
x engine (and per configuration the scheme runs the engine in), with every setting resolved
(scheme > model > defaults); the on-demand tiers only when named. Which cells a ``-k`` expression selects is harness.selection. Nothing here imports
torch."""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from harness.accuracy.spec import AccuracyTask, CellAccuracyTask
from harness.matrix_blocks import (
    CPU_TIERS,
    DEFAULT_PATH,
    ENGINES,
    GATED_TIERS,
    ON_DEMAND_TIERS,
    TIERS,
    UNPINNED,
    Bounds,
    BoundsOverride,
    Configuration,
    Defaults,
    Engine,
    EnvName,
    Environment,
    Hardware,
    Hub,
    KnownFailure,
    MatrixError,
    Model,
    Name,
    Prompt,
    Scheme,
    Tier,
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ------------------------------------------------------------------------------------- the matrix


class Matrix(_Strict):
    version: Literal[1]
    environments: dict[EnvName, Environment] = Field(min_length=1)
    defaults: Defaults
    prompt_sets: dict[Name, Annotated[list[Prompt], Field(min_length=1)]] = {}
    accuracy_tasks: dict[Name, AccuracyTask] = {}  # docs/design.md, "Accuracy"
    configurations: dict[Name, Configuration] = {}  # docs/design.md, "Configurations"
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
    # An engine configuration beside the plain one (docs/design.md, "Configurations"): its name,
    # and what it sets; the plain cell (one rank, eager) has none.
    configuration: str | None = None
    tensor_parallel: int = 1
    compiled: bool = False

    @property
    def base(self) -> str | None:
        """A configuration cell's plain cell, ``<model>.<scheme>.<engine>``, which it is judged
        against (None for a plain cell)."""
        return f"{self.model}.{self.scheme}.{self.engine}" if self.configuration else None

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
        """On a gated tier, for a plain cell: a configuration's load differs from the plain one's by
        design (ranks, compilation), and it is judged against that, not against a baseline."""
        return self.tier in GATED_TIERS and self.configuration is None

    @property
    def untraceable(self) -> str | None:
        """Why no module traces are recorded for this cell (None: they are). At more than one rank
        each rank computes its part of a module's output; the loaded state's module diff names the
        module and the rank instead."""
        if self.tensor_parallel > 1:
            return (f"module traces at {self.tensor_parallel} ranks are not recorded: each rank computes its "
                    f"part of a module's output (the loaded state's module diff names the module and the rank)")
        return None

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
            plain = _scheme_cells(matrix, mname, model, sname, s, cell_tier, engine_set)
            if cell_tier in tiers:
                cells += plain
            configured = s.configurations if s.configurations is not None else model.configurations
            cells += [_configured(c, name, matrix.configurations[name], tier, s.known_failures)
                      for name, tier in (configured or {}).items() if tier in tiers
                      for c in plain if c.engine == matrix.configurations[name].engine]
    cells.sort(key=lambda c: c.id)
    return cells


def _configured(plain: Cell, name: str, configuration: Configuration, tier: str,
                known_failures: Iterable[KnownFailure]) -> Cell:
    """The plain cell run in a configuration, in the tier the scheme names for it: its id
    ``<model>.<scheme>.<engine>-<configuration>``; on a GPU tier one GPU per rank; the plain
    cell's known failures and the configuration's own; no accuracy tasks (the loaded state and the
    logprobs are what a configuration is judged by, and the tasks cost a plain cell's time again)."""
    hw = plain.hardware
    if tier not in CPU_TIERS:
        hw = hw.model_copy(update={"gpus": max(hw.gpus or 1, configuration.tensor_parallel)})
    return plain.model_copy(update={
        "id": f"{plain.id}-{name}", "tier": tier, "hardware": hw, "configuration": name,
        "tensor_parallel": configuration.tensor_parallel, "compiled": configuration.compiled, "accuracy": (),
        "description": configuration.description or plain.description,
        "known_failures": plain.known_failures + tuple(k for k in known_failures
                                                       if k.engine == plain.engine and k.configuration == name)})


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
                known_failures=tuple(k for k in s.known_failures if k.engine == engine and k.configuration is None),
                accuracy=accuracy if accuracy_engines is None or engine in accuracy_engines else (),
            )
        )
    return cells


def _family(scheme: str) -> str:
    """Bounds family from a scheme name: "online-bnb-nf4" -> "bnb", "torchao-int8wo" -> "torchao"."""
    name = scheme.removeprefix("online-")
    return name.split("-", 1)[0]


def _resolved_bounds(family_bounds: Bounds, *overrides: BoundsOverride | None) -> dict[str, float]:
    """The family's bounds, each override's values on top in turn (a later one wins)."""
    bounds = family_bounds.model_dump()
    for layer in overrides:
        if layer is not None:
            bounds.update({k: v for k, v in layer.model_dump().items() if v is not None})
    return bounds


def _merge_hardware(*layers: Hardware | None) -> Hardware:
    merged: dict[str, Any] = {}
    for layer in layers:
        if layer is not None:
            merged.update({k: v for k, v in layer.model_dump().items() if v is not None})
    return Hardware(**merged)


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


def warnings(cells: Iterable[Cell]) -> list[str]:
    """Human-readable warnings about cells, one per line: unpinned hub revisions on gpu-full."""
    out = []
    for c in cells:
        if not c.pinned and c.tier == "gpu-full":
            out.append(f"warning: {c.id}: hub revision of {c.hub.id} is unpinned; pin a 40-hex commit in models.yaml")
    return out
