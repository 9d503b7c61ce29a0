"""Every field of a quantization config is checked by type where the harness reads it
(harness.quant.schema; docs/design.md, "Bad input and faults").

The configs are the ones the libraries write (the fixtures' config.json for bitsandbytes,
compressed-tensors and torchao; transformers' and vLLM's fields for ``quant_method: fp8``):

- every key in them, nested configs included, is a field its schema declares: none is left to a
  library unchecked, where a wrong type would load without a word (``bnb_4bit_compute_dtype: 32``
  did) or end in a library's traceback;
- each declared field set to each JSON type (``faultlib.EVERY_JSON_TYPE``): a type the field does
  not take is one line naming the file, the field, what was expected and what was found;
- a hypothesis property: any field set to any JSON value is accepted, or refused in that one line;
  a value of a type the field does not take is always refused.

What a field takes is written here, from the libraries (``TAKES``), or else read from the value the
library wrote: a test of the schema that does not read the schema.
"""
from __future__ import annotations

import copy
import json
import typing

import pytest
from faultlib import EVERY_JSON_TYPE
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel
from test_fuzz import RUNS, any_json, fuzz_settings, report

from harness import fixtures
from harness.errors import CheckpointError
from harness.quant import schema
from harness.validation import short

FILE = "config.json"
# quant_method -> (the model its config is checked by, where a config the library writes comes from)
CONFIGS = {
    "bitsandbytes": (schema.BitsandbytesConfig, "llama-bnb-nf4-dq"),
    "compressed-tensors": (schema.CompressedTensorsConfig, "llama-fp8-static-kv"),
    "torchao": (schema.TorchaoConfig, "llama-torchao-int8wo-skip-fqn"),
    "fp8": (schema.Fp8Config, {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                               "modules_to_not_convert": ["lm_head"], "modules_to_convert": None, "dequantize": False,
                               "scale_fmt": "float", "ignored_layers": ["lm_head"]}),
}
# The JSON types a field takes (besides null) where the written value does not show them all: null
# there, or one of several types.
TAKES = {
    "llm_int8_skip_modules": {"array"}, "modules_to_not_convert": {"array"}, "modules_to_convert": {"array"},
    "llm_int8_threshold": {"integer", "number"}, "global_compression_ratio": {"integer", "number"},
    "group_size": {"integer"}, "block_structure": {"array"}, "actorder": {"boolean", "string"},
    "observer": {"string"}, "scale_dtype": {"string"}, "zp_dtype": {"string"}, "format": {"string"},
    "output_activations": {"object"}, "kv_cache_scheme": {"object"}, "dynamic": {"boolean", "string"},
}


def json_type(value) -> str:
    if value is None:
        return "null"
    for kind, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array")):
        if isinstance(value, kind):
            return name
    return "object"


def _model_in(annotation) -> tuple[type[BaseModel] | None, bool]:
    """The schema model a field's annotation holds, and whether it maps names to it (config_groups)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is dict:
        return _model_in(args[1])[0], True
    for arg in args:
        found = _model_in(arg)
        if found[0] is not None:
            return found
    return None, False


def declared_fields(model: type[BaseModel], doc: dict, path: tuple = ()):
    """(path, value) of each field of ``doc``, nested configs included; fails on a key ``model``
    does not declare."""
    keys = {info.alias or name: info for name, info in model.model_fields.items()}
    assert set(doc) <= set(keys), f"{'.'.join(map(str, path)) or 'the config'}: not in {model.__name__}: {set(doc) - set(keys)}"
    for key, value in doc.items():
        yield path + (key,), value
        sub, mapping = _model_in(keys[key].annotation)
        if sub is None or not isinstance(value, dict):
            continue
        for name, inner in (value.items() if mapping else [(None, value)]):
            if isinstance(inner, dict):
                yield from declared_fields(sub, inner, path + (key,) + ((name,) if mapping else ()))


@pytest.fixture(scope="module")
def written():
    """quant_method -> the quantization config its library writes."""
    out = {}
    for method, (_, source) in CONFIGS.items():
        if isinstance(source, str):
            source = json.loads((fixtures.build(source) / FILE).read_text())["quantization_config"]
        out[method] = source
    return out


def fields_of(written) -> list[tuple[str, tuple, set[str]]]:
    """(quant_method, path, the JSON types it takes) of every field of every written config."""
    out = []
    for method, doc in written.items():
        for path, value in declared_fields(CONFIGS[method][0], doc):
            takes = TAKES.get(path[-1], {json_type(value)}) - {"null"}
            if takes:
                out.append((method, path, takes))
    return out


def set_field(doc: dict, path: tuple, value) -> dict:
    doc = copy.deepcopy(doc)
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = copy.deepcopy(value)
    return doc


def check(doc: dict, path: tuple, value, takes: set[str]) -> int:
    """Validate ``doc`` (``path`` set to ``value``): accepted (0), or one line naming the field
    (2); never accepted when the field does not take the value's type."""
    where = "quantization_config." + ".".join(map(str, path))
    wrong = json_type(value) not in takes | {"null"}
    try:
        schema.quantization_config(doc, FILE, "quantization_config")
    except CheckpointError as e:
        text = str(e)
        assert "\n" not in text and text.startswith(f"{FILE}: {where}"), text
        if wrong:  # the file, the field, what it must be, what it was
            assert text.startswith(f"{FILE}: {where}: must be ") and f"(got {short(value)})" in text, text
        return 2
    assert not wrong, f"{where} = {value!r} ({json_type(value)}) was accepted"
    return 0


def test_every_library_config_is_declared_field_by_field(written):
    """Every quant_method the harness knows has its config here, and every key of it is declared."""
    assert set(CONFIGS) == set(schema.KNOWN_METHODS)
    assert len(fields_of(written)) > 60


def test_each_field_of_the_wrong_type_is_one_line_naming_it(written):
    refused = 0
    for method, path, takes in fields_of(written):
        for value in EVERY_JSON_TYPE:
            if path == ("quant_method",):
                continue  # which schema applies: harness.quant.schema.method_of, its own cases
            refused += check(set_field(written[method], path, value), path, value, takes) // 2
    assert refused > 500


def test_any_field_of_any_type_is_accepted_or_one_line(written):
    fields = [f for f in fields_of(written) if f[1] != ("quant_method",)]

    @fuzz_settings(ci_examples=300)
    @given(st.sampled_from(fields), any_json)
    def prop(field, value):
        method, path, takes = field
        code = check(set_field(written[method], path, value), path, value, takes)
        RUNS.setdefault("quantization config fields", {0: 0, 2: 0})[code] += 1

    prop()
    report("quantization config fields")
