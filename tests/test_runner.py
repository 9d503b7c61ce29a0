"""`harness run` end to end on a small matrix (tiny Whisper, two schemes, both engines), with the
engines in child processes: baselines are written only on request, a baseline altered by hand
makes its cell regressed (exit 1), a deliberately broken decode of one format fails its cells and
--update-baselines refuses them, a hang becomes an error after the timeout (with the log tail)
while the rest of the matrix goes on, and a cell run on its own scores the same sequence.

The children are slow to start (torch + transformers), so the runs here use `-j 2` and few cells.
"""
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import cli, cpu, judging, runner, supervise
from harness import matrix as M
from harness import records as R
from harness import selection
from harness.engines import worker
from tests.stand_in_build import stand_in_build

ROOT = Path(__file__).resolve().parent.parent

MATRIX = """
version: 1
environments:
  core:
    engines: {reference: "0.1.0", transformers: "5.19.0"}
defaults:
  max_tokens: 4
  top_k: 3
  timeout_s: TIMEOUT
  bounds:
    unquantized: {logprob: 1.0e-4, topk: 1.0e-4, load_time: 1.5}
    bnb:         {logprob: 2.0e-3, topk: 2.0e-3, load_time: 1.5}
models:
  whisper:
    arch: WhisperForConditionalGeneration
    fixture: whisper
    prompts: fixture
    tier: cpu-tiny
    engines: {reference: core, transformers: core}
    schemes:
      unquantized:
      bnb-nf4:
"""
CELLS = ["whisper.bnb-nf4.reference", "whisper.bnb-nf4.transformers",
         "whisper.unquantized.reference", "whisper.unquantized.transformers"]


def write_matrix(path: Path, timeout: int = 300) -> Path:
    path.write_text(MATRIX.replace("TIMEOUT", str(timeout)))
    return path


def harness(capsys, *args) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def records(results: Path) -> dict[str, R.Record]:
    return {p.stem: R.load(p) for p in results.glob("*.json")}


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """Baselines of the four cells, written by an explicit --update-baselines run."""
    tmp = tmp_path_factory.mktemp("generated")
    matrix = write_matrix(tmp / "models.yaml")
    baselines = tmp / "baselines"
    code = cli.main(["run", "--matrix", str(matrix), "--baselines", str(baselines), "--results", str(tmp / "r0"),
                     "--update-baselines", "-j", "2"])
    return {"code": code, "matrix": matrix, "baselines": baselines, "results": tmp / "r0"}


def copy_baselines(generated, tmp_path) -> Path:
    dst = tmp_path / "baselines"
    shutil.copytree(generated["baselines"], dst)
    return dst


def _counting_judgements(monkeypatch) -> list[str]:
    """The cells judging.decide, the one judgement, is called for, as it is called."""
    judged, decide = [], judging.decide
    monkeypatch.setattr(judging, "decide", lambda record, known=(): judged.append(record.cell) or decide(record, known))
    return judged


@pytest.mark.slow("the module's --update-baselines run of 4 Whisper cells, then a second harness run")
def test_update_baselines_writes_every_cell_then_the_matrix_passes(generated, tmp_path, capsys, monkeypatch):
    assert generated["code"] == 0
    files = sorted(p.name for p in (generated["baselines"] / "cpu-tiny").glob("*.json"))
    assert files == [f"{c}.json" for c in sorted(CELLS)]
    updated = records(generated["results"])
    assert {c: r.verdict for c, r in updated.items()} == {c: "pass" for c in CELLS}
    assert updated[CELLS[0]].verdict_reason == "matches the baseline; baseline new by --update-baselines"
    # all engines of a (model, scheme) scored the same tokens: the reference's greedy continuation
    for scheme in ("bnb-nf4", "unquantized"):
        ref, tf = updated[f"whisper.{scheme}.reference"], updated[f"whisper.{scheme}.transformers"]
        assert [s.scored.tokens for s in ref.sequences] == [s.scored.tokens for s in tf.sequences]
        assert all(s.scored.tokens == s.prompt_tokens + s.greedy.tokens for s in ref.sequences)
        assert {c.name for c in tf.checks} >= {"teacher-forced:reference", "greedy:reference", "teacher-forced:baseline"}

    baselines = copy_baselines(generated, tmp_path)
    before = {p.name: p.read_bytes() for p in (baselines / "cpu-tiny").iterdir()}
    judged = _counting_judgements(monkeypatch)
    code, out, _ = harness(capsys, "run", "--matrix", generated["matrix"], "--baselines", baselines,
                           "--results", tmp_path / "r", "-j", "2")
    assert code == 0, out
    assert sorted(judged) == sorted(CELLS)  # one judgement per record
    assert "pass              4" in out and f"records in {tmp_path / 'r'}" in out
    for cell in CELLS:  # one progress line per cell, in the order they finish
        assert re.search(rf"^\[\d/4\] pass +{re.escape(cell)}  \(load \d", out, re.M), out
    assert {c: r.verdict for c, r in records(tmp_path / "r").items()} == {c: "pass" for c in CELLS}
    assert {p.name: p.read_bytes() for p in (baselines / "cpu-tiny").iterdir()} == before  # never written
    assert (tmp_path / "r" / "summary.txt").read_text().startswith("verdict")
    assert (tmp_path / "r" / "logs" / "whisper.bnb-nf4.transformers.log").exists()
    report = (tmp_path / "r" / "report" / "report.html").read_text()  # harness run ends in the report
    assert all(cell in report for cell in CELLS) and f"report: {tmp_path / 'r' / 'report' / 'report.html'}" in out


@pytest.mark.slow("uses the module's --update-baselines run of 4 Whisper cells (generated)")
def test_the_pytest_plugins_entry_point_judges_each_cell_once(generated, tmp_path, monkeypatch):
    """pytest runs one cell per test (Runner.run_cell, the other engines of its group read from raw/
    where another test made them): each cell's record is judged once, by judging.decide."""
    results = tmp_path / "results"
    shutil.copytree(generated["results"], results)
    cells = M.load(generated["matrix"]).cells()
    r = runner.Runner(M.load(generated["matrix"]), cells, results=results,
                      baselines_root=copy_baselines(generated, tmp_path), matrix_path=generated["matrix"])
    judged = _counting_judgements(monkeypatch)
    assert {c.id: r.run_cell(c).verdict for c in cells} == {c: "pass" for c in CELLS}
    assert sorted(judged) == sorted(CELLS)


