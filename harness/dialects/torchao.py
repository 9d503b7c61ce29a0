"""The ``torchao`` dialect: torchao 0.18 ``quantize_(model, FqnToConfig)``.

Also the ``FqnToConfig`` reading that the three torchao readers share (torchao itself,
``transformers-torchao`` and ``vllm-torchao``): the serialized config, the resolution record, the
entries, and the order-dependence check.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from harness.dialects import patterns
from harness.dialects.base import Decision, Dialect, EntryDisagreement, Reading, SkipEntry, is_linear, register

NAME = "torchao"


@dataclass(frozen=True)
class FqnResolution:
    """Which ``FqnToConfig`` entry decides one weight.

    ``key`` is the entry (``"_default"`` for the default, ``None`` when no entry applies),
    ``config`` its value. ``config is None`` means the weight stays unquantized, whether an entry
    said ``None`` (``key`` set) or nothing matched (``key`` None, ``how == "unmatched"``).
    ``how`` is ``param`` / ``module`` (exact FQN), ``param-regex`` / ``module-regex``, ``default``,
    ``unmatched``, ``untouched`` (torchao: another parameter of the module matched, so neither the
    module entries nor the default apply) or ``skip_modules`` (vLLM's dot-bounded skip list).
    ``also`` lists further keys that torchao *also* applies to the same weight (every matching
    parameter regex is applied in turn, not just the first).
    """

    key: str | None
    config: Any
    how: str
    also: tuple[str, ...] = ()

    @property
    def skipped(self) -> bool:
        return self.config is None


def regex_or_default(fqn_to_config: Mapping[str, Any], module_fqn: str, owner: str = "re") -> FqnResolution:
    """The first ``re:`` key matching the whole module name, else ``_default``, else unmatched:
    the tail of the lookup that torchao and vLLM's torchao config share (``owner``: the regex
    engine, ``re`` for torchao, ``regex`` for vLLM)."""
    for pattern in fqn_to_config:
        if pattern.startswith("re:") and patterns.fullmatch(pattern[3:], module_fqn, owner):
            return FqnResolution(pattern, fqn_to_config[pattern], "module-regex")
    if fqn_to_config.get("_default") is not None:
        return FqnResolution("_default", fqn_to_config["_default"], "default")
    return FqnResolution(None, None, "unmatched")


def torchao_fqn_matches(fqn: str, fqn_to_config: Mapping[str, Any]) -> bool:
    """torchao 0.18 ``quant_api.fqn_matches_fqn_config``: an exact key, or any ``re:`` key that
    ``re.fullmatch``-es ``fqn``. ``None`` entries match too; ``_default`` is an ordinary key here."""
    if fqn in fqn_to_config:
        if fqn.startswith("re:"):
            raise AssertionError(f"Error: Exact match but regex {fqn} specified.")
        return True
    return any(p.startswith("re:") and patterns.fullmatch(p[3:], fqn) for p in fqn_to_config)


def _param_fqn(module_fqn: str, param: str) -> str:
    return f"{module_fqn}.{param}" if module_fqn else param


def _torchao_gated(fqn_to_config: Mapping[str, Any], module_fqn: str, param_names: Sequence[str], is_linear: bool) -> bool:
    """The gate in ``quantize_``: an entry for the module or one of its top-level parameters, or
    ``_default`` on a linear. A module that fails it is never handed to the handler."""
    return (
        torchao_fqn_matches(module_fqn, fqn_to_config)
        or any(torchao_fqn_matches(_param_fqn(module_fqn, p), fqn_to_config) for p in param_names)
        or ("_default" in fqn_to_config and is_linear)
    )


@dataclass
class _ParamMatches:
    """The parameter entries (steps 1 and 3 of ``torchao_resolve``) that match each of one module's
    parameters, as ``(key, how)`` in the order torchao applies them: ``applied`` the keys with a
    config, ``none_keys`` those whose value is ``None``. ``found``: some parameter entry matched,
    which rules out the module entries and ``_default`` for the whole module."""

    applied: dict[str, list[tuple[str, str]]]
    none_keys: dict[str, list[tuple[str, str]]]
    found: bool = False

    @classmethod
    def empty(cls, param_names: Sequence[str]) -> _ParamMatches:
        return cls({p: [] for p in param_names}, {p: [] for p in param_names})

    def add(self, param: str, key: str, how: str, config: Any) -> None:
        self.found = True
        (self.applied if config is not None else self.none_keys)[param].append((key, how))

    def resolution(self, fqn_to_config: Mapping[str, Any], param: str) -> FqnResolution:
        """What the matched parameter entries make of ``param``: the first applied key (the later
        ones in ``also``), else the first ``None`` key, else untouched."""
        if param not in self.applied:  # another of the module's parameters matched
            return FqnResolution(None, None, "untouched")
        if self.applied[param]:
            (key, how), *rest = self.applied[param]
            return FqnResolution(key, fqn_to_config[key], how, tuple(k for k, _ in rest))
        if self.none_keys[param]:
            key, how = self.none_keys[param][0]
            return FqnResolution(key, None, how)
        return FqnResolution(None, None, "untouched")


def _match_exact_params(fqn_to_config: Mapping[str, Any], module_fqn: str, param_names: Sequence[str],
                        matches: _ParamMatches) -> list[str]:
    """Step 1 of ``torchao_resolve``; returns the parameters left for the regex pass."""
    remaining = list(param_names)
    for p in param_names:
        key = _param_fqn(module_fqn, p)
        if key in fqn_to_config:
            config = fqn_to_config[key]
            if config is None:
                remaining.remove(p)
            matches.add(p, key, "param", config)
    return remaining


def _match_param_regexes(fqn_to_config: Mapping[str, Any], module_fqn: str, remaining: Sequence[str],
                         matches: _ParamMatches) -> None:
    """Step 3 of ``torchao_resolve``: every matching ``re:`` key, in dict order."""
    for p in remaining:
        for pattern in fqn_to_config:
            if pattern.startswith("re:") and patterns.fullmatch(pattern[3:], _param_fqn(module_fqn, p)):
                matches.add(p, pattern, "param-regex", fqn_to_config[pattern])


def torchao_resolve(
    fqn_to_config: Mapping[str, Any],
    module_fqn: str,
    param: str = "weight",
    param_names: Sequence[str] = ("weight",),
    is_linear: bool = True,
) -> FqnResolution:
    """torchao 0.18 ``quantize_(model, FqnToConfig(...))`` for one parameter of one module.

    Mirrors the gate in ``quantize_`` (``fqn_matches_fqn_config`` on the module or one of its
    top-level parameters, or ``_default`` and ``_is_linear``) and then ``_fqn_to_config_handler``:

    1. exact parameter FQN (``...q_proj.weight``); a ``None`` there removes that parameter from
       the regex pass;
    2. only if no parameter matched exactly: exact module FQN;
    3. parameter regexes, ``re.fullmatch``: *every* matching key is applied in order, not the first;
    4. only if no parameter matched at all: the first module regex, in dict order, that fully matches;
    5. only if no parameter matched at all: ``_default``.

    ``param_names`` are the module's top-level parameters in ``named_parameters()`` order (a biased
    Linear has ``("weight", "bias")``). torchao's ``top_level_params.pop(i)`` uses the index over
    all parameters, so two exact ``None`` parameter entries on one module raise ``IndexError`` in
    torchao; this mirror removes the right one instead.

    Dict order matters (steps 3, 4). transformers writes ``config.json`` with ``sort_keys=True``, so
    after a save/load the order of ``re:`` keys is alphabetical, not the order the producer wrote.
    """
    if not _torchao_gated(fqn_to_config, module_fqn, param_names, is_linear):
        return FqnResolution(None, None, "unmatched")
    matches = _ParamMatches.empty(param_names)
    remaining = _match_exact_params(fqn_to_config, module_fqn, param_names, matches)
    if not matches.found and module_fqn in fqn_to_config:
        return FqnResolution(module_fqn, fqn_to_config[module_fqn], "module")
    _match_param_regexes(fqn_to_config, module_fqn, remaining, matches)
    if not matches.found:
        return regex_or_default(fqn_to_config, module_fqn)
    return matches.resolution(fqn_to_config, param)


def torchao_quant_type(quantization_config: Mapping[str, Any]) -> tuple[str | None, dict | None]:
    """The torchao config that transformers 5.19 ``TorchAoConfig.to_dict`` wrote, as
    ``(type name, fqn_to_config dict or None)``.

    ``quant_type`` is ``{"default": {"_type": ..., "_version": ..., "_data": {...}}}``; for
    ``FqnToConfig`` (alias ``ModuleFqnToConfig``) ``_data`` holds both ``fqn_to_config`` and
    ``module_fqn_to_config`` (the same dict twice), values ``null`` or serialized configs.
    """
    qt = quantization_config.get("quant_type")
    if not isinstance(qt, Mapping) or "default" not in qt:
        return None, None
    default = qt["default"]
    if not isinstance(default, Mapping):
        return None, None
    type_name = default.get("_type")
    if type_name not in ("FqnToConfig", "ModuleFqnToConfig"):
        return type_name, None
    data = default.get("_data") or {}
    fqn = data.get("fqn_to_config") or data.get("module_fqn_to_config") or {}
    return type_name, dict(fqn)


# ---------------------------------------------------------------------------------------------
# What the three torchao readers share
# ---------------------------------------------------------------------------------------------


def read_unmapped(reading: Reading, reads_mtnc: bool) -> None:
    """``modules_to_not_convert`` as written (honoured only when ``reads_mtnc``), then the
    ``FqnToConfig`` keys: torchao and vLLM, which never rename entries."""
    mtnc = reading.config.get("modules_to_not_convert")
    reading.entries.extend(SkipEntry(k, "modules_to_not_convert", (k,), honoured=reads_mtnc) for k in mtnc or [])
    read_fqn_to_config(reading)


def read_fqn_to_config(reading: Reading) -> None:
    """The ``FqnToConfig`` keys as entries (a None value skips, any other selects), after a
    reader's own ``modules_to_not_convert`` entries."""
    type_name, fqn = torchao_quant_type(reading.config)
    for key, value in (fqn or {}).items():
        match_as = (key,) if key == "_default" else reading.spell(key)
        reading.entries.append(SkipEntry(key, "fqn_to_config", match_as, value, role="skip" if value is None else "target"))
    if type_name is None:
        reading.notes.append("quant_type.default is missing: nothing is known to be quantized")


