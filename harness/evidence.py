"""What a verdict is judged from, gathered before anything is judged (docs/design.md, "Verdicts").

:func:`gather` attaches to a record every check (``record.checks``: the module diff, the input
sensitivity, the cross-engine checks, then the loaded state, sequences and accuracy against the
baseline, then the load time) and the facts about its baselines (``record.evidence``: whether there
was one, why it is stale, which accuracy tasks it lacks, what is shown but not judged). The one
judgement, harness.judging.decide, then reads only the record, wherever it is: in the run, in
pytest, in the Buildkite merge after new cross-engine checks are added.

Across machines only what carries is judged (docs/design.md, "Portability across CPUs"): against a
baseline from other kernels, a check of what the record computed (harness.checks: ``computed``)
is shown, not judged, where its computation does not carry (harness.records.Computation).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from harness.accuracy import gates as accuracy_gates
from harness.baselines import Baseline, kernel_set_of, other_kernels
from harness.compare import (KnownFailureLike, baseline_key_problems, check_input_sensitivity, check_loaded_state,
                             check_module_diff, compare_sequences, cross_engine)
from harness.loadcheck import check_load_time
from harness.records import Check, Evidence, Record

if TYPE_CHECKING:
    from harness.matrix import Bounds, Cell


def judged_against(record: Record, baseline) -> bool:
    """Whether what ``record`` computed is judged against ``baseline`` (logprob or accuracy): on
    the baseline's own kernels, or where the record's computation carries to other kernels
    (float32, no quantized activation). Elsewhere an FP8 rounding flip or a bfloat16 sum moves
    it by more than any bound that still guards, so it is shown, not judged; a configuration
    cell's record is on other kernels than any baseline's (docs/design.md, "Configurations")."""
    computation = record.computation
    carries = computation is not None and computation.carries
    # a configuration cell's record (harness.configurations) computes with other kernels than the
    # plain cell's it is judged against: an all-reduce or inductor's fused code sums in another order
    return baseline is None or carries or (record.configuration is None and not other_kernels(record, baseline))


def why_not_judged(record: Record, baseline) -> str:
    """Why the checks against ``baseline`` are not judged, for a check's detail and a reason."""
    computation = record.computation
    what = ("its computation is unknown" if computation is None
            else f"it computes in {computation.dtype}" if computation.dtype != "float32"
            else f"it quantizes activations ({', '.join(computation.quantized_activations)})")
    if record.configuration is not None:
        return f"the {record.configuration} configuration computes with other kernels than one rank, eager, and {what}"
    return f"the baseline is from other kernels ({kernel_set_of(baseline)}) and {what}"


def shown(check: Check, why: str) -> Check:
    """``check`` kept for the record and the report, but not judged: ok, its data saying so."""
    return check.model_copy(update={"ok": True, "detail": f"not judged: {why}: {check.detail}",
                                    "data": {**(check.data or {}), "judged": False, "within_bounds": check.ok}})


