"""The comparison rules (docs/design.md, "Comparison rules"). Pure functions on records.

Checks (each a records.Check of a kind of harness.checks.KINDS, against a baseline, another engine
or a contrast input):
- ``teacher-forced``: the main check. On the same scored sequence, |Δlogprob| of the scored token
  and over the shared top-k ids, bounded at every position; max |Δ|, worst position, per position.
- ``scored-tokens``: the runs scored different sequences (teacher-forced then means nothing).
- ``greedy``: vLLM's check_logprobs_close rule: where the greedy tokens first differ, each run's
  token must be in the other run's top-k.
- ``prompts``: both runs have the same prompt ids.
- ``load-time``: the load-time ratio, calibrated where both runs measured the calibration
  (harness.loadcheck).
- ``module-diff``: vLLM's module-level conformance (from the record).
- ``input-sensitivity``: a multimodal record's output against a second image or audio input,
  which must differ by more than the noise (docs/design.md, "Input sensitivity"; no baseline).

``cross_engine()`` and ``disagreement()`` are the cross-engine rule and its judgement, shared by
the runner and the Buildkite merge step (harness.report.merge). The verdict built from these
checks is harness.judging's; what each verdict means for the exit status and every output is the
table in harness.verdicts.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from harness.checks import BASELINE, logprob_difference
from harness.accuracy import gates as accuracy_gates
from harness.registry import fuses_shards
from harness.records import Check, Evidence, KnownFailureRef, Record, SequenceResult, platform_key

if TYPE_CHECKING:
    from harness.baselines import Baseline
    from harness.matrix import Bounds


class KnownFailureLike(Protocol):
    engine: str
    versions: str
    pattern: str
    reason: str
    link: str | None

    def applies_to(self, engine: str, version: str | None) -> bool: ...

    def matches(self, text: str) -> bool: ...


@dataclass
class Judgement:
    verdict: str
    reason: str
    checks: list[Check] = field(default_factory=list)
    known_failure: KnownFailureLike | None = None
    # what it was judged from besides the checks (harness.evidence), for the record
    evidence: Evidence | None = None

    def apply(self, record: Record) -> Record:
        """A copy of ``record`` carrying this verdict, its reason, checks, evidence and known failure."""
        k = self.known_failure
        kf = k and KnownFailureRef(engine=k.engine, versions=k.versions, pattern=k.pattern, reason=k.reason, link=k.link)
        update = {"verdict": self.verdict, "verdict_reason": self.reason, "checks": list(self.checks), "known_failure": kf}
        return record.model_copy(update=update | ({"evidence": self.evidence} if self.evidence is not None else {}))


# --------------------------------------------------------------------------------- helpers


def _delta(a: float, b: float) -> float:
    return logprob_difference(a, b, nan="apart")


def _safe(x: float) -> float | None:
    """JSON-safe number for check data: non-finite becomes None."""
    return x if math.isfinite(x) else None


def fmt(x: float) -> str:
    """A number as the checks' details write it."""
    return f"{x:.3g}" if math.isfinite(x) else str(x)


def _pair(expected: Sequence[SequenceResult], obtained: Sequence[SequenceResult]):
    e = {s.prompt.id: s for s in expected}
    o = {s.prompt.id: s for s in obtained}
    shared = [pid for pid in e if pid in o]
    return [(pid, e[pid], o[pid]) for pid in shared], sorted(set(e) - set(o)), sorted(set(o) - set(e))


# ------------------------------------------------------------------------------------ checks


def check_prompts(expected: Sequence[SequenceResult], obtained: Sequence[SequenceResult], *, against: str) -> Check | None:
    """A failing ``prompts`` check when the prompt ids differ, else None."""
    _, missing, extra = _pair(expected, obtained)
    if not missing and not extra:
        return None
    parts = []
    if missing:
        parts.append(f"missing {', '.join(missing)}")
    if extra:
        parts.append(f"not in {against}: {', '.join(extra)}")
    return Check(kind="prompts", against=against, ok=False, detail="prompt set differs: " + "; ".join(parts),
                 data={"missing": missing, "extra": extra})


def _token_difference(pid: str, e: SequenceResult, o: SequenceResult, against: str) -> dict:
    et, ot = e.scored.tokens, o.scored.tokens
    pos = next((i for i, (x, y) in enumerate(zip(et, ot)) if x != y), min(len(et), len(ot)))
    return {"prompt": pid, "position": pos, against: et[pos] if pos < len(et) else None,
            "obtained": ot[pos] if pos < len(ot) else None, "lengths": [len(et), len(ot)]}


