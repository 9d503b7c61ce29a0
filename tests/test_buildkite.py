"""The Buildkite pipeline generator: schema validity, queues, keys, timeouts, retries, quoting,
change-based selection."""
from __future__ import annotations

import json
import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from harness import buildkite as bk
from harness.buildkite import agents
from harness import changes
from harness import matrix as mx
from harness import selection
from harness.matrix import MatrixError

ROOT = Path(__file__).resolve().parent.parent
SCHEMA_PATH = Path(__file__).parent / "data" / "buildkite" / "pipeline.schema.json"
SHARED_SCHEMA = ROOT.parent / "shared" / "buildkite" / "pipeline.schema.json"
MATRIX = mx.load()
CELLS = MATRIX.cells()


@pytest.fixture(scope="module")
def validator():
    schema = json.loads(SCHEMA_PATH.read_text())
    return jsonschema.Draft7Validator(schema)


def validate(validator, pipeline: dict) -> None:
    errors = sorted(validator.iter_errors(pipeline), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors[:5])


def cell_steps(pipeline: dict) -> list[dict]:
    out = []
    for step in pipeline["steps"]:
        out += step.get("steps", []) if "group" in step else []
    return out


def by_cell(pipeline: dict) -> dict[str, dict]:
    """Cell id -> the step that runs it."""
    return {cid: s for s in cell_steps(pipeline) for cid in s["env"]["HARNESS_CELLS"].split()}


def final(pipeline: dict) -> dict:
    return next(s for s in pipeline["steps"] if s.get("key") == "harness-report")


def test_vendored_schema_is_buildkites(validator):
    if SHARED_SCHEMA.exists():
        assert json.loads(SHARED_SCHEMA.read_text()) == json.loads(SCHEMA_PATH.read_text())
    # the schema is strict enough to reject what we must never emit
    assert list(validator.iter_errors({"steps": [{"command": "x", "key": "a b"}]}))
    assert list(validator.iter_errors({"steps": [{"command": "x", "retry": {"automatic": {"signal_reason": "lost"}}}]}))


def test_whole_matrix_pipeline_validates_and_has_one_step_per_cell(validator):
    p = bk.generate(MATRIX, CELLS)
    validate(validator, p)
    # the YAML text, parsed back, is the same pipeline and validates too
    again = yaml.safe_load(bk.to_yaml(p, comments=["a comment\nwith a newline"]))
    assert again == p
    validate(validator, again)
    steps = cell_steps(p)
    assert sorted(by_cell(p)) == sorted(c.id for c in CELLS)
    # the engines of one model x scheme sharing an environment run in one step (cpu-tiny: reference
    # and transformers together, vLLM in a step of its own), a configuration cell in one of its own
    units = {(c.model, c.scheme, c.environment, c.configuration) for c in CELLS}
    assert len(steps) == len(bk.units(CELLS)) == len(units)
    for s in steps:
        ids = s["env"]["HARNESS_CELLS"].split()
        assert len({i.rsplit(".", 1)[0] for i in ids}) == 1
        assert len({next(c.environment for c in CELLS if c.id == i) for i in ids}) == 1
    groups = [s for s in p["steps"] if "group" in s]
    # a group per model and tier, in tier order, then models.yaml order (on-demand tiers aside)
    assert [g["group"] for g in groups] == [f"{m} ({t})" for t in mx.TIERS for m in MATRIX.models
                                            if any(c.model == m and c.tier == t for c in CELLS)]
    keys = [s["key"] for s in steps] + [g["key"] for g in groups] + ["harness-report"]
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize("kwargs", [
    {"tier": "cpu-tiny"}, {"tier": "gpu-tiny"}, {"tier": "gpu-full"}, {"engines": "vllm"},
    {"tier": ["cpu-tiny", "gpu-tiny"], "engines": "reference"},
])
def test_selected_pipelines_validate(validator, kwargs):
    cells = mx.expand(MATRIX, **kwargs)
    p = bk.generate(MATRIX, cells)
    validate(validator, p)
    assert sorted(by_cell(p)) == sorted(c.id for c in cells)
    assert final(p)["depends_on"] == [s["key"] for s in cell_steps(p)]


