"""The verdict of a record (docs/design.md, "Verdicts"): ``VERDICT_ORDER``, the one place the
order is written, a sequence of steps that each judge a record or pass it on; ``verdict()`` applies
it to one record and its baseline; ``judge()`` is verdict() with the cell's settings and the
cross-engine checks, the entry point the runner uses; ``rounding_flip()`` the verdict a
localisation between engines may settle after it. The checks themselves are harness.compare's.

Across machines only what carries is judged (docs/design.md, "Portability across CPUs"): against a
baseline from other kernels, a cell whose computation carries (harness.records.Computation) is
judged as on the baseline's own kernels; one that quantizes activations or computes in bfloat16 is
judged by its loaded state and the other engines of its run, its logprobs against the baseline
shown, not judged (``portable-pass``).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from harness.accuracy import gates as accuracy_gates
from harness.accuracy.store import AccuracyBaseline
from harness.baselines import Baseline, kernel_set_of
from harness import verdicts
from harness.compare import (Judgement, KnownFailureLike, applicable, baseline_key_problems, check_input_sensitivity,
                             SEQUENCE_CHECKS, check_load_time, check_loaded_state, check_module_diff, compare_sequences, cross_engine,
                             disagreement, failed_or_waived, fmt, match_error, other_kernels)
from harness.records import Check, Record
from harness.registry import ENGINE_NAMES

if TYPE_CHECKING:
    from harness.matrix import Bounds, Cell


@dataclass(frozen=True)
class _Case:
    """One record with everything verdict() was given to judge it. Each check is computed once, by
    the first step that needs it: the steps before the baseline's need none of the baseline's."""

    record: Record
    baseline: Baseline | None
    bounds: Bounds
    known_failures: tuple[KnownFailureLike, ...]
    cross_engine_checks: tuple[Check, ...]
    expected_engine_version: str | None
    platform: str | None
    gate_load_time: bool
    accuracy_baseline: object
    keyed_by_version: bool = True  # False against another build of the same run (judge_against_base)
    # the baseline of the load time where it is not ``baseline`` (baselines.load_baseline_for)
    load_baseline: Baseline | None = None
    # checks a rounding flip between engines explained (rounding_flip(), by name), which pass in
    # place of the same checks computed here
    explained: tuple[Check, ...] = ()

    def _settled(self, checks: list[Check]) -> list[Check]:
        flipped = {c.name: c for c in self.explained}
        return [flipped.get(c.name, c) if not c.ok else c for c in checks]

    @cached_property
    def known(self) -> list[KnownFailureLike]:
        """The known failures covering this engine version."""
        return applicable(self.known_failures, self.record.engine, self.record.engine_info.version)

    @cached_property
    def other_checks(self) -> list[Check]:
        """The checks not against the baseline: the module diff, the input sensitivity, then the
        cross-engine checks."""
        record = self.record
        md = check_module_diff(record)
        sensitivity = check_input_sensitivity(record, self.bounds.logprob)
        return [c for c in (md, sensitivity) if c is not None] + self._settled(list(self.cross_engine_checks))

    @cached_property
    def disagreement(self) -> Judgement | None:
        return disagreement(self.record, self.other_checks, self.known_failures)

    @property
    def waiver(self) -> Judgement | None:
        """Step 3's waiver, which holds only as far as the engine's recorded behaviour (step 6)."""
        j = self.disagreement
        return j if j is not None and j.verdict == "waived" else None

    @cached_property
    def other_kernels(self) -> bool:
        """Whether the baseline was recorded on other kernels than this run's."""
        return self.baseline is not None and other_kernels(self.record, self.baseline)

    def judged_against(self, baseline) -> bool:
        """Whether what the record computed is judged against ``baseline`` (logprob or accuracy): on
        the baseline's own kernels, or where the record's computation carries to other kernels
        (float32, no quantized activation). Elsewhere an FP8 rounding flip or a bfloat16 sum moves
        it by more than any bound that still guards, so it is shown, not judged (docs/design.md,
        "Portability across CPUs")."""
        computation = self.record.computation
        return (baseline is None or not other_kernels(self.record, baseline)
                or (computation is not None and computation.carries))

    @property
    def judges_logprobs(self) -> bool:
        """Whether every check against a stored baseline is judged (:meth:`judged_against`)."""
        return self.not_judged is None

    @property
    def not_judged(self) -> str | None:
        """What is not judged against its baseline and why, for a reason; None when all is judged."""
        if not self.judged_against(self.baseline):
            return f"logprobs against the baseline not judged: {self.why_not_judged(self.baseline)}"
        if not self.judged_against(self.accuracy_baseline):
            return f"accuracy against its baseline not judged: {self.why_not_judged(self.accuracy_baseline)}"
        return None

    @cached_property
    def accuracy(self) -> accuracy_gates.AgainstBaseline:
        return accuracy_gates.against_baseline(self.record, self.accuracy_baseline)

    @cached_property
    def baseline_checks(self) -> list[Check]:
        """The loaded state, the sequences and accuracy against the baseline (not the load time)."""
        record, baseline = self.record, self.baseline
        state = check_loaded_state(record, baseline)
        sequences = compare_sequences(baseline.record_sequences(), record.sequences, self.bounds, against="baseline")
        # which prompts ran carries to any kernels; what they computed may not
        return ([state] if state is not None else []) + [
            c if c.name.startswith("prompts:") else self._judged_or_shown(c, baseline) for c in sequences] + [
            self._judged_or_shown(c, self.accuracy_baseline) for c in self.accuracy.checks]

    def _judged_or_shown(self, check: Check, baseline) -> Check:
        return check if self.judged_against(baseline) else _shown(check, self.why_not_judged(baseline))

    def why_not_judged(self, baseline) -> str:
        """Why the checks against ``baseline`` are not judged, for a check's detail and a reason."""
        computation = self.record.computation
        what = ("its computation is unknown" if computation is None
                else f"it computes in {computation.dtype}" if computation.dtype != "float32"
                else f"it quantizes activations ({', '.join(computation.quantized_activations)})")
        return f"the baseline is from other kernels ({kernel_set_of(baseline)}) and {what}"

    @cached_property
    def load_check(self) -> Check | None:
        return check_load_time(self.record, self.load_baseline or self.baseline, bound=self.bounds.load_time,
                               gated=self.gate_load_time)

    @property
    def checks(self) -> list[Check]:
        """Every check, as a judgement from step 4 on carries them."""
        load = [self.load_check] if self.load_check is not None else []
        return self.other_checks + self.baseline_checks + load

    def key_problems(self, baseline) -> list[str]:
        return baseline_key_problems(self.record, baseline, expected_engine_version=self.expected_engine_version,
                                     platform=self.platform, keyed_by_version=self.keyed_by_version)