def _scored_tokens_check(differing: list[dict], against: str) -> Check:
    first = differing[0]
    return Check(kind="scored-tokens", against=against, ok=False, data={"sequences": differing},
                 detail=(f"scored tokens differ from {against}'s in {len(differing)} sequence(s); first: prompt "
                         f"{first['prompt']} position {first['position']}: {against} {first[against]} vs obtained "
                         f"{first['obtained']} (the runs scored different sequences; logprobs not comparable)"))


def _deltas(e: SequenceResult, o: SequenceResult) -> tuple[list[float], list[float]]:
    """Per logprob index: |Δ| of the scored token, and max |Δ| over the top-k ids both runs share."""
    tokens, topk = [], []
    for la, lb, ka, kb in zip(e.scored.logprobs, o.scored.logprobs, e.scored.topk, o.scored.topk):
        tokens.append(_delta(la, lb))
        kb_map = dict(kb)
        topk.append(max((_delta(x, kb_map[t]) for t, x in ka if t in kb_map), default=0.0))
    return tokens, topk


def check_teacher_forced(expected: Sequence[SequenceResult], obtained: Sequence[SequenceResult], *,
                         logprob_bound: float, topk_bound: float, against: str) -> list[Check]:
    """The teacher-forced check, plus a distinct ``scored-tokens`` failure for sequences whose
    scored tokens differ (those are left out of the logprob comparison)."""
    pairs, _, _ = _pair(expected, obtained)
    differing = [_token_difference(pid, e, o, against) for pid, e, o in pairs if e.scored.tokens != o.scored.tokens]
    same = [(pid, e, o) for pid, e, o in pairs if e.scored.tokens == o.scored.tokens]
    checks = [_scored_tokens_check(differing, against)] if differing else []
    if not same:
        return checks
    positions = _judge_positions(same, logprob_bound, topk_bound)
    worst = positions.worst
    where = f" at prompt {worst['prompt']} position {worst['position']} ({worst['what']})" if worst["prompt"] is not None else ""
    detail = (f"max |Δlogprob| vs {against} {fmt(worst['delta'])}{where}; scored tokens {fmt(positions.worst_tok)} "
              f"(bound {fmt(logprob_bound)}), shared top-k {fmt(positions.worst_topk)} (bound {fmt(topk_bound)})")
    checks.append(Check(
        kind="teacher-forced", against=against,
        ok=not positions.exceeding,
        detail=detail if not positions.exceeding else "exceeds bound: " + detail,
        data=_teacher_forced_data(positions, same, logprob_bound, topk_bound),
    ))
    return checks


@dataclass
class _JudgedPositions:
    """The teacher-forced |Δ|s of the sequences that scored the same tokens, position by position."""

    per_position: dict[str, list[float]] = field(default_factory=dict)
    topk_per_position: dict[str, list[float]] = field(default_factory=dict)
    worst: dict = field(default_factory=lambda: {"delta": 0.0, "prompt": None, "position": None, "what": None})
    exceeding: set[str] = field(default_factory=set)  # the prompts with a position over its bound

    @property
    def worst_tok(self) -> float:
        return max((x for deltas in self.per_position.values() for x in deltas), default=0.0)

    @property
    def worst_topk(self) -> float:
        return max((x for deltas in self.topk_per_position.values() for x in deltas), default=0.0)


def _judge_positions(same: list[tuple[str, SequenceResult, SequenceResult]],
                     logprob_bound: float, topk_bound: float) -> _JudgedPositions:
    out = _JudgedPositions()
    for pid, e, o in same:
        tokens, topk = _deltas(e, o)
        out.per_position[pid], out.topk_per_position[pid] = tokens, topk
        for i, cases in enumerate(zip((("token", d) for d in tokens), (("topk", d) for d in topk))):
            pos = i + 1  # logprobs[i] scores tokens[i + 1]
            for (what, d), bound in zip(cases, (logprob_bound, topk_bound)):
                if d > out.worst["delta"]:
                    out.worst = {"delta": d, "prompt": pid, "position": pos, "what": what}
                if not d <= bound:
                    out.exceeding.add(pid)
    return out