def test_empty_selection_still_validates(validator):
    p = bk.generate(MATRIX, [])
    validate(validator, p)
    assert [s["key"] for s in p["steps"]] == ["harness-report"]
    assert final(p)["env"]["HARNESS_EXPECTED_CELLS"] == ""


def test_bootstrap_pipeline_validates_and_uploads_without_interpolation(validator):
    text = (ROOT / ".buildkite" / "pipeline.yml").read_text()
    p = yaml.safe_load(text)
    validate(validator, p)
    cmd = p["steps"][0]["command"]
    assert "buildkite-agent pipeline upload --no-interpolation" in cmd
    assert "python3 -m harness.buildkite" in cmd
    # Buildkite interpolates this file at upload: every runtime `$` must be escaped as `$$`
    assert not re.search(r"(?<!\$)\$(?!\$)", cmd.replace("$$", "")), "unescaped $ in the bootstrap command"


# ------------------------------------------------------------------------------- queues


def _cell(cell_id: str) -> mx.Cell:
    return next(c for c in CELLS if c.id == cell_id)


def test_queue_by_hardware_needs():
    assert agents.queue_for(_cell("llama.bnb-nf4.reference")).name == "cpu"
    assert agents.queue_for(_cell("llama-gpu.fp8-dynamic.vllm")).name == "gpu-1x24gb"  # 8 GB, sm 8.9
    assert agents.queue_for(_cell("mllama-11b-fp8-kv.fp8-static-kv.vllm")).name == "gpu-1x48gb"  # 40 GB
    assert agents.queue_for(_cell("mllama-11b-unsloth.bnb-nf4-unsloth.vllm")).name == "gpu-1x24gb"  # 24 GB
    c = _cell("bart-large-cnn.unquantized.vllm")
    hw = lambda **k: c.model_copy(update={"hardware": mx.Hardware(**{"gpus": 1, **k})})  # noqa: E731
    assert agents.queue_for(hw(gpus=2, gpu_memory_gb=40)).name == "gpu-2x48gb"
    assert agents.queue_for(hw(gpu_memory_gb=70)).name == "gpu-1x80gb"
    assert agents.queue_for(hw(gpu_memory_gb=8, compute_capability="9.0")).name == "gpu-1x80gb"
    with pytest.raises(MatrixError, match="no GPU queue"):
        agents.queue_for(hw(gpu_memory_gb=200))
    with pytest.raises(MatrixError, match="no GPU queue"):
        agents.queue_for(hw(compute_capability="10.0"))
    steps = by_cell(bk.generate(MATRIX, CELLS))
    for c in CELLS:
        assert steps[c.id]["agents"] == {"queue": agents.queue_for(c).name}


# ---------------------------------------------------------------------------- step fields


def test_step_keys_fit_buildkites_charset():
    pattern = re.compile(r"^[a-zA-Z0-9_\-:${}.,]+$")
    for c in CELLS:
        k = bk.step_key(c.id)
        assert k == f"cell:{c.id}" and pattern.match(k)
    keys = [s["key"] for s in cell_steps(bk.generate(MATRIX, CELLS))]
    assert "cell:llama.bnb-nf4.reference,transformers" in keys and "cell:llama-gpu.fp8-dynamic.vllm" in keys
    assert all(pattern.match(k) and len(k) <= 100 for k in keys)
    odd = ["a+b.c.reference", "a_b.c.reference", "x" * 120 + ".s.vllm", "x" * 120 + ".t.vllm"]
    keys = [bk.step_key(i) for i in odd]
    assert all(pattern.match(k) and len(k) <= 100 for k in keys)
    assert len(set(keys)) == len(keys)


def test_timeouts_leave_room_for_the_harness_per_cell_timeout():
    steps = by_cell(bk.generate(MATRIX, CELLS))
    for s in cell_steps(bk.generate(MATRIX, CELLS)):
        unit = [c for c in CELLS if c.id in s["env"]["HARNESS_CELLS"].split()]
        minutes = s["timeout_in_minutes"]
        assert isinstance(minutes, int)
        # the harness's own per-cell timeouts fire first, even one after the other (plus the
        # reference continuation child of a group without the reference) after the setup allowance
        budget = sum(c.timeout_s for c in unit) + (0 if any(c.engine == "reference" for c in unit) else unit[0].timeout_s)
        setup = bk.SETUP_MINUTES_IMAGE if "plugins" in s else bk.SETUP_MINUTES_VENV
        assert minutes * 60 > budget + setup * 60
    assert steps["llama.bnb-nf4.reference"]["timeout_in_minutes"] == 2 * 10 + 20 + 5
    # a hub checkpoint's step also has its prefetch's own time (tests/test_hub.py)
    assert steps["mllama-11b-fp8-kv.fp8-static-kv.vllm"]["timeout_in_minutes"] == 2 * 40 + 30 + 5 + bk.prefetch_minutes()


