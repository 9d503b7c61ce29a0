"""A generated pipeline, run locally: its CPU steps in dependency order with a recording stand-in
for buildkite-agent on PATH (tests/bk_local.py). The cell steps run the real `harness run` on a
small matrix; one CPU step's agent is "lost" and the GPU step has no agent here, so their cells
come back missing. The final step downloads, merges, reports, annotates and uploads."""
from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import bk_local
import jsonschema
import pytest
import yaml

from harness import buildkite as bk
from harness import matrix as mx
from harness.verdicts import ROWS

ROOT = Path(__file__).resolve().parent.parent
MATRIX_FILE = Path(__file__).parent / "data" / "pipeline-matrix.yaml"
SCHEMA = json.loads((Path(__file__).parent / "data" / "buildkite" / "pipeline.schema.json").read_text())
LOST = "cell:llama.bnb-nf4-dq.reference"

CURL = """#!{python}
import json, os, sys
with open(os.path.join(os.environ["BK_LOCAL_STATE"], "curl.jsonl"), "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
"""


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bk")
    m = mx.load(MATRIX_FILE)
    cells = m.cells()
    # the generator's own CLI, as the bootstrap step runs it
    out = tmp / "pipeline.yml"
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        assert bk.main(["--matrix", str(MATRIX_FILE.relative_to(ROOT)), "--all", "-o", str(out)]) == 0
    finally:
        os.chdir(cwd)
    pipeline = yaml.safe_load(out.read_text())
    jsonschema.validate(pipeline, SCHEMA)
    # the checkout: the steps see the matrix at its repository path (the harness package and the
    # baselines come from this machine's .venv, which installed the repository)
    checkout = tmp / "checkout"
    rel = MATRIX_FILE.relative_to(ROOT)
    (checkout / rel.parent).mkdir(parents=True)
    (checkout / rel).write_text(MATRIX_FILE.read_text())
    tools = tmp / "tools"
    tools.mkdir()
    (tools / "curl").write_text(CURL.format(python=sys.executable))
    (tools / "curl").chmod(0o755)
    venv_bin = Path(sys.executable).parent
    env = {
        "HARNESS_PREINSTALLED": "1",  # this machine's .venv is the environment
        "PATH": f"{tools}:{venv_bin}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "BUILDKITE_ANALYTICS_TOKEN": "test-engine-token",
    }
    run = bk_local.run_pipeline(pipeline, checkout, tmp / "state", env=env, skip={LOST})
    return m, cells, pipeline, run, checkout, env


@pytest.mark.slow("the module's local pipeline run: real harness runs of its cell steps, then the report step")
def test_steps_ran_in_dependency_order(pipeline_run):
    m, cells, pipeline, run, *_ = pipeline_run
    keys = [s.key for s in run.steps]
    assert keys[-1] == "harness-report"
    ran = {s.key: s for s in run.steps if s.status is not None}
    assert set(ran) == {"cell:llama.unquantized.reference,transformers", "cell:llama.bnb-nf4.reference", "harness-report"}
    for key in ("cell:llama.unquantized.reference,transformers", "cell:llama.bnb-nf4.reference"):
        assert ran[key].status in (0, 1), ran[key].output[-3000:]  # 2 would be a usage error
        assert "harness run: " in ran[key].output
    assert run.step(LOST).why == "agent lost"
    assert run.step("cell:llama-gpu.fp8-dynamic.vllm").why == "no agent on queue 'gpu-1x24gb' here"
    # the report step runs although dependencies failed, and fails the build: cells are missing
    assert ran["harness-report"].status == 1, ran["harness-report"].output[-3000:]


def test_records_and_logs_were_uploaded_and_downloaded(pipeline_run):
    m, cells, pipeline, run, checkout, env = pipeline_run
    ran = ["llama.unquantized.reference", "llama.unquantized.transformers", "llama.bnb-nf4.reference"]
    for cid in ran:
        # each job's records in its own directory (harness.runs): the steps share the checkout
        assert len(list(run.artifact("results").glob(f"job-*/{cid}.json"))) == 1
        assert len(list(run.artifact("results").glob(f"job-*/logs/{cid}.log"))) == 1
        assert len(list((checkout / "results").glob(f"job-*/{cid}.json"))) == 1
    downloads = [c for c in run.calls if c["argv"][:2] == ["artifact", "download"]]
    assert [c["argv"][2] for c in downloads] == ["results/*/*.json", "results/*/logs/*.log"]
    assert sorted(p.rsplit("/", 1)[1] for p in downloads[0]["downloaded"]) == sorted(f"{c}.json" for c in ran)
    # raw/, witness/ and sequences/ stay on the agent
    assert not list(run.artifact("results").glob("*/raw"))


def test_annotation_and_report(pipeline_run):
    m, cells, pipeline, run, checkout, env = pipeline_run
    records = {p.stem: json.loads(p.read_text()) for p in (run.state / "artifacts" / "results").glob("*/*.json")}
    verdicts = {cid: r["verdict"] for cid, r in records.items()}
    assert sorted(verdicts) == ["llama.bnb-nf4.reference", "llama.unquantized.reference", "llama.unquantized.transformers"]
    assert "error" not in verdicts.values(), {c: r["verdict_reason"] for c, r in records.items()}
    missing = ["llama.bnb-nf4-dq.reference", "llama-gpu.fp8-dynamic.vllm"]

    context = bk.annotation_context(cells, bk.Options())
    (ann,) = run.annotations().values()
    assert ann["context"] == context
    assert ann["style"] == "error"  # missing cells
    body = ann["body"]
    assert body.startswith(f"#### Quantized loading matrix: {sum(v not in ('pass', 'improved') for v in verdicts.values()) + 2}"
                           f" of 5 cells need attention")
    for cid in missing:
        assert f"- ⛔ `{cid}` **missing**: no result record came back" in body
    for cid, v in verdicts.items():
        if v not in ("pass", "improved"):
            assert f"`{cid}` **{v}**" in body
    assert "| unquantized | " + f"{ROWS[verdicts['llama.unquantized.reference']].emoji}ref " \
           f"{ROWS[verdicts['llama.unquantized.transformers']].emoji}tf |" in body
    assert '<a href="artifact://reports/report.html">' in body

    html = run.artifact("reports/report.html").read_text()
    for cid in [*records, *missing]:
        assert cid in html
    junit = ET.parse(run.artifact("reports/junit.xml")).getroot()
    assert sorted(c.get("name") for c in junit.iter("testcase")) == sorted(c.id for c in cells)
    assert run.artifact("reports/annotation.md").read_text() == body

    (curl,) = [json.loads(line) for line in (run.state / "curl.jsonl").read_text().splitlines()]
    assert "data=@reports/junit.xml" in curl and "format=junit" in curl
    assert 'Authorization: Token token="test-engine-token"' in curl
    assert curl[-1] == "https://analytics-api.buildkite.com/v1/uploads"
    assert curl[curl.index("run_env[branch]=local") - 1] == "--form-string" and "run_env[message]=" in curl


def test_a_rerun_of_the_report_step_replaces_the_annotation(pipeline_run):
    m, cells, pipeline, run, checkout, env = pipeline_run
    final = next(s for s in pipeline["steps"] if s.get("key") == "harness-report")
    rerun = bk_local.run_pipeline({"steps": [{**final, "depends_on": []}]}, checkout, run.state, env=env)
    assert rerun.steps[0].status == 1
    annotates = [c for c in rerun.calls if c["argv"][:1] == ["annotate"]]
    assert len(annotates) == 2 and len({c["annotated"] for c in annotates}) == 1
    assert len(rerun.annotations()) == 1
