"""`harness pin` and prefetch against a stand-in for the hub API on 127.0.0.1 (tests/hub_standin.py),
never the internet; and the generated pipeline's prefetch phase."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from harness import buildkite as bk
from harness import hub
from harness import matrix as M
from harness.engines import base
from tests import netguard
from tests.hub_standin import StandinHub

ROOT = Path(__file__).resolve().parent.parent


def copy_matrix(tmp_path: Path) -> Path:
    """models.yaml copied into ``tmp_path``, beside links to the checkout's folders (a matrix may
    name files relative to itself)."""
    for d in ROOT.iterdir():
        if d.is_dir() and not d.name.startswith(".") and not (tmp_path / d.name).exists():
            (tmp_path / d.name).symlink_to(d)
    path = tmp_path / "models.yaml"
    path.write_text((ROOT / "models.yaml").read_text())
    return path


def sha(i: int) -> str:
    return f"{i:040x}"


def cli(tmp_path: Path, url: str, *args, guard: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_TOKEN")}
    env.update({"HF_ENDPOINT": url, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_DISABLE_TELEMETRY": "1"})
    if guard:  # the stand-in on 127.0.0.1 only; any other address is refused and logged
        env.update(netguard.install(tmp_path / "guard", tmp_path / "network.log"))
    return subprocess.run([sys.executable, "-m", "harness.cli", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


# ------------------------------------------------------------------------------------------ pin


@pytest.mark.slow("a harness pin subprocess over models.yaml's unpinned models, against a stand-in hub")
def test_pin_resolves_every_unpinned_revision_keeping_comments_and_order(tmp_path):
    original = (ROOT / "models.yaml").read_text()
    path = copy_matrix(tmp_path)
    unpinned = {n: m.hub.id for n, m in M.load(path).models.items() if m.hub and m.hub.revision == M.UNPINNED}
    assert len(unpinned) >= 2
    missing = sorted(unpinned)[0]  # the stand-in does not know this one
    repos = {rid: {"refs": {"main": sha(i + 1)}, "files": {}} for i, (n, rid) in enumerate(sorted(unpinned.items()))
             if n != missing}
    with StandinHub(repos) as standin:
        out = cli(tmp_path, standin.url, "pin", "--matrix", path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert (tmp_path / "network.log").read_text() == ""
    errors = out.stderr.strip().splitlines()
    assert len(errors) == 1
    assert errors[0].startswith(f"error: {path}: models.{missing}.hub: cannot resolve {unpinned[missing]}@main: "
                                "RepositoryNotFoundError")
    pinned = M.load(path)
    for i, (name, rid) in enumerate(sorted(unpinned.items())):
        want = M.UNPINNED if name == missing else sha(i + 1)
        assert pinned.models[name].hub.revision == want, name
        if name != missing:
            assert f"models.{name}: {rid}@main -> {want}" in out.stdout
    # only the revisions (and their TODO comments) changed: every other line, comment and the order stay
    new = path.read_text()
    old_lines, new_lines = original.splitlines(), new.splitlines()
    assert len(old_lines) == len(new_lines)
    changed = [(a, b) for a, b in zip(old_lines, new_lines) if a != b]
    assert len(changed) == len(unpinned) - 1
    assert re.search(r'revision: "\d{40}"', new)  # an all-digit commit is quoted, or YAML reads an integer
    for a, b in changed:
        assert "revision: unpinned" in a and "# TODO: pin" in a
        assert re.sub(r"# pinned \d{4}-\d\d-\d\d from main", "# TODO: pin", re.sub(r'"?\b[0-9a-f]{40}\b"?', "unpinned", b)) == a
    # everything but the revisions resolves exactly as before
    before = {c.id: c.model_dump() for c in M.load(ROOT / "models.yaml").cells()}
    after = {c.id: c.model_dump() for c in pinned.cells()}
    for d in (*before.values(), *after.values()):
        if d["hub"]:
            d["hub"]["revision"] = "x"
    assert before == after


@pytest.mark.slow("two harness pin subprocesses, the first against a stand-in hub")
def test_pin_handles_block_style_quoted_revisions_and_leaves_pinned_ones(tmp_path):
    text = """version: 1
# a comment at the top
environments:
  e: {engines: {vllm: "0.32.0"}, image: "vllm/vllm-openai:v0.32.0"}
defaults: {max_tokens: 4, top_k: 3, timeout_s: 60, bounds: {unquantized: {logprob: 0.1, topk: 0.2, load_time: 1.5}}}
prompt_sets:
  t: [{id: a, text: "hi"}]
