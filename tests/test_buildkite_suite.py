"""The harness's own suite split over Buildkite agents (harness/buildkite/suite.py): the step's own
command, run for each of its parallel jobs, selects disjoint groups that together are the suite."""
import os
import subprocess
from pathlib import Path

import pytest

from harness.buildkite import Options, generate, suite
from harness.matrix import load

ROOT = Path(__file__).resolve().parent.parent
# A slice of the suite, so that collecting it three times stays quick, with the matrix's cells.
SLICE = "tests/test_verdicts.py tests/test_records.py tests/test_compare.py suites/matrix"


def _collected(command: str, env: dict[str, str]) -> list[str]:
    # -n 0 after the step's -n 2: collected in this process, the same selection the workers make
    p = subprocess.run(["bash", "-c", f"{command} -n 0 --collect-only -q -p no:cacheprovider"],
                       cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return [line for line in p.stdout.splitlines() if "::" in line]


def test_the_suite_step_runs_make_tests_pytest_on_each_agent():
    step = generate(load(ROOT / "models.yaml"), [], Options(suite_agents=3))["steps"][-1]
    assert step["key"] == "harness-suite" and step["parallelism"] == 3 and step["agents"] == {"queue": "cpu"}
    assert "scripts/bootstrap" in step["command"] and suite.pytest_command() in step["command"]
    assert step["env"]["OMP_NUM_THREADS"] == "1"  # as the Makefile sets it
    makefile = (ROOT / "Makefile").read_text()  # the same tests as make test
    assert f"SUITE_TIERS = {suite.SUITE_TIERS}\n" in makefile
    assert f"pytest -n 2 --tier $(SUITE_TIERS) {suite.SUITE_PATHS}\n" in makefile
    assert all(s.get("key") != "harness-suite" for s in generate(load(ROOT / "models.yaml"), [])["steps"])


@pytest.mark.slow("four pytest --collect-only subprocesses: the slice, then each of 3 agents' groups")
def test_the_agents_groups_are_disjoint_and_together_the_whole_suite(tmp_path):
    whole = _collected(f".venv/bin/python -m pytest --tier {suite.SUITE_TIERS} {SLICE}", {})
    assert any("vllm-tp2]" in test for test in whole)  # the configuration cells are the suite's too
    command = suite.pytest_command(junit=str(tmp_path / "suite-$BUILDKITE_PARALLEL_JOB.xml"), paths=SLICE)
    groups = [_collected(command, {"BUILDKITE_PARALLEL_JOB": str(job), "BUILDKITE_PARALLEL_JOB_COUNT": "3"})
              for job in range(3)]
    assert all(groups) and sum(map(len, groups)) == len(whole) and sorted(sum(groups, [])) == sorted(whole)