def fqn_map(policy) -> dict[str, Any]:
    """The policy's ``FqnToConfig`` in its entries' ``match_as`` spelling."""
    out: dict[str, Any] = {}
    for e in policy.entries:
        if e.source == "fqn_to_config":
            for k in e.match_as:
                out.setdefault(k, e.value)
    return out


def renamed_config(policy) -> dict[str, Any]:
    """The config with every entry in its ``match_as`` spelling (order kept)."""
    qc = dict(policy.config)
    qc["modules_to_not_convert"] = [k for e in policy.entries if e.source == "modules_to_not_convert" for k in e.match_as]
    qt = policy.config.get("quant_type")
    if isinstance(qt, Mapping) and isinstance(qt.get("default"), Mapping) and torchao_quant_type(policy.config)[1] is not None:
        default = dict(qt["default"])
        data = dict(default.get("_data") or {})
        fmap = fqn_map(policy)
        for key in ("fqn_to_config", "module_fqn_to_config"):
            if key in data:
                data[key] = fmap
        default["_data"] = data
        qc["quant_type"] = {"default": default}
    return qc


def decide_fqn(policy, res: FqnResolution) -> Decision:
    """A decision from the ``FqnToConfig`` entry that resolved a weight."""
    ents = tuple(e for e in policy.entries if e.source == "fqn_to_config" and res.key in e.match_as)
    type_name, fqn = torchao_quant_type(policy.config)
    if fqn is None:
        if type_name is None:
            return Decision(True, (), "no torchao config")
        return Decision(False, (), f"{type_name} applies to every linear")
    if res.skipped:
        if res.key is None:
            return Decision(True, (), f"no FqnToConfig entry applies ({res.how}) and no _default")
        return Decision(True, ents, f"FqnToConfig {res.how} entry {res.key!r} is None")
    return Decision(False, ents, f"FqnToConfig {res.how} entry {res.key!r}")


