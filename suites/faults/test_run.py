"""Faults during ``harness run``, in a subprocess: what only a process shows (signals, the fork
server, engine children, what the terminal gets).

- One run keeps its work: every fault of a baseline is an ``error`` for its cell alone, a child
  killed by SIGKILL is an ``error`` record, every other cell gets its record, the summary and the
  report are written, a new baseline has the normal file mode.
- SIGINT and SIGTERM at each stage (a cell waiting for a fork server that is still importing, a
  cell running, the report being written), reached through the test-only ``HARNESS_TEST_SIGNAL``
  hook (never a sleep), with every core busy: answered within a second, exit 130 (SIGINT) or 143
  (SIGTERM) with one line, no child started after the signal, no process left behind, and nothing
  written after the exit.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from faultlib import (
    ROOT,
    Tree,
    assert_no_process_left,
    assert_one_error,
    assert_written_only_under,
    cpu_hog,
    matrix,
    subprocess_run,
)

REFERENCE_SCHEMES = ("unquantized", "bnb-nf4", "bnb-fp4", "fp8-dynamic", "torchao-int8wo", "bnb-nf4-dq", "fp8-static-kv")


def _committed(cell: str) -> dict:
    return json.loads((ROOT / "baselines" / "cpu-tiny" / f"{cell}.json").read_text())


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


STAGES = {"fork-server-start": "running the cells", "cell-running": "running the cells",
          "report-writing": "writing the report"}
EXIT = {"SIGINT": 130, "SIGTERM": 143}
ANSWER_S = 1.0  # from the signal to the exit, on a loaded machine


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
