"""Bad checkpoints: ``harness load DIR`` exits 2 with exactly one line ``error: <file or tensor>: <what>``.

One table, by class (issue 11): a traceback before the fix (``traceback``), a hang or unbounded
memory (``hang``), a silent pass (``silent``), the smaller ones (``small``) and what already held
(``held``). Each case copies a fixture, breaks one thing, runs the command in this process (the
imports are shared; a subprocess is not the point here) and asserts the exit status, the exact
line, no traceback, and that nothing was written in the sandbox (the checkpoint is read only). A
case that could hang runs under a deadline.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from faultlib import Tree, assert_one_error, assert_written_only_under, in_process
from safetensors import safe_open
from safetensors.torch import save_file

from harness import fixtures

Q = "model.layers.0.self_attn.q_proj"
UP = "model.layers.0.mlp.up_proj.weight"
SLOW = "(.|.)*(?<!j)$"  # backtracks for ever in Python's re on every module name not ending in j
TRANSFORMERS = __import__("transformers").__version__
DEADLINE_S = 60  # a case that could hang must end well before this


# --------------------------------------------------------------------------------- mutations


def cfg(edit: Callable[[dict], object]):
    """Edit config.json as a dict (a non-None return replaces it)."""
    def apply(d: Path):
        file = d / "config.json"
        data = json.loads(file.read_text())
        out = edit(data)
        file.write_text(json.dumps(data if out is None else out))
    return apply


def qc(**values):
    """Set keys of the quantization config."""
    return cfg(lambda c: c["quantization_config"].update(values))


def groups(**values):
    """Set keys of every compressed-tensors config group."""
    return cfg(lambda c: [g.update(values) for g in c["quantization_config"]["config_groups"].values()] and None)


def fqn(**entries):
    """Add FqnToConfig entries (both spellings transformers writes)."""
    def edit(c):
        data = c["quantization_config"]["quant_type"]["default"]["_data"]
        for key in ("fqn_to_config", "module_fqn_to_config"):
            data[key].update(entries)
    return cfg(edit)


def raw_config(data: bytes):
    return lambda d: (d / "config.json").write_bytes(data)


def replace_with_fifo(name: str):
    def apply(d: Path):
        (d / name).unlink(missing_ok=True)
        os.mkfifo(d / name)
    return apply


def replace_with_dir(name: str):
    def apply(d: Path):
        (d / name).unlink(missing_ok=True)
        (d / name).mkdir()
    return apply


def tensors(edit: Callable[[dict], None]):
    """Edit the tensors of model.safetensors (its metadata kept)."""
    def apply(d: Path):
        file = d / "model.safetensors"
        with safe_open(file, "pt") as f:
            ts = {k: f.get_tensor(k) for k in f.keys()}
            meta = f.metadata()
        edit(ts)
        save_file(ts, file, meta)
    return apply


def drop(key: str):
    return tensors(lambda ts: ts.pop(key))


def put(key: str, make: Callable[[torch.Tensor], torch.Tensor]):
    def edit(ts):
        ts[key] = make(ts[key])
    return tensors(edit)


def header(edit: Callable[[bytes], bytes]):
    """Rewrite the raw JSON header of model.safetensors; the data is kept."""
    def apply(d: Path):
        file = d / "model.safetensors"
        blob = file.read_bytes()
        n = int.from_bytes(blob[:8], "little")
        new = edit(blob[8:8 + n])
        file.write_bytes(len(new).to_bytes(8, "little") + new + blob[8 + n:])
    return apply


def header_json(edit: Callable[[dict], object]):
    def apply(text: bytes) -> bytes:
        data = json.loads(text)
        out = edit(data)
        return json.dumps(data if out is None else out).encode()
    return header(apply)


def duplicate_key(text: bytes) -> bytes:
    """The header with its last tensor entry written a second time, identical (safetensors keeps
    the last copy and loads without a word)."""
    data = json.loads(text)
    name = next(k for k in reversed(list(data)) if k != "__metadata__")
    return text.rstrip()[:-1] + b"," + json.dumps({name: data[name]})[1:-1].encode() + b"}"


def torchao_meta(weight: str, edit: Callable[[dict], object]):
    """Edit the torchao metadata JSON of one weight in the safetensors __metadata__."""
    def apply(d: Path):
        file = d / "model.safetensors"
        with safe_open(file, "pt") as f:
            ts = {k: f.get_tensor(k) for k in f.keys()}
            meta = dict(f.metadata())
        value = json.loads(meta[weight])
        out = edit(value)
        meta[weight] = json.dumps(value if out is None else out)
        save_file(ts, file, meta)
    return apply


def torchao_meta_raw(weight: str, text: str | None):
    def apply(d: Path):
        file = d / "model.safetensors"
        with safe_open(file, "pt") as f:
            ts = {k: f.get_tensor(k) for k in f.keys()}
            meta = dict(f.metadata())
        if text is None:
            meta.pop(weight)
        else:
            meta[weight] = text
        save_file(ts, file, meta)
    return apply


def quant_state(weight: str, edit: Callable[[dict], object]):
    """Edit the JSON quant state bitsandbytes stores beside a 4-bit weight."""
    def edit_tensors(ts):
        key = f"{weight}.quant_state.bitsandbytes__nf4"
        state = json.loads(bytes(ts[key].numpy()).decode())
        out = edit(state)
        ts[key] = torch.tensor(list(json.dumps(state if out is None else out).encode()), dtype=torch.uint8)
    return tensors(edit_tensors)


def sharded(edit: Callable[[dict], object] | None = None, index_text: bytes | None = None):
    """Split model.safetensors into two shards with an index, then edit the index."""
    def apply(d: Path):
        file = d / "model.safetensors"
        with safe_open(file, "pt") as f:
            ts = {k: f.get_tensor(k) for k in f.keys()}
            meta = f.metadata()
        names = sorted(ts)
        half = len(names) // 2
        parts = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
        weight_map = {}
        for shard, keys in parts.items():
            save_file({k: ts[k] for k in keys}, d / shard, meta)
            weight_map.update({k: shard for k in keys})
        file.unlink()
        index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
        out = edit(index) if edit else None
        (d / "model.safetensors.index.json").write_bytes(
            index_text if index_text is not None else json.dumps(index if out is None else out).encode())
    return apply


def pickled(obj):
    """Replace the safetensors file by a pickle (a legacy .bin)."""
    def apply(d: Path):
        (d / "model.safetensors").unlink()
        with open(d / "pytorch_model.bin", "wb") as f:
            pickle.dump(obj, f)
    return apply


def saved(obj):
    """Replace the safetensors file by ``torch.save(obj)`` (a legacy .bin torch can read)."""
    def apply(d: Path):
        (d / "model.safetensors").unlink()
        torch.save(obj, d / "pytorch_model.bin")
    return apply


class _Exploit:
    """Unpickling this would run a shell command that creates a marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def both(*steps):
    def apply(d: Path):
        for s in steps:
            s(d)
    return apply


