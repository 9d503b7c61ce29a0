"""``SkipPolicy``: a checkpoint's ``quantization_config``, read in one dialect.

The policy holds the entries and answers questions; what each dialect reads and how it matches
lives in that dialect's module (docs/design.md).
"""
from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

from harness import architectures
from harness.dialects import patterns
from harness.dialects.base import REGISTRY, Decision, Dialect, Reading, SkipEntry, producer_dialects, readers
from harness.errors import CheckpointError


class SkipPolicy:
    """A checkpoint's ``quantization_config`` read in one dialect.

    ``skips(fqn, module_class)`` answers "does this dialect's library leave the module
    unquantized". ``fqn`` is in memory spelling for the transformers / torchao /
    compressed-tensors dialects and in vLLM spelling (``names.to_vllm``) for the ``vllm-*`` dialects.

    Build it with ``SkipPolicy.from_quantization_config(qc)``:

    - ``dialect``: default is the producer's (``PRODUCER_DIALECT``); ``VLLM_DIALECT`` gives vLLM's.
    - ``arch``: for ``normalise=True`` (entries rewritten with ``normalise_entry``, i.e. what the
      producer meant in whatever spelling it wrote) and for the vLLM dialects (fp8 and
      compressed-tensors entries renamed with ``vllm_rename_entry``, packed modules from the
      architecture registry).
    - ``normalise=False`` matches raw entries: what transformers 5.19 itself does with them.
    - ``default_keys``: what ``get_keys_to_not_convert(model)`` gives for this model (use
      ``transformers_default_skip_keys(model)``); ``keep_in_fp32``: ``model._keep_in_fp32_modules``.
    """

    def __init__(
        self,
        quant_method: str,
        dialect: str,
        entries: Sequence[SkipEntry],
        config: Mapping[str, Any],
        arch: str | None = None,
        fused_mapping: Mapping[str, Sequence[str]] | None = None,
        notes: Sequence[str] = (),
    ):
        if dialect not in REGISTRY:
            raise ValueError(f"unknown skip dialect {dialect!r}; one of {tuple(REGISTRY)}")
        self.quant_method = quant_method
        self.dialect = dialect
        self.reader: Dialect = REGISTRY[dialect]
        self.entries = tuple(entries)
        self.config = config
        self.arch = architectures.canonical(arch)
        self.fused_mapping = dict(fused_mapping or {})
        self.notes = tuple(notes)

    def __repr__(self) -> str:
        return f"SkipPolicy({self.quant_method!r}, {self.dialect!r}, {len(self.entries)} entries)"

    @classmethod
    def from_quantization_config(
        cls,
        quantization_config: Mapping[str, Any],
        *,
        dialect: str | None = None,
        arch: str | None = None,
        normalise: bool = False,
        default_keys: Sequence[str] = ("lm_head",),
        keep_in_fp32: Sequence[str] = (),
        fused_mapping: Mapping[str, Sequence[str]] | None = None,
    ) -> SkipPolicy:
        qc = quantization_config
        method = qc.get("quant_method")
        method = getattr(method, "value", method)
        producers = producer_dialects()
        if method not in producers:
            raise CheckpointError("quantization_config", f"quant_method {method!r} has no skip dialect here")
        dialect = dialect or producers[method]
        reader = REGISTRY.get(dialect)
        if reader is None or reader.quant_method != method:
            raise ValueError(f"{method} configs are read in {' or '.join(readers(method))}, not {dialect}")
        arch = architectures.canonical(arch)
        spec = architectures.get(arch)
        if reader.vllm and fused_mapping is None and spec is not None and spec.vllm_packed_modules is not None:
            fused_mapping = spec.vllm_packed_modules
        reading = Reading(qc, arch, reader.vllm, normalise, default_keys, keep_in_fp32)
        reader.read(reading)
        return cls(method, dialect, reading.entries, qc, arch, fused_mapping, reading.notes)

    @contextlib.contextmanager
    def checked(self, where: str):
        """Within: a skip entry its owner cannot compile, or one whose match runs past the time
        limit (harness.dialects.patterns), is a ``CheckpointError(where, ...)`` naming the entry."""
        try:
            yield
        except (re.error, patterns.PatternTimeout) as e:
            pattern = getattr(e, "pattern", None)
            entry = self.entry_for(pattern) if isinstance(pattern, str) else None
            what = f"quantization_config.{entry.source}: entry {entry.raw!r}" if entry else f"pattern {pattern!r}"
            raise CheckpointError(where, f"{what}: {getattr(e, 'reason', e)}") from None

    def entry_for(self, pattern: str) -> SkipEntry | None:
        """The entry a regular expression the dialect matched came from (a spelling, its ``re:``
        body, or transformers' ``<key>\\.``), for naming it in an error; None if none."""
        for e in self.entries:
            for s in e.match_as:
                body = s.removeprefix("re:")
                if pattern in (s, body) or (body and pattern == body + "\\."):
                    return e
        return None

    def from_source(self, source: str) -> list[SkipEntry]:
        """The entries that came from one config key (``source`` prefix match for config groups)."""
        return [e for e in self.entries if e.source == source or e.source.startswith(source + ".")]

    @property
    def honoured(self) -> tuple[SkipEntry, ...]:
        return tuple(e for e in self.entries if e.honoured)

    def skips(self, fqn: str, module_class: Any = "Linear") -> bool:
        """True when this dialect's library leaves ``fqn`` unquantized. May raise what the owner
        raises (``re.error`` on a bad transformers key, ``ValueError`` on mixed fused shards in vLLM)."""
        return self.decide(fqn, module_class).skipped

    def decide(self, fqn: str, module_class: Any = "Linear") -> Decision:
        return self.reader.decide(self, fqn, module_class)