def test_automatic_retry_only_for_lost_agents_never_143():
    p = bk.generate(MATRIX, CELLS)
    for step in [*cell_steps(p), final(p)]:
        rules = step["retry"]["automatic"]
        lost = {("agent_stop", None), (None, -1)}
        hub = "prefetch" in step["command"]  # and a failed prefetch (tests/test_hub.py)
        assert {(r.get("signal_reason"), r.get("exit_status")) for r in rules} == lost | ({(None, 75)} if hub else set())
        assert all(r.get("exit_status") not in (143, "*") for r in rules)
        assert "manual" not in step["retry"]


def test_artifacts_env_and_environment_install():
    steps = by_cell(bk.generate(MATRIX, CELLS))
    for c in CELLS:
        s = steps[c.id]
        assert f"results/*/{c.id}.json" in s["artifact_paths"] and f"results/*/logs/{c.id}.log" in s["artifact_paths"]
        assert len(s["artifact_paths"]) == 2 * len(s["env"]["HARNESS_CELLS"].split())
        env = MATRIX.environments[c.environment]
        for k, v in env.env.items():
            assert s["env"][k] == v
        cmd = s["command"]
        unit = [u for u in bk.units(CELLS) if c in u][0]
        assert f"-k {shlex.quote(selection.exact_k_many(unit, CELLS))}" in cmd
        assert f"--tier {c.tier} --engine {','.join(u.engine for u in unit)}" in cmd
        for line in agents.pip_commands(c.environment, env):
            assert line in cmd
        if env.image:
            (plugin,) = s["plugins"]
            conf = plugin[bk.DOCKER_PLUGIN]
            assert conf["image"] == env.image
            assert conf["entrypoint"] == ""
            assert conf.get("gpus") == ("all" if c.hardware.gpus else None)
        else:
            assert "plugins" not in s
            assert "python3 -m venv" in cmd and "--no-deps -e ." in cmd
    core = agents.pip_commands("core", MATRIX.environments["core"])
    assert core == [
        "python3 -m pip install --disable-pip-version-check --progress-bar off -c constraints.txt torch==2.13.0 "
        "--index-url https://download.pytorch.org/whl/cpu",
        "python3 -m pip install --disable-pip-version-check --progress-bar off -c constraints.txt -e .",
    ]


def test_soft_fail_for_cells_with_known_failures(validator):
    text = (ROOT / "models.yaml").read_text().replace(
        "      fp8-static-kv:\n        description: Static FP8 with KV-cache scales, cross-attention's encoder K/V included.\n",
        "      fp8-static-kv:\n        description: Static FP8 with KV-cache scales, cross-attention's encoder K/V included.\n"
        "        known_failures:\n"
        "          - {engine: transformers, versions: '>=5', pattern: 'k_scale', reason: 'a known bug'}\n")
    m = mx.loads(text)
    p = bk.generate(m, m.cells())
    validate(validator, p)
    soft = {s["env"]["HARNESS_CELLS"] for s in cell_steps(p) if "soft_fail" in s}
    vllm_known = {c.id for c in m.cells() if c.engine == "vllm" and c.known_failures}
    assert vllm_known  # the vLLM cells with known failures (models.yaml) run in steps of their own
    # a step soft-fails when any of its cells has a known failure
    known = {" ".join(sorted(c.id for c in unit)) for unit in bk.units(m.cells())
             if any(c.known_failures for c in unit)}
    assert "whisper.fp8-static-kv.reference whisper.fp8-static-kv.transformers" in soft
    assert vllm_known <= soft and soft == known
    step = next(s for s in cell_steps(p) if "soft_fail" in s)
    assert step["soft_fail"] == [{"exit_status": 1}]  # a crash (exit 2, a signal) still fails hard


