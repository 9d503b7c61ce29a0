"""Fuzzing of what a user hands the harness: every JSON file it reads (config.json with each
library's quantization config, the bitsandbytes quant state, the safetensors header and its
metadata, the index, torchao's tensor metadata, result records, logprob and accuracy baselines)
and models.yaml.

Two kinds of test:

- every field, every JSON type (``test_every_field_of_*``): each field of a real file set to each
  of ``faultlib.EVERY_JSON_TYPE`` and each key deleted, at the function that reads the file (for a
  checkpoint, which then decodes what it read). Exhaustive and deterministic: 7,537 calls.
- hypothesis properties (``test_any_*``): random mutations (values drawn from every JSON type as
  well), and for checkpoints and models.yaml the whole command in this process.

The property: the command loads, or exits 2 with exactly one ``error:`` line (a reading function:
returns, or raises its one-line error); never a traceback, a hang (each command runs under an
alarm) or unbounded memory (the size guards of harness.reference.loader decide before anything
is allocated). Records and baselines are fuzzed at their reading function, a whole ``harness
run`` per example being too slow; suites/faults/test_run.py runs one such baseline end to end.

In CI (``make test``) each property runs a fixed number of examples from a fixed seed
(``derandomize``): 1,024 examples, and with the exhaustive tests the file takes about a minute
(37 s against 30 s before them, on an idle 2-core machine). A longer, random run is a command (the exhaustive tests are the
same at any length):

    HARNESS_FUZZ_EXAMPLES=2000 .venv/bin/python -m pytest suites/faults/test_fuzz.py -q   # or: make fuzz

which also prints hypothesis' statistics with ``--hypothesis-show-statistics``.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
from faultlib import EVERY_JSON_TYPE, every_field_every_type, in_process
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import fixtures

LONG = int(os.environ.get("HARNESS_FUZZ_EXAMPLES", "0"))
EXAMPLE_LIMIT_S = 30  # one example; the guards make a bad one end in well under a second
RUNS: dict[str, dict[int, int]] = {}  # per property (this process): examples by exit code, for the record


def fuzz_settings(ci_examples: int):
    return settings(max_examples=LONG or ci_examples, derandomize=not LONG, database=None, deadline=None,
                    suppress_health_check=list(HealthCheck), print_blob=True)


def report(name: str) -> None:
    """The number of examples a property ran (``pytest -s`` shows it)."""
    codes = RUNS.get(name, {0: 0, 2: 0})
    print(f"\nfuzz: {name}: {sum(codes.values())} examples, {codes[0]} loaded, {codes[2]} one-line errors")


def _alarm(signum, frame):
    raise AssertionError(f"an example ran past {EXAMPLE_LIMIT_S} s: a hang")


def check_one_line(argv: list, name: str) -> int:
    """Run ``harness ARGV`` in this process under the alarm; assert the property; the exit code."""
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(EXAMPLE_LIMIT_S)
    try:
        o = in_process(argv)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert "Traceback" not in o.out + o.err
    assert o.code in (0, 2), (o.code, o.err[-2000:])
    if o.code == 2:
        assert o.err.count("\n") == 1 and o.err.startswith("error: ") and o.err.endswith("\n"), o.err
    else:
        assert o.err == "", o.err
    RUNS.setdefault(name, {0: 0, 2: 0})[o.code] += 1
    return o.code


# ------------------------------------------------------------------------------- JSON values

TRICKY_STRINGS = ["", "((", "re:((", "(.|.)*(?<!j)$", "re:(.|.)*(?<!j)$", "re:.*", ".*", "lm_head", "model.layers.1",
                  "model.layers.0.self_attn.q_proj", "Linear", "float32", "bfloat16", "nf4", "fp4", "static", "dynamic",
                  "tensor", "channel", "Int8WeightOnlyConfig", "Float8WeightOnlyConfig", "FqnToConfig", "os.system",
                  "torch.dtype", "LlamaForCausalLM", "llama", "\x00", "é", "../x"]
TRICKY_INTS = [0, -1, 1, 2, 3, 4, 12, 13, 32, 64, 127, 128, 256, 512, 2 ** 31, 2 ** 40, 10 ** 12, -(2 ** 63)]

scalars = (st.none() | st.booleans() | st.sampled_from(TRICKY_INTS) | st.integers()
           | st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(TRICKY_STRINGS) | st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.sampled_from(TRICKY_STRINGS) | st.text(max_size=8), inner, max_size=4),
                           max_leaves=8)
# every JSON type, on top of the drawn values (copies: a mutation must not change the list's own)
any_json = st.sampled_from(EVERY_JSON_TYPE).map(copy.deepcopy) | json_values


def mutated(data, original):
    """A mutation of a copy of a JSON document: one in ten replaced whole, else one ``mutate``."""
    if data.draw(st.integers(0, 9)) == 0:
        return data.draw(any_json)
    return mutate(json.loads(json.dumps(original)), data.draw)


def key_paths(value, prefix=()) -> list[tuple]:
    """Every path to a value inside nested dicts and lists."""
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += key_paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += key_paths(v, prefix + (i,))
    return out


def mutate(data, draw):
    """One mutation of a JSON-like document: set, delete or add a key somewhere (a document
    without fields is replaced)."""
    paths = key_paths(data)
    if not paths:
        return draw(any_json)
    path = draw(st.sampled_from(paths))
    parent = data
    for p in path[:-1]:
        parent = parent[p]
    action = draw(st.sampled_from(["set", "set", "delete", "add"]))
    if action == "delete" and isinstance(parent, dict):
        parent.pop(path[-1])
    elif action == "add" and isinstance(parent, dict):
        parent[draw(st.sampled_from(TRICKY_STRINGS) | st.text(max_size=8))] = draw(any_json)
    else:
        parent[path[-1]] = draw(any_json)
    return data


# --------------------------------------------------------------------------------- config.json

CONFIG_FIXTURES = ["llama-unquantized", "llama-bnb-nf4", "llama-fp8-static-kv", "llama-torchao-int8wo-skip-fqn"]


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-templates")
    out = {}
    for name in CONFIG_FIXTURES:
        out[name] = root / name
        shutil.copytree(fixtures.build(name), out[name])
    return out


@pytest.mark.slow("60 hypothesis examples of `harness load` on a mutated config.json per fixture")
@pytest.mark.parametrize("fixture", CONFIG_FIXTURES)
def test_any_config_json_loads_or_is_one_line(fixture, templates, tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt") / "c"
    shutil.copytree(templates[fixture], d)
    config = json.loads((templates[fixture] / "config.json").read_text())
    quantized = "quantization_config" in config

    @fuzz_settings(ci_examples=60)
    @given(st.data())
    def prop(data):
        doc = json.loads(json.dumps(config))
        for _ in range(data.draw(st.integers(1, 3))):
            if quantized and data.draw(st.booleans()):  # half the mutations inside the quantization config
                doc["quantization_config"] = mutate(doc["quantization_config"], data.draw) \
                    if isinstance(doc.get("quantization_config"), dict) else data.draw(json_values)
            else:
                doc = mutate(doc, data.draw)
        (d / "config.json").write_text(json.dumps(doc))
        check_one_line(["load", d], f"config.json of {fixture}")

    prop()
    report(f"config.json of {fixture}")


# --------------------------------------------------------------------------- safetensors header


@pytest.fixture(scope="module")
def safetensors_parts(templates):
    blob = (templates["llama-unquantized"] / "model.safetensors").read_bytes()
    n = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def header_mutation(draw, header: dict) -> bytes:
    kind = draw(st.sampled_from(["entry", "entry", "metadata", "metadata value", "bytes", "length", "duplicate"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    h = json.loads(json.dumps(header))
    names = sorted(k for k in h if k != "__metadata__")
    if kind == "entry":
        name = draw(st.sampled_from(names))
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra", "whole"]))
        if field == "dtype":
            h[name]["dtype"] = draw(st.sampled_from(["F32", "F16", "BF16", "I8", "U8", "F8_E4M3", "F64", "BOOL", "F7", ""])
                                    | any_json)
        elif field == "shape":
            h[name]["shape"] = draw(st.lists(st.sampled_from(TRICKY_INTS), max_size=4) | any_json)
        elif field == "data_offsets":
            h[name]["data_offsets"] = draw(st.lists(st.sampled_from(TRICKY_INTS) | st.integers(0, 8 << 20), max_size=3))
        elif field == "extra":
            h[name][draw(st.text(max_size=6))] = draw(any_json)
        else:
            h[name] = draw(any_json)
    elif kind == "metadata":
        h["__metadata__"] = draw(st.dictionaries(st.text(max_size=8), any_json, max_size=3) | any_json)
    elif kind == "metadata value":
        h.setdefault("__metadata__", {})[draw(st.sampled_from(["format", "x"]))] = draw(any_json)
    elif kind == "duplicate":
        name = draw(st.sampled_from(names))
        text = json.dumps(h)
        return (text[:-1] + ", " + json.dumps({name: h[name]})[1:-1] + "}").encode()
    text = json.dumps(h).encode()
    return text


@pytest.mark.slow("150 hypothesis examples of `harness load` on a mutated safetensors header")
def test_any_safetensors_header_loads_or_is_one_line(safetensors_parts, templates, tmp_path_factory):
    header, body = safetensors_parts
    d = tmp_path_factory.mktemp("st") / "c"
    shutil.copytree(templates["llama-unquantized"], d, ignore=shutil.ignore_patterns("model.safetensors"))

    @fuzz_settings(ci_examples=150)
    @given(st.data())
    def prop(data):
        new = header_mutation(data.draw, header)
        length = len(new)
        if data.draw(st.integers(0, 9)) == 0:  # a wrong length prefix
            length = data.draw(st.sampled_from([0, 1, 7, length - 1, length + 1, 2 ** 40, 2 ** 64 - 1]))
        (d / "model.safetensors").write_bytes(max(0, min(length, 2 ** 64 - 1)).to_bytes(8, "little") + new + body)
        check_one_line(["load", d], "safetensors header")

    prop()
    report("safetensors header")


# --------------------------------------------------------------------------------- models.yaml

YAML_TEXT = Path(__file__).with_name("fuzz-models.yaml")
YAML_PIECES = st.lists(st.sampled_from(list("[]{}:,-&*!|>'\"#%@`?<= \n\t.0123456789abcxyz")
                                      + ["<<", ": ", "\n  ", "\xff", "\x00"]), min_size=1, max_size=6).map("".join)


@pytest.mark.slow("500 hypothesis examples of `harness cells` on a mutated models.yaml")
def test_any_models_yaml_is_accepted_or_one_line(tmp_path_factory):
    m = tmp_path_factory.mktemp("yaml") / "m.yaml"

    @fuzz_settings(ci_examples=500)
    @given(st.data())
    def prop(data):
        yaml_example(data, m)

    prop()
    report("models.yaml")


def yaml_example(data, m: Path) -> None:
    text = YAML_TEXT.read_text()
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["insert", "delete", "replace", "value"]))
        i = data.draw(st.integers(0, len(text)))
        if kind == "insert":
            text = text[:i] + data.draw(YAML_PIECES) + text[i:]
        elif kind == "delete":
            text = text[:i] + text[i + data.draw(st.integers(1, 8)):]
        elif kind == "replace":
            text = text[:i] + data.draw(YAML_PIECES) + text[i + 1:]
        else:  # a value somewhere: "key: <value>" with a YAML scalar or flow collection
            lines = text.splitlines(keepends=True)
            j = data.draw(st.integers(0, len(lines) - 1))
            if ": " in lines[j]:
                head = lines[j].split(": ", 1)[0]
                lines[j] = head + ": " + data.draw(st.sampled_from(
                    ["-1", "0", "1e12", "1000000000000", ".inf", ".nan", "null", "[]", "{}", "[[[[[]]]]]", "*x", "&x 1",
                     "'((", "\"\\xff\"", "!!python/object:os.system x", "{<<: 1}", "yes", "~"])) + "\n"
            text = "".join(lines)
    m.write_bytes(text.encode("latin-1"))  # "\xff" becomes a byte that is not UTF-8
    check_one_line(["cells", "--matrix", m, "--tier", "all"], "models.yaml")




# ------------------------------------------------------------ every field of every JSON file
#
# Each file the harness reads JSON from, at the boundary that reads it: every field set to every
# JSON type (faultlib.every_field_every_type, exhaustive and deterministic), then random
# mutations. The boundary returns, or raises its one-line error; anything else is a traceback.
# For the files of a checkpoint the boundary goes on to decode what it read, and a property runs
# the whole command on top.

Q_WEIGHT = "model.layers.0.self_attn.q_proj.weight"
BNB_WEIGHT = "model.layers.0.mlp.up_proj.weight"


def check_boundary(call, errors: tuple, name: str) -> int:
    """``call()`` returns (0) or raises one of ``errors`` with a one-line text (2); the code."""
    try:
        call()
        code = 0
    except errors as e:
        text = str(e)
        assert text and "\n" not in text, text
        code = 2
    RUNS.setdefault(name, {0: 0, 2: 0})[code] += 1
    return code


def every_field(doc, call, errors: tuple, name: str) -> None:
    """``call(changed)`` for doc with each field set to each JSON type, under check_boundary."""
    for path, value, changed in every_field_every_type(doc):
        try:
            check_boundary(lambda: call(changed), errors, name)
        except BaseException as e:
            raise AssertionError(f"{name}: {path} = {value!r}: {type(e).__name__}: {e}") from e
    report(name)


def tensors_of(directory: Path, prefix: str) -> tuple[dict, dict]:
    """The tensors of a checkpoint whose names start with ``prefix``, and its metadata."""
    from safetensors import safe_open

    with safe_open(directory / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}, dict(f.metadata() or {})


def save_tensors(directory: Path, edit) -> None:
    """Rewrite model.safetensors with ``edit(tensors, metadata)`` applied."""
    from safetensors.torch import save_file

    ts, meta = tensors_of(directory, "")
    edit(ts, meta)
    save_file(ts, directory / "model.safetensors", meta)


def json_tensor(doc):
    """A JSON document as the uint8 tensor bitsandbytes stores a quant state in."""
    import torch

    return torch.tensor(list(json.dumps(doc).encode()), dtype=torch.uint8)


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A copy of a fixture checkpoint by name, made once for the module."""
    made: dict[str, Path] = {}

    def copy_of(name: str) -> Path:
        if name not in made:
            made[name] = tmp_path_factory.mktemp("fuzz-template") / name
            shutil.copytree(fixtures.build(name), made[name])
        return made[name]

    return copy_of


