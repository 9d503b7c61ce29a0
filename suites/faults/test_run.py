"""Faults during ``harness run``, in a subprocess: what only a process shows (signals, the fork
server, engine children, what the terminal gets).

- A baseline field of the wrong JSON type is an ``error`` for its cell, with the field named.
- One run keeps its work: every fault of a baseline is an ``error`` for its cell alone, a child
  killed by SIGKILL is an ``error`` record, every other cell gets its record, the summary and the
  report are written, a new baseline has the normal file mode.
- SIGINT and SIGTERM at each stage (the fork server starting, a cell running, the report being
  written), reached through the test-only ``HARNESS_TEST_SIGNAL`` hook (never a sleep): exit 130
  with one line, no process left behind, and nothing written after the exit.
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


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("stage", STAGES)
def test_a_signal_at_each_stage_exits_130_with_no_late_writes(tmp_path, stage, sig):
    """The report stage is reached with a cell that needs no child (a fixture that does not exist
    is a configuration error, decided before any child): the run gets there in a second."""
    body = matrix()
    if stage == "report-writing":
        body = body.replace("      unquantized:\n", "      unquantized: {fixture_scheme: nope}\n")
    (tmp_path / "m.yaml").write_text(body)
    tree = Tree(tmp_path)
    o = subprocess_run(["run", "--matrix", "m.yaml", "--results", "r", "--baselines", "b"], cwd=tmp_path,
                       env={"HARNESS_TEST_SIGNAL": f"{sig}@{stage}"}, timeout=600)
    assert_one_error(o, 130, f"error: r: interrupted while {STAGES[stage]}; the records written so far are there")
    at_exit = Tree(tmp_path / "r")
    assert_no_process_left(o)
    assert at_exit.written() == [], "written after the run exited"
    record = tmp_path / "r" / "llama.unquantized.reference.json"
    assert record.exists() == (stage == "report-writing")  # a finished cell's record is kept, an interrupted one has none
    assert_written_only_under(tree, "r", "b", "cache")  # b: the obtained file beside a missing baseline