def _teacher_forced_data(positions: _JudgedPositions, same: list[tuple[str, SequenceResult, SequenceResult]],
                         logprob_bound: float, topk_bound: float) -> dict:
    worst = positions.worst
    return {
        "max_abs_delta": _safe(worst["delta"]),
        "max_abs_delta_tokens": _safe(positions.worst_tok),
        "max_abs_delta_topk": _safe(positions.worst_topk),
        "worst": {**worst, "delta": _safe(worst["delta"])},
        "bound": {"logprob": logprob_bound, "topk": topk_bound},
        "per_position": _safe_lists(positions.per_position),  # |Δ| of the scored token, index i = position i + 1
        "topk_per_position": _safe_lists(positions.topk_per_position),
        "prompt_len": {pid: len(e.prompt_tokens) for pid, e, _ in same},  # positions >= it are generated
        "exceeding_prompts": sorted(positions.exceeding),
    }


def _safe_lists(values: dict[str, list[float]]) -> dict[str, list[float | None]]:
    return {k: [_safe(x) for x in v] for k, v in values.items()}


def check_greedy(expected: Sequence[SequenceResult], obtained: Sequence[SequenceResult], *, against: str) -> Check | None:
    """vLLM's check_logprobs_close rule, per prompt: at the first step where the greedy tokens
    differ, each token must be in the other run's top-k at that step. Runs that agree on every
    step both produced (one may be shorter) pass, as in vLLM."""
    pairs, _, _ = _pair(expected, obtained)
    if not pairs:
        return None
    divergences = []
    bad = []
    for pid, e, o in pairs:
        for step, (te, to) in enumerate(zip(e.greedy.tokens, o.greedy.tokens)):
            if te == to:
                continue
            ke, ko = e.greedy.topk[step], o.greedy.topk[step]
            ok = te in {t for t, _ in ko} and to in {t for t, _ in ke}
            d = {"prompt": pid, "step": step, "ok": ok, against: te, "obtained": to,
                 f"{against}_topk": [[t, _safe(lp)] for t, lp in ke],
                 "obtained_topk": [[t, _safe(lp)] for t, lp in ko]}
            divergences.append(d)
            if not ok:
                bad.append(d)
            break
    if bad:
        d = bad[0]
        detail = (f"greedy tokens diverge from {against}'s at prompt {d['prompt']} step {d['step']}: {against} "
                  f"{d[against]} vs obtained {d['obtained']}, and a token is missing from the other run's top-k "
                  f"({against} top-k {[t for t, _ in d[f'{against}_topk']]}, obtained top-k {[t for t, _ in d['obtained_topk']]})")
        return Check(kind="greedy", against=against, ok=False, detail=detail, data={"divergences": divergences})
    if divergences:
        d = divergences[0]
        detail = (f"greedy tokens diverge at prompt {d['prompt']} step {d['step']} ({against} {d[against]} vs "
                  f"obtained {d['obtained']}), each within the other's top-k")
    else:
        detail = f"greedy tokens equal to {against}'s"
    return Check(kind="greedy", against=against, ok=True, detail=detail, data={"divergences": divergences})


def compare_sequences(expected: Sequence[SequenceResult], obtained: Sequence[SequenceResult], bounds: Bounds, *,
                      against: str) -> list[Check]:
    """All sequence checks of ``obtained`` against ``expected`` (a baseline or another engine): of
    the kinds of harness.checks that compare sequences, those that apply."""
    checks: list[Check] = []
    p = check_prompts(expected, obtained, against=against)
    if p is not None:
        checks.append(p)
    checks += check_teacher_forced(expected, obtained, logprob_bound=bounds.logprob, topk_bound=bounds.topk,
                                   against=against)
    g = check_greedy(expected, obtained, against=against)
    if g is not None:
        checks.append(g)
    return checks


def check_loaded_state(record: Record, baseline: Baseline) -> Check | None:
    """The loaded state, module by module, bit for bit against the baseline's (docs/design.md,
    "Loaded state"): the same on every CPU, so no tolerance and no kernel condition applies. None
    when either side has no digests (an engine that cannot read its modules, an older baseline)."""
    mine, theirs = record.loaded_state, baseline.loaded_state
    if mine is None or theirs is None:
        return None
    differing = [m for m in theirs if m in mine and mine[m] != theirs[m]]
    missing = [m for m in theirs if m not in mine]
    extra = [m for m in mine if m not in theirs]
    data = {"modules": len(theirs), "differing": differing, "missing": missing, "extra": extra}
    if not (differing or missing or extra):
        return Check(kind="loaded-state", against=BASELINE, ok=True, data=data,
                     detail=f"loaded state equal to the baseline's in all {len(theirs)} modules")
    moved = {*differing, *missing, *extra}
    first = next(m for m in [*theirs, *extra] if m in moved)
    parts = [f"{len(differing)} differ"] if differing else []
    parts += [f"{len(missing)} not loaded ({_few(missing)})"] if missing else []
    parts += [f"{len(extra)} not in the baseline ({_few(extra)})"] if extra else []
    data["first"] = first
    return Check(kind="loaded-state", against=BASELINE, ok=False, data=data,
                 detail=f"loaded state differs from the baseline's at {first}: of {len(theirs)} modules, " + ", ".join(parts))


