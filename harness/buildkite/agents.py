"""What a pipeline step needs of its Buildkite agent: the queue whose agents have the cell's
hardware (``queue_for``), the shell lines that install the cell's engine environment on it, in a
virtualenv or inside the environment's image, and those that send the report's JUnit to Buildkite
Test Engine (docs/README-buildkite.md)."""
from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from harness.matrix import Cell, Environment, MatrixError


@dataclass(frozen=True)
class Queue:
    """A Buildkite agent queue and the hardware every agent on it has."""

    name: str
    gpus: int = 0
    gpu_memory_gb: float = 0  # per GPU
    compute_capability: str = "0.0"
    example: str = ""


CPU_QUEUE = Queue("cpu", example="x86_64 CPU agent, 2+ cores")
# The GPU agent queues, smallest first. A cell goes to the first queue that has at least its GPU
# count, per-GPU memory and compute capability. Queue names say what they hold: gpu-<n>x<mem>gb.
GPU_QUEUES: tuple[Queue, ...] = tuple(
    Queue(f"gpu-{n}x{mem}gb", n, mem, cc, f"{n} x {card}")
    for n in (1, 2, 4, 8)
    for mem, cc, card in ((24, "8.9", "L4"), (48, "8.9", "L40S"), (80, "9.0", "H100"))
)


def _cc(v: str | None) -> tuple[int, int]:
    if not v:
        return (0, 0)
    major, minor = v.split(".")
    return int(major), int(minor)


def queue_for(cell: Cell, queues: Sequence[Queue] = GPU_QUEUES) -> Queue:
    """The agent queue for a cell's hardware needs (``cpu`` when it needs no GPU)."""
    hw = cell.hardware
    gpus = hw.gpus or 0
    if gpus == 0:
        return CPU_QUEUE
    for q in queues:
        if (q.gpus >= gpus and q.gpu_memory_gb >= (hw.gpu_memory_gb or 0)
                and _cc(q.compute_capability) >= _cc(hw.compute_capability)):
            return q
    raise MatrixError(f"{cell.id}: no GPU queue has {gpus} GPU(s) with {hw.gpu_memory_gb or 0:g} GB and compute "
                      f"capability {hw.compute_capability or 'any'} (queues: {', '.join(q.name for q in queues)})")


def largest(queues: Iterable[Queue]) -> Queue:
    """The queue that holds every one of ``queues``' cells: the most GPUs, memory and compute capability."""
    return max(queues, key=lambda q: (q.gpus, q.gpu_memory_gb, _cc(q.compute_capability)))


# ------------------------------------------------------------------------------ environments

VENV = ".venv-buildkite"
PIP = ("python3", "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off")
# What the harness itself imports beyond an engine image's own packages (pytest: -k expressions).
HARNESS_RUNTIME = ("pydantic>=2", "pyyaml", "packaging", "filelock", "pytest", "jinja2", "junitparser")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
IMAGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@+-]*$")
_CONSTRAINT_OPTS = ("-c", "--constraint")


def _split(value: str, where: str) -> list[str]:
    try:
        return shlex.split(value)
    except ValueError as e:
        raise MatrixError(f"{where}: {value!r} is not a list of pip arguments ({e})") from None


def pip_commands(env_name: str, env: Environment) -> list[str]:
    """Shell lines that install an environment's ``pip`` items, then its ``plugins``, then its
    ``wheel``, one ``pip install`` per item, in order. A ``-c FILE`` item is a constraint that
    applies to every install. Each argument is shell-quoted."""
    where = f"environments.{env_name}"
    constraints: list[str] = []
    installs: list[list[str]] = []
    for i, item in enumerate(env.pip):
        args = _split(item, f"{where}.pip[{i}]")
        if args and (args[0] in _CONSTRAINT_OPTS or args[0].startswith("--constraint=")):
            constraints += args
        elif args:
            installs.append(args)
    for i, item in enumerate(env.plugins):
        args = _split(item, f"{where}.plugins[{i}]")
        if args:
            installs.append(args)
    if env.wheel:
        installs.append([env.wheel])
    return [shlex.join([*PIP, *constraints, *args]) for args in installs]


def check_environment(env_name: str, env: Environment) -> None:
    """Values that reach fields other than commands are validated instead of quoted."""
    for k in env.env:
        if not _ENV_NAME.match(k):
            raise MatrixError(f"environments.{env_name}.env: {k!r} is not an environment variable name")
    if env.image is not None and not IMAGE.match(env.image):
        raise MatrixError(f"environments.{env_name}.image: {env.image!r} is not a container image reference")


def venv_setup(lines: list[str]) -> list[str]:
    """Build a virtualenv and install into it, unless the agent says its environment is already
    installed (HARNESS_PREINSTALLED=1: ``python3`` on PATH already has everything)."""
    return [
        'if [ -z "${HARNESS_PREINSTALLED:-}" ]; then',
        f"  python3 -m venv {VENV}",
        f"  . {VENV}/bin/activate",
        *(f"  {line}" for line in lines),
        "fi",
    ]


def image_setup(env_name: str, env: Environment) -> list[str]:
    # Inside the engine's image: its packages are the environment; add the environment's
    # installs (no-ops when the image has them), the harness's light runtime, and run the
    # harness from the checkout (no editable install writing into the mounted checkout).
    return [
        'if [ -z "${HARNESS_PREINSTALLED:-}" ]; then',
        *(f"  {c}" for c in pip_commands(env_name, env)),
        f"  {shlex.join([*PIP, *HARNESS_RUNTIME])}",
        "fi",
        'export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"',
    ]


# What Buildkite's own collectors send of the build, by --form-string: with -F, a value starting with
# < or @ (a branch may be named so) makes curl send a file of the agent's instead.
_RUN_ENV = (("key", "BUILDKITE_BUILD_ID"), ("number", "BUILDKITE_BUILD_NUMBER"), ("job_id", "BUILDKITE_JOB_ID"),
            ("branch", "BUILDKITE_BRANCH"), ("commit_sha", "BUILDKITE_COMMIT"), ("url", "BUILDKITE_BUILD_URL"),
            ("message", "BUILDKITE_MESSAGE"))


def junit_upload(reports: str) -> list[str]:
    """The report step's JUnit to Buildkite Test Engine, only when a suite token is set on the agent
    or pipeline (docs/decisions.md, "Test Engine gets the report step's JUnit by curl, not
    buildkite-test-collector")."""
    return [
        f'if [ -n "${{BUILDKITE_ANALYTICS_TOKEN:-}}" ] && [ -f {reports}/junit.xml ]; then',
        "  curl -sS --fail --max-time 60 -X POST"
        ' -H "Authorization: Token token=\\"$BUILDKITE_ANALYTICS_TOKEN\\""'
        f" -F data=@{reports}/junit.xml -F format=junit -F 'run_env[CI]=buildkite'"
        + "".join(f' --form-string "run_env[{field}]=${{{var}:-}}"' for field, var in _RUN_ENV)
        + ' "${BUILDKITE_ANALYTICS_API_URL:-https://analytics-api.buildkite.com/v1}/uploads"'
        " || echo 'Test Engine upload failed'",
        "fi",
    ]