def _probe_unsupported(case: _Case) -> Judgement | None:
    """1. Status unsupported (a capability probe) -> unsupported."""
    if case.record.status != "unsupported":
        return None
    return Judgement("unsupported", case.record.unsupported_reason or "unsupported")


def _engine_error(case: _Case) -> Judgement | None:
    """2. Status error: a known failure (engine, version range, pattern) matches -> unsupported with
    its reason; otherwise -> error."""
    if case.record.status != "error":
        return None
    k = match_error(case.known_failures, case.record)
    if k is not None:
        return Judgement("unsupported", f"known failure: {k.reason}", known_failure=k)
    err = case.record.error
    first_line = (err.message.strip().splitlines() or [""])[0]
    return Judgement("error", f"{err.type}: {first_line}")


def _disagreement(case: _Case) -> Judgement | None:
    """3. Module diff, an output that does not depend on its image or audio (the input
    sensitivity), or cross-engine disagreement beyond the bounds (accuracy's checks against
    other engines among them) -> failed. When known failures match every failing check, the cell
    is waived only if it also agrees with its own baseline, the engine's recorded known behaviour
    (steps 4, 6 and 8): a known failure never excuses a second bug in the same cell."""
    j = case.disagreement
    return j if j is not None and j.verdict == "failed" else None


