"""Faults during ``harness run``, in a subprocess: what only a process shows (signals, the fork
server, engine children, what the terminal gets).

- A baseline field of the wrong JSON type is an ``error`` for its cell, with the field named.
- One run keeps its work: every fault of a baseline is an ``error`` for its cell alone, a child
  killed by SIGKILL is an ``error`` record, every other cell gets its record, the summary and the
  report are written, a new baseline has the normal file mode.
- A path the run would write that cannot be written is refused before anything runs or is built:
  one line, exit 2, in under 2 s, nothing written. "Unwritable" is a file where a directory must
  be, a directory where a file must be, or (where ``chattr`` works: root on ext4 and most local
  filesystems) an immutable directory or file, which stops root too.
- SIGINT and SIGTERM at each stage (a cell waiting for a fork server that is still importing, a
  cell running, the report being written), reached through the test-only ``HARNESS_TEST_SIGNAL``
  hook (never a sleep), with every core busy: answered within a second, exit 130 (SIGINT) or 143
  (SIGTERM) with one line, no child started after the signal, no process left behind, and nothing
  written after the exit.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path

import pytest
from faultlib import (
    ROOT,
    Tree,
    assert_no_process_left,
    assert_one_error,
    assert_written_only_under,
    cpu_hog,
    in_process,
    matrix,
    subprocess_run,
)

REFERENCE_SCHEMES = ("unquantized", "bnb-nf4", "bnb-fp4", "fp8-dynamic", "torchao-int8wo", "bnb-nf4-dq", "fp8-static-kv")


def _committed(cell: str) -> dict:
    return json.loads((ROOT / "baselines" / "cpu-tiny" / f"{cell}.json").read_text())


@pytest.mark.slow("a harness run subprocess of 7 reference cells, broken baselines and a SIGKILLed child")
def test_the_run_keeps_its_work(tmp_path):
    (tmp_path / "m.yaml").write_text(matrix(REFERENCE_SCHEMES))
    b = tmp_path / "baselines" / "cpu-tiny"
    b.mkdir(parents=True)
    (b / "llama.unquantized.reference.json").write_bytes(b'{"schema_version": 1, "cell": "\xff"}')
    (b / "llama.bnb-nf4.reference.json").write_text(json.dumps(_committed("llama.unquantized.reference")))
    wrong_tier = _committed("llama.bnb-fp4.reference")
    wrong_tier["tier"] = "gpu-tiny"
    (b / "llama.bnb-fp4.reference.json").write_text(json.dumps(wrong_tier))
    (b / "llama.fp8-dynamic.reference.json").write_text("{")
    os.mkfifo(b / "llama.torchao-int8wo.reference.json")
    tree = Tree(tmp_path)
    o = subprocess_run(["run", "--matrix", "m.yaml", "--results", "r", "--baselines", "baselines", "--update-baselines"],
                       cwd=tmp_path, env={"HARNESS_TEST_HOOK": "crash=SIGKILL@llama.fp8-static-kv.reference"}, timeout=600)
    assert "Traceback" not in o.out + o.err
    assert o.code == 1, o.out[-3000:] + o.err[-2000:]  # error verdicts fail the run
    assert o.err == "", o.err  # no third-party noise, no error line: the run itself went through
    records = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "r").glob("llama.*.json")}
    assert sorted(records) == sorted(f"llama.{s}.reference" for s in REFERENCE_SCHEMES)
    reasons = {c: r["verdict_reason"] for c, r in records.items() if r["verdict"] == "error"}
    where = str(Path("baselines") / "cpu-tiny")
    assert reasons == {
        "llama.unquantized.reference": f"baseline unreadable: {where}/llama.unquantized.reference.json: is not UTF-8 (byte 0xff at offset 31)",
        "llama.bnb-nf4.reference": f"baseline unreadable: {where}/llama.bnb-nf4.reference.json: cell: 'llama.unquantized.reference' "
                                   "is not this file's cell 'llama.bnb-nf4.reference' (a baseline copied from another cell?)",
        "llama.bnb-fp4.reference": f"baseline unreadable: {where}/llama.bnb-fp4.reference.json: tier: 'gpu-tiny' is not this file's "
                                   "tier 'cpu-tiny' (a baseline copied from another cell?)",
        "llama.fp8-dynamic.reference": f"baseline unreadable: {where}/llama.fp8-dynamic.reference.json: not JSON: Expecting property "
                                       "name enclosed in double quotes at line 1",
        "llama.torchao-int8wo.reference": f"baseline unreadable: {where}/llama.torchao-int8wo.reference.json: is a FIFO, not a regular file",
        "llama.fp8-static-kv.reference": "EngineCrashed: the reference engine child was killed by SIGKILL without a record",
    }, reasons
    assert records["llama.bnb-nf4-dq.reference"]["verdict"] == "pass"
    new = b / "llama.bnb-nf4-dq.reference.json"
    umask = os.umask(0o022)
    os.umask(umask)
    assert new.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600
    assert (tmp_path / "r" / "summary.txt").exists() and (tmp_path / "r" / "report" / "report.html").exists()
    assert_written_only_under(tree, "r", "baselines", "cache")
    assert_no_process_left(o)


@pytest.mark.slow("a harness run subprocess of the llama reference cell, its engine child included")
def test_a_baseline_field_of_the_wrong_type_is_that_cells_error(tmp_path):
    """A token written as a string ("510", not 510): before the baselines were read strictly it
    was taken for the number, and the cell passed against a file that is not a baseline."""
    (tmp_path / "m.yaml").write_text(matrix())
    b = tmp_path / "baselines" / "cpu-tiny"
    b.mkdir(parents=True)
    baseline = _committed("llama.unquantized.reference")
    token = baseline["sequences"][0]["prompt_tokens"][0]
    baseline["sequences"][0]["prompt_tokens"][0] = str(token)
    (b / "llama.unquantized.reference.json").write_text(json.dumps(baseline))
    o = subprocess_run(["run", "--matrix", "m.yaml", "--results", "r", "--baselines", "baselines"], cwd=tmp_path, timeout=600)
    assert "Traceback" not in o.out + o.err
    assert (o.code, o.err) == (1, ""), o.out[-3000:] + o.err[-2000:]  # the cell's error fails the run, no error line
    record = json.loads((tmp_path / "r" / "llama.unquantized.reference.json").read_text())
    where = Path("baselines") / "cpu-tiny" / "llama.unquantized.reference.json"
    assert (record["verdict"], record["verdict_reason"]) == (
        "error", f'baseline unreadable: {where}: sequences[0].prompt_tokens[0]: must be an integer (got "{token}")')
    assert_no_process_left(o)


STAGES = {"fork-server-start": "running the cells", "cell-running": "running the cells",
          "report-writing": "writing the report"}
EXIT = {"SIGINT": 130, "SIGTERM": 143}
ANSWER_S = 1.0  # from the signal to the exit, on a loaded machine


@pytest.mark.slow("a harness run subprocess per stage and signal, with a CPU hog on every core")
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("stage", STAGES)
def test_a_signal_at_each_stage_is_answered_within_a_second_with_no_late_writes(tmp_path, stage, sig):
    """The report stage is reached with a cell that needs no child (a fixture that does not exist
    is a configuration error, decided before any child): the run gets there in a second. At
    fork-server-start the cell waits for a server still importing its preload: the server is ended
    before it forks, so the cell's child never starts (no log). Every core is busy meanwhile."""
    body = matrix()
    if stage == "report-writing":
        body = body.replace("      unquantized:\n", "      unquantized: {fixture_scheme: nope}\n")
    (tmp_path / "m.yaml").write_text(body)
    tree = Tree(tmp_path)
    stamp = tmp_path / "signalled-at"
    with cpu_hog():
        o = subprocess_run(["run", "--matrix", "m.yaml", "--results", "r", "--baselines", "b"], cwd=tmp_path,
                           env={"HARNESS_TEST_SIGNAL": f"{sig}@{stage}", "HARNESS_TEST_SIGNAL_STAMP": str(stamp)},
                           timeout=600)
    assert_one_error(o, EXIT[sig], f"error: r: interrupted while {STAGES[stage]}; the records written so far are there")
    answered = o.ended_at - float(stamp.read_text())
    assert answered < ANSWER_S, f"{sig} at {stage} answered {answered:.2f} s after it was sent"
    at_exit = Tree(tmp_path / "r")
    assert_no_process_left(o)
    assert at_exit.written() == [], "written after the run exited"
    record = tmp_path / "r" / "llama.unquantized.reference.json"
    assert record.exists() == (stage == "report-writing")  # a finished cell's record is kept, an interrupted one has none
    log = tmp_path / "r" / "logs" / "llama.unquantized.reference.log"
    assert log.exists() == (stage == "cell-running")  # no child is started after the signal
    assert_written_only_under(tree, "r", "b", "cache", stamp.name)  # b: the obtained file beside a missing baseline


