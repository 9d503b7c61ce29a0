"""The verdict of a record (docs/design.md, "Verdicts"): ``VERDICT_ORDER``, the one place the
order is written, a sequence of steps that each judge a record or pass it on, and :func:`decide`,
the one judgement, which applies it to a record whose checks and evidence are gathered
(harness.evidence). Before it, a cell that fails may be localised (:func:`needs_localisation`) and
rounding flips between engines it shows explained (:func:`explain_flips`). ``verdict()`` and
``judge()`` gather and decide in one call, for a record and a baseline in hand;
``judge_against_base()`` judges a candidate build against the pinned build's record of the run.

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

from harness import evidence
from harness.accuracy.store import AccuracyBaseline
from harness.baselines import Baseline
from harness.compare import (Judgement, KnownFailureLike, applicable, cross_engine, disagreement, failed_or_waived, fmt,
                             match_error)
from harness.checks import KINDS
from harness.records import Check, Evidence, Record
from harness.registry import ENGINE_NAMES

if TYPE_CHECKING:
    from harness.matrix import Bounds, Cell


@dataclass(frozen=True)
class _Case:
    """One record with its gathered checks and evidence (harness.evidence), and the cell's known
    failures: all a step reads."""

    record: Record
    known_failures: tuple[KnownFailureLike, ...]

    @property
    def evidence(self) -> Evidence:
        return self.record.evidence

    @property
    def checks(self) -> list[Check]:
        return list(self.record.checks)

    @cached_property
    def other_checks(self) -> list[Check]:
        """The checks not against the baseline: the module diff, the input sensitivity, the cross-engine checks."""
        return [c for c in self.record.checks if not c.against_baseline]

    @cached_property
    def cross_engine_checks(self) -> list[Check]:
        return [c for c in self.other_checks if c.cross_engine]

    @cached_property
    def baseline_checks(self) -> list[Check]:
        """The loaded state, the sequences and accuracy against the baseline (not the load time)."""
        return [c for c in self.record.checks if c.against_baseline and c.kind != "load-time"]

    @cached_property
    def load_check(self) -> Check | None:
        return next((c for c in self.record.checks if c.kind == "load-time"), None)

    @cached_property
    def known(self) -> list[KnownFailureLike]:
        """The known failures covering this engine version."""
        return applicable(self.known_failures, self.record.engine, self.record.engine_info.version)

    @cached_property
    def disagreement(self) -> Judgement | None:
        return disagreement(self.record, self.other_checks, self.known_failures)

    @property
    def waiver(self) -> Judgement | None:
        """Step 3's waiver, which holds only as far as the engine's recorded behaviour (step 6)."""
        j = self.disagreement
        return j if j is not None and j.verdict == "waived" else None

    @property
    def judges_logprobs(self) -> bool:
        """Whether every check against a stored baseline is judged (harness.evidence.judged_against)."""
        return self.evidence.not_judged is None


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
    """4. No baseline, or an accuracy task with no value in the accuracy baseline -> missing-baseline."""
    if case.evidence.accuracy_missing:
        return Judgement("missing-baseline", f"no accuracy baseline for {', '.join(case.evidence.accuracy_missing)}; "
                         "run with --update-baselines to create one", case.checks)
    if case.evidence.baseline:
        return None
    if case.waiver is not None:
        return Judgement("missing-baseline", f"no baseline stored for this cell: {_excused(case)} only as far "
                         "as this engine's recorded behaviour; run with --update-baselines to record it", case.checks)
    return Judgement("missing-baseline", "no baseline stored for this cell; run with --update-baselines to create one",
                     case.checks)


def _stale_baseline(case: _Case) -> Judgement | None:
    """5. Baseline from another engine version / platform (or fixture, source), or an accuracy
    baseline's, or a changed accuracy task -> stale-baseline (the baseline checks are still run and
    reported)."""
    stale = case.evidence.stale
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
    return failed_or_waived("regressed", case.known, [load], case.checks)


def _waived(case: _Case) -> Judgement | None:
    """8. Step 3's waiver, once the baseline checks held -> waived."""
    j = case.waiver
    if j is None:
        return None
    within = ("within its baseline" if case.judges_logprobs
              else f"its loaded state equal to its baseline's; {case.evidence.not_judged}")
    return Judgement("waived", f"{j.reason}; {within}", case.checks, j.known_failure)


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
                         f"which records that behaviour (run the {absent} too to decide it)", case.checks, k)
    return Judgement("unexpected-pass", f"passes, but a known failure covers {record.engine} "
                     f"{record.engine_info.version}: {k.reason}; remove or narrow it in models.yaml", case.checks, k)


