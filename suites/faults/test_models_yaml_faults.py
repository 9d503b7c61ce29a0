"""Bad matrices and bad run options: exit 2 with exactly one ``error:`` line, before any cell runs.

``harness cells --matrix FILE`` (or ``harness run``, for what only a run checks) in this process,
in a sandbox directory whose every change is checked afterwards: a refused run writes nothing.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from faultlib import (
    Tree,
    assert_one_error,
    assert_written_only_under,
    in_process,
    matrix,
)

MATRIX = matrix()


def text(t: str):
    return lambda f: f.write_text(t)


def raw(b: bytes):
    return lambda f: f.write_bytes(b)


def replaced(old: str, new: str):
    def apply(f: Path):
        assert old in MATRIX
        f.write_text(MATRIX.replace(old, new))
    return apply


def fifo(f: Path):
    os.mkfifo(f)


def nested_mappings(depth: int) -> str:
    return MATRIX + "extra: " + "{a: " * depth + "1" + "}" * depth + "\n"


LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join(['*' + p] * 10)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))

M = "error: {m}"
CASES = {
    # kind, how the file is made, the line
    "not UTF-8": ("traceback", raw(MATRIX.encode() + b"# \xff\n"), f"{M}: is not UTF-8 (byte 0xff at offset {len(MATRIX) + 2})"),
    "5000 nested [": ("traceback", text("[" * 5000), f"{M}:1: YAML syntax error: nested deeper than 64 levels"),
    "100 nested mappings": ("traceback", text(nested_mappings(100)), f"{M}:23: YAML syntax error: nested deeper than 64 levels"),
    "max_tokens 10**12": ("hang", replaced("max_tokens: 4", "max_tokens: 1000000000000"),
                          f"{M}: defaults.max_tokens: must be less than or equal to 4096 (got 1000000000000)"),
    "timeout_s infinite": ("hang", replaced("timeout_s: 300", "timeout_s: .inf"),
                           f"{M}: defaults.timeout_s: must be a finite number (got inf)"),
    "a FIFO": ("hang", fifo, f"{M}: is a FIFO, not a regular file"),
    "billion laughs": ("hang", text(MATRIX + LAUGHS), f"{M}: a: unknown key (allowed: version, environments, defaults, "
                                                      "prompt_sets, accuracy_tasks, configurations, models)"),
    "bounds.logprob infinite": ("silent", replaced("{logprob: 1.0e-4,", "{logprob: .inf,"),
                                f"{M}: defaults.bounds.unquantized.logprob: must be a finite number (got inf)"),
    "top_k 10**6": ("silent", replaced("top_k: 3", "top_k: 1000000"),
                    f"{M}: defaults.top_k: must be less than or equal to 1000 (got 1000000)"),
    "duplicate key": ("held", replaced("  max_tokens: 4\n", "  max_tokens: 4\n  max_tokens: 5\n"),
                      f"{M}:7: YAML syntax error: duplicate key 'max_tokens'"),
    "a directory": ("held", lambda f: f.mkdir(), f"{M}: is a directory, not a regular file"),
    "missing": ("held", lambda f: None, f"{M}: cannot read: missing"),
    "YAML syntax error": ("held", text("version: [1\n"), f"{M}:2: YAML syntax error: expected ',' or ']', but got '<stream end>'"),
    "top level a list": ("held", text("- 1\n"), f"{M}: the top level must be a mapping (found list)"),
    "unknown key": ("held", replaced("  top_k: 3\n", "  top_k: 3\n  topk: 3\n"),
                    f"{M}: defaults.topk: unknown key (allowed: max_tokens, top_k, timeout_s, bounds)"),
    "unhashable key": ("held", text(MATRIX + "? [1, 2]\n: 3\n"), f"{M}:23: YAML syntax error: found unhashable key"),
    "version 2": ("held", replaced("version: 1", "version: 2"), f"{M}: version: 2 is not one of 1"),
    "top_k 0": ("held", replaced("top_k: 3", "top_k: 0"), f"{M}: defaults.top_k: must be > 0"),
    "unknown environment": ("held", replaced("engines: {reference: core}", "engines: {reference: nope}"),
                            f"{M}: models.llama.engines.reference: environment 'nope' is not defined under environments (defined: core)"),
}


def _deadline(signum, frame):
    raise AssertionError("the case ran past 60 s: a hang")


@pytest.mark.parametrize("name", CASES, ids=lambda n: f"{CASES[n][0]}: {n}")
def test_bad_matrix(name, tmp_path, monkeypatch):
    kind, make, line = CASES[name]
    monkeypatch.chdir(tmp_path)
    m = Path("m.yaml")  # as a user in that directory names it; messages show it so
    make(tmp_path / m)
    tree = Tree(tmp_path)
    previous = signal.signal(signal.SIGALRM, _deadline)
    signal.alarm(60)
    try:
        outcome = in_process(["cells", "--matrix", m])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert_one_error(outcome, 2, line.replace("{m}", str(m)))
    assert outcome.out == ""
    assert_written_only_under(tree)


def test_merge_keys_are_yaml_not_duplicates(tmp_path, monkeypatch):
    """``<<: *anchor`` merges; the mapping's own keys override the merged ones."""
    monkeypatch.chdir(tmp_path)
    m = tmp_path / "m.yaml"
    m.write_text(MATRIX.replace("    engines: {reference: core}", "    engines: &eng {reference: core}")
                 .replace("      unquantized:\n", "      unquantized:\n        engines: {<<: *eng, transformers: core}\n"))
    outcome = in_process(["cells", "--matrix", m])
    assert outcome.code == 0 and outcome.err == "", outcome.err
    assert outcome.out.split() == ["llama.unquantized.reference", "llama.unquantized.transformers"]