def check_stored_json(d: Path, original, store, name: str) -> None:
    """The property for a JSON document kept in model.safetensors (``store(tensors, metadata, doc)``
    puts it there): any mutation of it loads, or is one line."""
    @fuzz_settings(ci_examples=12)
    @given(st.data())
    def prop(data):
        doc = mutated(data, original)
        save_tensors(d, lambda t, m: store(t, m, doc))
        check_one_line(["load", d], name)

    prop()
    report(name)


BNB_FIXTURE, BNB_STATE = "llama-bnb-nf4-dq", f"{BNB_WEIGHT}.quant_state.bitsandbytes__nf4"  # double quant: nested_* too


def test_every_field_of_a_bnb_quant_state(template):
    from harness.errors import CheckpointError
    from harness.quant import formats
    from harness.quant.source import TensorSource

    ts, _ = tensors_of(template(BNB_FIXTURE), BNB_WEIGHT)
    state = json.loads(bytes(ts[BNB_STATE].numpy()).decode())
    every_field(state, lambda s: formats.decode_weight(TensorSource.from_tensors({**ts, BNB_STATE: json_tensor(s)}), BNB_WEIGHT),
                (CheckpointError,), "bnb quant state, every field")


def test_any_bnb_quant_state_loads_or_is_one_line(template, tmp_path_factory):
    d = tmp_path_factory.mktemp("bnb") / "c"
    shutil.copytree(template(BNB_FIXTURE), d)
    ts, _ = tensors_of(d, BNB_WEIGHT)
    check_stored_json(d, json.loads(bytes(ts[BNB_STATE].numpy()).decode()),
                      lambda t, m, doc: t.update({BNB_STATE: json_tensor(doc)}), "bnb quant state")