def _compared_with_absent_engine(k: KnownFailureLike, record: Record, cross_engine_checks: Iterable[Check]) -> str | None:
    """The engine with which a comparison of ``record`` would match the known failure, where no
    check against that engine ran here (a run of one engine: `harness run -k vllm`)."""
    compared = {c.against for c in cross_engine_checks}
    return next((engine for engine in ENGINE_NAMES if engine != record.engine and engine not in compared
                 and any(k.matches(f"{kind.name}:{engine}: ") for kind in KINDS.values() if kind.sequence)), None)


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
    state = next((c for c in case.baseline_checks if c.kind == "loaded-state"), None)
    engines = [c.against for c in case.cross_engine_checks if c.kind == "teacher-forced"]
    said = [f"loaded state exact ({state.data['modules']} modules)" if state is not None
            else "loaded state not compared (no digest on one side)",
            f"agrees with {', '.join(dict.fromkeys(engines))} in this run" if engines
            else "no other engine in this run to agree with"]
    # a configuration cell has no baseline of its own to record (harness.configurations)
    record_it = ("" if case.record.configuration else
                 f" (record this kind's: harness run --update-kernel-baselines -k {case.record.scheme})")
    return Judgement("portable-pass", f"{'; '.join(said)}; {case.evidence.not_judged}{record_it}{note}", case.checks)


def _pass(case: _Case) -> Judgement:
    """12. Otherwise pass."""
    return Judgement("pass", "matches the baseline", case.checks)


# The verdict order of docs/design.md, "Verdicts": each step judges the record or passes it on.
VERDICT_ORDER: tuple[Callable[[_Case], Judgement | None], ...] = (
    _probe_unsupported,
    _engine_error,
    _disagreement,
    _missing_baseline,
    _stale_baseline,
    _regressed,
    _load_time_regressed,
    _waived,
    _unexpected_pass,
    _improved,
    _portable_pass,
    _pass,
)


def decide(record: Record, known_failures: Iterable[KnownFailureLike] = ()) -> Judgement:
    """The verdict of a record whose checks and evidence are gathered (harness.evidence.gather):
    the judgement of the first step of VERDICT_ORDER that judges it (each step's docstring gives
    its rule and its number in docs/design.md, "Verdicts"), with the cell's ``known_failures``.
    The one judgement of a record, in a run, in pytest and in the Buildkite merge alike."""
    if record.evidence is None:
        raise ValueError(f"{record.cell}: judged before its evidence was gathered (harness.evidence.gather)")
    j = next(j for j in (step(_Case(record, tuple(known_failures))) for step in VERDICT_ORDER) if j is not None)
    flips = record.evidence.rounding_flips
    if flips:  # what explained the failing checks against other engines, in the reason
        j = dataclasses.replace(j, reason=flips if j.verdict == "pass" else f"{j.reason}; {flips}")
    # every check gathered goes with the verdict, whichever step decided it
    return dataclasses.replace(j, checks=list(record.checks), evidence=record.evidence)


def verdict(record: Record, baseline: Baseline | None, *, bounds: Bounds,
            known_failures: Iterable[KnownFailureLike] = (), **gathering) -> Judgement:
    """:func:`decide` on ``record`` gathered against ``baseline`` (harness.evidence.gather, whose
    keyword arguments ``gathering`` are)."""
    return decide(evidence.gather(record, baseline, bounds=bounds, **gathering), known_failures)


def judge(cell: Cell, record: Record, baseline: Baseline | None, others: Iterable[Record] = (), *,
          known_failures: Iterable[KnownFailureLike] = (), unfused: Record | None = None,
          accuracy_baseline=None, load_baseline: Baseline | None = None) -> Judgement:
    """:func:`decide` on ``record`` gathered with the cell's settings against ``baseline`` and
    ``others``, the other engines' records of its (model, scheme) in this run
    (harness.evidence.gather_for; ``known_failures``: the group's)."""
    return decide(evidence.gather_for(cell, record, baseline, others, known_failures=known_failures, unfused=unfused,
                                      accuracy_baseline=accuracy_baseline, load_baseline=load_baseline),
                  cell.known_failures)