def _missing_baseline(case: _Case) -> Judgement | None:
    """4. No baseline -> missing-baseline."""
    if case.baseline is not None:
        return None
    if case.waiver is not None:
        return Judgement("missing-baseline", f"no baseline stored for this cell: {_excused(case)} only as far "
                         "as this engine's recorded behaviour; run with --update-baselines to record it", case.other_checks)
    return Judgement("missing-baseline", "no baseline stored for this cell; run with --update-baselines to create one",
                     case.other_checks)


def _missing_accuracy_baseline(case: _Case) -> Judgement | None:
    """4, for accuracy: a task with no value in the accuracy baseline -> missing-baseline."""
    if not case.accuracy.missing:
        return None
    return Judgement("missing-baseline", f"no accuracy baseline for {', '.join(case.accuracy.missing)}; run with "
                     "--update-baselines to create one", case.checks)


def _stale_baseline(case: _Case) -> Judgement | None:
    """5. Baseline from another engine version / platform (or fixture, source), or an accuracy
    baseline's, or a changed accuracy task -> stale-baseline (the baseline checks are still run and
    reported)."""
    stale = case.key_problems(case.baseline)
    if case.accuracy.checks:
        stale += [f"accuracy baseline: {p}" for p in case.key_problems(case.accuracy_baseline)] + case.accuracy.stale
    return Judgement("stale-baseline", "; ".join(stale), case.checks) if stale else None


def _regressed(case: _Case) -> Judgement | None:
    """6. A judged baseline check fails (the loaded state and accuracy among them) -> regressed, or
    waived when known failures match every failing check. A cell that step 3 waived is failed
    instead: it left its known failure's recorded behaviour. Where the logprobs are not judged
    (_Case.judges_logprobs), that is the loaded state alone."""
    failing = [c for c in case.baseline_checks if not c.ok]
    if case.waiver is not None:
        return Judgement("failed", f"{_excused(case)}, but this run left its recorded behaviour: "
                         + "; ".join(f"{c.name}: {c.detail}" for c in failing), case.checks,
                         case.waiver.known_failure) if failing else None
    return failed_or_waived("regressed", case.known, failing, case.checks) if failing else None


def _load_time_regressed(case: _Case) -> Judgement | None:
    """7. Gated tier and load-time ratio > bound -> regressed (same waiver rule)."""
    load = case.load_check
    if load is None or load.ok:
        return None
    # a load time is judged on any kernels of its kind of CPU; the logprobs still as step 6 says
    return dataclasses.replace(failed_or_waived("regressed", case.known, [load], case.checks),
                               loaded_state_only=not case.judges_logprobs)


def _waived(case: _Case) -> Judgement | None:
    """8. Step 3's waiver, once the baseline checks held -> waived."""
    j = case.waiver
    if j is None:
        return None
    within = ("within its baseline" if case.judges_logprobs
              else f"its loaded state equal to its baseline's; {case.not_judged}")
    return Judgement("waived", f"{j.reason}; {within}", case.checks, j.known_failure,
                     loaded_state_only=not case.judges_logprobs)


def _shown(check: Check, why: str) -> Check:
    """``check`` kept for the record and the report, but not judged: ok, its data saying so."""
    return check.model_copy(update={"ok": True, "detail": f"not judged: {why}: {check.detail}",
                                    "data": {**(check.data or {}), "judged": False, "within_bounds": check.ok}})


def _excused(case: _Case) -> str:
    """Which known failure excuses which checks, for a reason."""
    k = case.waiver.known_failure
    excused = ", ".join(c.name for c in case.other_checks if not c.ok)
    return f"known failure {k.pattern!r} ({k.engine} {k.versions}) excuses {excused}"


