"""Property-based fuzzing (hypothesis) of what a user hands the harness: the safetensors header,
config.json with each library's quantization config, and models.yaml.

The property, for any mutation: the command loads, or exits 2 with exactly one ``error:`` line;
never a traceback, a hang (each example runs under an alarm) or unbounded memory (the size guards
of harness.reference.loader decide before anything is allocated).

In CI (``make test``) each property runs a fixed number of examples from a fixed seed
(``derandomize``): 890 examples, about a minute. A longer, random run is a command:

    HARNESS_FUZZ_EXAMPLES=2000 .venv/bin/python -m pytest suites/faults/test_fuzz.py -q   # or: make fuzz

which also prints hypothesis' statistics with ``--hypothesis-show-statistics``.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
from faultlib import in_process
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
    """One mutation of a JSON-like document: set, delete or add a key somewhere."""
    paths = key_paths(data)
    path = draw(st.sampled_from(paths))
    parent = data
    for p in path[:-1]:
        parent = parent[p]
    action = draw(st.sampled_from(["set", "set", "delete", "add"]))
    if action == "delete" and isinstance(parent, dict):
        parent.pop(path[-1])
    elif action == "add" and isinstance(parent, dict):
        parent[draw(st.sampled_from(TRICKY_STRINGS) | st.text(max_size=8))] = draw(json_values)
    else:
        parent[path[-1]] = draw(json_values)
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
    kind = draw(st.sampled_from(["entry", "entry", "metadata", "bytes", "length", "duplicate"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    h = json.loads(json.dumps(header))
    names = sorted(k for k in h if k != "__metadata__")
    if kind == "entry":
        name = draw(st.sampled_from(names))
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra", "whole"]))
        if field == "dtype":
            h[name]["dtype"] = draw(st.sampled_from(["F32", "F16", "BF16", "I8", "U8", "F8_E4M3", "F64", "BOOL", "F7", ""])
                                    | json_values)
        elif field == "shape":
            h[name]["shape"] = draw(st.lists(st.sampled_from(TRICKY_INTS), max_size=4) | json_values)
        elif field == "data_offsets":
            h[name]["data_offsets"] = draw(st.lists(st.sampled_from(TRICKY_INTS) | st.integers(0, 8 << 20), max_size=3))
        elif field == "extra":
            h[name][draw(st.text(max_size=6))] = draw(json_values)
        else:
            h[name] = draw(json_values)
    elif kind == "metadata":
        h["__metadata__"] = draw(st.dictionaries(st.text(max_size=8), json_values, max_size=3) | json_values)
    elif kind == "duplicate":
        name = draw(st.sampled_from(names))
        text = json.dumps(h)
        return (text[:-1] + ", " + json.dumps({name: h[name]})[1:-1] + "}").encode()
    text = json.dumps(h).encode()
    return text


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


