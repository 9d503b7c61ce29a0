"""Wires the harness pytest plugin (harness/pytest_plugin.py) into the suites: its options
(--tier, --engine, --update-baselines, --results, --baselines, --matrix), the cell
parametrization and the terminal summary. This conftest is loaded at startup for `pytest`,
`pytest suites` and `pytest suites/matrix/...`, which the options need."""
from harness.pytest_plugin import *  # noqa: F401,F403  (pytest hooks and the harness_runner fixture)