def _unexpected_pass(case: _Case) -> Judgement | None:
    """9. A known failure covers this engine version, yet all passed -> unexpected-pass; but
    portable-pass where the logprobs are not judged and other engines ran: a known failure about
    them, which the baseline from other kernels records, need not show on these kernels."""
    if not case.known:
        return None
    k, record = case.known[0], case.record
    if not case.judges_logprobs and case.cross_engine_checks:
        return _portable_pass(case, f"; known failure {k.pattern!r} ({k.engine} {k.versions}) does not show on these kernels")
    absent = _compared_with_absent_engine(k, record, case.cross_engine_checks)
    if absent:
        return Judgement("waived", f"no comparison with the {absent} ran here, so known failure {k.pattern!r} "
                         f"({k.engine} {k.versions}), about it, can neither show nor be refuted; matches its baseline, "
                         f"which records that behaviour (run the {absent} too to decide it)", case.checks, k,
                         loaded_state_only=not case.judges_logprobs)
    return Judgement("unexpected-pass", f"passes, but a known failure covers {record.engine} "
                     f"{record.engine_info.version}: {k.reason}; remove or narrow it in models.yaml", case.checks, k)


def _compared_with_absent_engine(k: KnownFailureLike, record: Record, cross_engine_checks: Iterable[Check]) -> str | None:
    """The engine with which a comparison of ``record`` would match the known failure, where no
    check against that engine ran here (a run of one engine: `harness run -k vllm`)."""
    compared = {c.name.partition(":")[2] for c in cross_engine_checks}
    return next((engine for engine in ENGINE_NAMES if engine != record.engine and engine not in compared
                 and any(k.matches(f"{check}:{engine}: ") for check in SEQUENCE_CHECKS)), None)


def _improved(case: _Case) -> Judgement | None:
    """10. Gated tier and load-time ratio < 1/bound -> improved."""
    load = case.load_check
    if load is None or not load.data or not load.data.get("improved"):
        return None
    return Judgement("improved", f"{load.name}: {load.detail}", case.checks)


def _portable_pass(case: _Case, note: str = "") -> Judgement | None:
    """11. The logprobs are not judged (_Case.judges_logprobs), and every judged check held ->
    portable-pass: never counted as pass, its reason says what was judged and what could not be."""
    if case.judges_logprobs:
        return None
    state = next((c for c in case.baseline_checks if c.name == "loaded-state:baseline"), None)
    engines = [c.name.partition(":")[2] for c in case.cross_engine_checks if c.name.startswith("teacher-forced:")]
    said = [f"loaded state exact ({state.data['modules']} modules)" if state is not None
            else "loaded state not compared (no digest on one side)",
            f"agrees with {', '.join(dict.fromkeys(engines))} in this run" if engines
            else "no other engine in this run to agree with"]
    return Judgement("portable-pass", f"{'; '.join(said)}; {case.not_judged} (record this kind's: harness run "
                     f"--update-kernel-baselines -k {case.record.scheme}){note}", case.checks, loaded_state_only=True)


def _pass(case: _Case) -> Judgement:
    """12. Otherwise pass."""
    return Judgement("pass", "matches the baseline", case.checks)


# The verdict order of docs/design.md, "Verdicts": each step judges the record or passes it on.
VERDICT_ORDER: tuple[Callable[[_Case], Judgement | None], ...] = (
    _probe_unsupported,
    _engine_error,
    _disagreement,
    _missing_baseline,
    _missing_accuracy_baseline,
    _stale_baseline,
    _regressed,
    _load_time_regressed,
    _waived,
    _unexpected_pass,
    _improved,
    _portable_pass,
    _pass,
)


def verdict(record: Record, baseline: Baseline | None, *, bounds: Bounds,
            known_failures: Iterable[KnownFailureLike] = (), cross_engine_checks: Iterable[Check] = (),
            expected_engine_version: str | None = None, platform: str | None = None,
            gate_load_time: bool = False, accuracy_baseline=None, keyed_by_version: bool = True,
            explained: Iterable[Check] = (), load_baseline: Baseline | None = None) -> Judgement:
    """The verdict of one record: the judgement of the first step of VERDICT_ORDER that judges it
    (each step's docstring gives its rule and its number in docs/design.md, "Verdicts").
    ``keyed_by_version=False``: the baseline is another build's record of this run, whose engine
    version differs on purpose. ``explained``: the checks of a rounding flip's judgement
    (:func:`settle_flip`). ``load_baseline``: the load time's, where not ``baseline``'s
    (baselines.load_baseline_for)."""
    case = _Case(record, baseline, bounds, tuple(known_failures), tuple(cross_engine_checks),
                 expected_engine_version, platform, gate_load_time, accuracy_baseline, keyed_by_version,
                 load_baseline, tuple(explained))
    return next(j for j in (step(case) for step in VERDICT_ORDER) if j is not None)