def test_every_field_of_torchao_tensor_metadata(template):
    from harness.errors import CheckpointError
    from harness.quant import formats
    from harness.quant.source import TensorSource

    ts, meta = tensors_of(template("llama-torchao-int8wo"), Q_WEIGHT.removesuffix("weight"))
    every_field(json.loads(meta[Q_WEIGHT]),
                lambda m: formats.decode_weight(TensorSource.from_tensors(ts, {Q_WEIGHT: json.dumps(m)}), Q_WEIGHT),
                (CheckpointError,), "torchao tensor metadata, every field")


def test_any_torchao_tensor_metadata_loads_or_is_one_line(template, tmp_path_factory):
    d = tmp_path_factory.mktemp("torchao") / "c"
    shutil.copytree(template("llama-torchao-int8wo"), d)
    _, meta = tensors_of(d, Q_WEIGHT)
    check_stored_json(d, json.loads(meta[Q_WEIGHT]), lambda t, m, doc: m.update({Q_WEIGHT: json.dumps(doc)}),
                      "torchao tensor metadata")


@pytest.mark.parametrize("fixture", CONFIG_FIXTURES)
def test_every_field_of_config_json(fixture, templates):
    from harness.errors import CheckpointError
    from harness.quant import schema

    config = json.loads((templates[fixture] / "config.json").read_text())
    every_field(config, lambda c: schema.config_json(c, "config.json"), (CheckpointError,), f"config.json of {fixture}, every field")