def _altered_by_hand(generated, tmp_path) -> Path:
    """A copy of the baselines with whisper.bnb-nf4.reference's edited well beyond the bnb bound
    (2e-3); that baseline's path."""
    path = copy_baselines(generated, tmp_path) / "cpu-tiny" / "whisper.bnb-nf4.reference.json"
    data = json.loads(path.read_text())
    data["sequences"][1]["scored"][5]["logprob"] -= 0.05
    path.write_text(json.dumps(data, indent=1))
    return path


@pytest.mark.slow("uses the module's --update-baselines run of 4 Whisper cells (generated), and a run of 2")
def test_baseline_altered_by_hand_is_regressed_and_exit_1(generated, tmp_path, capsys):
    baselines = _altered_by_hand(generated, tmp_path).parents[1]
    code, out, _ = harness(capsys, "run", "--matrix", generated["matrix"], "--baselines", baselines,
                           "--results", tmp_path / "r", "-k", "bnb")
    assert code == 1, out
    got = records(tmp_path / "r")
    assert got["whisper.bnb-nf4.reference"].verdict == "regressed"
    assert "teacher-forced:baseline: exceeds bound" in got["whisper.bnb-nf4.reference"].verdict_reason
    assert "prompt p1 position 5" in got["whisper.bnb-nf4.reference"].verdict_reason
    assert got["whisper.bnb-nf4.transformers"].verdict == "pass"
    assert "regressed         1" in out and "pass              1" in out
    assert (baselines / "cpu-tiny" / "whisper.bnb-nf4.reference.obtained.json").exists()


@pytest.mark.slow("uses the module's --update-baselines run of 4 Whisper cells (generated), and a run of 2")
def test_a_baseline_file_that_cannot_be_written_leaves_the_verdict_and_says_which(generated, tmp_path, capsys,
                                                                                  monkeypatch):
    """A disk that fills between the run's write check and a cell's baseline step: the cell keeps
    its verdict and its record, the run goes on, and the line names the file and the error."""
    from harness import baselines as B

    path = _altered_by_hand(generated, tmp_path)
    baselines, obtained = path.parents[1], path.with_name("whisper.bnb-nf4.reference.obtained.json")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(obtained))

    monkeypatch.setattr(B, "handle", full)
    code, out, _ = harness(capsys, "run", "--matrix", generated["matrix"], "--baselines", baselines,
                           "--results", tmp_path / "r", "-k", "bnb")
    assert code == 1, out
    got = records(tmp_path / "r")
    assert {c: r.verdict for c, r in got.items()} == {"whisper.bnb-nf4.reference": "regressed",
                                                      "whisper.bnb-nf4.transformers": "pass"}
    assert f"baseline files not written: {obtained}: No space left on device" in out
    assert not obtained.exists()


@pytest.mark.slow("a harness run of 4 Whisper cells in engine children with a broken bnb decode")
def test_broken_decode_fails_its_cells_and_update_refuses_them(generated, tmp_path, capsys, monkeypatch):
    """The test hook halves every bnb weight the reference decodes (a wrong absmax): the bnb cells
    disagree across engines (failed; the reference also regressed against its baseline, but
    failed comes first), the unquantized cells are untouched, and --update-baselines refuses."""
    baselines = copy_baselines(generated, tmp_path)
    before = {p.name: p.read_bytes() for p in (baselines / "cpu-tiny").iterdir()}
    monkeypatch.setenv("HARNESS_TEST_HOOK", "break=harness.quant.bnb:decode@*.reference")
    code, out, _ = harness(capsys, "run", "--matrix", generated["matrix"], "--baselines", baselines,
                           "--results", tmp_path / "r", "--update-baselines", "-j", "2")
    assert code == 1, out
    got = records(tmp_path / "r")
    assert {c: r.verdict for c, r in got.items()} == {
        "whisper.bnb-nf4.reference": "failed", "whisper.bnb-nf4.transformers": "failed",
        "whisper.unquantized.reference": "pass", "whisper.unquantized.transformers": "pass"}
    assert "teacher-forced:transformers: exceeds bound" in got["whisper.bnb-nf4.reference"].verdict_reason
    assert "teacher-forced:reference: exceeds bound" in got["whisper.bnb-nf4.transformers"].verdict_reason
    for cell in ("whisper.bnb-nf4.reference", "whisper.bnb-nf4.transformers"):
        assert f"baseline refused: {cell}: refusing to update the baseline: verdict is failed" in out
    assert "baselines: 0 new, 0 updated, 2 unchanged, 2 refused" in out
    after = {p.name: p.read_bytes() for p in (baselines / "cpu-tiny").iterdir() if not p.name.endswith(".obtained.json")}
    assert after == before


@pytest.mark.slow("a harness run of 4 Whisper cells: one hangs until its 20 s timeout, one crashes")
def test_hang_and_crash_become_errors_and_the_matrix_goes_on(generated, tmp_path, capsys, monkeypatch):
    baselines = copy_baselines(generated, tmp_path)
    # the timeout holds every cell: the others' run, a fraction of it, ends well within it
    matrix = write_matrix(tmp_path / "models.yaml", timeout=20)
    monkeypatch.setenv("HARNESS_TEST_HOOK", "sleep=600@whisper.unquantized.transformers;crash@whisper.bnb-nf4.reference")
    code, out, _ = harness(capsys, "run", "--matrix", matrix, "--baselines", baselines, "--results", tmp_path / "r",
                           "-j", "2")
    assert code == 1, out
    got = records(tmp_path / "r")
    hung = got["whisper.unquantized.transformers"]
    assert hung.verdict == "error" and hung.error.type == "Timeout"
    assert "did not finish within the cell's timeout_s (20 s)" in hung.error.message
    assert "test hook: sleep=600" in hung.error.log_tail
    assert hung.engine_info.version == "5.19.0"  # from the child's info file, written before loading
    assert 20 <= hung.duration_s < 90
    crashed = got["whisper.bnb-nf4.reference"]
    assert crashed.verdict == "error" and crashed.error.type == "EngineCrashed"
    assert "killed by SIGABRT" in crashed.error.message and "test hook: crash" in crashed.error.log_tail
    # the rest of the matrix went on; a cell whose partner errored is judged against its baseline
    assert got["whisper.unquantized.reference"].verdict == "pass"
    assert got["whisper.bnb-nf4.transformers"].verdict == "pass"
    assert "error             2" in out