REFUSED_WITHIN_S = 2.0
CELL = "llama.unquantized.reference"


@contextlib.contextmanager
def immutable(path: Path):
    """``chattr +i path`` while the body runs (skipped where chattr cannot: not root, no such fs)."""
    done = subprocess.run(["chattr", "+i", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"chattr +i does not work here: {done.stderr.decode().strip()}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def _tier_dir_file(t: Path):
    (t / "b").mkdir()
    (t / "b" / "cpu-tiny").write_text("not a directory")


def _committed_baseline(t: Path) -> Path:
    (t / "b" / "cpu-tiny").mkdir(parents=True)
    path = t / "b" / "cpu-tiny" / f"{CELL}.json"
    path.write_text((ROOT / "baselines" / "cpu-tiny" / f"{CELL}.json").read_text())
    return path


WRITE_CASES = {
    "tier folder is a file, --update-baselines": (
        _tier_dir_file, ["--update-baselines"], None, "error: b/cpu-tiny: is not a directory (--baselines)"),
    "tier folder is a file, obtained files only": (
        _tier_dir_file, [], None, "error: b/cpu-tiny: is not a directory (--baselines)"),
    "tier folder immutable": (
        lambda t: (t / "b" / "cpu-tiny").mkdir(parents=True), ["--update-baselines"], "b/cpu-tiny",
        "error: b/cpu-tiny: is not writable: Operation not permitted (--baselines)"),
    "baseline file immutable": (
        _committed_baseline, ["--update-baselines"], f"b/cpu-tiny/{CELL}.json",
        f"error: b/cpu-tiny/{CELL}.json: cannot be replaced: it is immutable or append-only (--baselines)"),
    "obtained file is a directory": (
        lambda t: (t / "b" / "cpu-tiny" / f"{CELL}.obtained.json").mkdir(parents=True), [], None,
        f"error: b/cpu-tiny/{CELL}.obtained.json: is a directory, which a file cannot replace (--baselines)"),
    "report folder is a file": (
        lambda t: (t / "r").mkdir() or (t / "r" / "report").write_text("x"), [], None,
        "error: r/report: is not a directory (--results)"),
    "record is a directory": (
        lambda t: (t / "r" / f"{CELL}.json").mkdir(parents=True), [], None,
        f"error: r/{CELL}.json: is a directory, which a file cannot replace (--results)"),
    "fixture cache under a file": (
        lambda t: (t / "file").write_text("x"), [], None,
        "error: file/fixtures: cannot be created: {t}/file is not a directory ($HARNESS_FIXTURE_CACHE or .cache/fixtures)"),
}


@pytest.mark.parametrize("name", WRITE_CASES)
def test_a_path_the_run_cannot_write_is_refused_before_anything_runs(tmp_path, monkeypatch, name):
    """In this process (the refusal starts no process): the time is the harness's own, without an
    interpreter's start-up."""
    prepare, args, frozen, line = WRITE_CASES[name]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.yaml").write_text(matrix())
    prepare(tmp_path)
    if name.startswith("fixture cache"):
        monkeypatch.setenv("HARNESS_FIXTURE_CACHE", "file/fixtures")
    tree = Tree(tmp_path)
    with immutable(tmp_path / frozen) if frozen else contextlib.nullcontext():
        o = in_process(["run", "--matrix", "m.yaml", "--results", "r", "--baselines", "b", *args])
    assert_one_error(o, 2, line.replace("{t}", str(tmp_path)))
    assert o.wall < REFUSED_WITHIN_S, f"refused after {o.wall:.1f} s"
    assert tree.written() == [], "written before the refusal"
