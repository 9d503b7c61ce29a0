"""The model x quantization matrix: one test per cell, id ``<model>.<scheme>.<engine>``.

``pytest suites -k "whisper and torchao"`` selects those cells; ``--tier``, ``--engine`` and
``--update-baselines`` as for ``harness run``. How verdicts become outcomes: harness/pytest_plugin.py.
"""
from harness.pytest_plugin import check


def test_cell(harness_cell, harness_runner, record_property):
    result = harness_runner.run_cell(harness_cell)
    check(result, record_property, harness_runner.record_path(harness_cell))


def test_candidate_cell(harness_candidate_cell, harness_runner, record_property):
    """``--candidate ENGINE=SPEC``: the cell on that build, judged against the pinned build's result."""
    result = harness_runner.run_candidate_cell(harness_candidate_cell)
    check(result, record_property, harness_runner.candidate_layout.record(harness_candidate_cell.id))
