"""The blocks of models.yaml as strict pydantic models (environments, defaults and bounds,
hardware, known failures, prompts, hub sources, models and their schemes), with the names, tiers
and limits their values must keep to, and ``MatrixError``, the one-line error every models.yaml
problem becomes. The whole document is harness.cells.Matrix; harness.matrix loads it. Nothing
here imports torch."""
from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Annotated, Literal

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

from harness import architectures
from harness.registry import ENGINE_NAMES, known_engine

ENGINES: tuple[str, ...] = ENGINE_NAMES
TIERS: tuple[str, ...] = ("cpu-tiny", "cpu-load", "cpu-config", "gpu-tiny", "gpu-full")
# Tiers on which load time is gated (docs/design.md, "Load time": never on cpu-tiny, where Python
# overhead dominates; cpu-load holds the benchmark checkpoints that are large enough to time).
GATED_TIERS: frozenset[str] = frozenset({"cpu-load", "gpu-tiny", "gpu-full"})
# CPU tiers (no GPU); and the tiers run only when selected by name (never by default nor in the
# generated pipeline): cpu-load's checkpoints are built on demand (harness.fixtures.benchmark) and
# take minutes. cpu-config holds the configuration cells of the tiny fixtures (tensor-parallel,
# compiled), which cost several plain cells each (docs/design.md, "Configurations"): `harness run`
# and `pytest suites` run cpu-tiny unless told otherwise; `make test` and the generated pipeline
# run cpu-config too.
CPU_TIERS: frozenset[str] = frozenset({"cpu-tiny", "cpu-load", "cpu-config"})
ON_DEMAND_TIERS: frozenset[str] = frozenset({"cpu-load"})
DEFAULT_PATH = Path(__file__).resolve().parent.parent / "models.yaml"
UNPINNED = "unpinned"


def tier_selection(text: str) -> str:
    """``--tier``'s argparse type, for ``harness`` and pytest alike: one tier, several joined by
    commas, or ``all``; normalised to ``a,b``."""
    named = [t.strip() for t in text.split(",")]
    bad = [t for t in named if t not in (*TIERS, "all")]
    if bad or ("all" in named and len(named) > 1):
        raise argparse.ArgumentTypeError(f"{text!r}: give one of {', '.join((*TIERS, 'all'))}, or tiers "
                                         "separated by commas (cpu-tiny,cpu-config)")
    return ",".join(named)


# A registered engine (harness.registry, an installed package's included): an unknown name is one
# line listing the choices.
Engine = Annotated[str, AfterValidator(known_engine)]
Tier = Literal["cpu-tiny", "cpu-load", "cpu-config", "gpu-tiny", "gpu-full"]
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
    # Only the cells of this configuration (docs/design.md, "Configurations"); None: the plain cell
    # and, as the same bug shows there too, its configuration cells.
    configuration: Name | None = None

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


class Configuration(_Strict):
    """An engine configuration beside the one every cell runs (one rank, eager): its cells are
    judged against that plain cell of the same run (docs/design.md, "Configurations")."""

    description: str | None = None
    engine: Engine
    tensor_parallel: int = Field(default=1, ge=1, le=64)  # ranks; on a GPU tier, one GPU each
    compiled: bool = False  # the engine's default compiled execution instead of eager

    @model_validator(mode="after")
    def _not_the_plain_cell(self) -> Configuration:
        if self.tensor_parallel == 1 and not self.compiled:
            raise ValueError("one rank, eager is the plain cell every scheme has; set tensor_parallel above 1 or compiled")
        return self


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
    # configuration name (under configurations) -> the tier its cells run in; a scheme's replaces its model's
    configurations: dict[Name, Tier] | None = None


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