def judge(cell: Cell, record: Record, baseline: Baseline | None, others: Iterable[Record] = (), *,
          known_failures: Iterable[KnownFailureLike] = (), unfused: Record | None = None,
          accuracy_baseline=None, explained: Iterable[Check] = (), load_baseline: Baseline | None = None) -> Judgement:
    """verdict() with every setting taken from the cell (bounds, known failures, the pinned engine
    version, load-time gating) and the cross-engine checks against ``others``, the other engines'
    records of its (model, scheme) in this run, by cross_engine()'s rule (``known_failures``: the
    group's; ``unfused``: the reference executed unfused), and the cell's accuracy baseline
    (``accuracy_baseline``, harness.accuracy.store)."""
    return verdict(
        record,
        baseline,
        bounds=cell.bounds,
        known_failures=cell.known_failures,
        cross_engine_checks=cross_engine(record, others, cell.bounds, known_failures=known_failures, unfused=unfused),
        expected_engine_version=cell.engine_version,
        gate_load_time=cell.gate_load_time,
        accuracy_baseline=accuracy_baseline,
        explained=explained,
        load_baseline=load_baseline,
    )


def judge_against_base(cell: Cell, record: Record, base: Record, others: Iterable[Record] = (), *,
                       known_failures: Iterable[KnownFailureLike] = (), unfused: Record | None = None) -> Judgement:
    """A candidate build's record judged against ``base``, the pinned build's judged record of the
    same cell in this run (docs/design.md, "Candidate builds"): the base's record stands in for the
    baseline (sequences with the family bounds, the loaded state exactly, accuracy by the paired
    gate), unkeyed by engine version, and the cross-engine checks are the candidate's own. A known
    failure of the base that the candidate no longer shows is ``fixed``; a known failure that the
    base does not match (none, or another) is named as new."""
    ok = base.status == "ok"
    j = verdict(record, Baseline.from_record(base) if ok else None, bounds=cell.bounds,
                known_failures=cell.known_failures,
                cross_engine_checks=cross_engine(record, others, cell.bounds, known_failures=known_failures,
                                                 unfused=unfused),
                gate_load_time=cell.gate_load_time, keyed_by_version=False,
                accuracy_baseline=AccuracyBaseline.from_record(base) if ok and base.accuracy else None)
    base_name = f"base {base.engine} {base.engine_info.version or '(version unknown)'}"
    # what vouches for the candidate: a base that could not run at all, or another engine of this run
    vouched = base.status != "ok" or any(c.name.partition(":")[2] not in ("baseline", "") for c in j.checks)
    if base.known_failure is not None and record.status == "ok" and vouched and disagreement(record, j.checks) is None:
        k = base.known_failure
        return Judgement("fixed", f"{base_name} is {base.verdict} by known failure {k.pattern!r} ({k.engine} "
                         f"{k.versions}); the candidate agrees with the other engines of this run", j.checks)
    if j.verdict == "missing-baseline":
        return Judgement("missing-baseline", f"{base_name} has no results to compare with ({base.verdict}: "
                         f"{base.verdict_reason})", j.checks, j.known_failure)
    if j.known_failure is not None and record.status == "ok" and not vouched and all(c.ok for c in j.checks):
        # The candidate agrees with the base, and no other engine of this run can show the known
        # failure's pattern (a run of one engine): it behaves as the base does, whatever that is.
        if base.known_failure is not None:
            k = base.known_failure
            return Judgement("waived", f"against {base_name}: the same within the bounds, and the base is {base.verdict} "
                             f"by known failure {k.pattern!r} ({k.engine} {k.versions})", j.checks, k)
        return Judgement("pass", f"against {base_name}: the same within the bounds; no other engine in this run can "
                         "show the known failure that covers it, for the candidate or the base", j.checks)
    if j.known_failure is not None and (base.known_failure is None or base.known_failure.pattern != j.known_failure.pattern):
        return Judgement(j.verdict, f"new in the candidate: {j.reason}", j.checks, j.known_failure)
    return Judgement(j.verdict, f"against {base_name}: {j.reason}", j.checks, j.known_failure)


