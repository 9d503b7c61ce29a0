"""One-line problems of JSON documents validated by pydantic models: checkpoint structures
(harness.quant.schema), result records and baselines.

- ``problem(e, prefix)``: the first problem of a ValidationError as (key path, what is wrong), the
  value found named (``dtype``, ``must be a string (got list)``);
- ``one_line(e)``: the same as ``<key path>: <what is wrong>``;
- ``strict_json(model, text)``: ``text`` validated by ``model`` with no coercion between JSON
  types (a ``"5"`` is not an integer, a ``true`` not a number), as a file on disk is checked.
"""
from __future__ import annotations

import json
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

Model = TypeVar("Model", bound=BaseModel)


def key_path(loc: tuple) -> str:
    """``("a", 0, "b")`` -> ``a[0].b``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def short(value: Any) -> str:
    """A JSON value as a message shows it: a scalar as JSON (cut at 60 characters), a container by its type."""
    text = json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__
    return text if len(text) <= 60 else text[:59] + "…"


_ARTICLE = {"list": "a list", "string": "a string", "integer": "an integer", "boolean": "a boolean", "number": "a number"}


def problem(e: ValidationError, prefix: str = "") -> tuple[str, str]:
    """The first problem of a validation error: (key path, what is wrong, with the value found)."""
    err = e.errors(include_url=False)[0]
    where = key_path(tuple(err["loc"]))
    where = f"{prefix}.{where}" if prefix and where else (prefix or where)
    if err["type"] == "missing":
        return where, "required key is missing"
    if err["type"] == "value_error":
        return where, err["msg"].removeprefix("Value error, ")
    if err["type"] == "int_parsing_size":  # an integer past what pydantic parses (2**4300 and up)
        return where, f"integer too large (got {short(err.get('input'))})"
    msg = re.sub(r"a valid dictionary( or instance of \w+)?", "an object", err["msg"])
    msg = re.sub(r"a valid (list|string|integer|boolean|number)", lambda m: _ARTICLE[m.group(1)], msg)
    msg = re.sub(r"a valid (tuple|array)", "a list", msg)
    return where, f"{msg.replace('Input should be', 'must be')} (got {short(err.get('input'))})"


def one_line(e: ValidationError, prefix: str = "") -> str:
    where, what = problem(e, prefix)
    return f"{where}: {what}" if where else what


def strict_json(model: type[Model], text: str) -> Model:
    """``text`` parsed and validated by ``model`` in pydantic's strict JSON mode (raises ValidationError)."""
    return model.model_validate_json(text, strict=True)
