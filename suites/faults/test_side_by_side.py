"""Runs side by side on one checkout (docs/design.md, "Runs side by side"), as they happen:
harness processes started at the same moment in one working directory, sharing its caches, its
baselines and its ``results/``.

Each round starts its processes together just after a second begins, so that their default
results directories are named in the same second: the race of two terminals that started
``harness run`` at once, which used to give both one directory, each report counting the other
run's cells. Two rounds of cells decided before any engine child (a fixture that does not exist:
a configuration error, a few seconds a process), then one of real cells:

1. two ``harness run`` with overlapping selections and ``pytest suites/matrix`` beside them, each
   in its default directory;
2. two ``harness run`` given the same ``--results``: one runs, the other is refused in one line;
3. two ``harness run --update-baselines`` of the reference engine's tiniest cells, which both
   update one baseline and judge against it while the other may be writing it.

After each: every run's records are in a directory of its own, each one whole (it reads as a
record) and each of its cells there; its report's JUnit and its summary count its cells and no
other; every baseline reads whole, the runs that wrote one say so with their run's id, and no
temporary file is left beside it. About 25 s on an idle 2-core machine (the real round's engine
children import torch and transformers, about 7 s of CPU each).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from faultlib import ROOT, matrix

from harness import baselines as B
from harness import records as R
from harness import runs

REAL = ("unquantized", "bnb-nf4", "bnb-fp4")
# a second model whose fixture does not exist: each cell a configuration error, decided before any child
DECIDED = ("  broken:\n    arch: LlamaForCausalLM\n    fixture: nosuch\n    prompts: fixture\n    tier: cpu-tiny\n"
           "    engines: {reference: core}\n    schemes:\n" + "".join(f"      {s}:\n" for s in REAL))
TIMEOUT_S = 240

pytestmark = pytest.mark.slow("three rounds of harness runs side by side, the last with engine children")


def cells(model: str, *schemes: str) -> set[str]:
    return {f"{model}.{s}.reference" for s in schemes}


def k_of(selected: set[str]) -> str:
    return " or ".join(sorted(selected))


# A process that imports what its command will import, says so, and waits for the start: then
# ``harness ARGS`` (``harness.cli.main``) or ``pytest ARGS`` (``pytest.main``) runs exactly as from a
# shell, every side of a round at the same moment; without the wait, how long each interpreter takes
# to import decides who starts first, and on a busy machine they drift apart by more than the
# moments a race needs.
READY = "ready"
LAUNCH = f"""
import sys
from harness import liblog
liblog.route()  # before the libraries' imports, as `harness` does: their noise goes to the log
from harness import cli, matrix, report, runner, selection
cli.parser()
if sys.argv[1] == "pytest":
    import pytest
    from harness import pytest_plugin