def settle_flip(judged: Record, rejudge: Callable[[list[Check]], Judgement]) -> Judgement | None:
    """The verdict of a localised record once rounding flips explain its failing logprobs against
    other engines (:func:`rounding_flip`): ``rejudge``, the verdict order run again with the
    explained checks passing, its reason ending in the flips' (a pass: the flips' alone); None when
    no flip explains them. A disagreement with another engine is judged (step 3) before the
    baseline is read, so a flip that explains it leaves every later step to run: the baseline's
    key, its sequences and loaded state, the load time."""
    flip = rounding_flip(judged)
    if flip is None:
        return None
    settled = rejudge([c for c in flip.checks if c.data and "rounding_flip" in c.data])
    return dataclasses.replace(settled, reason=flip.reason if settled.verdict == "pass" else f"{settled.reason}; {flip.reason}")


# The checks a rounding flip can move: the logprobs, not the loaded state, the load time or accuracy.
FLIP_MOVES = ("teacher-forced", "greedy")


def rounding_flip(record: Record) -> Judgement | None:
    """A ``failed`` record whose disagreement with other engines rounding flips explain, judged
    ``pass`` (docs/design.md, "Cross-engine"); None when the rule does not apply, and the record
    keeps its verdict.

    The rule: every failing check is a logprob check against another engine (same machine, same
    kernels); for each engine, the localisation against it shows a rounding flip on every prompt
    that differs (harness.traces.flips), among them every prompt whose logprobs fail there: a flip
    on one prompt explains nothing on another; and every module's effective weights equal that
    engine's (harness.traces.flips.explain_across requires it). Nothing is explained away against a
    baseline: there, other kernels leave such a cell's logprobs unjudged instead."""
    if record.verdict not in verdicts.LOCALISED:  # the rule reads the localisation
        return None
    failing = [c for c in record.checks if not c.ok]
    if not failing or any(c.name.partition(":")[0] not in FLIP_MOVES or c.name.endswith(":baseline") for c in failing):
        return None
    shown = {}
    for against in dict.fromkeys(c.name.partition(":")[2] for c in failing):
        loc = next((x for x in record.localisation if x.against == against), None)
        flip = loc.rounding_flip if loc is not None else None
        if flip is None or not flip.explained:
            return None
        flipped = {a.prompt for a in flip.at}
        for c in (c for c in failing if c.name.endswith(f":{against}")):
            prompts = _failing_prompts(c)
            if prompts is None or not prompts <= flipped:
                return None
        tf = next((c for c in failing if c.name == f"teacher-forced:{against}" and c.data), None)
        worst = tf.data["worst"] if tf is not None else None
        where = f", largest move {fmt(worst['delta'])} at prompt {worst['prompt']} position {worst['position']}" if worst else ""
        shown[against] = (flip, f"{flip.detail}{where}; every module's effective weights equal to {against}'s, same kernels")
    checks = [c if c.ok else c.model_copy(update={
        "ok": True, "detail": f"explained by a rounding flip ({shown[c.name.partition(':')[2]][0].detail}): {c.detail}",
        "data": {**(c.data or {}), "rounding_flip": shown[c.name.partition(':')[2]][0].model_dump()}})
        for c in record.checks]
    return Judgement("pass", "; ".join(reason for _, reason in shown.values()), checks)


def _failing_prompts(check: Check) -> set[str] | None:
    """The prompts on which a failing logprob check fails (None: its data does not say)."""
    data = check.data or {}
    if check.name.startswith("greedy:"):
        return {d["prompt"] for d in data.get("divergences", []) if not d["ok"]}
    exceeding = data.get("exceeding_prompts")
    return set(exceeding) if exceeding is not None else None