def test_final_step_reports_and_annotates():
    p = bk.generate(MATRIX, CELLS)
    f = final(p)
    assert f["depends_on"] == [s["key"] for s in cell_steps(p)]
    assert f["allow_dependency_failure"] is True
    assert f["agents"] == {"queue": "cpu"}
    assert f["env"]["HARNESS_EXPECTED_CELLS"].split() == [c.id for c in bk.ordered(MATRIX, CELLS)]
    cmd = f["command"]
    context = bk.annotation_context(CELLS, bk.Options())
    assert re.fullmatch(r"harness-cpu-config\+cpu-tiny\+gpu-full\+gpu-tiny-[0-9a-f]{8}", context)
    assert "buildkite-agent artifact download 'results/*/*.json' ." in cmd
    assert "buildkite-agent artifact download 'results/*/logs/*.log' ." in cmd
    assert 'set -- results/*/\n[ -d "$1" ] || set -- results\n' in cmd  # each job's directory, or none
    assert 'python3 -m harness.report "$@" -o reports --matrix models.yaml --strict' in cmd
    assert f"--context {shlex.quote(context)}" in cmd and '--style "$(cat reports/annotation-style.txt)"' in cmd
    assert 'if [ -n "${BUILDKITE_ANALYTICS_TOKEN:-}" ]' in cmd and "format=junit" in cmd
    # the build's values sent as strings, never read as a file a branch named "<path" would name
    assert '-F "run_env' not in cmd and '--form-string "run_env[branch]=${BUILDKITE_BRANCH:-}"' in cmd
    assert f["artifact_paths"] == ["reports/*"]
    # one context per pipeline: the same selection gives the same context, another selection another
    assert bk.annotation_context(list(reversed(CELLS)), bk.Options()) == context
    assert bk.annotation_context(CELLS[:3], bk.Options()) != context


def test_exact_k_selects_exactly_one_cell():
    for c in CELLS:
        assert selection.select(CELLS, selection.exact_k(c, CELLS)) == [c]
    for unit in bk.units(CELLS):
        assert selection.select(CELLS, selection.exact_k_many(unit, CELLS)) == sorted(unit, key=lambda c: c.id)
    # an id that is a substring of another's (pytest -k matches substrings)
    text = (ROOT / "models.yaml").read_text().replace("\n  whisper:\n", "\n  tiny-llama:\n    arch: LlamaForCausalLM\n"
                                                      "    fixture: llama\n    prompts: fixture\n    tier: cpu-tiny\n"
                                                      "    engines: {reference: core}\n    schemes:\n      unquantized:\n"
                                                      "\n  whisper:\n", 1)
    m = mx.loads(text)
    cells = m.cells()
    c = next(c for c in cells if c.id == "llama.unquantized.reference")
    assert selection.exact_k(c, cells) == ("llama.unquantized.reference and not mllama.unquantized.reference"
                                    " and not tiny-llama.unquantized.reference")
    assert selection.select(cells, selection.exact_k(c, cells)) == [c]
    unit = [c, next(x for x in cells if x.id == "llama.unquantized.transformers")]
    assert selection.exact_k_many(unit, cells) == (
        "(llama.unquantized.reference and not mllama.unquantized.reference and not tiny-llama.unquantized.reference)"
        " or (llama.unquantized.transformers and not mllama.unquantized.transformers)")
    assert selection.select(cells, selection.exact_k_many(unit, cells)) == unit


# ----------------------------------------------------------------------------- quoting


STUB_PYTHON = """#!/usr/bin/env python3
import json, os, sys
args = sys.argv[1:]
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps(["python3", *args]) + "\\n")
if args[:2] == ["-m", "venv"]:
    os.makedirs(os.path.join(args[2], "bin"), exist_ok=True)
    open(os.path.join(args[2], "bin", "activate"), "w").close()
"""
STUB_AGENT = """#!/usr/bin/env python3
import json, os, sys
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps(["buildkite-agent", *sys.argv[1:], sys.stdin.read() if "annotate" in sys.argv else ""]) + "\\n")
"""


def _stub_bin(tmp_path: Path) -> Path:
    b = tmp_path / "bin"
    b.mkdir()
    for name, body in (("python3", STUB_PYTHON), ("buildkite-agent", STUB_AGENT)):
        (b / name).write_text(body.replace("/usr/bin/env python3", sys.executable))
        (b / name).chmod(0o755)
    return b


