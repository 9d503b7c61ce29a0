"""Engines from other packages (harness.registry, entry-point group ``harness.engines``).

A small engine package (tests/plugins/harness_reference_plugin: the reference loader under the name
``reference-plugin``) is pip-installed into a temporary directory, never into the venv, and one
cpu-tiny cell runs through it in a ``harness run`` that has that directory on its PYTHONPATH:
nothing under harness/ names it. Two providers of one engine name are one error naming both; an
unknown engine name, wherever it is looked up, is one line listing the registered engines.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from harness import matrix as M
from harness import records as R
from harness import registry
from harness.engines import base

REPO = Path(__file__).resolve().parent.parent
PLUGIN = REPO / "tests" / "plugins" / "harness_reference_plugin"
ENGINE = "reference-plugin"
PROVIDER = f"harness-reference-plugin 0.1.0 (entry point harness.engines: {ENGINE} = harness_reference_plugin:SPEC)"

MATRIX = f"""
version: 1
environments:
  plugin:
    engines: {{reference: "0.1.0", {ENGINE}: "0.1.0"}}
defaults:
  max_tokens: 4
  top_k: 3
  timeout_s: 300
  bounds:
    unquantized: {{logprob: 1.0e-4, topk: 1.0e-4, load_time: 1.5}}
models:
  llama:
    arch: LlamaForCausalLM
    fixture: llama
    prompts: fixture
    tier: cpu-tiny
    engines: {{reference: plugin, {ENGINE}: plugin}}
    schemes:
      unquantized:
