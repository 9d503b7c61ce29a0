"""The harness's own test suite as one parallel Buildkite step (``harness pipeline --suite-agents N``).

``make test`` is one command on one machine; on Buildkite the same suite runs on N agents at once,
each taking its share of the tests by their recorded durations (pytest-split, from the committed
``.test_durations``; a test not recorded there counts as the average). Every agent runs
``scripts/bootstrap`` and pytest exactly as ``make test`` does, with ``--splits N --group G``: G is
Buildkite's 0-based ``BUILDKITE_PARALLEL_JOB`` plus one. The groups are disjoint and together are
the whole suite (tests/test_buildkite_suite.py runs the step's command to check it).

The durations are refreshed with ``make durations`` (the whole suite once, ``--store-durations``)
when the suite's shape changes; stale durations only unbalance the groups, never drop a test.
"""
from __future__ import annotations

from typing import Any

from harness.buildkite.agents import CPU_QUEUE

DURATIONS = ".test_durations"
# The matrix tiers the suite runs and its paths, as the Makefile's test target names them
# (tests/test_buildkite_suite.py): pytest knows --tier, an option of suites/conftest.py, when it
# parses the command line only if a path there loads that conftest.
SUITE_TIERS = "cpu-tiny,cpu-config"
SUITE_PATHS = "tests suites"
# The longest share of the suite one agent may take: the suite on a 2-core agent and the bootstrap.
TIMEOUT_MINUTES = 60
# 1-based group of this parallel job; "$" reaches the shell as is (the pipeline is uploaded with
# --no-interpolation).
GROUP = '"$((BUILDKITE_PARALLEL_JOB + 1))"'


def pytest_command(junit: str = "reports/suite-$BUILDKITE_PARALLEL_JOB.xml", paths: str = SUITE_PATHS) -> str:
    """This agent's share of the suite: ``make test``'s pytest, split by recorded durations."""
    return (f'.venv/bin/python -m pytest -n 2 --tier {SUITE_TIERS} --splits "$BUILDKITE_PARALLEL_JOB_COUNT" --group {GROUP} '
            f"--durations-path {DURATIONS} --junitxml={junit} {paths}")


def suite_step(agents: int, retry: dict[str, Any]) -> dict[str, Any]:
    return {
        "label": f":pytest: harness test suite, {agents} agents",
        "key": "harness-suite",
        "command": "\n".join([
            "set -euo pipefail",
            "scripts/bootstrap",
            ".venv/bin/lint-imports --no-cache",
            pytest_command(),
        ]),
        "parallelism": agents,
        "agents": {"queue": CPU_QUEUE.name},
        "env": {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
        "timeout_in_minutes": TIMEOUT_MINUTES,
        "retry": retry,
        "artifact_paths": ["reports/suite-*.xml"],
    }