def test_a_malicious_name_cannot_inject_shell(tmp_path):
    """models.yaml validation already rejects such names; the generator quotes regardless
    (defense in depth), so the commands run the harness with the name as one literal argument."""
    sentinel = tmp_path / "pwned"
    evil = f"m$(touch {sentinel})`touch {sentinel}`;touch {sentinel};'\"x"
    base = _cell("llama.bnb-nf4.reference")
    cell = base.model_copy(update={"model": evil, "id": f"{evil}.bnb-nf4.reference", "environment": "evil-env"})
    evil_env = mx.Environment(engines={"reference": "0.1.0"}, pip=[f"pkg$(touch {sentinel})", f"a;touch {sentinel}"],
                              plugins=[f"`touch {sentinel}` --no-deps"], env={"X": f"$(touch {sentinel})"})
    m = MATRIX.model_copy(update={"environments": {**MATRIX.environments, "evil-env": evil_env}})
    opts = bk.Options(results_dir=f"res;touch {sentinel}", matrix_path=f"m$(touch {sentinel}).yaml")
    p = bk.generate(m, [cell], opts, universe=[cell])
    step, fin = cell_steps(p)[0], final(p)
    assert step["key"].startswith("cell:m__touch_") and len(step["key"]) <= 100
    log = tmp_path / "log.jsonl"
    env = {"PATH": f"{_stub_bin(tmp_path)}:/usr/bin:/bin", "STUB_LOG": str(log)}
    for s in (step, fin):
        r = subprocess.run(["bash", "-e", "-c", s["command"]], cwd=tmp_path, env={**env, **s["env"]},
                           capture_output=True, text=True, timeout=60)
        assert not sentinel.exists(), r.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    run = next(c for c in calls if c[:4] == ["python3", "-m", "harness.cli", "run"])
    assert run[run.index("-k") + 1] == selection.exact_k_many([cell], [cell]) == cell.id
    assert run[run.index("--results") + 1].startswith(f"{tmp_path}/{opts.results_dir}/local-")  # the job's own
    assert run[run.index("--matrix") + 1] == opts.matrix_path
    pips = [c for c in calls if c[1:4] == ["-m", "pip", "install"]]
    # each item is split into pip arguments as a shell would, and every argument reaches pip literally
    for item in [*evil_env.pip, *evil_env.plugins]:
        args = shlex.split(item)
        assert any(c[-len(args):] == args for c in pips), item
    report = next(c for c in calls if c[1:3] == ["-m", "harness.report"])
    assert report[report.index("--expect") + 1] == cell.id
    assert any(c[:2] == ["buildkite-agent", "annotate"] for c in calls)
    # values that reach fields other than commands are validated instead
    bad = MATRIX.model_copy(update={"environments": {**MATRIX.environments, "evil-env": evil_env.model_copy(
        update={"image": "img;rm -rf /"})}})
    with pytest.raises(MatrixError, match="not a container image"):
        bk.generate(bad, [cell], universe=[cell])
    bad = MATRIX.model_copy(update={"environments": {**MATRIX.environments, "evil-env": evil_env.model_copy(
        update={"env": {"A;B": "1"}})}})
    with pytest.raises(MatrixError, match="not an environment variable name"):
        bk.generate(bad, [cell], universe=[cell])


# ---------------------------------------------------------------------- change selection


def _ids(cells):
    return {c.id for c in cells}


