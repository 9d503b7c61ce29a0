"""Bad input gets one clear line naming the file or tensor, from the API and from `harness load`."""
import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from harness import fixtures, reference
from harness.errors import CheckpointError

Q = "model.layers.0.self_attn.q_proj"


def _copy(name: str, tmp_path):
    out = tmp_path / name
    shutil.copytree(fixtures.build(name), out)
    return out


def _rewrite(path, edit):
    """Apply `edit` to the checkpoint's tensor dict and write it back."""
    file = path / "model.safetensors"
    with safe_open(file, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = f.metadata()
    edit(tensors)
    save_file(tensors, file, metadata)


def _drop(key):
    return lambda tensors: tensors.pop(key)


def _set(key, value):
    def edit(tensors):
        tensors[key] = value(tensors[key])
    return edit


def _config(path, edit):
    file = path / "config.json"
    config = json.loads(file.read_text())
    edit(config)
    file.write_text(json.dumps(config))


CASES = {
    "missing quant_state": ("llama-bnb-nf4", _drop(f"{Q}.weight.quant_state.bitsandbytes__nf4"),
                            f"{Q}.weight.quant_state.bitsandbytes__nf4"),
    "missing absmax": ("llama-bnb-nf4", _drop(f"{Q}.weight.absmax"), f"{Q}.weight.absmax"),
    "missing weight_scale": ("llama-fp8-static-kv", _drop(f"{Q}.weight_scale"), f"{Q}.weight_scale"),
    "NaN scale": ("llama-fp8-static-kv", _set(f"{Q}.weight_scale", lambda t: torch.full_like(t, float("nan"))),
                  f"{Q}.weight_scale"),
    "zero scale": ("llama-fp8-static-kv", _set(f"{Q}.weight_scale", torch.zeros_like), f"{Q}.weight_scale"),
    "zero torchao scale": ("llama-torchao-int8wo", _set(f"{Q}._weight_scale", torch.zeros_like), f"{Q}._weight_scale"),
    "shape mismatch": ("llama-unquantized", _set(f"{Q}.weight", lambda t: t[:-1]), f"{Q}.weight"),
    "shape mismatch, norm": ("llama-unquantized", _set("model.norm.weight", lambda t: t[:-1]), "model.norm.weight"),
    "missing tensor": ("llama-unquantized", _drop("model.norm.weight"), "model.norm.weight"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_tensor_is_named(case, tmp_path):
    name, edit, where = CASES[case]
    path = _copy(name, tmp_path)
    _rewrite(path, edit)
    with pytest.raises(CheckpointError) as raised:
        reference.load(path)
    assert raised.value.where == where, str(raised.value)


def test_truncated_safetensors(tmp_path):
    path = _copy("llama-bnb-nf4", tmp_path)
    file = path / "model.safetensors"
    os.truncate(file, file.stat().st_size // 2)
    with pytest.raises(CheckpointError) as raised:
        reference.load(path)
    assert raised.value.where.endswith("model.safetensors")


def test_unknown_quant_method(tmp_path):
    path = _copy("llama-bnb-nf4", tmp_path)
    _config(path, lambda c: c["quantization_config"].update(quant_method="hqq-v9"))
    with pytest.raises(CheckpointError, match="unknown quant_method 'hqq-v9'") as raised:
        reference.load(path)
    assert raised.value.where == str(path / "config.json")


class _Exploit:
    """Unpickling this would run a shell command that creates a marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_disallowed_pickle_is_refused_never_executed(tmp_path):
    path = _copy("llama-unquantized", tmp_path)
    (path / "model.safetensors").unlink()
    marker = tmp_path / "pwned"
    with open(path / "pytorch_model.bin", "wb") as f:
        pickle.dump({"model.norm.weight": _Exploit(marker)}, f)
    with pytest.raises(CheckpointError, match="refused to unpickle"):
        reference.load(path)
    assert not marker.exists()


def test_cli_prints_one_line_and_exits_2(tmp_path):
    path = _copy("llama-fp8-static-kv", tmp_path)
    _rewrite(path, _drop(f"{Q}.weight_scale"))
    run = subprocess.run([sys.executable, "-m", "harness.cli", "load", str(path)], capture_output=True, text=True)
    assert run.returncode == 2
    assert run.stdout == ""
    assert "Traceback" not in run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and lines[0].startswith(f"error: {Q}.weight_scale: missing tensor"), run.stderr[-2000:]