RUN_CASES = {
    "results under a file": ("traceback", lambda t: (t / "file").write_text("x"), ["--results", "{t}/file/results"],
                             "error: {t}/file/results: cannot be created: {t}/file is not a directory (--results)"),
    "baselines under a file": ("traceback", lambda t: (t / "file").write_text("x"),
                               ["--update-baselines", "--baselines", "{t}/file/b", "--results", "{t}/r"],
                               "error: {t}/file/b: cannot be created: {t}/file is not a directory (--baselines)"),
    "model path does not exist": ("small", lambda t: None, ["MATRIX:path", "--results", "{t}/r"],
                                  "error: {m}: models.llama.path: 'no-such-checkpoint' is not a directory (resolved against {t})"),
    "bad -k": ("held", lambda t: None, ["-k", "llama and ("], "error: -k 'llama and (': wrong expression: "
                                                               "expected not OR left parenthesis OR identifier; got end of input"),
    "no cells selected": ("held", lambda t: None, ["-k", "whisper"],
                          "error: no cells selected (tier cpu-tiny -k 'whisper'); `harness cells --tier all` lists them"),
    "unknown engine": ("held", lambda t: None, ["--engine", "vlm"], "error: --engine: unknown engine 'vlm' (known: reference, transformers, vllm)"),
    "--jobs 0": ("held", lambda t: None, ["--jobs", "0"], "error: --jobs must be >= 1"),
    "unknown option": ("held", lambda t: None, ["--bogus"], "error: harness: unrecognized arguments: --bogus (see harness --help)"),
}


@pytest.mark.parametrize("name", RUN_CASES, ids=lambda n: f"{RUN_CASES[n][0]}: {n}")
def test_run_refused_before_any_cell(name, tmp_path, monkeypatch):
    kind, prepare, args, line = RUN_CASES[name]
    monkeypatch.chdir(tmp_path)
    m = tmp_path / "m.yaml"
    body = MATRIX
    if "MATRIX:path" in args:
        args = [a for a in args if a != "MATRIX:path"]
        body = MATRIX.replace("    fixture: llama\n    prompts: fixture\n",
                              "    path: no-such-checkpoint\n    prompts: p\n").replace(
            "models:\n", "prompt_sets:\n  p: [{id: a, text: hello}]\nmodels:\n")
    m.write_text(body)
    prepare(tmp_path)
    tree = Tree(tmp_path)
    outcome = in_process(["run", "--matrix", m, *[a.replace("{t}", str(tmp_path)) for a in args]])
    assert_one_error(outcome, 2, line.replace("{t}", str(tmp_path)).replace("{m}", m.name))
    assert outcome.out == ""
    assert_written_only_under(tree)  # nothing: not even the results directory