@pytest.mark.parametrize("path, expect", [
    ("harness/quant/bnb.py", lambda c: c.family == "bnb"),
    ("harness/quant/torchao.py", lambda c: c.family == "torchao"),
    ("harness/dialects/policy.py", lambda c: True),
    ("harness/engines/vllm.py", lambda c: c.engine == "vllm"),
    ("harness/engines/transformers.py", lambda c: c.engine == "transformers"),
    ("harness/reference/loader.py", lambda c: c.engine in ("reference", "vllm")),
    ("harness/fixtures/recipes.py", lambda c: c.source_kind == "fixture"),
    ("harness/compare.py", lambda c: True),
    ("pyproject.toml", lambda c: True),
    ("README.md", lambda c: False),
    ("docs/README-matrix.md", lambda c: False),
    ("tests/test_compare.py", lambda c: False),
    ("harness/report/html.py", lambda c: c.tier == "cpu-tiny"),
    ("harness/buildkite/agents.py", lambda c: c.tier == "cpu-tiny"),
    ("baselines/cpu-tiny/llama.bnb-nf4.reference.json", lambda c: c.id == "llama.bnb-nf4.reference"),
    ("models.yaml", lambda c: True),  # the previous matrix is not known
])
def test_project_paths_map_to_cells(path, expect):
    chosen, notes = changes.select_changed(MATRIX, CELLS, [path])
    assert _ids(chosen) == {c.id for c in CELLS if expect(c)}
    assert notes and notes[0].startswith(path)


@pytest.mark.parametrize("engine, path, expect", [
    ("vllm", "vllm/model_executor/models/mllama.py", lambda c: c.arch == "MllamaForConditionalGeneration"),
    ("vllm", "vllm/model_executor/models/whisper.py", lambda c: c.arch == "WhisperForConditionalGeneration"),
    ("vllm", "vllm/model_executor/models/gemma3.py", lambda c: False),
    ("vllm", "vllm/model_executor/models/utils.py", lambda c: True),
    ("vllm", "vllm/model_executor/layers/quantization/fp8.py", lambda c: c.family == "fp8"),
    ("vllm", "vllm/model_executor/layers/quantization/compressed_tensors/schemes/w8a8_fp8.py", lambda c: c.family == "fp8"),
    ("vllm", "vllm/model_executor/layers/quantization/torchao.py", lambda c: c.family == "torchao"),
    ("vllm", "vllm/model_executor/layers/quantization/awq.py", lambda c: False),
    ("vllm", "vllm/model_executor/layers/linear.py", lambda c: True),
    ("vllm", "docs/models/supported_models.md", lambda c: False),
    ("vllm", "csrc/quantization/fp8/common.cu", lambda c: (c.hardware.gpus or 0) > 0),
    ("transformers", "src/transformers/models/whisper/modeling_whisper.py", lambda c: c.arch.startswith("Whisper")),
    ("transformers", "src/transformers/quantizers/quantizer_bnb_4bit.py", lambda c: c.family == "bnb"),
    ("transformers", "src/transformers/quantizers/quantizer_awq.py", lambda c: False),
    ("transformers", "src/transformers/modeling_utils.py", lambda c: True),
])
def test_engine_source_paths_map_to_that_engines_cells(engine, path, expect):
    chosen, _ = changes.select_changed(MATRIX, CELLS, [], engine_changed={engine: [path]})
    assert _ids(chosen) == {c.id for c in CELLS if c.engine == engine and expect(c)}


def test_changed_matrix_selects_changed_cells():
    text = (ROOT / "models.yaml").read_text()
    new = mx.loads(text.replace("  fp8:         {logprob: 1.0e-2", "  fp8:         {logprob: 2.0e-2"))
    chosen, notes = changes.select_changed(new, new.cells(), ["models.yaml"], old_matrix=MATRIX)
    assert _ids(chosen) == {c.id for c in CELLS if c.family == "fp8" and c.model not in
                            ("mllama-11b-fp8-kv", "mllama-11b-fp8-dynamic")}  # those override the bound
    assert "new or changed" in notes[0]
    # an environment's install changing selects its cells
    new = mx.loads(text.replace('plugins: ["vllm-bnb-plugin==0.0.3 --no-deps"]\n    image: "vllm/vllm-openai:v0.32.0"',
                                'plugins: ["vllm-bnb-plugin==0.0.4 --no-deps"]\n    image: "vllm/vllm-openai:v0.32.0"'))
    chosen, _ = changes.select_changed(new, new.cells(), ["models.yaml"], old_matrix=MATRIX)
    assert _ids(chosen) == {c.id for c in CELLS if c.environment == "vllm-0.32-cuda"}


def _git(cwd, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True, capture_output=True)