@pytest.mark.slow("a spawned Whisper child that hangs until its 25 s timeout")
def test_hang_in_a_spawned_child_is_killed_too(generated, tmp_path, capsys, monkeypatch):
    """HARNESS_ISOLATION=spawn: a fresh interpreter per cell instead of the fork server."""
    baselines = copy_baselines(generated, tmp_path)
    # time for a fresh interpreter's imports (~6 s here) before the hook's sleep
    matrix = write_matrix(tmp_path / "models.yaml", timeout=25)
    monkeypatch.setenv("HARNESS_ISOLATION", "spawn")
    monkeypatch.setenv("HARNESS_TEST_HOOK", "sleep=600")
    code, out, _ = harness(capsys, "run", "--matrix", matrix, "--baselines", baselines, "--results", tmp_path / "r",
                           "-k", "unquantized", "--engine", "transformers")
    assert code == 1, out
    hung = records(tmp_path / "r")["whisper.unquantized.transformers"]
    assert hung.error.type == "Timeout" and "test hook: sleep=600" in hung.error.log_tail


@pytest.mark.slow("a harness run of a Whisper transformers cell, plus a reference child for its sequences")
def test_a_cell_run_alone_scores_the_same_sequence(generated, tmp_path, capsys):
    """No baseline and only the transformers engine selected: the continuation comes from a
    reference child on the fixture, the same tokens the full run scored."""
    code, out, _ = harness(capsys, "run", "--matrix", generated["matrix"], "--baselines", tmp_path / "none",
                           "--results", tmp_path / "r", "-k", "bnb", "--engine", "transformers")
    assert code == 1, out  # missing-baseline fails the run (harness.verdicts): CI cannot pass without baselines
    alone = records(tmp_path / "r")["whisper.bnb-nf4.transformers"]
    assert alone.verdict == "missing-baseline"
    full = records(generated["results"])["whisper.bnb-nf4.transformers"]
    assert [s.scored.tokens for s in alone.sequences] == [s.scored.tokens for s in full.sequences]
    assert (tmp_path / "r" / "sequences" / "whisper.bnb-nf4.json").exists()
    assert "computing the scored sequences of whisper.bnb-nf4 with the reference engine" in out


def test_a_cell_of_a_tier_run_only_by_name_scores_its_baselines_sequence(tmp_path):
    """vLLM's cpu-load cell selected alone scores the tokens its group's committed baselines scored,
    as every cell does (harness.sequences, rule 1): not its own greedy continuation, which the bnb
    plugin's bfloat16 moves off the reference's within a few steps, so that every scored token and
    logprob would then read as a regression against the baseline."""
    from harness import baselines, matrix

    m = matrix.load(ROOT / "models.yaml")
    [cell] = [c for c in m.cells(tier="cpu-load", engines=["vllm"]) if c.scheme == "bnb-nf4"]
    r = runner.Runner(m, [cell], results=tmp_path / "r", baselines_root=ROOT / "baselines")

    def compute(cells, path):
        raise AssertionError(f"the continuation of {cells[0].id} computed, though its baselines hold one")

    r.sequences.compute = compute
    tokens, source = r.sequences.get(runner.group_key(cell), [cell])
    reference = baselines.read(ROOT / "baselines", "cpu-load", "llama-m-bnb-nf4.bnb-nf4.reference")
    assert source.startswith("baseline llama-m-bnb-nf4.bnb-nf4.reference")
    assert tokens == {s.prompt.id: s.scored.tokens for s in reference.record_sequences()}


