"""Loading models.yaml: ``load(path)`` parses and validates models.yaml. Any problem (a YAML
syntax error, an unknown key, a bad value, a dangling reference) raises ``MatrixError`` whose text
is ONE line naming the file and the key path, e.g.::

    models.yaml: models.llama.schemes.bnb-nf4.bounds.logprob: must be > 0

``check_paths`` checks, for the cells a run selects, what the file names on disk. The schema's
blocks are harness.matrix_blocks, the document and its expansion into cells harness.cells: this
module re-exports their public names, so harness.matrix stays the one import for models.yaml.

Nothing here imports torch; loading models.yaml is cheap.
"""
from __future__ import annotations

import typing
from collections.abc import Iterable
from pathlib import Path

from pydantic import ValidationError

from harness import files, yamldoc
from harness.registry import ENGINES as ENGINE_SPECS

# The public names of the schema and of the expansion, re-exported: callers import them from here.
from harness.cells import Cell, Matrix, _family, _merge_hardware, expand, warnings
from harness.matrix_blocks import (
    _PATTERN_NAMES,
    CPU_TIERS,
    DEFAULT_PATH,
    ENGINES,
    GATED_TIERS,
    MAX_TIMEOUT_S,
    MAX_TOKENS,
    MAX_TOP_K,
    ON_DEMAND_TIERS,
    TIERS,
    UNPINNED,
    Arch,
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
    tier_selection,
)

__all__ = [
    "CPU_TIERS", "DEFAULT_PATH", "ENGINES", "GATED_TIERS", "MAX_TIMEOUT_S", "MAX_TOKENS", "MAX_TOP_K",
    "ON_DEMAND_TIERS", "TIERS", "UNPINNED", "Arch", "Bounds", "BoundsOverride", "Cell", "Defaults", "Engine",
    "EnvName", "Environment", "Hardware", "Hub", "KnownFailure", "Matrix", "MatrixError", "Model", "Name",
    "Prompt", "Scheme", "Tier", "check_paths", "expand", "load", "loads", "tier_selection", "warnings",
]


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
            configured = (s.configurations if s.configurations is not None else model.configurations) or {}
            for i, kf in enumerate(s.known_failures):
                if kf.engine not in engines:
                    fail(f"{spath}.known_failures[{i}].engine", f"{kf.engine!r} is not one of this cell's engines ({', '.join(engines)})")
                if kf.configuration is not None and kf.configuration not in configured:
                    fail(f"{spath}.known_failures[{i}].configuration", f"{kf.configuration!r} is not one of this "
                         f"scheme's configurations{_defined(configured)}")
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
            where = spath if s.configurations is not None else mpath
            for cname, ctier in configured.items():
                _check_configuration(m, cname, ctier, tier, engines, f"{where}.configurations.{cname}", fail)


def _check_configuration(m: Matrix, name: str, tier: str, scheme_tier: str, engines, path: str, fail) -> None:
    """A configuration a scheme runs: defined, on one of the scheme's engines (its plain cell is
    what it is judged against), in a tier on the same kind of machine as the scheme's."""
    if name not in m.configurations:
        fail(path, f"configuration {name!r} is not defined under configurations{_defined(m.configurations)}")
    configuration = m.configurations[name]
    engine = configuration.engine
    needs = [k for k in ("tensor_parallel", "compiled") if getattr(configuration, k) != Configuration.model_fields[k].default]
    unable = [k for k in needs if k not in ENGINE_SPECS[engine].configurable]
    if unable:
        fail(f"configurations.{name}", f"engine {engine!r} does not run {' or '.join(unable)} (it runs: "
                                       f"{', '.join(ENGINE_SPECS[engine].configurable) or 'no configuration'})")
    if engine not in engines:
        fail(path, f"configuration {name!r} runs {engine!r}, which is not one of this cell's engines ({', '.join(engines)})")
    if (tier in CPU_TIERS) != (scheme_tier in CPU_TIERS):
        fail(path, f"tier {tier!r} runs on {'a CPU' if tier in CPU_TIERS else 'GPUs'}, the scheme's tier {scheme_tier!r} "
                   f"on {'a CPU' if scheme_tier in CPU_TIERS else 'GPUs'}: a configuration is judged against the plain "
                   "cell on the same machine")


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