def judge_against_base(cell: Cell, record: Record, base: Record, others: Iterable[Record] = (), *,
                       known_failures: Iterable[KnownFailureLike] = (), unfused: Record | None = None,
                       base_name: str | None = None, subject: str = "the candidate") -> Judgement:
    """A candidate build's record judged against ``base``, the pinned build's judged record of the
    same cell in this run (docs/design.md, "Candidate builds"): the base's record stands in for the
    baseline (sequences with the family bounds, the loaded state exactly, accuracy by the paired
    gate), unkeyed by engine version, and the cross-engine checks are the candidate's own. A known
    failure of the base that the candidate no longer shows is ``fixed``; a known failure that the
    base does not match (none, or another) is named as new. A configuration cell is judged so too,
    against its plain cell (harness.configurations): ``base_name`` and ``subject`` name the two."""
    ok = base.status == "ok"
    j = verdict(record, Baseline.from_record(base) if ok else None, bounds=cell.bounds,
                known_failures=cell.known_failures,
                cross_engine_checks=cross_engine(record, others, cell.bounds, known_failures=known_failures,
                                                 unfused=unfused),
                gate_load_time=cell.gate_load_time, keyed_by_version=False,
                accuracy_baseline=AccuracyBaseline.from_record(base) if ok and base.accuracy else None)
    base_name = base_name or f"base {base.engine} {base.engine_info.version or '(version unknown)'}"
    return dataclasses.replace(_as_candidate(j, record, base, base_name, subject), evidence=j.evidence)


def _as_candidate(j: Judgement, record: Record, base: Record, base_name: str, subject: str) -> Judgement:
    """The verdict of a candidate's record, ``j`` against the base's, said as a candidate's
    (:func:`judge_against_base`)."""
    # what vouches for the candidate: a base that could not run at all, or the other engines of this
    # run, the one the base's known failure is about among them. Not the input's contrast, which a
    # cell of a run of one engine has too: its known failure can neither show nor be refuted there.
    between = [c for c in j.checks if not c.against_baseline and c.spec.between_engines]
    k = base.known_failure
    vouched = base.status != "ok" or (
        bool(between) and not (k is not None and _compared_with_absent_engine(k, record, between)))
    if k is not None and record.status == "ok" and vouched and disagreement(record, j.checks) is None:
        shown = f"{base_name} is {base.verdict} by known failure {k.pattern!r} ({k.engine} {k.versions})"
        if not _rounding_cascade(base, k):
            return Judgement("fixed", f"{shown}; {subject} agrees with the other engines of this run", j.checks)
        return _fix_or_flip(j, shown, subject)
    if j.verdict == "missing-baseline":
        return Judgement("missing-baseline", f"{base_name} has no results to compare with ({base.verdict}: "
                         f"{base.verdict_reason})", j.checks, j.known_failure)
    if j.known_failure is not None and record.status == "ok" and not vouched and all(c.ok for c in j.checks):
        # The candidate agrees with the base, and no other engine of this run can show the known
        # failure's pattern (a run of one engine): it behaves as the base does, whatever that is.
        unjudged = j.evidence.not_judged if j.evidence is not None else None
        same = f"its loaded state the same; {unjudged}" if unjudged else "the same within the bounds"
        if base.known_failure is not None:
            k = base.known_failure
            return Judgement("waived", f"against {base_name}: {same}, and the base is {base.verdict} "
                             f"by known failure {k.pattern!r} ({k.engine} {k.versions})", j.checks, k)
        return Judgement("pass", f"against {base_name}: {same}; no other engine in this run can "
                         f"show the known failure that covers it, for {subject} or the base", j.checks)
    if j.known_failure is not None and (base.known_failure is None or base.known_failure.pattern != j.known_failure.pattern):
        return Judgement(j.verdict, f"new in {subject}: {j.reason}", j.checks, j.known_failure)
    return Judgement(j.verdict, f"against {base_name}: {j.reason}", j.checks, j.known_failure)


def _rounding_cascade(base: Record, k: KnownFailureLike) -> bool:
    """Whether the base's known failure ``k`` is a cascade of rounding flips: every check of the
    base it excuses is a logprob check (checks.KINDS, ``moved_by_rounding``), on a computation that
    does not carry (harness.records.Computation). Such logprobs move between two builds as they do
    between two kernel sets, so their moving is no evidence of a fix (docs/design.md, "Candidate
    builds")."""
    excused = [c for c in base.checks if not c.ok and k.matches(f"{c.name}: {c.detail}")]
    carries = base.computation is not None and base.computation.carries
    return bool(excused) and all(c.spec.moved_by_rounding for c in excused) and not carries


def _fix_or_flip(j: Judgement, shown: str, subject: str) -> Judgement:
    """A candidate that no longer shows the base's rounding cascade (``shown`` says which): ``fixed``
    when what it loads changed, module by module (the loaded-state digest covers each module's
    values, quant method, scheme and settings: the code path it computes with), and the reason
    names the first module that changed; otherwise ``portable-pass``, its logprobs against the base
    shown, not judged, as across kernels: a flip that lands the other way."""
    state = next((c for c in j.checks if c.kind == "loaded-state" and c.against_baseline), None)
    if state is not None and not state.ok:
        return Judgement("fixed", f"{shown}, a rounding cascade; {subject} agrees with the other engines of this "
                         f"run, and what it loads changed: {state.detail}", j.checks)
    why = (f"the base's known failure is a rounding cascade and {subject} loads what the base loads" if state
           else "the base's known failure is a rounding cascade and no loaded state was compared")
    checks = [evidence.shown(c, why) if c.against_baseline and c.spec.computed and not c.ok else c for c in j.checks]
    said = (f"loaded state equal to the base's ({state.data['modules']} modules, quant methods and settings "
            "included)" if state else "loaded state not compared (no digest on one side)")
    return Judgement("portable-pass", f"{shown}, a rounding cascade; {subject} agrees with the other engines of "
                     f"this run, but {said}: nothing names a fix, and a flip that lands the other way is none; its "
                     "logprobs against the base shown, not judged", checks)