"""


def python(args: list[str], *path: Path, cwd: Path) -> subprocess.CompletedProcess:
    """A fresh interpreter with ``path`` (then the repo) on its PYTHONPATH."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (*path, REPO))), "OMP_NUM_THREADS": "1",
           "HARNESS_LOG": str(cwd / "libraries.log")}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The plugin, pip-installed (offline, from a copy: a build writes beside its sources) into a
    directory of its own."""
    tmp = tmp_path_factory.mktemp("plugin")
    shutil.copytree(PLUGIN, tmp / "src", ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                          "--quiet", "--target", str(tmp / "site"), str(tmp / "src")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return tmp / "site"


def fake_distribution(root: Path, engine: str) -> Path:
    """A distribution ``harness-dup`` 0.1 as importlib.metadata finds it on sys.path: its .dist-info,
    with one ``harness.engines`` entry point, and the module that entry point names."""
    info = root / "harness_dup-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: harness-dup\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[harness.engines]\n{engine} = dup_engine:SPEC\n")
    (root / "dup_engine.py").write_text("from harness.registry import EngineSpec\n\n"
                                        f"SPEC = EngineSpec({engine!r}, 'dup_engine:Engine', 'dup', fuses_shards=True)\n")
    return root


@pytest.mark.slow("a harness run subprocess of reference and plugin-engine cells, with engine children")
def test_a_cell_runs_through_an_engine_from_an_installed_package(site, tmp_path):
    out = python(["-c", "import harness.registry as r; print(r.ENGINE_NAMES[-1]); print(r.PROVIDERS[r.ENGINE_NAMES[-1]])"],
                 site, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.splitlines() == [ENGINE, PROVIDER], out.stderr
    (tmp_path / "models.yaml").write_text(MATRIX)
    run = python(["-m", "harness.cli", "run", "--matrix", "models.yaml", "--baselines", "b", "--results", "r",
                  "--engine", f"reference,{ENGINE}", "--update-baselines", "-j", "1"], site, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"pass             llama.unquantized.{ENGINE}" in run.stdout
    record = json.loads((tmp_path / "r" / f"llama.unquantized.{ENGINE}.json").read_text())
    assert (record["engine"], record["status"], record["verdict"]) == (ENGINE, "ok", "pass")
    assert record["engine_info"]["name"] == ENGINE and record["engine_info"]["version"] == "0.1.0"
    assert record["sequences"] and all(s["scored"]["logprobs"] for s in record["sequences"])
    # what it computed is the reference loader's: the same scored tokens, the same logprobs
    checks = {(c["kind"], c["against"]): c for c in record["checks"]}
    assert checks[("teacher-forced", "reference")]["ok"]
    assert checks[("teacher-forced", "reference")]["data"]["max_abs_delta"] == 0.0
    assert (tmp_path / "b" / "cpu-tiny" / f"llama.unquantized.{ENGINE}.json").is_file()
    # where the package is not installed, its records name an engine that is not registered
    with pytest.raises(R.RecordError) as e:
        R.load(tmp_path / "r" / f"llama.unquantized.{ENGINE}.json")
    assert str(e.value).endswith(f": engine: {registry.unknown_engine(ENGINE)}") and "\n" not in str(e.value)


DUP = "harness-dup 0.1 (entry point harness.engines: {} = dup_engine:SPEC)"


# the built-in engines are registered first, then the entry points by name and value
@pytest.mark.parametrize("name, with_plugin, providers", [
    ("reference", False, (registry.BUILT_IN, DUP.format("reference"))),
    (ENGINE, True, (DUP.format(ENGINE), PROVIDER)),
])
def test_one_name_registered_twice_is_one_error_naming_both_providers(site, tmp_path, name, with_plugin, providers):
    dup = fake_distribution(tmp_path / "dup", name)
    out = python(["-c", "import harness.registry"], *((site,) if with_plugin else ()), dup, cwd=tmp_path)
    assert out.returncode == 1, out.stderr
    assert out.stderr.splitlines()[-1] == (f"harness.registry.RegistryError: engine {name!r} is registered twice: "
                                           f"by {providers[0]} and by {providers[1]}; uninstall one of them"), out.stderr


def test_an_entry_point_must_give_an_engine_spec_of_its_own_name(tmp_path, monkeypatch):
    (tmp_path / "bad_engines.py").write_text(textwrap.dedent("""
        from harness.registry import EngineSpec

        def spec():
            return EngineSpec("made", "bad_engines:Engine", "made", fuses_shards=False)

        OTHER = EngineSpec("other", "bad_engines:Engine", "oth", fuses_shards=False)
        DOTTED = EngineSpec("a.b", "bad_engines:Engine", "ab", fuses_shards=False)
        NOT_A_SPEC = {"name": "x"}
        """))
    monkeypatch.syspath_prepend(str(tmp_path))

    def ep(name, value):
        return EntryPoint(name, value, registry.ENTRY_POINT_GROUP)

    engines, providers = registry.discover([ep("made", "bad_engines:spec")])  # a function returning one
    assert list(engines) == [*(s.name for s in registry.BUILT_IN_ENGINES), "made"]
    assert providers["made"] == "a package (entry point harness.engines: made = bad_engines:spec)"
    for entry, problem in [
        (ep("renamed", "bad_engines:OTHER"), "names engine 'other'; the entry point's name must be the engine's"),
        (ep("a.b", "bad_engines:DOTTED"), "engine name 'a.b' is not a valid name"),
        (ep("x", "bad_engines:NOT_A_SPEC"), "gives a dict, not a harness.registry.EngineSpec"),
        (ep("gone", "no_such_module:SPEC"), "cannot be loaded: ModuleNotFoundError: No module named 'no_such_module'"),
    ]:
        with pytest.raises(registry.RegistryError) as e:
            registry.discover([entry])
        assert str(e.value).startswith(f"a package (entry point harness.engines: {entry.name} = {entry.value}): ")
        assert problem in str(e.value) and "\n" not in str(e.value)


def test_an_unknown_engine_is_one_line_listing_the_registered_ones():
    choices = f"(registered: {', '.join(registry.ENGINES)})"
    assert registry.unknown_engine("nope") == f"unknown engine 'nope' {choices}"
    with pytest.raises(registry.UnknownEngine, match=rf"^unknown engine 'nope' \(registered: reference, "):
        registry.engine("nope")
    with pytest.raises(base.EngineUnavailable) as e:
        base.engine_class("nope")
    assert str(e.value).endswith(choices)
    # models.yaml naming an engine whose package is not installed here, in an environment, in a model
    with pytest.raises(M.MatrixError) as e:
        M.loads(MATRIX)
    assert str(e.value) == f"models.yaml: environments.plugin.engines.{ENGINE}: unknown engine '{ENGINE}' {choices}"
    with pytest.raises(M.MatrixError) as e:
        M.loads(MATRIX.replace(f"{ENGINE}: \"0.1.0\"", "transformers: \"5.19.0\""))
    assert str(e.value) == f"models.yaml: models.llama.engines.{ENGINE}: unknown engine '{ENGINE}' {choices}"
    with pytest.raises(M.MatrixError, match=r"--engine: unknown engine 'nope' \(known: reference, "):
        M.loads(MATRIX.replace(ENGINE, "transformers")).cells(engines="reference,nope")
    with pytest.raises(ValueError, match=rf"unknown engine 'nope' \(registered: reference, "):
        R.EngineInfo(name="nope")