def check_module_diff(record: Record, *, against: str = "reference") -> Check | None:
    if record.module_diff is None:
        return None
    md = record.module_diff
    return Check(kind="module-diff", against=against, ok=False,
                 detail=f"first differing module {md.first_differing_module}: {md.detail}",
                 data={"first_differing_module": md.first_differing_module})


def cross_engine(record: Record, others: Iterable[Record], bounds: Bounds, *,
                 known_failures: Iterable[KnownFailureLike] = (), unfused: Record | None = None) -> list[Check]:
    """The cross-engine rule (docs/design.md, "Cross-engine" and "Fusion rule"): checks of
    ``record`` against the other engines' records of its (model, scheme), within ``bounds``.

    - Records that are not ok, or are this same engine, are skipped.
    - An engine that one of ``known_failures`` (the group's, any engine) covers is no witness.
    - Engines that differ in fusing shards are compared only through ``unfused``, the reference's
      results executed unfused (the runner's witness), which replaces the reference's side; the
      check's detail says so when it differs. Without it (a merge of separate runs) such a pair is
      not compared, and two non-reference engines that differ in fusion never are.
    - Accuracy results (harness.accuracy.gates, ``accuracy/<task>:<engine>``) are compared with the
      other engine's directly, and across fusion only when the witness shows that fusing changed
      nothing on the cell's prompts.
    """
    checks: list[Check] = []
    if record.status != "ok":
        return checks
    known = list(known_failures)
    for other in others:
        if other.status != "ok" or other.engine == record.engine:
            continue
        if applicable(known, other.engine, other.engine_info.version):
            continue
        mine, theirs, note = record, other, ""
        accuracy = accuracy_gates.cross_engine(record, other, against=other.engine)
        if fuses_shards(record.engine) != fuses_shards(other.engine):
            if unfused is None or "reference" not in (record.engine, other.engine):
                continue
            reference, executes = (record, other.engine) if record.engine == "reference" else (other, record.engine)
            if unfused.sequences != reference.sequences:
                note = f" [reference executed unfused, as {executes} executes]"
                # fusing changes the numerics here and the witness runs no accuracy tasks: the two
                # engines' accuracy is compared only with their own baselines (docs/design.md, "Accuracy")
                accuracy = []
            mine, theirs = (unfused, other) if record.engine == "reference" else (record, unfused)
        for c in compare_sequences(theirs.sequences, mine.sequences, bounds, against=other.engine):
            checks.append(c.model_copy(update={"detail": c.detail + note}) if note else c)
        checks += accuracy
    return checks


# ------------------------------------------------------------------------------- known failures


def applicable(known_failures: Iterable[KnownFailureLike], engine: str, version: str | None) -> list[KnownFailureLike]:
    return [k for k in known_failures if k.applies_to(engine, version)]


def match_error(known_failures: Iterable[KnownFailureLike], record: Record) -> KnownFailureLike | None:
    """The first known failure covering the record's engine version whose pattern matches its
    error: searched in "<type>: <message>", then in the log tail."""
    if record.error is None:
        return None
    texts = [f"{record.error.type}: {record.error.message}", record.error.log_tail]
    for k in applicable(known_failures, record.engine, record.engine_info.version):
        if any(t and k.matches(t) for t in texts):
            return k
    return None


def _waiver(known: list[KnownFailureLike], failing: list[Check]) -> KnownFailureLike | None:
    """A known failure when every failing check is matched by one (searched in "name: detail")."""
    first = None
    for c in failing:
        hit = next((k for k in known if k.matches(f"{c.name}: {c.detail}")), None)
        if hit is None:
            return None
        first = first or hit
    return first


# --------------------------------------------------------------------------------------- verdict