def test_cli_since_and_all_override(tmp_path, monkeypatch, capsys, validator):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "models.yaml").write_text((ROOT / "models.yaml").read_text())
    (repo / "harness").mkdir()
    (repo / "harness" / "compare.py").write_text("# v1\n")
    (repo / "README.md").write_text("v1\n")
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "base")
    (repo / "README.md").write_text("v2\n")
    (repo / "models.yaml").write_text((ROOT / "models.yaml").read_text().replace(
        "timeout_s: 1800\n    bounds: {logprob: 0.1, topk: 0.2}\n    hardware: {gpus: 1, gpu_memory_gb: 16, compute_capability: \"8.0\"}\n    schemes:\n      unquantized:",
        "timeout_s: 1900\n    bounds: {logprob: 0.1, topk: 0.2}\n    hardware: {gpus: 1, gpu_memory_gb: 16, compute_capability: \"8.0\"}\n    schemes:\n      unquantized:"))
    _git(repo, "commit", "-q", "-am", "change")
    monkeypatch.chdir(repo)

    assert bk.main(["--matrix", "models.yaml", "--since", "HEAD~1"]) == 0
    out, err = capsys.readouterr()
    p = yaml.safe_load(out)
    validate(validator, p)
    assert list(by_cell(p)) == ["whisper-large-v3.unquantized.vllm", "whisper-large-v3.unquantized.vllm-tp2"]
    assert "README.md: documentation and tests (no cell): 0 cell(s)" in err
    assert "# models.yaml: 2 new or changed cell(s)" in out

    assert bk.main(["--matrix", "models.yaml", "--since", "HEAD~1", "--all", "--tier", "cpu-tiny"]) == 0
    p = yaml.safe_load(capsys.readouterr()[0])
    cpu = [c for c in CELLS if c.tier == "cpu-tiny"]
    assert len(by_cell(p)) == len(cpu)
    assert len(cell_steps(p)) == len({(c.model, c.scheme, c.environment, c.configuration) for c in cpu})

    changed = tmp_path / "changed.txt"
    changed.write_text("vllm/model_executor/models/mllama.py\n")
    assert bk.main(["--matrix", "models.yaml", "--changed-files", "/dev/null",
                    "--engine-changed-files", f"vllm={changed}"]) == 0
    p = yaml.safe_load(capsys.readouterr()[0])
    assert set(by_cell(p)) == {  # their two-rank cells too: a change to the model's code reaches them
        f"{cell}{configuration}" for configuration in ("", "-tp2") for cell in (
            "mllama-11b-unsloth.bnb-nf4-unsloth.vllm", "mllama-11b-fp8-kv.fp8-static-kv.vllm",
            "mllama-11b-fp8-dynamic.fp8-dynamic.vllm")}

    assert bk.main(["--matrix", "models.yaml", "--tier", "gpu-huge"]) == 2
    assert "unknown tier" in capsys.readouterr()[1]


def test_harness_cli_pipeline_subcommand(capsys):
    from harness import cli

    assert cli.main(["pipeline", "--tier", "gpu-tiny", "-k", "whisper-gpu"]) == 0
    p = yaml.safe_load(capsys.readouterr()[0])
    assert list(by_cell(p)) == ["whisper-gpu.fp8-static-kv.vllm", "whisper-gpu.fp8-static-kv.vllm-compiled",
                                "whisper-gpu.fp8-static-kv.vllm-tp2", "whisper-gpu.fp8-dynamic.vllm",
                                "whisper-gpu.fp8-dynamic.vllm-compiled", "whisper-gpu.fp8-dynamic.vllm-tp2"]


