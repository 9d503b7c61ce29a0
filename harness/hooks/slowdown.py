"""A test-only slowdown inside an engine loader's own work: ``HARNESS_TEST_HOOK=slow=0.2`` (harness.engines.worker).

The engine's load entry point and its work are wrapped (its registry entry: ``slowdown_entry``,
``slowdown_work``): for the reference, ``harness.reference.load`` and its reading
(``TensorSource.get``) and each format's decode entry point; for vLLM, the model loading span
``BaseModelLoader.load_model`` and the copies its weight loaders and weight processing end in. During a load, after each call of its work the same
call is repeated (its result discarded) until the repeated work amounts to ``fraction`` of the
load's own time so far, and once more at the end of the load: a loader that does ``fraction`` more
of its own reading and decoding, never a sleep. Outside a load (a decode called lazily in a
forward pass) nothing is repeated. A call is repeated only while that brings the injected time
nearer the target (the repeated work ends within half a call of it, over or under: a load made
of few large decodes would otherwise overshoot a 20% slowdown by a whole decode); the slowdown
actually injected is measured, not assumed (harness.bench.detection reports it).
"""
from __future__ import annotations

import importlib
import time

from harness.registry import ENGINES


class Slowdown:
    """The state of one injection: when the current load started, how much work it repeated."""

    def __init__(self, fraction: float):
        if not fraction > 0:
            raise ValueError(f"slow={fraction}: the slowdown must be a fraction > 0 (0.2 for 20%)")
        self.fraction = fraction
        self.start: float | None = None  # None outside a load
        self.injected = 0.0
        self._last = None  # the last call of the loader's work, to repeat, and its seconds
        self._depth = 0

    def wrap_entry(self, original):
        def load(*args, **kwargs):
            self.start, self.injected, self._last = time.perf_counter(), 0.0, None
            try:
                result = original(*args, **kwargs)
                if self._last is not None:
                    self._catch_up(self._last)
                return result
            finally:
                self.start = self._last = None

        return load

    def wrap(self, original):
        def work(*args, **kwargs):
            if self.start is None or self._depth:  # outside a load, or inside a call being timed already
                return original(*args, **kwargs)
            self._depth += 1
            try:
                t0 = time.perf_counter()
                result = original(*args, **kwargs)
                self._last = (lambda: original(*args, **kwargs), time.perf_counter() - t0)
                self._catch_up(self._last)
            finally:
                self._depth -= 1
            return result

        return work

    def _catch_up(self, last) -> None:
        repeat, seconds = last
        while self.injected + seconds / 2 < self.fraction * (time.perf_counter() - self.start - self.injected):
            t0 = time.perf_counter()
            repeat()
            seconds = time.perf_counter() - t0
            self.injected += seconds


def _resolve(target: str):
    """(owner, attribute name) of ``module:attr[.attr]``."""
    module_name, _, attr = target.partition(":")
    owner = importlib.import_module(module_name)
    *path, leaf = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, leaf


def targets(engine: str) -> tuple[str, tuple[str, ...]]:
    """(entry, work) of ``engine``'s slowdown hook (its registry entry)."""
    spec = ENGINES[engine]
    if spec.slowdown_entry is None:
        raise ValueError(f"slow=: the {engine} engine has no slowdown hook")
    return spec.slowdown_entry, spec.slowdown_work


def install(fraction: float, entry: str, work: tuple[str, ...]) -> Slowdown:
    """Wrap the entry point and every work target that exists (a format may have no decode)."""
    state = Slowdown(fraction)
    owner, leaf = _resolve(entry)
    setattr(owner, leaf, state.wrap_entry(getattr(owner, leaf)))
    for target in work:
        owner, leaf = _resolve(target)
        original = getattr(owner, leaf, None)
        if original is not None:
            setattr(owner, leaf, state.wrap(original))
    return state