@pytest.fixture(scope="module")
def small_safetensors(tmp_path_factory):
    """A checkpoint directory of two tiny tensors and some metadata: a header with every kind of field."""
    import torch
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("fuzz-header")
    save_file({"a.weight": torch.zeros(2, 3), "b": torch.ones(4, dtype=torch.uint8)}, d / "model.safetensors",
              {"format": "pt", "note": "x"})
    blob = (d / "model.safetensors").read_bytes()
    n = int.from_bytes(blob[:8], "little")
    return d, json.loads(blob[8:8 + n]), blob[8 + n:]


def test_every_field_of_a_safetensors_header(small_safetensors):
    from harness.errors import CheckpointError
    from harness.quant.source import TensorSource

    d, header, body = small_safetensors

    def open_with(h):
        text = json.dumps(h).encode()
        (d / "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + body)
        TensorSource.open(d).close()

    every_field(header, open_with, (CheckpointError,), "safetensors header, every field")


@pytest.fixture(scope="module")
def sharded_template(templates, tmp_path_factory):
    """The unquantized fixture in two shards, with its index."""
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("fuzz-index") / "c"
    shutil.copytree(templates["llama-unquantized"], d)
    ts, meta = tensors_of(d, "")
    names = sorted(ts)
    weight_map = {}
    for i, part in enumerate((names[:len(names) // 2], names[len(names) // 2:])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: ts[k] for k in part}, d / shard, meta)
        weight_map.update(dict.fromkeys(part, shard))
    (d / "model.safetensors").unlink()
    return d, {"metadata": {"total_size": 0}, "weight_map": weight_map}


def test_every_field_of_a_safetensors_index(sharded_template):
    from harness.errors import CheckpointError
    from harness.quant.source import TensorSource

    d, index = sharded_template

    def open_with(doc):
        (d / "model.safetensors.index.json").write_text(json.dumps(doc))
        TensorSource.open(d).close()

    every_field(index, open_with, (CheckpointError,), "safetensors index, every field")


def test_any_safetensors_index_loads_or_is_one_line(sharded_template):
    d, index = sharded_template

    @fuzz_settings(ci_examples=20)
    @given(st.data())
    def prop(data):
        doc = mutated(data, index)
        (d / "model.safetensors.index.json").write_text(json.dumps(doc))
        check_one_line(["load", d], "safetensors index")

    prop()
    report("safetensors index")


# --------------------------------------------------------------------- records and baselines

RECORD = Path(__file__).with_name("fuzz-record.json")  # one cell's record (one sequence kept)
BASELINE = Path(__file__).parents[2] / "baselines" / "cpu-tiny" / "llama.bnb-nf4-dq.reference.json"
ACCURACY = Path(__file__).parents[2] / "baselines" / "cpu-tiny" / "accuracy" / "llama.unquantized.reference.json"


def small_baseline() -> dict:
    """The committed baseline cut to a few of each repeated part (a baseline still, and 10x
    faster to read: one sequence, four scored and three greedy rows, three modules)."""
    doc = json.loads(BASELINE.read_text())
    doc["sequences"] = doc["sequences"][:1]
    doc["sequences"][0]["scored"] = doc["sequences"][0]["scored"][:4]
    doc["sequences"][0]["greedy"] = doc["sequences"][0]["greedy"][:3]
    doc["loaded_state"] = dict(list(doc["loaded_state"].items())[:3])
    doc["fingerprint"]["modules"] = doc["fingerprint"]["modules"][:3]
    return doc


def record_boundary():
    from harness.records import Record, RecordError

    return lambda doc: Record.from_json(json.dumps(doc), "r.json"), (RecordError,)


def baseline_boundary():
    from harness import baselines

    return lambda doc: baselines.parse(json.dumps(doc), "b.json"), (baselines.BaselineError,)


def accuracy_boundary():
    from harness import baselines
    from harness.accuracy.store import VERSION, AccuracyBaseline

    return (lambda doc: baselines.parse_document(AccuracyBaseline, json.dumps(doc), "a.json", VERSION, "accuracy baseline"),
            (baselines.BaselineError,))


FILES = {"record": (lambda: json.loads(RECORD.read_text()), record_boundary),
         "baseline": (small_baseline, baseline_boundary),
         "accuracy baseline": (lambda: json.loads(ACCURACY.read_text()), accuracy_boundary)}


@pytest.mark.parametrize("kind", FILES)
def test_every_field_of_a_record_or_baseline(kind):
    doc, boundary = FILES[kind][0](), FILES[kind][1]()
    assert check_boundary(lambda: boundary[0](doc), boundary[1], kind) == 0  # the file as written reads
    every_field(doc, *boundary, f"{kind}, every field")


@pytest.mark.parametrize("kind", FILES)
def test_any_record_or_baseline_reads_or_is_one_line(kind):
    original, (call, errors) = FILES[kind][0](), FILES[kind][1]()

    @fuzz_settings(ci_examples=30)
    @given(st.data())
    def prop(data):
        doc = json.loads(json.dumps(original))
        for _ in range(data.draw(st.integers(1, 3))):
            doc = mutate(doc, data.draw)
        check_boundary(lambda: call(doc), errors, kind)

    prop()
    report(kind)