def test_report_and_pipeline_need_only_the_light_runtime():
    """The bootstrap and report steps install only agents.HARNESS_RUNTIME (pydantic, pyyaml,
    packaging, filelock, pytest, jinja2 for the HTML report, junitparser for JUnit), never torch:
    what they import must come from those."""
    code = ("import sys, harness.report, harness.report.html, harness.report.junit, harness.report.annotation, "
            "harness.report.merge, harness.buildkite\n"
            "from harness.matrix import load\nfrom harness.selection import select\n"
            "select(load().cells(), 'llama')\n"
            "print(' '.join(sorted({n.split('.')[0] for n in sys.modules} - set(sys.stdlib_module_names))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout.split()
    allowed = {"harness", "pydantic", "pydantic_core", "annotated_types", "typing_extensions", "typing_inspection",
               "yaml", "packaging", "filelock", "pytest", "pluggy", "iniconfig", "py", "pygments", "cython_runtime",
               "jinja2", "markupsafe", "junitparser",
               "lxml"}  # junitparser uses lxml when it is installed (lm-eval brings it); the light runtime has none
    assert {m for m in out if not m.startswith("_")} <= allowed
    constraints = (ROOT / "constraints.txt").read_text().lower()
    for req in agents.HARNESS_RUNTIME:
        name = re.split(r"[<>=]", req)[0].lower()
        assert f"\n{name}==" in "\n" + constraints, name


def test_a_candidate_build_runs_beside_the_base_on_the_same_agent(validator, capsys):
    url = "https://example.org/wheels/vllm_cpu-0.32.1.dev12+g1234-cp311-linux_x86_64.whl"
    cells = selection.select(CELLS, "llama.fp8-dynamic")
    p = bk.generate(MATRIX, cells, bk.Options(candidates=(("vllm", url),)))
    validate(validator, p)
    steps = by_cell(p)
    vllm, ref = steps["llama.fp8-dynamic.vllm"], steps["llama.fp8-dynamic.reference"]
    assert shlex.join(["--candidate", f"vllm={url}"]) in vllm["command"]
    assert "--candidate" not in ref["command"]
    assert "results/*/candidate/llama.fp8-dynamic.vllm.json" in vllm["artifact_paths"]
    assert not any("candidate" in a for a in ref["artifact_paths"])
    assert "results/*/candidate/*" in final(p)["command"]
    assert "candidate" not in final(bk.generate(MATRIX, cells))["command"]
    assert bk.main(["--matrix", "models.yaml", "--candidate", "vlm=x.whl"]) == 2
    assert "--candidate 'vlm=x.whl': expected ENGINE=SPEC" in capsys.readouterr().err


def test_a_candidate_step_has_time_for_both_builds_and_shows_its_cost_in_its_label(tmp_path):
    """The step runs its cells twice, after building the candidate's environment: its timeout has
    room for both, and once the run is done it appends harness run's cost line to its own label,
    from inside the container too (the agent is mounted there for a candidate step alone)."""
    url = "https://example.org/wheels/vllm_cpu-0.32.1.dev12+g1234-cp311-linux_x86_64.whl"
    opts = bk.Options(candidates=(("vllm", url),))
    for cell_id in ("llama.fp8-dynamic.vllm", "llama-gpu.fp8-dynamic.vllm"):
        cells = [c for c in CELLS if c.id == cell_id]
        plain, tried = by_cell(bk.generate(MATRIX, cells))[cell_id], by_cell(bk.generate(MATRIX, cells, opts))[cell_id]
        extra = tried["timeout_in_minutes"] - plain["timeout_in_minutes"]
        assert extra == math.ceil((2 * cells[0].timeout_s) / 60) - math.ceil(cells[0].timeout_s / 60) \
            + bk.CANDIDATE_BUILD_MINUTES, (cell_id, extra)
        assert "step update label" not in plain["command"] and "step update label" in tried["command"]
        if "plugins" in tried:
            assert tried["plugins"][0][bk.DOCKER_PLUGIN]["mount-buildkite-agent"] is True
            assert plain["plugins"][0][bk.DOCKER_PLUGIN]["mount-buildkite-agent"] is False
    # the label's lines, run as the step runs them, against a summary harness run wrote
    job = tmp_path / "results" / "job-1"
    job.mkdir(parents=True)
    (job / "summary.txt").write_text("verdict  cells\ncandidate cost: wall 40 s; cells' own time: base 6 s, "
                                     "candidate 7 s; vllm 0.31.0: environment built in 23 s\nwall time 40.2 s\n")
    agent = tmp_path / "bin" / "buildkite-agent"
    agent.parent.mkdir()
    agent.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {tmp_path}/argv\n")
    agent.chmod(0o755)
    script = "\n".join(bk._cost_label(bk.Options(results_dir="results")))
    env = {"PATH": f"{agent.parent}:/usr/bin:/bin", "BUILDKITE_JOB_ID": "job-1"}
    subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, env=env, check=True)
    assert (tmp_path / "argv").read_text().splitlines() == [
        "step", "update", "label", " · wall 40 s; cells' own time: base 6 s, candidate 7 s; vllm 0.31.0: environment "
        "built in 23 s", "--append"]
