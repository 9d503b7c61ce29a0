"""The one-line promise on the terminal, in a fresh interpreter each time: what the libraries say
while importing (torchao's "Failed to load …so", torch's ``_pytree`` warnings) goes to the log,
never to stderr, on every command; an error is exactly one line."""
from __future__ import annotations

import json

import pytest
from faultlib import (
    Tree,
    assert_clean,
    assert_no_process_left,
    assert_one_error,
    assert_written_only_under,
    matrix,
    subprocess_run,
)

from harness import fixtures


@pytest.fixture
def sandbox(tmp_path):
    (tmp_path / "m.yaml").write_text(matrix())
    return tmp_path


@pytest.mark.slow("`harness load` in a fresh interpreter that imports torch and the quantization libraries")
def test_load_of_nothing_is_one_line(sandbox):
    """The issue's own check: ``harness load /nonexistent 2>&1 | wc -l`` was 5."""
    o = subprocess_run(["load", "/nonexistent"], cwd=sandbox)
    assert_one_error(o, 2, "error: /nonexistent: not a checkpoint directory")
    assert o.out == ""
    log = (sandbox / "cache" / "libraries.log").read_text()
    assert "load /nonexistent\n" in log  # the libraries' messages are kept, there


@pytest.mark.slow("builds the torchao fixture, then `harness load --json` of it in a fresh interpreter")
def test_load_that_works_says_nothing_on_stderr(sandbox):
    o = subprocess_run(["load", fixtures.build("llama-torchao-int8wo"), "--json"], cwd=sandbox)
    assert_clean(o)
    assert json.loads(o.out)["quant_method"] == "torchao"


@pytest.mark.parametrize("argv", [
    ["fixtures"],
    ["cells", "--matrix", "m.yaml"],
    ["run", "--dry-run", "--matrix", "m.yaml", "--baselines", "b"],
    ["accuracy", "list"],
    ["report", "nothing", "-o", "rep"],
], ids=lambda a: " ".join(a[:2]))
def test_every_command_is_quiet(sandbox, argv):
    (sandbox / "nothing").mkdir()  # an empty results directory
    tree = Tree(sandbox)
    o = subprocess_run(argv, cwd=sandbox)
    assert_clean(o)
    assert_written_only_under(tree, "cache", "rep")
    assert_no_process_left(o)


def test_pipeline_says_only_its_own_line(sandbox):
    o = subprocess_run(["pipeline", "--matrix", "m.yaml"], cwd=sandbox)
    assert o.code == 0 and "Traceback" not in o.err
    assert o.err == "harness pipeline: 1 of 1 cells of m.yaml selected by --tier/--engine/-k\n", o.err
