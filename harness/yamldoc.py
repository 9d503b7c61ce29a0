"""A YAML document read into a pydantic model, with one-line errors (models.yaml, task files).

``parse`` is ``yaml.safe_load`` except that a key written twice in one mapping and nesting deeper
than ``MAX_DEPTH`` are errors (PyYAML keeps the last key silently and composes recursively);
merge keys (``<<: *anchor``) work as YAML says. ``first_error`` turns pydantic's first problem
into ``<key path>: <what is wrong>``, naming the keys allowed where an unknown one was found.
"""
from __future__ import annotations

import types
import typing
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ValidationError


class DocumentError(Exception):
    """Not a YAML mapping. ``str()`` is one line: ``<file>[:<line>]: <what>``."""


MAX_DEPTH = 64  # nesting levels; the real models.yaml has 6


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load, except that a duplicated mapping key is an error (yaml silently keeps the last)
    and nesting deeper than MAX_DEPTH is an error (PyYAML composes recursively)."""

    _depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels",
                                                  self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    """A key written twice in one mapping is an error. Keys a merge key (``<<: *anchor``) brings
    in are not written there: the mapping's own keys override them, as YAML's merge says."""
    seen: set = set()
    for key_node, _ in node.value:
        key = "<<" if key_node.tag == "tag:yaml.org,2002:merge" else loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in seen
        except TypeError:  # unhashable: construct_mapping says so below
            continue
        if duplicate:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    loader.flatten_mapping(node)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def parse(text: str, filename: str) -> dict:
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{filename}:{mark.line + 1}" if mark is not None else filename
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise DocumentError(f"{where}: YAML syntax error: {problem}") from None
    if not isinstance(data, dict):
        raise DocumentError(f"{filename}: the top level must be a mapping (found {type(data).__name__})")
    return data


def _format_loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part == "[key]":
            continue
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def _unwrap(annotation: Any) -> Any:
    """Strip Annotated / Optional to the type that carries fields or items."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(args) != 1:
                return annotation
            annotation = args[0]
        else:
            return annotation


def _allowed_keys(root: type[BaseModel], loc: tuple[Any, ...]) -> list[str] | None:
    """The keys allowed in the mapping that holds loc[-1] (best effort)."""
    current: Any = root
    for part in loc[:-1]:
        current = _unwrap(current)
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = current.model_fields.get(part)
            if field is None:
                return None
            current = field.annotation
        elif typing.get_origin(current) in (dict, list, tuple):
            args = typing.get_args(current)
            current = args[-1] if typing.get_origin(current) is dict else args[0]
        else:
            return None
    current = _unwrap(current)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return list(current.model_fields)
    return None


def _num(x: Any) -> str:
    return f"{x:g}" if isinstance(x, (int, float)) else str(x)


def first_error(e: ValidationError, root: type[BaseModel], pattern_names: dict[str, str] | None = None) -> str:
    """``<key path>: <what is wrong>`` for the first problem pydantic found under ``root``."""
    err = e.errors(include_url=False)[0]
    loc = tuple(err["loc"])
    where = _format_loc(loc)
    kind = err["type"]
    ctx = err.get("ctx") or {}
    value = err.get("input")
    if kind == "extra_forbidden":
        allowed = _allowed_keys(root, loc)
        what = "unknown key" + (f" (allowed: {', '.join(allowed)})" if allowed else "")
    elif kind == "missing":
        what = "required key is missing"
    elif kind == "greater_than":
        what = f"must be > {_num(ctx.get('gt'))}"
    elif kind == "greater_than_equal":
        what = f"must be >= {_num(ctx.get('ge'))}"
    elif kind == "literal_error":
        what = f"{value!r} is not one of {ctx.get('expected')}"
    elif kind == "string_pattern_mismatch":
        named = (pattern_names or {}).get(ctx.get("pattern"))
        what = f"{value!r} {named}" if named else f"{value!r} does not match {ctx.get('pattern')}"
    elif kind == "too_short":
        what = "must not be empty"
    elif kind == "value_error":
        what = str(ctx.get("error", err["msg"]))
    else:
        what = err["msg"].replace("Input should be", "must be")
        if isinstance(value, (str, int, float, bool)) and kind != "missing":
            what += f" (got {value!r})"
    return f"{where}: {what}"
