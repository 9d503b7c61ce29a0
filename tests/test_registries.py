"""The engine and format registries (harness.registry) are the one place an engine or a format is
declared: a dummy entry of each reaches every table and function that needs to know about it.

The consumers derive their tables when they are imported, so the dummy entries are added in a
fresh interpreter before anything but the registry is imported (a monkeypatch of an already
imported registry would not reach them, and reloading the consumers would duplicate their
classes for the rest of the session).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# The dummy format's module and library, and the dummy engine: each records being used.
DUMMY_MODULE = '''
import torch

from harness.quant import Decoded

CALLS = []


def owns(src, weight):
    return f"{weight}_dummy" in src.keys


def decode(src, weight):
    return Decoded("dummy-int3", src.get(f"{weight}_dummy").float())


def validate(qc, file, prefix):
    CALLS.append(("validate", file, prefix))


def warm():
    CALLS.append("warm")


def produce(spec, out, scratch):
    CALLS.append(("produce", spec.name))
    return {"model": None, "labels": {}, "margins": {}}


class DummyEngine:
    pass
'''

CHECKS = '''
import json
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import harness.registry as r

method = r.MethodSpec("dummy-method", "dummy_format:validate", aliases=("dummy_method",), library="dummy_lib",
                      distribution="dummy-dist", warm_imports=("dummy_format",), warm="dummy_format:warm",
                      load_time_imports=("dummy_lib",), producer="dummy_format:produce")
r.FORMATS["dummy"] = r.FormatSpec(
    "dummy", "dummy_format", ("dummy-int3",), (method,),
    presets={"online-dummy": {"quant_method": "dummy-method", "bits": 3}},
    engine_sources={"vllm": ("vllm/model_executor/layers/quantization/dummy.py",),
                    "transformers": ("src/transformers/quantizers/quantizer_dummy.py",)})
r.ENGINES["dummy"] = r.EngineSpec("dummy", "dummy_format:DummyEngine", "dmy", fuses_shards=False,
                                  distributions=("dummy-engine",), preload="dummy_format", kernel_rtol=0.25,
                                  libraries=("dummy_engine_lib",))
r.ENGINE_NAMES = tuple(r.ENGINES)  # the registry's own list of names, derived like it

import torch

import dummy_format
from harness import changes, liblog, matrix, records, supervise
from harness.engines import base, reference, transformers
from harness.fixtures import cache, producers
from harness.fixtures.recipes import FixtureSpec
from harness.quant import LABELS, formats, schema
from harness.reference import online
from harness.report import html
from harness.traces import diff

seen = {}


def check(name, fn):
    """Whether fn() holds; a consumer that raises on the dummy has not heard of it either."""
    try:
        seen[name] = bool(fn())
    except Exception as e:
        seen[name] = False
        print(f"{name}: {type(e).__name__}: {e}", file=sys.stderr)


class Src:
    keys = {"m.weight_dummy"}

    def get(self, name):
        return torch.ones(2, 2)


def warmed():
    reference.warm_imports(SimpleNamespace(config={}, quantization_config={"quant_method": "dummy-method"}))
    return "warm" in dummy_format.CALLS


def produced():
    with tempfile.TemporaryDirectory() as tmp:
        spec = FixtureSpec(name="llama-dummy", model="llama", scheme="dummy", description="", producer="dummy-method")
        (Path(tmp) / "out").mkdir()
        producers.produce(spec, Path(tmp) / "out", Path(tmp))
    return ("produce", "llama-dummy") in dummy_format.CALLS


def rule(rules, path):
    return changes._apply(rules, path, ("", None))[0]


PRESET = {"quant_method": "dummy-method", "bits": 3}
check("labels", lambda: "dummy-int3" in LABELS)
check("formats", lambda: "dummy" in dict(formats.FORMATS))
check("owner", lambda: formats.owner(Src(), "m.weight") == "dummy")
check("decode", lambda: formats.decode_weight(Src(), "m.weight").label == "dummy-int3")
check("known_methods", lambda: "dummy-method" in schema.KNOWN_METHODS)
check("aliases", lambda: schema.ALIASES.get("dummy_method") == "dummy-method")
check("schema", lambda: schema.quantization_config({"quant_method": "Dummy_Method"}, "config.json") == "dummy-method"
      and ("validate", "config.json", "quantization_config") in dummy_format.CALLS)
check("quant_method", lambda: formats.quant_method({"quantization_config": {"quant_method": "dummy_method"}})
      == "dummy-method")
check("presets", lambda: online.PRESETS.get("online-dummy") == PRESET)
check("read_config", lambda: online.read_config("online-dummy") == PRESET)
check("quant_libraries", lambda: reference.QUANT_LIBRARIES.get("dummy-method") == ("dummy_format",))
check("warm_imports", warmed)
check("load_time_imports", lambda: transformers.LOAD_TIME_IMPORTS.get("dummy-method") == ("dummy_lib",))
check("liblog", lambda: "dummy_lib" in liblog.LIBRARIES)
check("versioned", lambda: "dummy-dist" in cache.VERSIONED)
check("producer", produced)
check("project_rule", lambda: rule(changes.PROJECT_RULES, "dummy_format.py") == "dummy schemes")
# paths that the engines' catch-all rules would take were the format's not asked first
check("engine_rules", lambda: rule(changes.ENGINE_RULES["vllm"], "vllm/model_executor/layers/quantization/dummy.py")
      == rule(changes.ENGINE_RULES["transformers"], "src/transformers/quantizers/quantizer_dummy.py") == "dummy schemes")

check("engine_matrix", lambda: "dummy" in matrix.ENGINES)
check("engine_records", lambda: records.EngineInfo(name="dummy").name == "dummy")
check("engine_models_yaml", lambda: matrix.Environment(engines={"dummy": "1"}).engines == {"dummy": "1"})
check("engine_html", lambda: "dummy" in html.ENGINE_NAMES)
check("engine_rule", lambda: rule(changes.PROJECT_RULES, "harness/engines/dummy.py") == "dummy cells")
check("engine_class", lambda: base.engine_class("dummy") is dummy_format.DummyEngine)
check("engine_preload", lambda: supervise.preload_for("dummy") == "dummy_format")
check("engine_fuses", lambda: r.fuses_shards("dummy") is False)
check("engine_kernel_rtol", lambda: diff.kernel_rtol("dummy") == 0.25)
check("engine_liblog", lambda: "dummy_engine_lib" in liblog.LIBRARIES)
print("SEEN " + json.dumps(seen))
'''


@pytest.mark.slow("a fresh interpreter importing every registry consumer (torch, engines) with dummy entries")
def test_a_dummy_format_and_engine_reach_every_consumer(tmp_path):
    (tmp_path / "dummy_format.py").write_text(DUMMY_MODULE)
    (tmp_path / "dummy_lib.py").write_text("")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path)]),
           "HARNESS_ISOLATION": "fork", "HARNESS_LOG": str(tmp_path / "libraries.log")}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(CHECKS)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.startswith("SEEN ")]
    assert out.returncode == 0 and lines, out.stderr[-4000:]
    seen = json.loads(lines[-1].removeprefix("SEEN "))
    missed = sorted(name for name, ok in seen.items() if not ok)
    assert not missed, f"consumers that do not derive from harness.registry: {missed}\n{out.stderr[-4000:]}"


def test_the_registry_is_a_leaf():
    """Standard library only: importing it imports no engine, no format, no torch."""
    out = subprocess.run([sys.executable, "-c", "import sys, harness.registry; "
                          "print(sorted(m for m in sys.modules if m.startswith(('harness.', 'torch'))))"],
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['harness.registry']"