def needs_localisation(record: Record, known_failures: Iterable[KnownFailureLike] = ()) -> bool:
    """Whether a trace of the loaded model should localise ``record`` (harness.traces.jobs), from its
    gathered checks: a check that a trace can place fails (checks.KINDS, ``traced``: not the load
    time, not the input sensitivity), and the cell's known failures do not excuse them all."""
    failing = [c for c in record.checks if not c.ok and KINDS[c.kind].traced]
    known = applicable(known_failures, record.engine, record.engine_info.version)
    return record.status == "ok" and bool(failing) and failed_or_waived("failed", known, failing, []).verdict != "waived"


def explain_flips(record: Record) -> Record:
    """``record`` (gathered and localised) with the failing logprob checks against other engines
    that rounding flips explain passing, each saying which flip, and the flips in its evidence for
    the verdict's reason (:func:`rounding_flip`); ``record`` itself where nothing is explained. A
    disagreement with another engine is judged (step 3) before the baseline is read, so a flip that
    explains it leaves every later step to judge: the baseline's key, its sequences and loaded
    state, the load time."""
    found = rounding_flip(record)
    if found is None:
        return record
    checks, reason = found
    return record.model_copy(update={"checks": checks,
                                     "evidence": record.evidence.model_copy(update={"rounding_flips": reason})})


def rounding_flip(record: Record) -> tuple[list[Check], str] | None:
    """The record's checks with its failing disagreement with other engines explained by rounding
    flips, and the flips' reason (docs/design.md, "Cross-engine"); None when the rule does not
    apply.

    The rule: every failing check is a logprob check against another engine (same machine, same
    kernels); for each engine, the localisation against it shows a rounding flip on every prompt
    that differs (harness.traces.flips), among them every prompt whose logprobs fail there: a flip
    on one prompt explains nothing on another; and every module's effective weights equal that
    engine's (harness.traces.flips.explain_across requires it). Nothing is explained away against a
    baseline: there, other kernels leave such a cell's logprobs unjudged instead."""
    if not record.localisation:  # the rule reads the localisation
        return None
    # what a disagreement is made of (step 3); the checks against the baseline are left to judge
    failing = [c for c in record.checks if not c.ok and not c.against_baseline]
    # a rounding flip moves logprobs (harness.checks: moved_by_rounding), not the module diff, the
    # input sensitivity or accuracy
    if not failing or any(not (c.spec.moved_by_rounding and c.cross_engine) for c in failing):
        return None
    shown = {}
    for against in dict.fromkeys(c.against for c in failing):
        loc = next((x for x in record.localisation if x.against == against), None)
        flip = loc.rounding_flip if loc is not None else None
        if flip is None or not flip.explained:
            return None
        flipped = {a.prompt for a in flip.at}
        for c in (c for c in failing if c.against == against):
            prompts = _failing_prompts(c)
            if prompts is None or not prompts <= flipped:
                return None
        tf = next((c for c in failing if c.kind == "teacher-forced" and c.against == against and c.data), None)
        worst = tf.data["worst"] if tf is not None else None
        where = f", largest move {fmt(worst['delta'])} at prompt {worst['prompt']} position {worst['position']}" if worst else ""
        shown[against] = (flip, f"{flip.detail}{where}; every module's effective weights equal to {against}'s, same kernels")
    checks = [c if c.ok or c.against_baseline else c.model_copy(update={
        "ok": True, "detail": f"explained by a rounding flip ({shown[c.against][0].detail}): {c.detail}",
        "data": {**(c.data or {}), "rounding_flip": shown[c.against][0].model_dump()}})
        for c in record.checks]
    return checks, "; ".join(reason for _, reason in shown.values())


def _failing_prompts(check: Check) -> set[str] | None:
    """The prompts on which a failing logprob check fails (None: its data does not say)."""
    data = check.data or {}
    if check.kind == "greedy":
        return {d["prompt"] for d in data.get("divergences", []) if not d["ok"]}
    exceeding = data.get("exceeding_prompts")
    return set(exceeding) if exceeding is not None else None