print("{READY}", flush=True)
sys.stdin.readline()
sys.exit(pytest.main(sys.argv[2:]) if sys.argv[1] == "pytest" else cli.main(sys.argv[2:]))
"""


class Side:
    """One process of a round, started and ready: what it selected, its output, where it says its
    records are."""

    def __init__(self, argv: list, selected: set[str], cwd: Path, env: dict):
        self.selected = selected
        self.proc = subprocess.Popen([sys.executable, "-c", LAUNCH, *map(str, argv)], cwd=cwd, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.cwd = cwd

    def ready(self) -> None:
        line = self.proc.stdout.readline()
        assert line == READY + "\n", line + self.proc.stderr.read()[-3000:]

    def go(self) -> None:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def finish(self) -> Side:
        self.out, self.err = self.proc.communicate(timeout=TIMEOUT_S)
        self.code = self.proc.returncode
        assert "Traceback" not in self.out + self.err, self.err[-3000:] + self.out[-3000:]
        return self

    @property
    def results(self) -> Path:
        found = re.search(r"(?:results|records) in (\S+)", self.out)
        assert found, self.out[-2000:] + self.err[-2000:]
        return self.cwd / found.group(1).rstrip(";")


def setup(tmp_path: Path) -> tuple[Path, dict]:
    """The working directory (matrix, baselines seeded with the committed ones) and the environment."""
    (tmp_path / "m.yaml").write_text(matrix(REAL) + DECIDED)
    tier = tmp_path / "b" / "cpu-tiny"
    tier.mkdir(parents=True)
    for cell in cells("llama", *REAL):
        shutil.copy(ROOT / "baselines" / "cpu-tiny" / f"{cell}.json", tier)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "HARNESS_LOG": str(tmp_path / "cache" / "libraries.log")}  # one library log for every process
    return tmp_path, env


def at_once(*starts: Callable[[], Side]) -> list[Side]:
    """Start every side, and once all are ready let them go together, just after a second begins
    (their default directories are named in the same second); wait for all."""
    sides = [start() for start in starts]
    for side in sides:
        side.ready()
    time.sleep(1.02 - time.time() % 1)
    for side in sides:
        side.go()
    return [s.finish() for s in sides]


def harness_run(cwd: Path, env: dict, selected: set[str], *extra) -> Callable[[], Side]:
    argv = ["harness", "run", "--matrix", "m.yaml", "--baselines", "b", "-j", "1", "-k", k_of(selected), *extra]
    return lambda: Side(argv, selected, cwd, env)


def pytest_session(cwd: Path, env: dict, selected: set[str]) -> Callable[[], Side]:
    argv = ["pytest", ROOT / "suites" / "matrix", "-q", "-p", "no:cacheprovider", "--matrix", "m.yaml",
            "--baselines", "b", "-k", k_of(selected)]
    return lambda: Side(argv, selected, cwd, env)


def assert_own_results(side: Side, report: bool = True) -> None:
    """The run's directory holds its mark and a whole record of each of its cells, nothing else;
    its JUnit and summary count those cells."""
    assert side.code in (0, 1), (side.code, side.err[-2000:])
    records = {p.stem: R.load(p) for p in side.results.glob("*.json")}  # R.load: whole and valid
    assert set(records) == side.selected, f"{side.results}: {sorted(records)} for {sorted(side.selected)}"
    assert all(rec.cell == cell for cell, rec in records.items())
    assert runs.owner_of(side.results) is not None, f"{side.results}: no run's"
    if report:
        junit = (side.results / "report" / "junit.xml").read_text()
        assert sorted(re.findall(r'<testcase\b[^>]*?\sname="([^"]+)"', junit)) == sorted(side.selected), junit[:2000]
        assert re.search(rf"^total\s+{len(side.selected)}$", (side.results / "summary.txt").read_text(), re.M)


def assert_baselines_whole(cwd: Path, sides: list[Side]) -> None:
    """Every baseline reads whole, nothing temporary beside it; each written one is said to be, by
    the run whose directory's mark carries that id."""
    tier = cwd / "b" / "cpu-tiny"
    assert sorted(p.name for p in tier.iterdir()) == sorted(f"{c}.json" for c in cells("llama", *REAL))
    for path in tier.iterdir():
        assert B.read(cwd / "b", "cpu-tiny", path.stem) is not None
    said = {}
    for side in sides:
        for cell, run_id in re.findall(r"cpu-tiny/(\S+)\.json: (?:new|updated) by run (\S+)", side.out):
            assert run_id == runs.owner_of(side.results).id, (cell, run_id)
            said.setdefault(cell, []).append(run_id)
    assert "llama.bnb-nf4.reference" in said, "the baseline both runs updated: no run says it wrote it"
    for side in sides:
        assert "baseline unreadable" not in side.out, side.out[-3000:]


def test_runs_side_by_side_keep_their_own_results(tmp_path):
    cwd, env = setup(tmp_path)

    # 1: default directories named in the same second, overlapping selections, pytest beside
    sides = at_once(harness_run(cwd, env, cells("broken", "unquantized", "bnb-nf4")),
                    harness_run(cwd, env, cells("broken", "bnb-nf4", "bnb-fp4")),
                    pytest_session(cwd, env, cells("broken", "unquantized", "bnb-fp4")))
    assert len({s.results for s in sides}) == 3, "runs sharing a results directory"
    for side in sides[:2]:
        assert_own_results(side)
    assert_own_results(sides[2], report=False)  # the pytest plugin writes records; reports are harness report's

    # 2: the same --results: exactly one runs there, the other is one line, before any cell
    sides = at_once(harness_run(cwd, env, cells("broken", "unquantized"), "--results", "shared"),
                    harness_run(cwd, env, cells("broken", "bnb-fp4"), "--results", "shared"))
    refused = [s for s in sides if s.code == 2]
    assert len(refused) == 1, [(s.code, s.err) for s in sides]
    assert re.fullmatch(r"error: shared: (run \S+ \(.*\) is writing its results here|holds the results of run .*); "
                        r"give another --results directory[^\n]*\n", refused[0].err), refused[0].err
    assert_own_results(next(s for s in sides if s.code != 2))

    # 3: real cells, default directories again; both runs update bnb-nf4's baseline and judge against it
    sides = at_once(harness_run(cwd, env, cells("llama", "unquantized", "bnb-nf4"), "--update-baselines"),
                    harness_run(cwd, env, cells("llama", "bnb-nf4", "bnb-fp4"), "--update-baselines"))
    assert len({s.results for s in sides}) == 2, "two runs, one results directory"
    for side in sides:
        assert_own_results(side)
    assert_baselines_whole(cwd, sides)