# ------------------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    kind: str  # traceback | hang | silent | small | held
    fixture: str
    mutate: Callable[[Path], None]
    line: str  # the expected error line; {d} the checkpoint directory
    argv: tuple[str, ...] = ()  # extra arguments after the directory


CFG = "error: {d}/config.json"
ST = "error: {d}/model.safetensors"
U, B, F8, AO, AOF = "llama-unquantized", "llama-bnb-nf4", "llama-fp8-static-kv", "llama-torchao-int8wo", "llama-torchao-int8wo-skip-fqn"

CASES: dict[str, Case] = {
    # --- config.json: tracebacks before the fix
    "config is a JSON array": Case("traceback", U, raw_config(b"[1, 2]"), f"{CFG}: must be a JSON object (got list)"),
    "config is not UTF-8": Case("traceback", U, raw_config(b'{"a": "\xff"}'), f"{CFG}: is not UTF-8 (byte 0xff at offset 7)"),
    "config is a directory": Case("traceback", U, replace_with_dir("config.json"), f"{CFG}: is a directory, not a regular file"),
    "architectures AutoConfig": Case("traceback", U, cfg(lambda c: c.update(architectures=["AutoConfig"])),
                                     f"{CFG}: architectures[0]: 'AutoConfig' is not a transformers {TRANSFORMERS} model class"),
    "architectures [5]": Case("traceback", U, cfg(lambda c: c.update(architectures=[5])),
                              f"{CFG}: architectures[0]: must be a string (got 5)"),
    "architectures a string": Case("traceback", U, cfg(lambda c: c.update(architectures="LlamaForCausalLM")),
                                   f'{CFG}: architectures: must be a list (got "LlamaForCausalLM")'),
    "architectures empty": Case("traceback", U, cfg(lambda c: c.update(architectures=[])),
                                f"{CFG}: architectures: List should have at least 1 item after validation, not 0 (got list)"),
    "unknown model_type": Case("traceback", U, cfg(lambda c: c.update(model_type="nope")),
                               f"{CFG}: model_type: 'nope' is not a model type transformers {TRANSFORMERS} knows"),
    "model_type missing": Case("traceback", U, cfg(lambda c: c.pop("model_type") and None), f"{CFG}: model_type: required key is missing"),
    "num_attention_heads 0": Case("traceback", U, cfg(lambda c: c.update(num_attention_heads=0)),
                                  f"{CFG}: transformers cannot build LlamaForCausalLM from it: ZeroDivisionError: integer modulo by zero"),
    "hidden_size a string": Case("traceback", U, cfg(lambda c: c.update(hidden_size="x")),
                                 f"{CFG}: transformers cannot build LlamaForCausalLM from it: StrictDataclassFieldValidationError: "
                                 "Validation error for field 'hidden_size': TypeError: Field 'hidden_size' expected int, got str (value: 'x')"),
    "quantization_config a list": Case("traceback", B, cfg(lambda c: c.update(quantization_config=[1])),
                                       f"{CFG}: quantization_config: must be an object (got list)"),
    "quant_method 5": Case("traceback", B, qc(quant_method=5), f"{CFG}: quantization_config.quant_method: must be a string (got 5)"),
    "bnb skip list 5": Case("traceback", B, qc(llm_int8_skip_modules=5),
                            f"{CFG}: quantization_config.llm_int8_skip_modules: must be a list (got 5)"),
    "bnb skip entry 5": Case("traceback", B, qc(llm_int8_skip_modules=[5]),
                             f"{CFG}: quantization_config.llm_int8_skip_modules[0]: must be a string (got 5)"),
    "bnb skip entry invalid regex": Case("traceback", B, qc(llm_int8_skip_modules=["(("]),
                                         f"{CFG}: quantization_config.llm_int8_skip_modules: entry '((': not a valid regular "
                                         "expression for Python (missing ), unterminated subpattern at position 1)"),
    "bnb modules_to_not_convert 5": Case("traceback", B, qc(modules_to_not_convert=5),
                                         f"{CFG}: quantization_config.modules_to_not_convert: must be a list (got 5)"),
    "ct ignore 5": Case("traceback", F8, qc(ignore=5), f"{CFG}: quantization_config.ignore: must be a list (got 5)"),
    "ct ignore entry 5": Case("traceback", F8, qc(ignore=[5]), f"{CFG}: quantization_config.ignore[0]: must be a string (got 5)"),
    "ct ignore invalid regex": Case("traceback", F8, qc(ignore=["re:(("]),
                                    f"{CFG}: quantization_config.ignore: entry 're:((': not a valid regular expression for Python "
                                    "(missing ), unterminated subpattern at position 1)"),
    "ct config_groups a list": Case("traceback", F8, qc(config_groups=[1]),
                                    f"{CFG}: quantization_config.config_groups: must be an object (got list)"),
    "ct targets 5": Case("traceback", F8, groups(targets=5),
                         f"{CFG}: quantization_config.config_groups.group_0.targets: must be a list (got 5)"),
    "ct input_activations a string": Case("traceback", F8, groups(input_activations="x"),
                                          f'{CFG}: quantization_config.config_groups.group_0.input_activations: must be an object (got "x")'),
    "ct num_bits a string": Case("traceback", F8, groups(weights={"num_bits": "8", "type": "float"}),
                                 f'{CFG}: quantization_config.config_groups.group_0.weights.num_bits: must be an integer (got "8")'),
    "torchao modules_to_not_convert 7": Case("traceback", AO, qc(modules_to_not_convert=7),
                                             f"{CFG}: quantization_config.modules_to_not_convert: must be a list (got 7)"),
    "torchao fqn_to_config a list": Case("traceback", AOF, cfg(lambda c: c["quantization_config"]["quant_type"]["default"]["_data"].update(fqn_to_config=[1])),
                                         f"{CFG}: quantization_config.quant_type.default._data.fqn_to_config: must be an object (got list)"),
    "torchao metadata _type a list": Case("traceback", AO, torchao_meta(f"{Q}.weight", lambda m: m.update(_type=["Int8Tensor"])),
                                          f"error: {Q}.weight: torchao metadata._type: must be a string (got list)"),
    "torchao metadata block_size an int": Case("traceback", AO, torchao_meta(f"{Q}.weight", lambda m: m["_data"].update(block_size=128)),
                                               f"error: {Q}.weight: torchao metadata._data.block_size: must be a list (got 128)"),
    "torchao metadata _data a list": Case("traceback", AO, torchao_meta(f"{Q}.weight", lambda m: m.update(_data=[1])),
                                          f"error: {Q}.weight: torchao metadata._data: must be an object (got list)"),
    "torchao metadata a list": Case("traceback", AO, torchao_meta_raw(f"{Q}.weight", "[1]"),
                                    f"error: {Q}.weight: torchao metadata: must be a JSON object (got list)"),
    "index weight_map a list": Case("traceback", U, sharded(lambda i: i.update(weight_map=[1])),
                                    "error: {d}/model.safetensors.index.json: weight_map: must be an object (got list)"),
    "bnb quant state dtype a list": Case("traceback", B, quant_state(UP, lambda s: s.update(dtype=["float32"])),
                                         f"{ST}: quant state of {UP}: dtype: must be 'float32', 'float16' or 'bfloat16' (got list)"),
    "index a list": Case("traceback", U, sharded(index_text=b"[]"),
                         "error: {d}/model.safetensors.index.json: must be a JSON object (got list)"),
    "head_dim 2**30": Case("traceback", U, cfg(lambda c: c.update(head_dim=1 << 30)),
                           f"{CFG}: the model it describes needs a tensor of shape [4294967296, 128] (549755813888 elements), "
                           "more than 4194304 (2x the largest tensor on disk, lm_head.weight [512, 128]); a size in it "
                           "does not fit the checkpoint"),
    "vocab_size 10**12": Case("traceback", U, cfg(lambda c: c.update(vocab_size=10 ** 12)),
                              f"{CFG}: the model it describes needs a tensor of shape [1000000000000, 128] (128000000000000 "
                              "elements), more than 4194304 (2x the largest tensor on disk, lm_head.weight [512, 128]); "
                              "a size in it does not fit the checkpoint"),
    "quantize config skip list 5": Case("traceback", U, lambda d: None,
                                        "error: quantization.llm_int8_skip_modules: must be a list (got 5)",
                                        ("--quantize", '{"quant_method": "bitsandbytes", "load_in_4bit": true, '
                                                       '"bnb_4bit_quant_type": "nf4", "llm_int8_skip_modules": 5}')),
    "quantize config file not UTF-8": Case("traceback", U, lambda d: (d.parent / "q.json").write_bytes(b'{"quant_method": "\xff"}'),
                                           "error: {d}/../q.json: is not UTF-8 (byte 0xff at offset 18)", ("--quantize", "{d}/../q.json")),
    # --- hangs and unbounded memory
    "bnb skip entry backtracks": Case("hang", B, qc(llm_int8_skip_modules=[SLOW]),
                                      f"{CFG}: quantization_config.llm_int8_skip_modules: entry '{SLOW}': matching it against "
                                      f"'{Q}' took longer than 0.25 s (catastrophic backtracking); the owning library would hang on it"),
    "ct ignore entry backtracks": Case("hang", F8, qc(ignore=[f"re:{SLOW}"]),
                                       f"{CFG}: quantization_config.ignore: entry 're:{SLOW}': matching it against '{Q}' took longer "
                                       "than 0.25 s (catastrophic backtracking); the owning library would hang on it"),
    "ct target backtracks": Case("hang", F8, groups(targets=[f"re:{SLOW}"]),
                                 f"{CFG}: quantization_config.config_groups.group_0.targets: entry 're:{SLOW}': matching it against "
                                 f"'{Q}' took longer than 0.25 s (catastrophic backtracking); the owning library would hang on it"),
    "torchao fqn key backtracks": Case("hang", AOF, fqn(**{f"re:{SLOW}": None}),
                                       f"{CFG}: quantization_config.fqn_to_config: entry 're:{SLOW}': matching it against "
                                       f"'{Q}' took longer than 0.25 s (catastrophic backtracking); the owning library would hang on it"),
    "quantize config skip entry backtracks": Case("hang", U, lambda d: None,
                                                  f"error: quantization: quantization_config.llm_int8_skip_modules: entry '{SLOW}': "
                                                  f"matching it against '{Q}' took longer than 0.25 s (catastrophic backtracking); "
                                                  "the owning library would hang on it",
                                                  ("--quantize", json.dumps({"quant_method": "bitsandbytes", "load_in_4bit": True,
                                                                             "bnb_4bit_quant_type": "nf4",
                                                                             "llm_int8_skip_modules": [SLOW]}))),
    "shard is a FIFO": Case("hang", U, replace_with_fifo("model.safetensors"), f"{ST}: is a FIFO, not a regular file"),
    "config is a FIFO": Case("hang", U, replace_with_fifo("config.json"), f"{CFG}: is a FIFO, not a regular file"),
    "index is a FIFO": Case("hang", U, both(sharded(), replace_with_fifo("model.safetensors.index.json")),
                            "error: {d}/model.safetensors.index.json: is a FIFO, not a regular file"),
    "legacy bin is a FIFO": Case("hang", U, both(lambda d: (d / "model.safetensors").unlink(), replace_with_fifo("pytorch_model.bin")),
                                 "error: {d}/pytorch_model.bin: is a FIFO, not a regular file"),
    "num_hidden_layers 1000000": Case("hang", U, cfg(lambda c: c.update(num_hidden_layers=1_000_000)),
                                      f"{CFG}: the model it describes has more than 1468 modules, 4 per tensor on disk; a layer count "
                                      "in it does not fit the checkpoint"),
    "intermediate_size 10**9": Case("hang", U, cfg(lambda c: c.update(intermediate_size=10 ** 9)),
                                    f"{CFG}: the model it describes needs a tensor of shape [1000000000, 128] (128000000000 elements), "
                                    "more than 4194304 (2x the largest tensor on disk, lm_head.weight [512, 128]); a size "
                                    "in it does not fit the checkpoint"),
    # --- silent passes
    "num_hidden_layers -1": Case("silent", U, cfg(lambda c: c.update(num_hidden_layers=-1)),
                                 f"{CFG}: the model it describes has 0 entries in model.layers, but the checkpoint holds 12 "
                                 "(model.layers.0 to model.layers.11)"),
    "num_hidden_layers 2": Case("silent", U, cfg(lambda c: c.update(num_hidden_layers=2)),
                                f"{CFG}: the model it describes has 2 entries in model.layers, but the checkpoint holds 12 "
                                "(model.layers.0 to model.layers.11)"),
    "header duplicate key": Case("silent", U, header(duplicate_key),
                                 f"{ST}: the header names the tensor 'model.norm.weight' twice (safetensors would silently keep the last one)"),
    "index names a tensor no shard holds": Case("silent", U, sharded(lambda i: i["weight_map"].update({"model.ghost.weight": "model-00001-of-00002.safetensors"})),
                                                "error: {d}/model.safetensors.index.json: weight_map names 'model.ghost.weight' in "
                                                "model-00001-of-00002.safetensors, but no file holds it"),
    "index names the wrong shard": Case("silent", U, sharded(lambda i: i["weight_map"].update({"model.norm.weight": "model-00001-of-00002.safetensors"})),
                                        "error: {d}/model.safetensors.index.json: weight_map names 'model.norm.weight' in "
                                        "model-00001-of-00002.safetensors, but it is in model-00002-of-00002.safetensors"),
    "torchao unknown config class": Case("silent", AO, cfg(lambda c: c["quantization_config"]["quant_type"]["default"].update(_type="NoSuchConfig")),
                                         f"{CFG}: quantization_config.quant_type.default._type: 'NoSuchConfig' is not a torchao config "
                                         "class (torchao deserializes only AOBaseConfig subclasses of its own modules)"),
    "torchao config os.system": Case("silent", AO, cfg(lambda c: c["quantization_config"]["quant_type"]["default"].update(_type="os.system")),
                                     f"{CFG}: quantization_config.quant_type.default._type: 'os.system' is not a torchao config class "
                                     "(torchao deserializes only AOBaseConfig subclasses of its own modules)"),
    "torchao nested unknown class": Case("silent", AO, cfg(lambda c: c["quantization_config"]["quant_type"]["default"]["_data"]["granularity"].update(_type="subprocess.Popen")),
                                         f"{CFG}: quantization_config.quant_type.default._data.granularity._type: \"subprocess.Popen\" is "
                                         "not a class torchao deserializes"),
    "torchao include_input_output_embeddings a string": Case("silent", AO, qc(include_input_output_embeddings="no"),
                                                             f"{CFG}: quantization_config.include_input_output_embeddings: "
                                                             'must be a boolean (got "no")'),
    "torchao quant_type 5": Case("silent", AO, qc(quant_type=5), f"{CFG}: quantization_config.quant_type: must be an object (got 5)"),
    "ct kv_cache_scheme a string": Case("silent", F8, qc(kv_cache_scheme="x"),
                                        f'{CFG}: quantization_config.kv_cache_scheme: must be an object (got "x")'),
    "fp8 activation_scheme unknown": Case("silent", F8, cfg(lambda c: c.update(quantization_config={"quant_method": "fp8", "activation_scheme": "sometimes"})),
                                          f"{CFG}: quantization_config.activation_scheme: must be 'static' or 'dynamic' (got \"sometimes\")"),
    "fp8 ignored_layers 5": Case("silent", F8, cfg(lambda c: c.update(quantization_config={"quant_method": "fp8", "ignored_layers": 5})),
                                 f"{CFG}: quantization_config.ignored_layers: must be a list (got 5)"),
    "bnb quant type int4": Case("silent", B, qc(bnb_4bit_quant_type="int4"),
                                f"{CFG}: quantization_config.bnb_4bit_quant_type: must be 'nf4' or 'fp4' (got \"int4\")"),
    "bnb compute dtype 32": Case("silent", B, qc(bnb_4bit_compute_dtype=32),
                                 f"{CFG}: quantization_config.bnb_4bit_compute_dtype: must be 'float32', 'float16', "
                                 "'bfloat16', 'float64', 'float', 'half' or 'double' (got 32)"),
    # --- smaller ones
    "static FP8 without input_scale": Case("small", F8, drop(f"{Q}.input_scale"),
                                           f"error: {Q}.input_scale: missing tensor: the static activation scheme needs an input_scale"),
    "pickle refused with torch's reason": Case("small", U, pickled({"model.norm.weight": _Exploit("/nonexistent/pwned")}),
                                               "error: {d}/pytorch_model.bin: refused to unpickle: Unsupported operand 149"),
    "torch.save'd exploit refused with torch's reason": Case("small", U, saved({"model.norm.weight": _Exploit("/nonexistent/pwned")}),
                                                             "error: {d}/pytorch_model.bin: refused to unpickle: Trying to load "
                                                             "unsupported GLOBAL posix.system whose module posix is blocked."),
    "bnb quant state blocksize a string": Case("small", B, quant_state(UP, lambda s: s.update(blocksize="64")),
                                               f"{ST}: quant state of {UP}: blocksize: must be 32, 64, 128, 256, 512, 1024, "
                                               '2048 or 4096 (got "64")'),
    "bnb quant state shape an object": Case("small", B, quant_state(UP, lambda s: s.update(shape={"out": 256})),
                                            f"{ST}: quant state of {UP}: shape: must be a list (got dict)"),
    "bnb quant state a list": Case("small", B, quant_state(UP, lambda s: [s]),
                                   f"{ST}: quant state of {UP}: must be a JSON object (got list)"),
    "safetensors metadata value a list": Case("small", U, header_json(lambda h: h["__metadata__"].update(format=["pt"])),
                                              f"{ST}: __metadata__.format: must be a string (got list)"),
    "safetensors shape a string": Case("small", U, header_json(lambda h: h["model.norm.weight"].update(shape="128")),
                                       f'{ST}: model.norm.weight.shape: must be a list (got "128")'),
    # --- what already held (kept)
    "config missing": Case("held", U, lambda d: (d / "config.json").unlink(), f"{CFG}: missing"),
    "config invalid JSON": Case("held", U, raw_config(b"{"), f"{CFG}: invalid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
    "unknown quant_method": Case("held", B, qc(quant_method="hqq-v9"),
                                 f"{CFG}: quantization_config.quant_method: unknown quant_method 'hqq-v9' (known: bitsandbytes, "
                                 "compressed-tensors, fp8, torchao)"),
    "num_hidden_layers 13": Case("held", U, cfg(lambda c: c.update(num_hidden_layers=13)),
                                 "error: model.layers.12.self_attn.q_proj.weight: missing tensor"),
    "not a directory": Case("held", U, lambda d: None, "error: {d}: not a checkpoint directory", ("SUBPATH",)),
    "truncated safetensors": Case("held", U, lambda d: os.truncate(d / "model.safetensors", (d / "model.safetensors").stat().st_size // 2),
                                  f"{ST}: not a readable safetensors file: Error while deserializing header: incomplete metadata, file not fully covered"),
    "empty safetensors": Case("held", U, lambda d: os.truncate(d / "model.safetensors", 0),
                              f"{ST}: not a readable safetensors file: 0 bytes, shorter than its 8-byte header length"),
    "header longer than the file": Case("held", U, lambda d: (d / "model.safetensors").write_bytes((1 << 40).to_bytes(8, "little") + b"{}"),
                                        f"{ST}: not a readable safetensors file: header length 1099511627776 exceeds the file (10 bytes) "
                                        "or safetensors' limit of 104857600"),
    "header not JSON": Case("held", U, header(lambda t: b"{" + b" " * 10),
                            f"{ST}: not a readable safetensors file: header is not JSON: Expecting property name enclosed in double quotes: "
                            "line 1 column 12 (char 11)"),
    "header not UTF-8": Case("held", U, header(lambda t: b'{"\xff": 1}'),
                             f"{ST}: not a readable safetensors file: its header is not UTF-8 (byte 0xff at offset 2)"),
    "header a JSON array": Case("held", U, header(lambda t: b"[]"), f"{ST}: not a readable safetensors file: header is not a JSON object"),
    "header unknown dtype": Case("held", U, header(lambda t: b'{"model.norm.weight": {"dtype": "F7", "shape": [128], "data_offsets": [0, 512]}}'),
                                 f"{ST}: not a readable safetensors file: Error while deserializing header: invalid JSON in header: unknown variant `F7`, "
                                 "expected one of `BOOL`, `F4`, `F6_E2M3`, `F6_E3M2`, `U8`, `I8`, `F8_E5M2`, `F8_E4M3`, `F8_E8M0`, "
                                 "`F8_E4M3FNUZ`, `F8_E5M2FNUZ`, `I16`, `U16`, `F16`, `BF16`, `I32`, `U32`, `F32`, `C64`, `F64`, `I64`, `U64` "
                                 "at line 1 column 80"),
    "shard is a directory": Case("held", U, replace_with_dir("model.safetensors"), f"{ST}: is a directory, not a regular file"),
    "index names a missing shard": Case("held", U, sharded(lambda i: i["weight_map"].update({"model.norm.weight": "model-00009.safetensors"})),
                                        "error: {d}/model-00009.safetensors: shard named in the index is missing"),
    "index path traversal": Case("held", U, sharded(lambda i: i["weight_map"].update({"model.norm.weight": "../x.safetensors"})),
                                 "error: {d}/model.safetensors.index.json: weight_map: shard '../x.safetensors' is not a file name in "
                                 "the checkpoint directory"),
    "index not JSON": Case("held", U, sharded(index_text=b"{"),
                           "error: {d}/model.safetensors.index.json: invalid JSON: Expecting property name enclosed in double quotes: "
                           "line 1 column 2 (char 1)"),
    "index weight_map entry a list": Case("held", U, sharded(lambda i: i["weight_map"].update({"model.norm.weight": ["x"]})),
                                          "error: {d}/model.safetensors.index.json: weight_map.model.norm.weight: must be "
                                          "a string (got list)"),
    "missing quant_state": Case("held", B, drop(f"{Q}.weight.quant_state.bitsandbytes__nf4"),
                                f"error: {Q}.weight.quant_state.bitsandbytes__nf4: missing tensor (bitsandbytes quant state)"),
    "missing absmax": Case("held", B, drop(f"{Q}.weight.absmax"), f"error: {Q}.weight.absmax: missing tensor (absmax)"),
    "missing weight_scale": Case("held", F8, drop(f"{Q}.weight_scale"), f"error: {Q}.weight_scale: missing tensor (weight_scale)"),
    "NaN scale": Case("held", F8, put(f"{Q}.weight_scale", lambda t: torch.full_like(t, float("nan"))),
                      f"error: {Q}.weight_scale: NaN or infinite scale"),
    "zero scale": Case("held", F8, put(f"{Q}.weight_scale", torch.zeros_like), f"error: {Q}.weight_scale: zero or negative scale"),
    "zero torchao scale": Case("held", AO, put(f"{Q}._weight_scale", torch.zeros_like), f"error: {Q}._weight_scale: zero or negative scale"),
    "torchao metadata missing": Case("held", AO, torchao_meta_raw(f"{Q}.weight", None),
                                     f"error: {Q}.weight: missing torchao metadata: no entry for it in the safetensors __metadata__"),
    "torchao metadata not JSON": Case("held", AO, torchao_meta_raw(f"{Q}.weight", "{"),
                                      f"error: {Q}.weight: torchao metadata JSON unreadable: Expecting property name enclosed in double "
                                      "quotes: line 1 column 2 (char 1)"),
    "shape mismatch": Case("held", U, put(f"{Q}.weight", lambda t: t[:-1]),
                           f"error: {Q}.weight: decodes to shape (127, 128), the model expects (128, 128)"),
    "shape mismatch, norm": Case("held", U, put("model.norm.weight", lambda t: t[:-1]),
                                 "error: model.norm.weight: shape (127,), the model expects (128,)"),
    "missing tensor": Case("held", U, drop("model.norm.weight"), "error: model.norm.weight: missing tensor"),
    "pickle that is not a state dict": Case("held", U, saved([1, 2]), "error: {d}/pytorch_model.bin: holds a list, not a state dict"),
}


def _deadline(signum, frame):
    raise AssertionError(f"the case ran past {DEADLINE_S} s: a hang")


@pytest.mark.parametrize("name", CASES, ids=lambda n: f"{CASES[n].kind}: {n}")
def test_bad_checkpoint(name, tmp_path, monkeypatch):
    case = CASES[name]
    sandbox = tmp_path / "sandbox"
    sandbox.mkdir()
    d = sandbox / "ckpt"
    shutil.copytree(fixtures.build(case.fixture), d)
    case.mutate(d)
    monkeypatch.chdir(sandbox)
    tree = Tree(sandbox)
    argv = ["load", str(d), *(a.replace("{d}", str(d)) for a in case.argv)]
    if case.argv[:1] == ("SUBPATH",):  # a file where the directory should be
        argv = ["load", str(d / "config.json")]
        d = d / "config.json"
    previous = signal.signal(signal.SIGALRM, _deadline)
    signal.alarm(DEADLINE_S)
    t0 = time.monotonic()
    try:
        outcome = in_process(argv)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert_one_error(outcome, 2, case.line.replace("{d}", str(d)))
    assert outcome.out == ""
    assert_written_only_under(tree)  # the checkpoint is only read
    if case.kind == "hang":
        assert time.monotonic() - t0 < 20, "bounded, but too slow"


def test_cases_cover_every_class():
    kinds = {}
    for c in CASES.values():
        kinds[c.kind] = kinds.get(c.kind, 0) + 1
    assert set(kinds) == {"traceback", "hang", "silent", "small", "held"}, kinds
    assert len(CASES) >= 60


def test_a_refused_pickle_never_runs(tmp_path, monkeypatch):
    d = tmp_path / "ckpt"
    shutil.copytree(fixtures.build(U), d)
    marker = tmp_path / "pwned"
    pickled({"model.norm.weight": _Exploit(marker)})(d)
    outcome = in_process(["load", d])
    assert outcome.code == 2 and not marker.exists()