def _few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def check_input_sensitivity(record: Record, bound: float) -> Check | None:
    """``input-sensitivity:contrast``, for a record that scored its image or audio prompts with a
    second input (harness.engines.execute.input_sensitivity): at the first positions after the
    input, max |Δlogprob| must exceed the cell's family ``bound`` (both scorings ran on the same
    kernels, in one child); Mllama's cross-attention gates must be non-zero. A prompt whose
    logprobs are NaN is left out (other checks judge NaN); None for a record without such prompts.
    Needs no baseline (docs/design.md, "Input sensitivity")."""
    s = record.input_sensitivity
    prompts = [p for p in s.prompts if not math.isnan(p.max_delta)] if s is not None else []
    if not prompts:
        return None
    deltas = {p.prompt: p.max_delta for p in prompts}
    kinds = {p.prompt: p.kind for p in prompts}
    margins = {pid: deltas[pid] / bound if bound > 0 else math.inf for pid in deltas}
    data = {"prompts": {pid: {"kind": kinds[pid], "max_delta": _safe(deltas[pid]), "bound": bound,
                              "margin": _safe(margins[pid])} for pid in deltas},
            "gates": dict(s.gates), "seconds": s.seconds}
    flat = [pid for pid in deltas if deltas[pid] <= bound]
    closed = sorted(n for n, v in s.gates.items() if v == 0.0)
    if flat or closed:
        parts = [f"the output does not depend on the {kinds[pid]} (prompt {pid}: max |Δlogprob| {fmt(deltas[pid])} "
                 f"<= bound {fmt(bound)} at the first positions after it, against a second input)"
                 for pid in flat]
        if closed:
            parts.append(f"cross-attention gate(s) {', '.join(closed)} are 0: the image never reaches the decoder")
        return Check(kind="input-sensitivity", against="contrast", ok=False, detail="; ".join(parts), data=data)
    worst = min(margins, key=margins.get)
    return Check(kind="input-sensitivity", against="contrast", ok=True, data=data,
                 detail=f"the output depends on every input: smallest max |Δlogprob| {fmt(deltas[worst])} "
                        f"against bound {fmt(bound)} (prompt {worst}, {fmt(margins[worst])}x)")



def baseline_key_problems(record: Record, baseline: Baseline, *, expected_engine_version: str | None = None,
                          platform: str | None = None, keyed_by_version: bool = True) -> list[str]:
    """Why ``baseline`` is not the one this record must be compared with (empty when it is);
    ``keyed_by_version=False`` for another build's record of the same run (a candidate's base)."""
    problems = []
    version = record.engine_info.version
    bv = baseline.provenance.engine_version
    if keyed_by_version and bv != version:
        problems.append(f"baseline recorded with {record.engine} {bv}, this run is {version}")
    if expected_engine_version is not None and not _same_public_version(expected_engine_version, version):
        problems.append(f"this run's {record.engine} {version} is not the environment's pinned {expected_engine_version}")
    run_platform = platform if platform is not None else record.engine_info.platform
    if platform_key(baseline.provenance.platform) != platform_key(run_platform):
        problems.append(f"baseline recorded on {baseline.provenance.platform}, this run is on {run_platform}")
    if baseline.fixture and record.fixture and baseline.fixture.identity != record.fixture.identity:
        # Fixtures build bit-identically on every CPU (docs/design.md, "Fixture identity"): a new
        # identity means the recipe or a producing library changed.
        problems.append(f"fixture identity changed: baseline {baseline.fixture.identity[:12]}, this run "
                        f"{record.fixture.identity[:12]}")
    if baseline.source and record.source and baseline.source != record.source:
        problems.append("checkpoint source changed (hub revision or path)")
    return problems


def _same_public_version(a: str, b: str | None) -> bool:
    if b is None:
        return False
    if a == b:
        return True
    from packaging.version import InvalidVersion, Version

    try:
        return Version(a).public == Version(b).public
    except InvalidVersion:
        return False


def failed_or_waived(verdict_name: str, known, failing: list[Check], checks: list[Check]) -> Judgement:
    """`verdict_name` for these failing checks, or `waived` when a known failure covers them all."""
    k = _waiver(known, failing)
    if k is not None:
        return Judgement("waived", f"known failure: {k.reason} ({failing[0].name})", checks, k)
    return Judgement(verdict_name, "; ".join(f"{c.name}: {c.detail}" for c in failing), checks)


def disagreement(record: Record, checks: Iterable[Check], known_failures: Iterable[KnownFailureLike] = ()) -> Judgement | None:
    """Step 3 of the verdict on its own, for the runner and the merge step alike: the checks of
    ``record`` that are not against its baseline (other engines, the module diff) and fail make it
    ``failed``, or ``waived`` when known failures match every one of them; None when none fails.
    The judgement carries all of ``checks``."""
    checks = list(checks)
    failing = [c for c in checks if not c.ok and not c.against_baseline]
    if not failing:
        return None
    return failed_or_waived("failed", applicable(known_failures, record.engine, record.engine_info.version),
                             failing, checks)