@pytest.mark.slow("a pytest -n 2 subprocess running two Whisper cells in engine children")
def test_pytest_runs_cells_under_xdist(generated, tmp_path):
    baselines = copy_baselines(generated, tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "suites/matrix", "-p", "no:cacheprovider", "-n", "2", "-q",
         "--matrix", str(generated["matrix"]), "--baselines", str(baselines), "--results", str(tmp_path / "r"),
         "-k", "unquantized"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 passed" in proc.stdout and "pass              2" in proc.stdout
    got = records(tmp_path / "r")
    assert sorted(got) == ["whisper.unquantized.reference", "whisper.unquantized.transformers"]


# ------------------------------------------------------------------------- usage errors, cells


def test_cells_lists_ids(capsys):
    code, out, _ = harness(capsys, "cells", "-k", "whisper and torchao and reference")
    assert code == 0
    assert out.split() == ["whisper.online-torchao-int8wo.reference", "whisper.torchao-float8wo.reference",
                           "whisper.torchao-int4wo.reference", "whisper.torchao-int8wo-skip-encoder.reference",
                           "whisper.torchao-int8wo.reference"]
    code, out, _ = harness(capsys, "cells", "--engine", "transformers", "-k", "whisper.unquantized")
    assert out.split() == ["whisper.unquantized.transformers"]


@pytest.mark.parametrize("args, message", [
    (["run", "-k", "whisper and ("], "error: -k 'whisper and (': wrong expression"),
    (["run", "-k", "no-such-cell"], "error: no cells selected"),
    (["run", "--engine", "vlm"], "error: --engine: unknown engine 'vlm'"),
    (["cells", "--matrix", "/nonexistent/models.yaml"], "error: /nonexistent/models.yaml: cannot read"),
    (["run", "--jobs", "0"], "error: --jobs must be >= 1"),
])
def test_usage_and_config_errors_exit_2_with_one_line(capsys, args, message):
    code, out, err = harness(capsys, *args)
    assert code == 2
    assert err.startswith(message) and err.count("\n") == 1, err


def test_argparse_errors_are_one_line_too(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["run", "--bogus"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == "error: harness: unrecognized arguments: --bogus (see harness --help)\n"


def test_tiers_are_named_one_or_several_at_once(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["cells", "--tier", "cpu-tiny,cpu-huge"])
    assert e.value.code == 2 and "'cpu-tiny,cpu-huge': give one of cpu-tiny, cpu-load" in capsys.readouterr().err
    assert cli.main(["cells", "--tier", "cpu-tiny,cpu-load", "-k", "llama-m-unquantized or llama.unquantized."]) == 0
    listed = capsys.readouterr().out.split()
    assert {"llama", "llama-m-unquantized"} <= {c.split(".")[0] for c in listed}


def test_the_gated_cpu_load_groups_run_last_and_alone():
    from harness import matrix

    cells = selection.select(matrix.load().cells(tier="cpu-tiny,cpu-load"), "llama-m-unquantized or llama.unquantized.")
    groups: dict = {}
    for c in cells:
        groups.setdefault(runner.group_key(c), []).append(c)
    untimed, timed = runner.untimed_and_timed(groups)
    assert timed and all(c.tier == "cpu-load" for k in timed for c in groups[k])
    assert untimed and all(c.tier == "cpu-tiny" for k in untimed for c in groups[k])


def test_bad_matrix_is_exit_2(tmp_path, capsys):
    bad = tmp_path / "models.yaml"
    bad.write_text(MATRIX.replace("TIMEOUT", "-1"))
    code, _, err = harness(capsys, "run", "--matrix", bad)
    assert code == 2 and err.startswith("error: ") and "defaults.timeout_s: must be > 0" in err


class _Stream:
    def __init__(self, tty: bool):
        self.tty, self.text = tty, ""

    def isatty(self):
        return self.tty

    def write(self, s):
        self.text += s

    def flush(self):
        pass


def test_progress_is_a_bar_on_a_terminal_and_lines_in_ci():
    from harness import matrix
    from harness.runner import CellResult

    cell = {c.id: c for c in matrix.load().cells()}["whisper.bnb-nf4.transformers"]
    rec = R.Record.for_cell(cell, engine_info=R.EngineInfo(name="transformers", version="5.19.0"),
                            status="unsupported", unsupported_reason="needs a GPU")
    res = CellResult(cell, rec.model_copy(update={"verdict": "unsupported", "verdict_reason": "needs a GPU"}),
                     messages=["baseline refused: no"])
    for tty in (False, True):
        stream = _Stream(tty)
        p = cli.Progress(2, stream=stream)
        p.echo("harness run: 2 cell(s)")
        p.cell(1, 2, res)
        p.close()
        assert "[1/2] unsupported      whisper.bnb-nf4.transformers  (needs a GPU)" in stream.text
        assert "    baseline refused: no" in stream.text
        assert ("1/2" in stream.text.replace("[1/2]", "") and "unsupported 1" in stream.text) == tty  # tqdm's bar


# ---------------------------------------------------------------------- fork server, -j default


LIGHT = "harness.engines.worker"  # a preload for fork servers whose children need no torch here


def _fork(tmp_path, job: Path, name: str, mark: str = ""):
    env = supervise.child_env({"MARK": mark}, 1)
    child = supervise.start_child(job, tmp_path / f"{name}.log", env, LIGHT)
    child.started()
    return child


@pytest.mark.slow("a fork server and two forked worker children, one hung until killed")
def test_a_forked_child_reports_its_exit_status_and_is_killed_on_timeout(tmp_path):
    try:
        missing = _fork(tmp_path, tmp_path / "no-such-job.json", "missing")
        assert missing.wait(60) == 1  # the worker's traceback goes to the cell's log
        assert "FileNotFoundError" in (tmp_path / "missing.log").read_text()
        fifo = tmp_path / "job.fifo"  # the worker blocks reading it: a hang
        os.mkfifo(fifo)
        hung = _fork(tmp_path, fifo, "hung")
        assert hung.wait(0.5) is None
        assert os.getpgid(hung.pid) == hung.pid  # its own process group, for killpg
        hung.kill()
        assert hung.wait(0) == -signal.SIGTERM
    finally:
        supervise.stop_fork_servers()
    assert missing.server.proc.poll() is not None


def _child_of_probe_preload(tmp_path, source: str) -> tuple[int, str]:
    """A child (of a job file that does not exist) forked from a server whose preload is ``source``:
    its exit status and log."""
    (tmp_path / "probe_preload.py").write_text(source)
    env = supervise.child_env({"MARK": "", "PYTHONPATH": str(tmp_path)}, 1)
    try:
        child = supervise.start_child(tmp_path / "no-such-job.json", tmp_path / "probe.log", env, "probe_preload")
        code = child.wait(60)
    finally:
        supervise.stop_fork_servers()
    return code, (tmp_path / "probe.log").read_text()


@pytest.mark.slow("a fork server preloading the engine worker, and one forked child")
def test_a_forked_child_starts_with_what_the_preload_imported_frozen(tmp_path):
    """The fork server freezes the objects its imports left (gc.freeze): unfrozen, a child's first
    full collection walks them all and copies their pages, ~350 ms inside whichever step of the
    child crosses the collector's threshold, a timed load among them."""
    code, log = _child_of_probe_preload(tmp_path, (
        "import gc\n"
        "import json\n"
        "from harness.engines import worker\n"
        "worker.main = lambda args: print(json.dumps({'frozen': gc.get_freeze_count()})) or 0\n"))
    assert code == 0, log
    report = json.loads(log.strip().splitlines()[-1])
    assert report["frozen"] > 10_000  # the worker's imports alone leave tens of thousands


@pytest.mark.slow("a fork server that imports torch, then a fresh interpreter for its child")
def test_a_preload_that_initialised_cuda_gets_fresh_interpreters_as_children(tmp_path):
    """CUDA does not survive a fork (the device check on an H200: every cell 'Cannot re-initialize
    CUDA in forked subprocess', bitsandbytes' import having initialised it in the server)."""
    code, log = _child_of_probe_preload(tmp_path, (
        "import torch\n"
        "from harness.engines import worker\n"
        "torch.cuda.is_initialized = lambda: True\n"
        "worker.main = lambda args: print('ran in the preloaded interpreter') or 0\n"))
    # a fresh worker, given no job file, fails reading it; the preloaded one would have printed
    assert code == 1 and "FileNotFoundError" in log and "preloaded interpreter" not in log, log


def test_a_child_whose_fork_server_is_still_importing_is_abandoned_at_once(tmp_path):
    """Starting a forked child waits for nothing: the request is sent and the child registered; an
    interrupt meanwhile abandons it at once, and the server's stop ends it before it forks."""
    (tmp_path / "slow_preload.py").write_text("import time\ntime.sleep(60)\n")
    env = supervise.child_env({"MARK": "", "PYTHONPATH": str(tmp_path)}, 1)
    try:
        t0 = time.monotonic()
        child = supervise.start_child(tmp_path / "job.json", tmp_path / "c.log", env, "slow_preload")
        assert child.wait(0.5) is None and child.pid is None  # the server is still importing
        child.kill()
        assert time.monotonic() - t0 < 5
        assert child.wait(0) == -signal.SIGKILL
    finally:
        supervise.stop_fork_servers()
    assert child.server.proc.poll() is not None
    assert not (tmp_path / "c.log").exists()  # never forked


@pytest.mark.slow("starts a fork server, kills it, and forks a child from its replacement")
def test_a_fork_server_killed_from_outside_is_replaced(tmp_path):
    try:
        first = supervise.fork_server(LIGHT, supervise.child_env({"MARK": ""}, 1))
        first.proc.kill()
        first.proc.wait()
        child = _fork(tmp_path, tmp_path / "no-such-job.json", "after")
        assert child.server is not first and child.wait(60) == 1
    finally:
        supervise.stop_fork_servers()


@pytest.mark.slow("a fork server preloading the engine worker, and two forked children")
def test_children_with_other_test_hooks_share_one_fork_server_and_each_gets_its_own(tmp_path):
    """The hooks are read after the fork: they travel in the request, so a test that plants a
    fault does not start its own servers (torch's and vLLM's imports again)."""
    (tmp_path / "hook_preload.py").write_text(
        "import os\n"
        "from harness.engines import worker\n"
        "assert worker.HOOK_ENV not in os.environ  # the server's own environment has none\n"
        "worker.main = lambda args: print(os.environ.get(worker.HOOK_ENV)) or 0\n")
    children = []
    try:
        for hook in ("crash@a.*", "sleep=1@b.*"):
            env = supervise.child_env({"MARK": "", "PYTHONPATH": str(tmp_path), worker.HOOK_ENV: hook}, 1)
            children.append(supervise.start_child(tmp_path / "job.json", tmp_path / f"{len(children)}.log", env,
                                                  "hook_preload"))
        assert [c.wait(60) for c in children] == [0, 0]
    finally:
        supervise.stop_fork_servers()
    assert children[0].server is children[1].server
    assert [(tmp_path / f"{i}.log").read_text().split() for i in (0, 1)] == [["crash@a.*"], ["sleep=1@b.*"]]


def test_the_variables_sent_after_the_fork_are_the_test_hooks_and_the_vllm_mutations():
    from harness.engines.vllm import MUTATION_ENV
    from harness.engines.vllm_mutations import MASK_LAYER_ENV

    assert set(supervise.AFTER_FORK_ENV) == {worker.HOOK_ENV, MUTATION_ENV, MASK_LAYER_ENV}


@pytest.mark.slow("three forked worker children of a job they cannot run")
def test_the_ledger_tells_a_child_repeating_another_childs_job_in_its_environment(tmp_path, monkeypatch):
    """What the suite's summary counts as work sharing could still save: the same job in the same
    environment again; a test hook (read after the fork) makes another environment."""
    ledger = tmp_path / "ledger.jsonl"
    monkeypatch.setenv(supervise.LEDGER_ENV, str(ledger))
    job = {"mode": "cell", "cell": {"id": "c", "engine": "reference"}, "sequences": None, "threads": 1}
    runs = supervise.Supervisor()
    try:
        for name, hook in (("a", None), ("b", None), ("c", "crash@c")):
            env = supervise.child_env({"MARK": "", **({worker.HOOK_ENV: hook} if hook else {})}, 1)
            runs.run({**job, "record": str(tmp_path / f"{name}.json")}, tmp_path / f"{name}.job.json",
                     tmp_path / f"{name}.log", env, preload=LIGHT, timeout=60)
    finally:
        supervise.stop_fork_servers()
    entries = [json.loads(line) for line in ledger.read_text().splitlines()]
    children = [e for e in entries if e["kind"] == "child"]
    assert len(children) == 3 and supervise.repeats(entries) == [children[1]]


def test_a_childs_environment_leaves_out_the_running_test(monkeypatch):
    """pytest changes PYTEST_CURRENT_TEST at every test phase; a fork server serves one environment,
    so with it every test would start its own servers (tens of seconds of imports each)."""
    assert os.environ.get("PYTEST_CURRENT_TEST")  # pytest sets it while this test runs
    assert "PYTEST_CURRENT_TEST" not in supervise.child_env({}, 1)


def test_the_ledger_has_a_line_per_child_only_where_the_session_asks(tmp_path, monkeypatch):
    ledger = tmp_path / "children.jsonl"
    monkeypatch.delenv(supervise.LEDGER_ENV, raising=False)
    supervise.ledger("child", engine="reference")
    monkeypatch.setenv(supervise.LEDGER_ENV, str(ledger))
    supervise.ledger("child", engine="reference", seconds=1.5)
    supervise.ledger("fork-server", preload="harness.engines._vllm_preload")
    lines = [json.loads(line) for line in ledger.read_text().splitlines()]
    test = os.environ["PYTEST_CURRENT_TEST"]
    assert lines == [{"kind": "child", "test": test, "engine": "reference", "seconds": 1.5},
                     {"kind": "fork-server", "test": test, "preload": "harness.engines._vllm_preload"}]


@pytest.mark.slow("starts three fork servers of the engine worker, one with a forked child")
def test_a_process_whose_environment_keeps_changing_keeps_few_fork_servers(tmp_path, monkeypatch):
    monkeypatch.setattr(supervise, "MAX_SERVERS", 2)
    fifo = tmp_path / "job.fifo"
    os.mkfifo(fifo)
    try:
        busy = _fork(tmp_path, fifo, "busy", mark="a")  # its server has a running child: it stays
        idle = supervise.fork_server(LIGHT, supervise.child_env({"MARK": "b"}, 1))
        third = supervise.fork_server(LIGHT, supervise.child_env({"MARK": "c"}, 1))
        assert idle.proc.wait(10) is not None  # the oldest idle one ended
        assert busy.server.alive() and third.alive()
        assert busy.wait(0.5) is None
        busy.kill()
    finally:
        supervise.stop_fork_servers()


def test_the_fork_server_asked_for_least_recently_is_the_one_that_ends(monkeypatch):
    """The servers beyond MAX_SERVERS end by latest use, not by age: a test process's plain
    environment, its first server and its most used, outlives the kernel conditions and builds
    that come and go (each a server's imports again, ~8 s, when it ended first)."""
    monkeypatch.setattr(supervise, "MAX_SERVERS", 2)
    try:
        plain = supervise.fork_server(LIGHT, supervise.child_env({"MARK": "plain"}, 1))
        other = supervise.fork_server(LIGHT, supervise.child_env({"MARK": "other"}, 1))
        assert supervise.fork_server(LIGHT, supervise.child_env({"MARK": "plain"}, 1)) is plain
        supervise.fork_server(LIGHT, supervise.child_env({"MARK": "third"}, 1))
        assert other.proc.wait(10) is not None
        assert plain.alive()
    finally:
        supervise.stop_fork_servers()


@pytest.mark.slow("a subprocess starting a fork server and a child, both waited out after it is killed")
def test_a_fork_server_and_its_children_end_with_the_process_that_started_them(tmp_path):
    fifo = tmp_path / "job.fifo"
    os.mkfifo(fifo)
    script = (f"import time\nfrom pathlib import Path\nfrom harness import supervise\n"
              f"s = supervise.fork_server('harness.engines.worker', supervise.child_env({{}}, 1))\n"
              f"c = s.fork(Path({str(fifo)!r}), Path({str(tmp_path / 'c.log')!r}), supervise.WORKER, {{}})\nc.started()\n"
              f"print(s.proc.pid, c.pid, flush=True)\ntime.sleep(600)\n")
    starter = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                               env=supervise.child_env({}, 1))
    pids = [int(p) for p in starter.stdout.readline().split()]
    assert len(pids) == 2, "the starter failed before forking"
    starter.kill()
    starter.wait()
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], "the fork server or its child outlived the runner"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def test_default_jobs_is_a_group_per_core_where_memory_allows(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(cpu, "available_memory", lambda: 64 * 2**30)
    assert runner.default_jobs(threads=1) == 8
    assert runner.default_jobs(threads=2) == 4  # a cell's torch threads take cores too
    monkeypatch.setattr(cpu, "available_memory", lambda: 7 * runner.CELL_MEMORY_BYTES - 1)
    assert runner.default_jobs(threads=1) == 6
    monkeypatch.setattr(cpu, "available_memory", lambda: runner.CELL_MEMORY_BYTES // 2)
    assert runner.default_jobs(threads=1) == 1
    monkeypatch.setattr(cpu, "available_memory", lambda: None)
    assert runner.default_jobs(threads=1) == 8


GATED_MATRIX = """
version: 1
environments:
  core:
    engines: {reference: "0.1.0"}
defaults:
  max_tokens: 2
  top_k: 3
  timeout_s: 300
  bounds:
    unquantized: {logprob: 1.0e-4, topk: 1.0e-4, load_time: 1.5}
models:
  whisper: &gated
    arch: WhisperForConditionalGeneration
    fixture: whisper
    prompts: fixture
    tier: cpu-load
    engines: {reference: core}
    schemes:
      unquantized:
  whisper-again:
    <<: *gated
"""
GATED = ("whisper.unquantized.reference", "whisper-again.unquantized.reference")


@pytest.mark.slow("two cpu-load harness runs timing loads in many children, one waiting out a 20 s later look")
def test_a_gated_cell_is_timed_in_several_children_for_its_baseline_and_confirmed_when_over(tmp_path, capsys,
                                                                                           monkeypatch):
    """On a load-time gated tier the baseline records the median of BASELINE_CHILDREN children, and
    a cell over its bound is timed again in fresh children, and again after --later-look seconds,
    and regressed only when every one is over (harness.loadtime): here the test hook makes the
    loader 3x slower. While the first cell waits for its later look the other gated cell is timed,
    so the run waits once, not once per cell."""
    from harness import loadtime

    matrix = tmp_path / "models.yaml"
    matrix.write_text(GATED_MATRIX)
    base = ["run", "--matrix", matrix, "--baselines", tmp_path / "b", "--tier", "cpu-load"]
    code, out, _ = harness(capsys, *base, "--results", tmp_path / "r0", "--update-baselines")
    assert code == 0, out
    medians = {}
    for cell in GATED:
        stored = json.loads((tmp_path / "b" / "cpu-load" / f"{cell}.json").read_text())["load"]
        assert len(stored["children"]) == loadtime.BASELINE_CHILDREN and stored["phases"]["calibration"] > 0
        medians[cell] = sorted(c["seconds"] / c["calibration"] for c in stored["children"])[loadtime.BASELINE_CHILDREN // 2]
        assert stored["seconds"] / stored["phases"]["calibration"] == pytest.approx(medians[cell])
    assert f"median of {loadtime.BASELINE_CHILDREN} children" in out

    monkeypatch.setenv("HARNESS_TEST_HOOK", "slow=3")
    started = time.monotonic()
    code, out, _ = harness(capsys, *base, "--results", tmp_path / "r1", "--later-look", "20")
    assert code == 1, out
    children = 2 * (1 + loadtime.CONFIRMATIONS)  # the first look and the later one
    for cell in GATED:
        slowed = R.load(tmp_path / "r1" / f"{cell}.json")
        assert slowed.verdict == "regressed" and "slower than bound" in slowed.verdict_reason
        assert len(slowed.load.children) == children
        assert all(c.seconds / c.calibration > 1.5 * medians[cell] for c in slowed.load.children)
        assert (tmp_path / "r1" / "logs" / f"{cell}.load{children - 1}.log").exists()
    assert time.monotonic() - started >= 20
    waiting = sorted(GATED, key=lambda cell: out.index(f"{cell}: load time over its bound in every child"))
    first, second = waiting
    assert "timing the other gated cells meanwhile" in out.split(f"{first}: load time over")[1].split("\n")[0]
    verdict_line = {cell: re.search(rf"\] regressed +{re.escape(cell)} ", out).start() for cell in GATED}
    assert out.index(f"{second}: load time over") < verdict_line[second] < verdict_line[first]
    looked = [int(s) for s in re.findall(r"looked again (\d+) s after it", out)]
    assert len(looked) == 2 and min(looked) >= 20


def _from_a_faster_machine(path: Path, *, logprob_shift: float = 0.0) -> None:
    """Make the baseline at ``path`` one recorded on an AMD EPYC (other kernels) whose loads took a
    tenth of this machine's, calibration alike (a third was within the bound once, the tiny load
    timed beside the other pytest worker's runs); ``logprob_shift`` moves its scored logprobs too."""
    data = json.loads(path.read_text())
    data["provenance"]["cpu"] = {"vendor": "AuthenticAMD", "model": "AMD EPYC 7B13", "capability": "avx2",
                                 "flags": ["avx2"], "kernel_env": {}}
    load = data["load"]
    load["seconds"] /= 10
    for child in load["children"]:
        child["seconds"] /= 10
    for sequence in data["sequences"]:
        for scored in sequence["scored"]:
            if scored["logprob"] is not None:
                scored["logprob"] += logprob_shift
    path.write_text(json.dumps(data, indent=2))


def _judged_by(record: R.Record, baseline: Path) -> None:
    """``record``'s load time was judged against ``baseline``'s and nothing but its load time failed:
    which baseline judged it, not how a tiny load on a shared host compared with it."""
    load = next(c for c in record.checks if c.kind == "load-time")
    assert load.data["baseline_seconds"] == json.loads(baseline.read_text())["load"]["seconds"]
    assert [c.name for c in record.checks if not c.ok and c.kind != "load-time"] == [], record.verdict_reason


@pytest.mark.slow("four cpu-load harness runs of two gated Whisper cells, loads timed in fresh children")
def test_a_gated_cells_baseline_of_these_kernels_is_recorded_where_its_own_is_from_another_machine(tmp_path, capsys):
    """A load time does not carry across machine kinds: --update-kernel-baselines records a gated
    cell whose baseline is from other kernels a baseline of this machine's (the median of
    BASELINE_CHILDREN children) under <baselines>/kernels/, its own left as it was, and later runs
    are judged against it; not where a check other than its load time fails."""
    from harness import loadtime

    matrix = tmp_path / "models.yaml"
    matrix.write_text(GATED_MATRIX)
    baselines = tmp_path / "b"
    base = ["run", "--matrix", matrix, "--baselines", baselines, "--tier", "cpu-load", "--later-look", "0"]
    assert harness(capsys, *base, "--results", tmp_path / "r0", "--update-baselines")[0] == 0
    own = {cell: baselines / "cpu-load" / f"{cell}.json" for cell in GATED}
    _from_a_faster_machine(own[GATED[0]])
    _from_a_faster_machine(own[GATED[1]], logprob_shift=0.5)
    before = {cell: path.read_text() for cell, path in own.items()}
    assert harness(capsys, *base, "--results", tmp_path / "r1")[0] == 1
    elsewhere = R.load(tmp_path / "r1" / f"{GATED[0]}.json")
    assert elsewhere.verdict == "regressed" and "--update-kernel-baselines records these kernels'" in elsewhere.verdict_reason

    _, out, _ = harness(capsys, *base, "--results", tmp_path / "r2", "--update-kernel-baselines")
    recorded, refused = (R.load(tmp_path / "r2" / f"{cell}.json") for cell in GATED)
    assert recorded.verdict == "pass" and "baseline new by --update-kernel-baselines (against the stored one: load-time:baseline: slower than bound" in recorded.verdict_reason
    assert len(recorded.load.children) == loadtime.BASELINE_CHILDREN
    [kernels] = (baselines / "kernels").iterdir()
    assert sorted(p.name for p in (kernels / "cpu-load").glob("*.json")) == [f"{GATED[0]}.json"]
    assert refused.verdict == "regressed", refused.verdict_reason
    assert "these kernels' baseline not recorded: teacher-forced:baseline" in out, out
    assert {cell: path.read_text() for cell, path in own.items()} == before

    _, out, _ = harness(capsys, *base, "--results", tmp_path / "r3", "-k", "not again")
    assert f"judged against the baseline of these kernels: {kernels / 'cpu-load' / GATED[0]}.json" in out
    _judged_by(R.load(tmp_path / "r3" / f"{GATED[0]}.json"), kernels / "cpu-load" / f"{GATED[0]}.json")


@pytest.mark.slow("four cpu-load harness runs of a gated Whisper cell, loads timed in fresh children")
def test_under_a_kernel_condition_a_gated_load_is_judged_against_this_cpus_own(tmp_path, capsys, monkeypatch):
    """A calibration is timed under the run's kernel condition, so a load time is judged against
    the one recorded on this kind of CPU under another condition (here its own kernels) before one
    from another CPU; the sequences are still judged against the cell's own baseline."""
    matrix = tmp_path / "models.yaml"
    matrix.write_text(GATED_MATRIX)
    baselines = tmp_path / "b"
    base = ["run", "--matrix", matrix, "--baselines", baselines, "--tier", "cpu-load", "--later-look", "0",
            "-k", "not again"]
    assert harness(capsys, *base, "--results", tmp_path / "r0", "--update-baselines")[0] == 0
    own = baselines / "cpu-load" / f"{GATED[0]}.json"
    _from_a_faster_machine(own)
    assert harness(capsys, *base, "--results", tmp_path / "r1", "--update-kernel-baselines")[0] == 0
    [kernels] = (baselines / "kernels").iterdir()

    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    _, out, _ = harness(capsys, *base, "--results", tmp_path / "r2")
    judged = R.load(tmp_path / "r2" / f"{GATED[0]}.json")
    assert judged.engine_info.cpu.kernel_env == {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    assert (f"load time judged against this CPU's under another kernel condition: {kernels / 'cpu-load' / GATED[0]}.json"
            in out), out
    _judged_by(judged, kernels / "cpu-load" / f"{GATED[0]}.json")

    shutil.rmtree(kernels)  # no load of this CPU's: the other CPU's, ten times as fast, is the one there is
    assert harness(capsys, *base, "--results", tmp_path / "r3")[0] == 1
    assert R.load(tmp_path / "r3" / f"{GATED[0]}.json").verdict == "regressed"


@pytest.mark.slow("four cpu-load harness runs of a gated Whisper cell, loads timed in fresh children")
def test_a_gated_cell_with_no_baseline_records_this_cpus_and_is_judged_against_it(tmp_path, capsys, monkeypatch):
    """A gated cell with no baseline anywhere (vLLM's fp8-dynamic, unsupported where the committed
    ones were recorded): --update-kernel-baselines records this machine's under <baselines>/kernels/,
    not the cell's own, and later runs on this CPU are judged against it, under another kernel
    condition too. The obtained file its own place got while it had none answered "no baseline",
    and goes once one of this CPU's answers it."""
    matrix = tmp_path / "models.yaml"
    matrix.write_text(GATED_MATRIX)
    baselines = tmp_path / "b"
    base = ["run", "--matrix", matrix, "--baselines", baselines, "--tier", "cpu-load", "--later-look", "0",
            "-k", "not again"]
    assert harness(capsys, *base, "--results", tmp_path / "none")[0] == 1
    unanswered = baselines / "cpu-load" / f"{GATED[0]}.obtained.json"
    assert unanswered.exists()
    code, out, _ = harness(capsys, *base, "--results", tmp_path / "r0", "--update-kernel-baselines")
    recorded = R.load(tmp_path / "r0" / f"{GATED[0]}.json")
    assert code == 0 and "matches the baseline; baseline new by --update-kernel-baselines" in recorded.verdict_reason, out
    [kernels] = (baselines / "kernels").iterdir()
    assert [p.name for p in (kernels / "cpu-load").iterdir()] == [f"{GATED[0]}.json"]
    assert not any((baselines / "cpu-load").iterdir())

    _, out, _ = harness(capsys, *base, "--results", tmp_path / "r1")
    assert f"judged against the baseline of these kernels: {kernels / 'cpu-load' / GATED[0]}.json" in out
    _judged_by(R.load(tmp_path / "r1" / f"{GATED[0]}.json"), kernels / "cpu-load" / f"{GATED[0]}.json")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    _, out, _ = harness(capsys, *base, "--results", tmp_path / "r2")
    assert (f"judged against the baseline of this CPU under another kernel condition: "
            f"{kernels / 'cpu-load' / GATED[0]}.json") in out
    _judged_by(R.load(tmp_path / "r2" / f"{GATED[0]}.json"), kernels / "cpu-load" / f"{GATED[0]}.json")


@pytest.mark.slow("a cpu-load run timing the base and a stand-in candidate build in pairs of children")
@pytest.mark.parametrize("hook", [None, "slow=3"])
def test_a_candidate_builds_gated_load_is_judged_in_pairs_against_the_pinned_build(tmp_path, capsys, hook):
    """A candidate's load is compared with the pinned build's of the same run, needing no stored
    load baseline of this machine: both builds are timed in balanced pairs of fresh children
    (harness.loadtime.paired); the same build passes (in one round, or in a second where the
    host's noise put a tiny load's first outside the bound), one whose loader the test hook slows is
    regressed on load time alone after a confirming round, untraced."""
    from harness import loadtime

    matrix = tmp_path / "models.yaml"
    matrix.write_text(GATED_MATRIX)
    build = stand_in_build(tmp_path / "build", {"HARNESS_TEST_HOOK": hook})
    results = tmp_path / "r"
    _, out, _ = harness(capsys, "run", "--matrix", matrix, "--baselines", tmp_path / "b", "--tier", "cpu-load",
                        "-k", "whisper and not again", "--results", results, "--candidate", f"reference={build}")
    cell = GATED[0]
    cand, base = R.load(results / "candidate" / f"{cell}.json"), R.load(results / f"{cell}.json")
    check = next(c for c in cand.checks if c.name == "load-time:baseline")
    said = re.search(r"their medians uncalibrated \(ratio ([\d., ]+);", out)
    assert said, out
    rounds = len(said.group(1).split(", "))  # a round outside the bound is confirmed by another
    assert rounds == loadtime.CANDIDATE_ROUNDS if hook else rounds in (1, loadtime.CANDIDATE_ROUNDS), out
    assert len(cand.load.children) == loadtime.CANDIDATE_PAIRS * rounds and "pairs of fresh children" in out
    timed = {name: [(results / "candidate" / "raw" / f"{name}.load{n}.json").stat().st_mtime_ns for n in (1, 2)]
             for name in (cell, f"{cell}.base")}
    # candidate, base; base, candidate
    assert timed[cell][0] < timed[f"{cell}.base"][0] < timed[f"{cell}.base"][1] < timed[cell][1]
    assert not base.load.children  # the pinned build's own record stays as it was judged
    if hook is None:
        assert cand.verdict == "pass" and check.ok, out
    else:
        assert cand.verdict == "regressed" and not check.ok and check.data["ratio"] > 1.5, out
        assert not cand.localisation


@pytest.mark.slow("a worker subprocess loading and running the Whisper reference cell")
def test_a_cell_child_ends_once_its_record_is_written_without_closing_its_engine(tmp_path):
    from harness import matrix as M

    cell = next(c for c in M.load(write_matrix(tmp_path / "models.yaml")).cells()
                if c.id == "whisper.unquantized.reference")
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"mode": "cell", "cell": cell.model_dump(mode="json"), "path": None, "sequences": None,
                               "threads": 1, "record": str(tmp_path / "record.json")}))
    marks = tmp_path / "marks"
    program = (
        "import atexit, sys\n"
        f"mark = lambda what: open({str(marks)!r}, 'a').write(what + '\\n')\n"
        "atexit.register(mark, 'exit handlers ran')\n"
        "from harness.engines import worker\n"
        "from harness.engines.reference import ReferenceEngine\n"
        "ReferenceEngine.close = lambda self: mark('engine closed')\n"
        f"worker.main([{str(job)!r}])\n"
        "mark('main returned')\n")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert R.load(tmp_path / "record.json").status == "ok"
    assert not marks.exists()  # os._exit: no engine shutdown, no exit handlers, nothing after main


# ---------------------------------------------------------------------- what a run writes

PATH_MATRIX = """\
version: 1
environments:
  core:
    engines: {reference: "0.1.0"}
defaults:
  max_tokens: 4
  top_k: 3
  timeout_s: 300
  bounds:
    unquantized: {logprob: 1.0e-4, topk: 1.0e-4, load_time: 1.5}
prompt_sets:
  p: [{id: a, text: hello}]
models:
  llama:
    arch: LlamaForCausalLM
    path: bench/llama-M-unquantized
    prompts: p
    tier: cpu-tiny
    engines: {reference: core}
    schemes:
      unquantized:
"""


def test_the_write_check_decides_no_cell_whose_checkpoint_is_built_after_it(tmp_path, monkeypatch):
    """harness run checks what it writes before it builds the benchmark checkpoints: a cell whose
    checkpoint is not built yet writes beside its baseline all the same, and is not decided a
    configuration error (no checkpoint) for the rest of the run."""
    from harness import matrix, store
    from harness.baselines import Baseline

    monkeypatch.setenv("HARNESS_BENCH_CACHE", str(tmp_path / "bench"))
    (tmp_path / "m.yaml").write_text(PATH_MATRIX)
    m = matrix.load(tmp_path / "m.yaml")
    [cell] = m.cells(tier="cpu-tiny")
    r = runner.Runner(m, [cell], results=tmp_path / "r", baselines_root=tmp_path / "b", matrix_path=tmp_path / "m.yaml")
    written = {w.path for w in r.writes()}
    assert store.obtained_path_for(Baseline, tmp_path / "b", cell.tier, cell.id) in written
    assert tmp_path / "bench" in written  # the checkpoint is built there
    (tmp_path / "bench" / "llama-M-unquantized").mkdir(parents=True)  # as benchmark.ensure_for_cells would
    assert r.decided(cell) is None


def test_the_write_check_covers_the_kernel_baselines_a_run_may_write(tmp_path, monkeypatch):
    """--update-kernel-baselines writes under <baselines>/kernels/, and a run judged against such a
    baseline writes its obtained file there: both are checked before anything runs."""
    from harness import matrix

    monkeypatch.setenv("HARNESS_BENCH_CACHE", str(tmp_path / "bench"))  # the cell's checkpoint is built later

    (tmp_path / "m.yaml").write_text(PATH_MATRIX)
    m = matrix.load(tmp_path / "m.yaml")
    [cell] = m.cells(tier="cpu-tiny")
    kernels = tmp_path / "b" / "kernels"

    def written(**kw):
        r = runner.Runner(m, [cell], results=tmp_path / "r", baselines_root=tmp_path / "b", matrix_path=tmp_path / "m.yaml", **kw)
        return {w.path for w in r.writes()}

    assert kernels not in written()
    assert kernels in written(update_kernel_baselines=True)
    (kernels / "amd-epyc-avx2-0000000" / "cpu-tiny").mkdir(parents=True)
    assert kernels in written()