@dataclass(frozen=True)
class _Gathering:
    record: Record
    baseline: Baseline | None
    bounds: Bounds
    cross_engine_checks: tuple[Check, ...]
    expected_engine_version: str | None
    platform: str | None
    gate_load_time: bool
    accuracy_baseline: object
    keyed_by_version: bool
    load_baseline: Baseline | None

    @cached_property
    def accuracy(self) -> accuracy_gates.AgainstBaseline:
        return accuracy_gates.against_baseline(self.record, self.accuracy_baseline)

    def other_checks(self) -> list[Check]:
        """Those not against the baseline: the module diff, the input sensitivity, the cross-engine checks."""
        md = check_module_diff(self.record)
        sensitivity = check_input_sensitivity(self.record, self.bounds.logprob)
        return [c for c in (md, sensitivity) if c is not None] + list(self.cross_engine_checks)

    def baseline_checks(self) -> list[Check]:
        """The loaded state, the sequences and accuracy against the baseline, then the load time."""
        record, baseline = self.record, self.baseline
        state = check_loaded_state(record, baseline)
        sequences = compare_sequences(baseline.record_sequences(), record.sequences, self.bounds, against="baseline")
        load = check_load_time(record, self.load_baseline or baseline, bound=self.bounds.load_time,
                               gated=self.gate_load_time)
        # which prompts ran carries to any kernels; what they computed may not
        return ([state] if state is not None else []) + [
            self._judged_or_shown(c, baseline) if c.spec.computed else c for c in sequences] + [
            self._judged_or_shown(c, self.accuracy_baseline) for c in self.accuracy.checks] + (
            [load] if load is not None else [])

    def _judged_or_shown(self, check: Check, baseline) -> Check:
        return check if judged_against(self.record, baseline) else shown(check, why_not_judged(self.record, baseline))

    def not_judged(self) -> str | None:
        """What is not judged against its baseline and why, for a reason; None when all is judged."""
        for what, baseline in (("logprobs", self.baseline), ("accuracy", self.accuracy_baseline)):
            if not judged_against(self.record, baseline):
                whose = "the baseline" if what == "logprobs" else "its baseline"
                return f"{what} against {whose} not judged: {why_not_judged(self.record, baseline)}"
        return None

    def stale(self) -> list[str]:
        def problems(baseline) -> list[str]:
            return baseline_key_problems(self.record, baseline, expected_engine_version=self.expected_engine_version,
                                         platform=self.platform, keyed_by_version=self.keyed_by_version)

        found = problems(self.baseline)
        if self.accuracy.checks:
            found += [f"accuracy baseline: {p}" for p in problems(self.accuracy_baseline)] + self.accuracy.stale
        return found

    def record_with_evidence(self) -> Record:
        record = self.record
        if record.status != "ok":  # nothing ran to compare: the verdict reads its status alone
            return record.model_copy(update={"checks": [], "evidence": Evidence(baseline=self.baseline is not None)})
        if self.baseline is None:
            return record.model_copy(update={"checks": self.other_checks(), "evidence": Evidence(baseline=False)})
        evidence = Evidence(baseline=True, stale=self.stale(), accuracy_missing=self.accuracy.missing,
                            not_judged=self.not_judged())
        return record.model_copy(update={"checks": self.other_checks() + self.baseline_checks(), "evidence": evidence})


def gather(record: Record, baseline: Baseline | None, *, bounds: Bounds, cross_engine_checks: Iterable[Check] = (),
           expected_engine_version: str | None = None, platform: str | None = None, gate_load_time: bool = False,
           accuracy_baseline=None, keyed_by_version: bool = True, load_baseline: Baseline | None = None) -> Record:
    """``record`` with its checks and evidence (module docstring), against ``baseline``.
    ``keyed_by_version=False``: the baseline is another build's record of this run, whose engine
    version differs on purpose. ``load_baseline``: the load time's, where not ``baseline``'s
    (harness.resolver)."""
    return _Gathering(record, baseline, bounds, tuple(cross_engine_checks), expected_engine_version, platform,
                      gate_load_time, accuracy_baseline, keyed_by_version, load_baseline).record_with_evidence()


def gather_for(cell: Cell, record: Record, baseline: Baseline | None, others: Iterable[Record] = (), *,
               known_failures: Iterable[KnownFailureLike] = (), unfused: Record | None = None,
               accuracy_baseline=None, load_baseline: Baseline | None = None) -> Record:
    """:func:`gather` with every setting taken from the cell (bounds, the pinned engine version,
    load-time gating) and the cross-engine checks against ``others``, the other engines' records of
    its (model, scheme) in this run, by compare.cross_engine's rule (``known_failures``: the
    group's; ``unfused``: the reference executed unfused)."""
    return gather(record, baseline, bounds=cell.bounds,
                  cross_engine_checks=cross_engine(record, others, cell.bounds, known_failures=known_failures,
                                                   unfused=unfused),
                  expected_engine_version=cell.engine_version, gate_load_time=cell.gate_load_time,
                  accuracy_baseline=accuracy_baseline, load_baseline=load_baseline)
