"""What every skip dialect shares: the ``Dialect`` interface, the registry, and the records a
policy is made of (``SkipEntry``, ``Decision``).

A dialect module defines one ``Dialect`` subclass and registers an instance with ``register``;
``harness.dialects`` imports every module of the package, so adding a dialect means adding one
module (docs/design.md).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from harness.dialects import names


@dataclass(frozen=True)
class SkipEntry:
    """One raw entry of a skip list, and where it came from.

    ``source`` is the config key (``llm_int8_skip_modules``, ``modules_to_not_convert``,
    ``ignored_layers``, ``fqn_to_config``, ``ignore``, ``config_groups.<g>.targets``) or
    ``default`` / ``keep_in_fp32`` for what transformers adds. ``value`` is the ``FqnToConfig``
    value (``None`` = leave unquantized) or the group name of a target. ``match_as`` are the
    spellings the dialect actually matches (after ``normalise_entry`` or ``vllm_rename_entry``).
    ``honoured`` is False when the dialect's loader never reads this source (bitsandbytes'
    ``modules_to_not_convert``; fp8 ``modules_to_not_convert`` beside a non-empty
    ``ignored_layers``). ``role`` is ``skip`` or ``target`` (compressed-tensors targets, torchao
    keys with a non-None config).
    """

    raw: str
    source: str
    match_as: tuple[str, ...]
    value: Any = None
    honoured: bool = True
    role: str = "skip"


@dataclass(frozen=True)
class Decision:
    """Whether a module stays unquantized under a policy, the entries that decided it, and why."""

    skipped: bool
    entries: tuple[SkipEntry, ...]
    reason: str


@dataclass
class Reading:
    """A ``quantization_config`` being read into entries: what ``Dialect.read`` fills in."""

    config: Mapping[str, Any]
    arch: str | None
    vllm: bool
    normalise: bool
    default_keys: Sequence[str]
    keep_in_fp32: Sequence[str]
    entries: list[SkipEntry] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def spell(self, raw: str, vllm_rename: bool = False) -> tuple[str, ...]:
        """The spellings a dialect matches for a raw entry: renamed by the model's vLLM mapper
        (vLLM dialects, where the config reader remaps), or normalised to memory spelling."""
        if self.vllm:
            return (names.vllm_rename_entry(raw, self.arch),) if (vllm_rename and self.arch) else (raw,)
        return names.normalise_entry(raw, self.arch) if (self.normalise and self.arch) else (raw,)


def class_names(module_class: Any) -> tuple[str, ...]:
    """The class names compressed-tensors' ``_match_class`` looks at: every ``torch.nn.Module``
    class in the MRO. A string ``"Linear"`` stands for ``torch.nn.Linear`` (``Linear``,
    ``Module``); any other string ``X`` for ``(X, "Module")``; a sequence is taken as given; a class
    is walked."""
    if isinstance(module_class, type):
        import torch

        return tuple(c.__name__ for c in module_class.__mro__ if issubclass(c, torch.nn.Module))
    if isinstance(module_class, str):
        return (module_class,) if module_class == "Module" else (module_class, "Module")
    return tuple(module_class)


def is_linear(module_class: Any, vllm: bool) -> bool:
    """``nn.Linear`` (or transformers' ``Conv1D``) for the HF libraries; any ``*Linear`` /
    ``LinearBase`` for vLLM (``ParallelLMHead`` is not one)."""
    names_ = class_names(module_class)
    if vllm:
        return any(n == "Linear" or n == "LinearBase" or n.endswith("Linear") for n in names_)
    return names_[0] in ("Linear", "Conv1D")


@dataclass(frozen=True)
class EntryDisagreement:
    """One place where what a dialect does with a skip entry differs from what its author evidently
    meant. ``kind``: ``overreach`` (matches a module the entry does not name: ``layers.1`` ->
    ``layers.11``), ``wildcard-dot`` (matches only because a ``.`` matched another character),
    ``underreach`` (names the module, dot-bounded, but the dialect does not match it: a
    transformers key ``vision_model`` vs ``model.vision_model.*``, a torchao key naming a container),
    ``unmatched`` (matches no module), ``spelling`` (matches nothing as written, but does in
    memory spelling), ``order-dependent`` (several regex keys decide one module differently, so
    dict order, alphabetical after a transformers save, decides), ``partial-fused-group`` (some
    but not all shards of a group that engines fuse are skipped), ``group-precedence``
    (compressed-tensors and vLLM choose different config groups), ``unread-source`` (the loader
    never reads this key), ``invalid-regex``."""

    entry: str
    module: str | None
    dialect: str
    kind: str
    explanation: str


class PolicyView(Protocol):
    """What a dialect reads of the policy it decides for (harness.dialects.policy.SkipPolicy, which
    is built from this module's registry and so cannot be imported here)."""

    dialect: str
    reader: Dialect
    entries: tuple[SkipEntry, ...]
    config: Mapping[str, Any]
    arch: str | None
    fused_mapping: dict[str, Sequence[str]]

    @property
    def honoured(self) -> tuple[SkipEntry, ...]: ...

    def skips(self, fqn: str, module_class: Any = "Linear") -> bool: ...


class Dialect:
    """One library's reading of one ``quant_method``'s skip list.

    A subclass sets the class attributes and implements ``read``, ``decide`` and ``entry_hits``;
    ``module_disagreements`` is optional. Module names are memory spelling, or vLLM spelling when
    ``vllm`` is set.
    """

    name: str = ""
    quant_method: str = ""
    producer: bool = False  # the quant_method's producer writes its skip list in this dialect
    vllm: bool = False  # names are vLLM prefixes (names.to_vllm), fused shards included
    keys_are_regexes: bool = False  # plain entries are regexes whose dots are wildcards (transformers)
    class_targets: bool = False  # an entry may name a module class (compressed-tensors)
    exact_containers: bool = False  # an entry naming a container applies to that exact module only
    uses_default_keys: bool = False  # reads transformers' default keys (``Reading.default_keys``)
    regex_owner: str = "re"  # the regex engine of the owner (harness.dialects.patterns): "re", or vLLM's "regex"

    def read(self, reading: Reading) -> None:
        """Append the config's entries (and notes) to ``reading``."""
        raise NotImplementedError

    def decide(self, policy: PolicyView, fqn: str, module_class: Any) -> Decision:
        """Whether this dialect's library leaves ``fqn`` unquantized, and why."""
        raise NotImplementedError

    def entry_hits(self, policy: PolicyView, entry: SkipEntry, spelling: str, name: str, module_class: Any) -> bool:
        """Does one spelling of one entry, on its own, reach ``name`` (skip it, or for a target /
        non-None FqnToConfig key, select it)."""
        raise NotImplementedError

    def module_disagreements(self, policy: PolicyView, names_: list[str], classes: Mapping[str, Any]) -> list[EntryDisagreement]:
        """Disagreements about single modules that only this dialect family has."""
        return []

    def __repr__(self) -> str:
        return f"<dialect {self.name}>"


REGISTRY: dict[str, Dialect] = {}


def register(dialect: Dialect) -> Dialect:
    if dialect.name in REGISTRY:
        raise ValueError(f"skip dialect {dialect.name!r} registered twice")
    REGISTRY[dialect.name] = dialect
    return dialect


def readers(quant_method: str) -> list[str]:
    """The dialects that read a quant_method's configs, in registry order."""
    return [d.name for d in REGISTRY.values() if d.quant_method == quant_method]


def producer_dialects() -> dict[str, str]:
    """quant_method -> the dialect its producer writes skip lists in."""
    return {d.quant_method: d.name for d in REGISTRY.values() if d.producer}


def vllm_dialects() -> dict[str, str]:
    """quant_method -> the dialect vLLM 0.32 (plus vllm-bnb-plugin) reads it in."""
    return {d.quant_method: d.name for d in REGISTRY.values() if d.vllm}