def fqn_entry_hits(spelling: str, name: str) -> bool:
    """An ``FqnToConfig`` key reaches a module through its name or its weight's (torchao, transformers)."""
    return torchao_fqn_matches(name, {spelling: 0}) or torchao_fqn_matches(f"{name}.weight", {spelling: 0})


def order_dependent(policy, names: list[str], param_names: bool) -> list[EntryDisagreement]:
    """Modules that several ``re:`` keys with different outcomes match: dict order decides.
    ``param_names``: the reader also matches keys against ``<module>.weight``."""
    out = []
    regex = [e for e in policy.entries if e.source == "fqn_to_config" and e.raw.startswith("re:")]
    owner = policy.reader.regex_owner
    for n in names:
        hits = [e for e in regex if any(
            patterns.fullmatch(k[3:], n, owner) or (param_names and patterns.fullmatch(k[3:], f"{n}.weight", owner))
            for k in e.match_as)]
        if len({h.value is None for h in hits}) > 1:
            out.append(EntryDisagreement(
                hits[0].raw, n, policy.dialect, "order-dependent",
                f"{len(hits)} regex keys match with different outcomes ({', '.join(h.raw for h in hits)}); "
                "dict order decides, and transformers saves config.json with sorted keys"))
    return out


class Torchao(Dialect):
    name = NAME
    quant_method = "torchao"
    exact_containers = True

    def read(self, reading: Reading) -> None:
        read_unmapped(reading, reads_mtnc=False)  # torchao never reads modules_to_not_convert

    def decide(self, policy, fqn: str, module_class: Any) -> Decision:
        linear = is_linear(module_class, False)
        if torchao_quant_type(policy.config)[1] is None:
            return Decision(not linear, (), "plain torchao config: every nn.Linear" if linear else "not an nn.Linear")
        return decide_fqn(policy, torchao_resolve(fqn_map(policy), fqn, is_linear=linear))

    def entry_hits(self, policy, entry: SkipEntry, spelling: str, name: str, module_class: Any) -> bool:
        if entry.source == "fqn_to_config":
            return fqn_entry_hits(spelling, name)
        return False  # torchao never reads modules_to_not_convert

    def module_disagreements(self, policy, names, classes):
        return order_dependent(policy, names, param_names=True)


register(Torchao())