models:
  one:
    arch: LlamaForCausalLM
    hub:
      id: acme/one
      revision: "unpinned"   # quoted, block style
    prompts: t
    tier: gpu-full
    engines: {vllm: e}
    schemes: {unquantized: }
  two:
    arch: LlamaForCausalLM
    hub: {id: acme/two, revision: 00000000000000000000000000000000000000aa}
    prompts: t
    tier: gpu-full
    engines: {vllm: e}
    schemes: {unquantized: }
"""
    path = tmp_path / "m.yaml"
    path.write_text(text)
    with StandinHub({"acme/one": {"refs": {"main": sha(7), "v1": sha(8)}, "files": {}}}) as standin:
        out = cli(tmp_path, standin.url, "pin", "--matrix", path, "--ref", "v1")
        assert out.returncode == 0, out.stderr
        assert [p for m, p in standin.requests] == ["/api/models/acme/one/revision/v1"]  # 'two' is pinned: not asked
    new = path.read_text()
    assert new == text.replace('"unpinned"', sha(8))
    out = cli(tmp_path, "http://127.0.0.1:9", "pin", "--matrix", path)  # nothing left to pin: no request at all
    assert out.returncode == 0 and "0 unpinned hub revision(s)" in out.stdout and path.read_text() == new


def test_pin_without_a_reachable_hub_says_so_in_one_line_per_model(tmp_path):
    path = copy_matrix(tmp_path)
    out = cli(tmp_path, "http://127.0.0.1:9", "pin", "--matrix", path, "--model", "whisper-large-v3",
              "--model", "no-such-model")
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith(f"error: {path}: models.") for line in lines)
    assert "models.no-such-model: no such model" in lines[0]
    assert "models.whisper-large-v3.hub: cannot resolve openai/whisper-large-v3@main: " in lines[1]
    assert path.read_text() == (ROOT / "models.yaml").read_text()


# ------------------------------------------------------------------------------------- prefetch

REPO = {"refs": {"main": sha(42)},
        "files": {"config.json": b'{"architectures": ["LlamaForCausalLM"]}', "model.safetensors": b"w" * 4096,
                  "pytorch_model.bin": b"b" * 4096, "onnx/model.onnx": b"o", "tokenizer.json": b"{}",
                  "original/consolidated.pth": b"p"}}


def test_choose_files_prefers_safetensors_and_skips_other_frameworks():
    assert hub.choose_files(REPO["files"]) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert hub.choose_files(["config.json", "pytorch_model.bin", "flax_model.msgpack"]) == ["config.json", "pytorch_model.bin"]


def test_prefetch_once_per_agent_then_cells_read_the_snapshot_without_the_hub(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # an in-process vLLM test of this worker sets it
    cache = tmp_path / "hub"
    with StandinHub({"acme/tiny": REPO}) as standin:
        o = hub.prefetch("acme/tiny", sha(42), endpoint=standin.url, cache=cache, attempts=1, log=lambda s: None)
        assert o.error is None and not o.cached
        assert sorted(p.name for p in o.snapshot.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
        fetched = list(standin.requests)
        assert not any("pytorch_model.bin" in p or "onnx" in p or "original" in p for _, p in fetched)
        again = hub.prefetch("acme/tiny", sha(42), endpoint=standin.url, cache=cache, log=lambda s: None)
        assert again.cached and again.snapshot == o.snapshot and standin.requests == fetched  # no request at all
    # the cell's checkpoint is that snapshot, with the hub out of reach
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    cell = M.Cell(id="tiny.unquantized.vllm", model="tiny", scheme="unquantized", engine="vllm", tier="gpu-full",
                  arch="LlamaForCausalLM", environment="e", engine_version="0.32.0", source_kind="hub",
                  hub=M.Hub(id="acme/tiny", revision=sha(42)), prompt_set="t", family="unquantized", max_tokens=4,
                  top_k=3, timeout_s=60, bounds=M.Bounds(logprob=0.1, topk=0.1, load_time=1.5), hardware=M.Hardware(gpus=1))
    assert base.resolve_checkpoint(cell).path == o.snapshot
    # a deleted file invalidates the marker: the next prefetch fetches again
    (o.snapshot / "model.safetensors").unlink()
    assert hub.prefetched("acme/tiny", sha(42), cache) is None


@pytest.mark.slow("waits out two 1.5 s attempt timeouts on a delayed stand-in hub download")
def test_prefetch_retries_and_times_out_per_attempt(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # an in-process vLLM test of this worker sets it
    cache = tmp_path / "hub"
    lines: list[str] = []
    with StandinHub({"acme/tiny": REPO}) as standin:
        standin.fail_next = 2  # the hub answers 500 twice, then recovers
        o = hub.prefetch("acme/tiny", "unpinned", endpoint=standin.url, cache=cache, attempts=3, backoff_s=0.05,
                         log=lines.append)
        assert o.error is None and o.attempts == 3, lines
        assert sum("failed" in line for line in lines) == 2 and "500" in next(line for line in lines if "failed" in line)
        assert hub.prefetched("acme/tiny", "unpinned", cache) == o.snapshot  # unpinned: main's commit
        assert o.snapshot.name == sha(42)
        standin.file_delay_s = 5.0  # a download slower than the attempt's limit
        o = hub.prefetch("acme/tiny", sha(42), endpoint=standin.url, cache=tmp_path / "other", attempts=2,
                         timeout_s=1.5, backoff_s=0.05, log=lines.append)
    assert o.snapshot is None and o.attempts == 2 and o.error == "timed out after 1.5 s"


@pytest.mark.slow("two harness prefetch subprocesses against a stand-in hub")
def test_harness_prefetch_command_fetches_the_selected_hub_cells_and_exits_75_on_failure(tmp_path):
    matrix = copy_matrix(tmp_path)
    with StandinHub({"openai/whisper-large-v3": REPO}) as standin:
        out = cli(tmp_path, standin.url, "prefetch", "--matrix", matrix, "--tier", "gpu-full", "-k", "whisper-large",
                  "--attempts", "1")
        assert out.returncode == 0, out.stdout + out.stderr
        assert "harness prefetch: 1 hub checkpoint(s)" in out.stdout and "[3/3] tokenizer.json" in out.stdout
        out = cli(tmp_path, standin.url, "prefetch", "--matrix", matrix, "--tier", "gpu-full", "-k", "bart",
                  "--attempts", "2", "--backoff-s", "0.05")
    assert out.returncode == hub.TEMPFAIL
    assert out.stderr.strip().splitlines()[-1].startswith(
        "error: facebook/bart-large-cnn@unpinned: prefetch failed after 2 attempt(s): error: facebook/bart-large-cnn@unpinned: RepositoryNotFoundError")
    assert (tmp_path / "network.log").read_text() == ""


# ---------------------------------------------------------------------------------- the pipeline


def test_pipeline_prefetches_hub_checkpoints_before_the_cells():
    schema = json.loads((ROOT / "tests" / "data" / "buildkite" / "pipeline.schema.json").read_text())
    m = M.load(ROOT / "models.yaml")
    cells = m.cells()
    p = bk.generate(m, cells, bk.Options(hub_cache="/srv/hub"))
    errors = list(jsonschema.Draft7Validator(schema).iter_errors(p))
    assert not errors, errors[0].message
    steps = [s for g in p["steps"] if "group" in g for s in g["steps"]]
    hub_steps = [s for s in steps if any(c.source_kind == "hub" for c in cells if c.id in s["env"]["HARNESS_CELLS"].split())]
    assert hub_steps and len(hub_steps) == len({(c.hub.id, c.configuration) for c in cells if c.source_kind == "hub"})
    for s in steps:
        lines = s["command"].splitlines()
        if s not in hub_steps:
            assert "prefetch" not in s["command"] and "HF_HUB_CACHE" not in s["env"]
            continue
        pre = next(i for i, line in enumerate(lines) if " harness.cli prefetch " in line)
        run = next(i for i, line in enumerate(lines) if " harness.cli run " in line)
        assert pre < run  # the download happens before the cells, outside their timeout and load time
        assert lines[pre].startswith("env HF_HUB_OFFLINE=0 ") and lines[pre].endswith("|| exit $?")
        assert lines[run].startswith("HF_HUB_OFFLINE=1 ")  # the cells never reach the hub
        k = lines[run].split(" -k ")[1].split(" --tier ")[0]
        assert f"-k {k} --tier" in lines[pre]
        assert s["env"]["HF_HUB_CACHE"] == "/srv/hub"
        docker = s["plugins"][0][bk.DOCKER_PLUGIN]
        assert docker["volumes"] == ["/srv/hub:/srv/hub"]  # the agent's cache survives the container
        assert {"exit_status": bk.PREFETCH_FAILED, "limit": 1} in s["retry"]["automatic"]
        assert s["timeout_in_minutes"] * 60 >= bk.PREFETCH_ATTEMPTS * bk.PREFETCH_TIMEOUT_S + 40 * 60
    assert bk.PREFETCH_FAILED == hub.TEMPFAIL
    with pytest.raises(SystemExit):
        bk.main(["--hub-cache"])
    assert bk.main(["--hub-cache", "relative/dir", "--tier", "gpu-full"]) == 2
    yaml.safe_load(bk.to_yaml(p))
