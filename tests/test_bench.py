"""harness bench's pieces on a TINY size or fake measurements (the real figures come from `harness bench`)."""
import argparse
import json
import math
import random
import subprocess
import sys
import types
from pathlib import Path

import pytest

from harness import cli, cpu, loadtime
from harness import matrix as M
from harness import records as R
from harness.bench import candidate, decode, detection, noise_model, pairs, portability, report
from harness.fixtures import benchmark
from harness.hooks import slowdown
from harness.bench.detection import CellRun

CELLS = ("a.unquantized.reference", "b.bnb-nf4.reference", "c.bnb-nf4.transformers")


def _run(rng, spread=0.01, slow=0.0, level=1.0, loads=5):
    """One fake run: every cell's loads ~ level * (1 + slow) with log-normal noise, calibration 1."""
    return [CellRun(c, tuple(level * (1 + slow) * math.exp(rng.gauss(0, spread)) for _ in range(loads)), 1.0, slow)
            for c in CELLS]


def _one_child(run):
    """A held-out run whose cells were each timed in one child (no confirmation)."""
    return [[cr] for cr in run]


def _gated_run(rng, rule, base, **kw):
    """A held-out run as the gate makes it: each cell's children, confirmations included."""
    return [detection.gated(lambda i=i: _run(rng, **kw)[i], (rule, base)) for i in range(len(CELLS))]


def _choose(runs, pairs=()):
    return detection.choose(runs, slowed_cells=2, baseline_children=5, pairs=pairs)


def test_rule_from_quiet_runs_catches_20_percent_and_not_clean_runs():
    rng = random.Random(0)
    rule, candidates = _choose([_run(rng) for _ in range(8)])
    assert {(c.repeats, c.statistic) for c in candidates} == {(1, "min"), (3, "min"), (3, "median"), (5, "min"), (5, "median")}
    assert {c.confirmations for c in candidates} == set(detection.CONFIRMATIONS)
    assert max(c.repeats for c in candidates) == 5  # no more loads than the choice runs timed
    assert 1.0 < rule.threshold < 1.2 and rule.modelled_20 > 0.99
    base = detection.baseline_of([_run(random.Random(1))], rule.repeats, rule.statistic, 1)
    clean = [_gated_run(rng, rule, base) for _ in range(20)]
    slowed = {0.2: [_gated_run(rng, rule, base, slow=0.2) for _ in range(10)]}
    ev = detection.evaluate(rule, base, clean, slowed)
    assert ev["rates"]["slowdown_20"] == 1.0 and ev["cell_rates"]["slowdown_20"] == 1.0 and ev["false_alarm"] == 0.0
    assert (ev["slowed_runs"]["slowdown_20"], ev["slowed_cell_runs"]["slowdown_20"]) == (10, 10 * len(CELLS))
    assert ev["injected"]["slowdown_20"] == pytest.approx(0.2, abs=0.05)
    assert ev["clean_cell_runs"] == 20 * len(CELLS)


def test_the_later_look_pairs_a_flagged_cell_run_with_the_same_cells_half_the_phase_later():
    # four runs of two cells: a cell flags only when its cell-run two runs on (counted round) does
    flags = [[True, False], [False, False], [True, True], [False, True]]
    assert detection.with_later_look(flags) == [True, False, True, False]
    rule = detection.Rule(repeats=1, statistic="min", threshold=1.1, spread=0.001)
    base = {c: 1.0 for c in CELLS}
    rng = random.Random(4)
    clean = [_one_child(_run(rng, spread=0.001, level=1.2 if i == 0 else 1.0, loads=1)) for i in range(6)]
    slowed = {0.2: [_one_child(_run(rng, spread=0.001, slow=0.2, loads=1)) for _ in range(6)]}
    ev = detection.evaluate(rule, base, clean, slowed)
    # one run's whole level up: a false alarm at once, not at the later look; a real slowdown is both
    assert (ev["false_alarm"], ev["later_look"]["false_alarm"]) == (pytest.approx(1 / 6), 0.0)
    assert ev["rates"]["slowdown_20"] == ev["later_look"]["slowdown_20"] == 1.0


def test_the_slowdown_injected_is_measured_against_the_clean_runs_held_out_beside_it():
    # the held-out phase sits 10% under the baseline (drift): 20% slower there reads 1.08 of the
    # baseline, which says nothing about the hook
    rng = random.Random(3)
    rule = detection.Rule(repeats=1, statistic="min", threshold=1.1, spread=0.001)
    base = {c: 1.0 for c in CELLS}
    clean = [_one_child(_run(rng, spread=0.001, level=0.9, loads=1)) for _ in range(5)]
    slowed = {0.2: [_one_child(_run(rng, spread=0.001, level=0.9, slow=0.2, loads=1)) for _ in range(5)]}
    ev = detection.evaluate(rule, base, clean, slowed)
    assert ev["clean_level"] == {c: pytest.approx(0.9, abs=0.01) for c in CELLS}
    assert ev["injected"]["slowdown_20"] == pytest.approx(0.2, abs=0.01)
    assert ev["injected_by_cell"]["slowdown_20"] == {c: pytest.approx(0.2, abs=0.01) for c in CELLS}
    assert ev["cell_rates"]["slowdown_20"] == 0.0  # 1.08 of the baseline, under the threshold


def test_rule_threshold_follows_the_noise_and_counts_a_false_alarm():
    rng = random.Random(2)
    quiet, quiet_all = _choose([_run(rng, spread=0.01) for _ in range(8)])
    noisy, noisy_all = _choose([_run(rng, spread=0.05) for _ in range(8)])
    same = {(c.repeats, c.statistic, c.confirmations): c.threshold for c in quiet_all}
    assert all(c.threshold > same[(c.repeats, c.statistic, c.confirmations)] for c in noisy_all)
    # More confirmations allow a lower threshold for the same false-alarm rate.
    by_conf = {c.confirmations: c.threshold for c in noisy_all if (c.repeats, c.statistic) == (1, "min")}
    assert by_conf[2] < by_conf[1] < by_conf[0]
    base = detection.baseline_of([_run(random.Random(3), spread=0.0)], 1, "min", 1)
    outlier = [CellRun(cr.cell, tuple(s * (2.0 if cr.cell == CELLS[0] else 1.0) for s in cr.samples), 1.0)
               for cr in _run(rng, spread=0.0)]
    ev = detection.evaluate(quiet, base, [_one_child(_run(rng, spread=0.0)), _one_child(outlier)], {})
    assert ev["false_alarm"] == 0.5 and ev["clean_cell_false_alarms"] == 1


def test_the_threshold_weighs_a_false_alarm_and_a_missed_20_percent_alike():
    for sd, conf in ((0.02, 0), (0.04, 2), (0.08, 1)):
        noise = noise_model.Noise(level=sd / 2, within=sd)
        t = noise_model.balanced_threshold(noise, conf, cells=8, slowed_cells=4, slowdown=0.2)
        false_alarm = noise_model.modelled_flag(t, noise, conf, 8, 0.0)
        miss = 1 - noise_model.modelled_flag(t, noise, conf, 4, 0.2)
        assert 1.0 < t < 1.2 and false_alarm == pytest.approx(miss, rel=1e-4, abs=1e-12)
    # a noisier host: a higher threshold
    quiet, noisy = noise_model.Noise(0.01, 0.02), noise_model.Noise(0.04, 0.08)
    assert noise_model.balanced_threshold(quiet, 0, 8, 4, 0.2) < noise_model.balanced_threshold(noisy, 0, 8, 4, 0.2)


def test_confirmations_count_for_less_when_children_timed_back_to_back_agree():
    # The same spread per child; in the second host most of it is a level the children share.
    independent, shared = noise_model.Noise.of(0.03, 0.03, 5), noise_model.Noise.of(0.03, 0.005, 5)
    assert shared.level > independent.level and shared.within == 0.005
    assert (noise_model.balanced_threshold(shared, 2, 8, 4, 0.2) > noise_model.balanced_threshold(independent, 2, 8, 4, 0.2))
    # With no shared level at all, confirmations are independent draws: the chance is a power.
    alone = noise_model.Noise(level=0.0, within=0.03)
    one = alone.cell_flags(1.05, 0, 0.0)
    assert alone.cell_flags(1.05, 2, 0.0) == pytest.approx(one ** 3, rel=1e-9)


def test_the_back_to_back_spread_is_measured_from_pairs_of_children():
    rng = random.Random(6)
    pairs = []
    for _ in range(400):  # a level shared by both children (sd 5%) and 1% of their own
        level = rng.gauss(0, 0.05)
        a, b = (CellRun("a", (math.exp(level + rng.gauss(0, 0.01)),), 1.0) for _ in range(2))
        pairs.append((a, b))
    assert detection._back_to_back_sd(pairs, 1, "min") == pytest.approx(0.01, rel=0.15)
    rule, _ = _choose([_run(rng, spread=0.05) for _ in range(8)], pairs=pairs)
    assert rule.within == pytest.approx(0.01, rel=0.15) and "back to back" in rule.describe()


def test_too_few_clean_runs_pass_on_the_models_rate_even_when_it_underflows_to_zero():
    det = {"false_alarm": 0.0, "clean_runs": 13}
    assert report._false_alarm_ok({**det, "predicted_false_alarm": 0.0})
    assert report._false_alarm_ok({**det, "predicted_false_alarm": 0.002})
    assert not report._false_alarm_ok({**det, "predicted_false_alarm": 0.02})
    assert not report._false_alarm_ok({**det, "predicted_false_alarm": None})
    assert not report._false_alarm_ok({"false_alarm": 1 / 13, "clean_runs": 13, "predicted_false_alarm": 0.0})


def test_a_cell_flags_only_when_every_confirmation_child_is_over():
    rule = detection.Rule(1, "min", 1.1, 0.01, confirmations=1)
    base = {c: 1.0 for c in CELLS}
    slow, fast = CellRun(CELLS[0], (1.5,), 1.0), CellRun(CELLS[0], (1.0,), 1.0)
    assert detection.cell_flags(base, [slow, slow], rule)
    assert not detection.cell_flags(base, [slow, fast], rule)
    quiet = [[CellRun(c, (1.0,), 1.0)] for c in CELLS[1:]]
    ev = detection.evaluate(rule, base, [[[slow, fast], *quiet]], {0.2: [[[slow, slow], *quiet]]})
    assert ev["false_alarm"] == 0.0 and ev["rates"]["slowdown_20"] == 1.0 and ev["confirmation_children"] == 2


def test_a_slowed_run_is_flagged_when_any_of_its_cells_is():
    rule = detection.Rule(1, "min", 1.1, 0.01)
    base = {c: 1.0 for c in CELLS}
    one_slow = [CellRun(c, (1.5 if c == CELLS[0] else 1.0,), 1.0) for c in CELLS]
    same = [CellRun(c, (1.0,), 1.0) for c in CELLS]
    ev = detection.evaluate(rule, base, [], {0.2: [_one_child(one_slow), _one_child(same)]})
    assert ev["rates"]["slowdown_20"] == 0.5 and ev["cell_rates"]["slowdown_20"] == pytest.approx(1 / 6)
    assert ev["false_alarm"] is None


def test_a_slower_machine_is_calibrated_away():
    rng = random.Random(4)
    rule, _ = _choose([_run(rng) for _ in range(7)])
    base = detection.baseline_of([_run(random.Random(5), spread=0.0)], rule.repeats, rule.statistic, 1)
    slower = [CellRun(cr.cell, tuple(2 * s for s in cr.samples), 2.0) for cr in _run(rng, spread=0.0)]
    assert detection.evaluate(rule, base, [_one_child(slower)], {})["false_alarm"] == 0.0


def test_without_the_calibration_a_slower_machine_is_a_slower_load():
    rng = random.Random(4)
    runs = [_run(rng) for _ in range(7)]
    plain, _ = detection.choose(runs, slowed_cells=2, baseline_children=5, calibrated=False)
    assert not plain.calibrated and "in seconds" in plain.describe()
    base = detection.baseline_of(runs, plain.repeats, plain.statistic, 5, calibrated=False)
    slower = [CellRun(cr.cell, tuple(2 * s for s in cr.samples), 2.0) for cr in _run(rng, spread=0.0)]
    assert detection.evaluate(plain, base, [_one_child(slower)], {})["false_alarm"] == 1.0


def test_two_rules_gate_one_cell_run_and_each_judges_its_own_children():
    calibrated = detection.Rule(1, "min", 1.1, 0.01, confirmations=0)
    plain = detection.Rule(1, "min", 1.1, 0.01, confirmations=2, calibrated=False)
    base = {CELLS[0]: 1.0}
    # the load is 1.5x, but so is the calibration: over only for the rule in seconds
    queue = [CellRun(CELLS[0], (1.5,), 1.5) for _ in range(3)]
    children = detection.gated(lambda: queue.pop(0), (calibrated, base), (plain, base))
    assert len(children) == 3 and not queue  # the plain rule's two confirmations were timed
    assert detection.cell_flags(base, children, plain) and not detection.cell_flags(base, children, calibrated)
    ev = detection.uncalibrated(plain, base, [[children]], {})
    assert ev["false_alarm"] == 1.0 and ev["false_alarm_runs"] == 1 and "in seconds" in ev["rule"]


def test_the_baseline_is_the_median_child_of_the_first_runs():
    runs = [[CellRun("a", (x,), 1.0)] for x in (3.0, 1.0, 2.0, 9.0, 0.5)]
    assert detection.baseline_of(runs, 1, "min", 3) == {"a": 2.0}
    assert detection.baseline_of(runs, 1, "min", 4) == {"a": 2.0}  # the lower median of an even count


def test_choosing_needs_the_baseline_runs_and_two_more():
    with pytest.raises(ValueError, match=">= 7 clean choice runs"):
        _choose([_run(random.Random(6))] * 6)


def _info(seconds, calibration=1.0):
    return R.LoadInfo(seconds=seconds, phases={"calibration": calibration})


def test_confirm_retimes_only_while_over_and_reports_the_fastest():
    over = lambda info: loadtime.calibrated(info) > 1.1  # noqa: E731
    queue = [_info(1.3), _info(1.05), _info(2.0)]
    got = loadtime.confirm(_info(1.5), lambda: queue.pop(0), over, confirmations=2)
    assert got.seconds == 1.05 and [c.seconds for c in got.children] == [1.5, 1.3, 1.05]
    assert queue == [_info(2.0)]  # stopped as soon as one child was within the bound
    assert loadtime.confirm(_info(1.0), lambda: pytest.fail("retimed a cell within its bound"), over).children == []
    slow = loadtime.confirm(_info(1.5), lambda: _info(1.4, 1.0), over, confirmations=2)
    assert over(slow) and len(slow.children) == 3
    # A failed child ends the confirmation: the cell is judged on what was timed.
    assert over(loadtime.confirm(_info(1.5), lambda: None, over, confirmations=2))


def test_a_cell_over_in_every_child_is_looked_at_again_and_over_only_when_over_there_too():
    """The host's level wanders over minutes, which the first look's children share: the later
    look's children are drawn at another moment (loadtime.LATER_LOOK_S)."""
    over = lambda info: loadtime.calibrated(info) > 1.1  # noqa: E731
    waited = []
    queue = [_info(1.3), _info(1.4), _info(1.05), _info(2.0)]
    passed = loadtime.confirm(_info(1.5), lambda: queue.pop(0), over, confirmations=2, later=lambda: waited.append(1))
    assert waited == [1] and passed.seconds == 1.05 and [c.seconds for c in passed.children] == [1.5, 1.3, 1.4, 1.05]
    slow = loadtime.confirm(_info(1.5), lambda: _info(1.4), over, confirmations=2, later=lambda: waited.append(2))
    assert over(slow) and len(slow.children) == 6 and waited == [1, 2]
    # one child of the first look within the bound: nothing to look at again
    quick = loadtime.confirm(_info(1.5), iter([_info(1.0)]).__next__, over,
                             later=lambda: pytest.fail("looked again at a cell within its bound"))
    assert not over(quick)
    # the later look's child failed: judged on the first look
    assert over(loadtime.confirm(_info(1.5), iter([_info(1.4), _info(1.3), None]).__next__, over, later=lambda: None))


def test_a_candidate_is_timed_against_the_base_in_balanced_pairs_and_their_medians_compared():
    """harness.loadtime.paired: a round of CANDIDATE_PAIRS pairs of fresh children, alternately
    candidate first and base first; each build's median child (the lower of an even count), by load
    seconds and without its calibration, is reported, every child listed."""
    order = []

    def timer(who, queue):
        return lambda: (order.append(who), queue.pop(0))[1]

    assert loadtime.CANDIDATE_PAIRS == 4
    mine = [_info(1.3, 0.5), _info(1.0, 2.0), _info(1.05, 1.0), _info(3.0, 1.0)]
    theirs = [_info(1.0, 1.0), _info(0.5, 1.0), _info(1.1, 1.0), _info(1.05, 9.0)]
    cand, base = loadtime.paired(timer("candidate", list(mine)), timer("base", list(theirs)), 1.1)
    assert order == ["candidate", "base", "base", "candidate"] * 2  # within the bound: one round
    assert (cand.seconds, base.seconds) == (1.05, 1.0)  # one slow or fast child moves neither
    assert "calibration" not in cand.phases and "calibration" not in base.phases
    assert [c.seconds for c in cand.children] == [1.3, 1.0, 1.05, 3.0] and base.children[3].calibration == 9.0
    # compared uncalibrated: the plain ratio of the medians
    assert loadtime.calibrated(cand) / loadtime.calibrated(base) == pytest.approx(1.05)
    # a failed child: nothing to judge by
    assert loadtime.paired(lambda: None, timer("base", [_info(1.0)]), 1.1) is None
    assert loadtime.paired(timer("candidate", [_info(1.0)]), lambda: None, 1.1) is None


def test_a_candidate_round_over_the_bound_is_confirmed_by_another():
    """A round outside [1/bound, bound] is timed again; the candidate is over (or under) only when
    every round is, and the round nearest 1 is reported, with every child of both."""
    def timer(values):  # None once the values are spent: a failed child
        queue = [_info(v) for v in values]
        return lambda: queue.pop(0) if queue else None

    spell = loadtime.paired(timer([1.2] * 4 + [1.0] * 4), timer([1.0] * 8), 1.1)
    assert spell[0].seconds / spell[1].seconds == pytest.approx(1.0) and len(spell[0].children) == 8
    slower = loadtime.paired(timer([1.3] * 4 + [1.2] * 4), timer([1.0] * 8), 1.1)
    assert slower[0].seconds / slower[1].seconds == pytest.approx(1.2) and len(slower[1].children) == 8
    assert loadtime.round_ratios(*slower) == pytest.approx([1.3, 1.2])
    # under 1/bound is confirmed the same way: one fast round of the candidate is not `improved`
    fast_spell = loadtime.paired(timer([0.8] * 4 + [0.99] * 4), timer([1.0] * 8), 1.1)
    assert fast_spell[0].seconds / fast_spell[1].seconds == pytest.approx(0.99)
    # the confirming round failed: the first round decides
    first_only = loadtime.paired(timer([1.3] * 4 + [1.2]), timer([1.0] * 4), 1.1)
    assert first_only[0].seconds == 1.3 and len(first_only[0].children) == 4


def test_baseline_load_is_the_median_child_by_calibrated_value():
    queue = [_info(2.0, 2.0), _info(3.0, 1.0), _info(0.5, 1.0), _info(1.2, 1.0)]
    got = loadtime.baseline_load(_info(1.1, 1.0), lambda: queue.pop(0), children=5)
    assert (got.seconds, got.phases["calibration"]) == (1.1, 1.0) and len(got.children) == 5
    assert loadtime.baseline_load(_info(1.0), lambda: None, children=5).children == []


def test_a_baseline_whose_fast_children_lie_beyond_the_bound_says_so():
    steady = loadtime.baseline_load(_info(1.0, 1.0), iter([_info(1.05, 1.0), _info(2.1, 2.0)]).__next__, children=3)
    assert loadtime.unsteady_baseline(steady, 1.113) is None
    queue = [_info(2.1, 1.0), _info(1.58, 1.0), _info(1.82, 1.0), _info(0.75, 1.0)]  # vLLM unquantized, the Xeon
    unsteady = loadtime.baseline_load(_info(1.07, 1.0), lambda: queue.pop(0), children=5)
    said = loadtime.unsteady_baseline(unsteady, 1.113)
    assert said and "the fastest loaded 2.11x faster than the median it stores" in said and "bound 1.113" in said
    assert loadtime.unsteady_baseline(_info(1.0), 1.113) is None  # one child: nothing to say
    # one slow child (the reference's first, on the Xeon) leaves the median where it was
    calibrated = [1.922, 1.701, 1.696, 1.728, 1.644]
    queue = [_info(v, 1.0) for v in calibrated[1:]]
    assert loadtime.unsteady_baseline(loadtime.baseline_load(_info(calibrated[0], 1.0), lambda: queue.pop(0),
                                                             children=5), 1.113) is None


@pytest.fixture
def fake_loader(monkeypatch):
    """A module with a loader entry point and its work, as harness.reference is, on a fake clock:
    each call of the work takes exactly 2 ms of it, so the test does not depend on the machine."""
    mod = types.ModuleType("fake_loader")
    mod.calls, mod.now = 0, 0.0

    def work(seconds=0.002):
        mod.calls += 1
        mod.now += seconds

    def load(n=20):
        for _ in range(n):
            mod.work()

    mod.work, mod.load = work, load
    monkeypatch.setitem(sys.modules, "fake_loader", mod)
    monkeypatch.setattr(slowdown, "time", types.SimpleNamespace(perf_counter=lambda: mod.now))
    return mod


def test_slowdown_repeats_the_loaders_work_inside_a_load_only(fake_loader):
    state = slowdown.install(0.5, entry="fake_loader:load", work=("fake_loader:work", "fake_loader:missing"))
    fake_loader.load()
    assert fake_loader.calls == 30  # 20 calls of its own and 10 repeated (50%): repeated work, not a sleep
    assert state.injected == pytest.approx(0.020)
    before = fake_loader.calls
    fake_loader.work()  # outside a load (a lazy decode in forward): never repeated
    assert fake_loader.calls == before + 1


def test_slowdown_ends_within_half_a_call_of_its_target(fake_loader):
    state = slowdown.install(0.2, entry="fake_loader:load", work=("fake_loader:work",))
    fake_loader.load(n=7)  # 14 ms of its own: 2.8 ms to inject, in 2 ms calls
    assert fake_loader.calls == 7 + 1  # one repeat (2 ms, 0.8 ms under) is nearer than two (1.2 ms over)
    assert abs(state.injected - 0.2 * 0.014) <= 0.001


def test_slowdown_needs_a_positive_fraction():
    with pytest.raises(ValueError, match="fraction > 0"):
        slowdown.Slowdown(0.0)


def test_worker_hook_slow_installs_the_slowdown(monkeypatch):
    from harness.engines import worker

    seen = []
    monkeypatch.setattr(slowdown, "install", lambda fraction, entry, work: seen.append((fraction, entry, work[0])))
    monkeypatch.setenv(worker.HOOK_ENV, "slow=0.2@*.reference;slow=0.1@*.vllm")
    worker.apply_hooks("llama.unquantized.transformers")
    worker.apply_hooks("llama.unquantized.reference")
    worker.apply_hooks("llama-m-unquantized.unquantized.vllm")
    assert seen == [(0.2, "harness.reference:load", "harness.quant.source:TensorSource.get"),
                    (0.1, "vllm.model_executor.model_loader.base_loader:BaseModelLoader.load_model", "torch:Tensor.copy_")]
    # an engine without the hook says so
    monkeypatch.setenv(worker.HOOK_ENV, "slow=0.2")
    with pytest.raises(ValueError, match="the transformers engine has no slowdown hook"):
        worker.apply_hooks("llama.unquantized.transformers")


@pytest.fixture
def small_calibration(monkeypatch, tmp_path):
    monkeypatch.setenv("HARNESS_BENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(loadtime, "CALIBRATION_BYTES", 1 << 16)


def test_the_calibration_is_the_geometric_mean_of_each_parts_fastest_pass(small_calibration, monkeypatch):
    memory, dispatch = iter([9.0, 4.0, 5.0]), iter([9.0, 1.0, 2.0])  # the first of each: the warm-up
    monkeypatch.setattr(loadtime, "memory_pass", lambda path: next(memory))
    monkeypatch.setattr(loadtime, "dispatch_pass", lambda: next(dispatch))
    assert loadtime.calibrate(repeats=2) == pytest.approx(2.0)  # sqrt(4 * 1)


def test_the_calibration_passes_run_for_real(small_calibration):
    assert loadtime.memory_pass(loadtime.calibration_file()) > 0 and loadtime.dispatch_pass() > 0


def test_the_torchao_workload_is_the_fastest_quantize_pass_and_recorded_by_name(small_calibration, monkeypatch):
    passes = iter([9.0, 3.0, 2.0, 4.0])  # the first: the warm-up
    monkeypatch.setattr(loadtime, "torchao_quantize_pass", lambda: next(passes))
    monkeypatch.setattr(loadtime, "memory_pass", lambda path: pytest.fail("the default workload was timed"))
    assert loadtime.calibrate(repeats=3, workload=loadtime.TORCHAO_QUANTIZE) == 2.0
    monkeypatch.setattr(loadtime, "torchao_quantize_pass", lambda: 0.5)
    info = loadtime.timed_load(lambda: (1.0, {}), gated=True, workload=loadtime.TORCHAO_QUANTIZE)
    assert info.phases["calibration"] == 0.5 and info.calibration_workload == loadtime.TORCHAO_QUANTIZE
    monkeypatch.setattr(loadtime, "memory_pass", lambda path: 1.0)
    assert loadtime.timed_load(lambda: (1.0, {}), gated=True).calibration_workload == loadtime.CALIBRATION_WORKLOAD
    with pytest.raises(ValueError, match="unknown calibration workload 'disk' \\(known: 2, 'torchao-quantize-1'\\)"):
        loadtime.calibrate(workload="disk")


def test_the_torchao_pass_quantizes_for_real():
    assert loadtime.torchao_quantize_pass() > 0
    assert loadtime.torchao_quantize_weight() is loadtime.torchao_quantize_weight()  # made once, reused
    assert loadtime.torchao_quantize_weight().shape == loadtime.TORCHAO_QUANTIZE_SHAPE


def test_a_gated_checkpoint_is_read_into_the_page_cache_only_where_it_fits(tmp_path, monkeypatch):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 1000)
    read = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda f, *a, **k: (read.append(Path(f).name), real_open(f, *a, **k))[1])
    monkeypatch.setattr(cpu, "available_memory", lambda: 4000)
    assert loadtime.warm_page_cache(tmp_path) and read == ["model.safetensors"]
    monkeypatch.setattr(cpu, "available_memory", lambda: 1999)
    assert not loadtime.warm_page_cache(tmp_path)
    monkeypatch.setattr(cpu, "available_memory", lambda: None)
    assert not loadtime.warm_page_cache(tmp_path) and read == ["model.safetensors"]


def test_a_gated_load_is_timed_after_a_full_collection(monkeypatch):
    """Else the collector's full pass (~350 ms under a preloaded parent) lands in whichever load
    crosses its threshold, which depends on what the parent allocated before the fork."""
    steps = []
    monkeypatch.setattr(loadtime.gc, "collect", lambda *a: steps.append("collect") or 0)
    monkeypatch.setattr(loadtime, "calibrate", lambda *a, **k: steps.append("calibrate") or 1.0)
    loadtime.timed_load(lambda: (steps.append("load") or 0.1, {}), gated=True)
    assert steps[:3] == ["collect", "calibrate", "load"]
    steps.clear()
    loadtime.timed_load(lambda: (steps.append("load") or 0.1, {}), gated=False)
    assert steps == ["load"]


def test_timed_load_gated_repeats_and_calibrates(small_calibration, monkeypatch):
    monkeypatch.setattr(loadtime, "LOAD_REPEATS", 3)
    for statistic, seconds in (("min", 0.1), ("median", 0.2)):
        monkeypatch.setattr(loadtime, "STATISTIC", statistic)
        times = iter([0.3, 0.1, 0.2])
        info = loadtime.timed_load(lambda: (t := next(times), {"read": t / 2}), gated=True)
        assert info.samples == [0.3, 0.1, 0.2] and info.seconds == seconds and info.phases["read"] == seconds / 2
        assert info.phases["calibration"] > 0
    ungated = loadtime.timed_load(lambda: (0.5, {"read": 0.2}), gated=False)
    assert ungated.samples == [] and ungated.seconds == 0.5 and "calibration" not in ungated.phases


def test_a_gated_load_says_which_memory_allocation_it_was_timed_under(monkeypatch):
    monkeypatch.setattr(loadtime, "calibrate", lambda *a, **k: 1.0)
    for name in loadtime.ALLOCATION_ENV:
        monkeypatch.delenv(name, raising=False)
    assert loadtime.timed_load(lambda: (0.1, {}), gated=True).allocation == {}
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    monkeypatch.setenv("LD_PRELOAD", "libgomp.so.1")  # vLLM sets it for its own processes
    info = loadtime.timed_load(lambda: (0.1, {}), gated=True)
    assert info.allocation == {"THP_MEM_ALLOC_ENABLE": "1", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert R.LoadInfo.model_validate_json(info.model_dump_json()).allocation == info.allocation
    assert loadtime.timed_load(lambda: (0.1, {}), gated=False).allocation == {}  # nothing to compare it with


def test_load_statistic_names_a_bad_statistic():
    assert loadtime.load_statistic([3.0, 1.0, 2.0], "median") == 2.0
    with pytest.raises(ValueError, match="unknown load statistic 'mean'"):
        loadtime.load_statistic([1.0], "mean")


def test_checkpoint_names_sizes_and_parameters():
    assert benchmark.name("M", "bnb-nf4") == "llama-M-bnb-nf4"
    assert benchmark.parameters("S", 512) == pytest.approx(46e6, rel=0.01)
    assert benchmark.parameters("M", 512) < benchmark.parameters("L", 512)
    with pytest.raises(ValueError, match="unknown benchmark size 'XL'"):
        benchmark.dims("XL")
    with pytest.raises(ValueError, match="unknown benchmark format 'gguf'"):
        benchmark.name("S", "gguf")


def test_cpu_load_cells_are_built_on_demand(monkeypatch, tmp_path):
    monkeypatch.setenv("HARNESS_BENCH_CACHE", str(tmp_path))
    m = M.load()
    m._dir = tmp_path.parent
    cells = [c.model_copy(update={"path": f"{tmp_path.name}/{benchmark.name('M', 'bnb-nf4')}"})
             for c in m.cells(tier="cpu-load") if c.scheme == "bnb-nf4"]
    built = []
    monkeypatch.setattr(benchmark, "build", lambda size, fmt, echo: built.append((size, fmt)))
    benchmark.ensure_for_cells(m, cells, echo=lambda _: None)
    assert built == [("M", "bnb-nf4")] * len(cells)
    (tmp_path / benchmark.name("M", "bnb-nf4")).mkdir()
    benchmark.ensure_for_cells(m, cells, echo=lambda _: None)  # there: nothing built
    assert len(built) == len(cells)


def _figures(**over):
    load = [{"size": s, "format": "bnb-nf4", "checkpoint_mb": mb, "floor_s": 0.01, "reference_s": t,
             "transformers_s": 0.5, "reference_forward_s": t + 0.1, "transformers_forward_s": 0.7,
             "reference_peak_mb": 900, "transformers_peak_mb": 900, "reference_peak_extra_mb": mb,
             "transformers_peak_extra_mb": mb} for s, mb, t in (("S", 100, 0.1), ("M", 400, 0.4))]
    fig = {"load": load, "decode": [{"format": "bnb-nf4", "shape": [5632, 2048], "decode_s": 0.02, "fill_s": 0.01,
                                     "ratio": 2.0}], "detection": None, "matrix": None, "machine": {}, "notes": []}
    fig.update(over)
    return fig


def test_targets_pass_miss_and_not_measured():
    marks = {t["target"][:2]: t["ok"] for t in report.targets(_figures())}
    assert marks == {"1a": True, "1b": True, "1c": True, "1d": True, "2 ": True, "3 ": None, "4 ": None, "5 ": None,
                     "6 ": None, "7 ": None}
    slow = _figures(matrix={"before_s": 100.0, "after_s": 80.0, "before": "x", "after": "y"},
                    decode=[{"format": "fp8", "shape": [1, 1], "decode_s": 0.04, "fill_s": 0.01, "ratio": 4.0}])
    marks = {t["target"][:2]: t["ok"] for t in report.targets(slow)}
    assert marks["4 "] is False and marks["2 "] is False
    reduced = _figures(matrix={"before_s": 100.0, "after_s": 10.0, "before": "x", "after": "y", "select": "llama"})
    assert {t["target"][:2]: t["ok"] for t in report.targets(reduced)}["4 "] is None


def test_decode_judges_dequantizations_and_shows_the_unquantized_copy_beside_them():
    copy = {"format": "unquantized", "shape": [1, 1], "decode_s": 0.035, "fill_s": 0.01, "ratio": 3.5,
            "decodes": False}
    fig = _figures()
    fig["decode"].append(copy)
    t = {t["target"][:2]: t for t in report.targets(fig)}["2 "]
    assert t["ok"] is True and t["detail"] == "worst ratio 2.00 (bnb-nf4); not judged: the unquantized copy 3.50"
    fig["targets"] = report.targets(fig)
    assert "| unquantized (a copy: not judged) | 1x1 | 35.00 |" in report.markdown(fig)
    fig["decode"][0]["ratio"] = 3.1
    assert {t["target"][:2]: t["ok"] for t in report.targets(fig)}["2 "] is False


def test_time_per_gb_spread_is_judged_across_sizes():
    fig = _figures()
    fig["load"][1]["reference_s"] = 0.8  # M twice as slow per GB as S
    t = {t["target"][:2]: t for t in report.targets(fig)}["1d"]
    assert t["ok"] is False and t["detail"].startswith("largest max/min over formats: 2.00")


def test_a_fixed_cost_per_load_misses_time_per_gb_but_cancels_per_added_gb():
    """50 ms per load plus 1 s per GB: the total per GB falls with size (judged, a miss), the cost
    of each added GB is the same from S to M as from M to L (reported beside it, 1.00)."""
    fig = _figures()
    fig["load"] = [{**fig["load"][0], "size": s, "checkpoint_mb": mb, "reference_s": 0.05 + mb / 1e3,
                    "reference_forward_s": 0.07 + 2 * mb / 1e3} for s, mb in (("S", 50), ("M", 200), ("L", 600))]
    t = {t["target"][:2]: t for t in report.targets(fig)}["1d"]
    assert t["ok"] is False and t["detail"].startswith("largest max/min over formats: 1.85")
    assert "load 1.00 (transformers' inf)" in t["detail"] and "load+forward 1.00 (transformers' inf)" in t["detail"]


def test_markdown_has_a_line_per_target_and_the_tables():
    fig = _figures(load_repeats=3)
    fig["targets"] = report.targets(fig)
    text = report.markdown(fig)
    assert "in a fresh child process (of 3 such children per engine and checkpoint, the one of median load time)" in text
    assert text.count("\n- **") == len(fig["targets"])
    assert "| M | bnb-nf4 | 400 |" in text and "| bnb-nf4 | 5632x2048 | 20.00 | 10.00 | 2.00 |" in text


def test_bench_rejects_unknown_parts_and_sizes(capsys):
    assert cli.main(["bench", "--parts", "load,speed"]) == 2
    assert "unknown part 'speed'" in capsys.readouterr().err
    assert cli.main(["bench", "--parts", "candidate"]) == 2
    assert "--parts candidate: name the build to try, --candidate ENGINE=SPEC" in capsys.readouterr().err
    assert cli.main(["bench", "--sizes", "XL"]) == 2
    assert "unknown size 'XL'" in capsys.readouterr().err


def test_bench_quick_decode_on_a_tiny_size(monkeypatch, tmp_path, capsys):
    """The decode part end to end through the CLI, on TINY checkpoints built by the producers."""
    monkeypatch.setenv("HARNESS_BENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(benchmark, "LAYER", dict(hidden_size=64, intermediate_size=128, num_attention_heads=2,
                                                   num_key_value_heads=1))
    monkeypatch.setattr(benchmark, "FORMATS", ("bnb-nf4", "unquantized"))
    from harness.quant import bnb

    timed = []  # the stored form's own decode is what is timed, once per repeat (not a copy of its result)
    real = bnb.Stored4bit.dequantize
    monkeypatch.setattr(bnb.Stored4bit, "dequantize", lambda self, out=None: timed.append(out) or real(self, out))
    out = tmp_path / "BENCHMARKS.md"
    assert cli.main(["bench", "--quick", "--parts", "decode", "--output", str(out), "--json"]) == 0
    assert len(timed) >= decode.measure.__defaults__[0] and all(o is not None for o in timed)
    import json

    fig = json.loads(capsys.readouterr().out)
    assert [(r["format"], r["decodes"]) for r in fig["decode"]] == [("bnb-nf4", True), ("unquantized", False)]
    assert all(r["shape"] == [128, 64] and r["decode_s"] > 0 and r["fill_s"] > 0 for r in fig["decode"])
    assert fig["load"] is None and any("load: not measured" in n for n in fig["notes"])
    assert "## Decode" in out.read_text()

    # without --output, a run of one part leaves the repository's BENCHMARKS.md as it was
    from harness.bench import main

    monkeypatch.setattr(main, "REPO_ROOT", tmp_path / "repo")
    committed = tmp_path / "repo" / "BENCHMARKS.md"
    committed.parent.mkdir()
    committed.write_text("# Benchmarks\n\nthe full run's figures\n")
    assert cli.main(["bench", "--quick", "--parts", "decode"]) == 0
    assert committed.read_text() == "# Benchmarks\n\nthe full run's figures\n"
    [written] = (tmp_path / "repo" / "results").glob("bench-*/BENCHMARKS.md")
    assert "## Decode" in written.read_text() and str(written) in capsys.readouterr().err


@pytest.mark.parametrize("argv, where", [
    ([], "BENCHMARKS.md"),  # every default part at every size: what BENCHMARKS.md holds
    (["--parts", "load,decode,detection,portability,matrix"], "BENCHMARKS.md"),
    (["--parts", "portability"], "results"),
    (["--quick"], "results"),
    (["--sizes", "M"], "results"),
    (["--parts", "portability", "--output", "/tmp/port.md"], "/tmp/port.md"),
])
def test_only_a_run_of_every_default_part_and_size_writes_benchmarks_md_by_default(argv, where, tmp_path, monkeypatch):
    import argparse

    from harness.bench import main as bench
    from harness.bench import options

    monkeypatch.setattr(bench, "REPO_ROOT", tmp_path)
    p = argparse.ArgumentParser()
    options.add_arguments(p)
    args = p.parse_args(argv)
    out = bench._output(args, bench._parts(args), bench._sizes(args))
    if where == "results":
        # a directory of its own, made when the figures are written (harness.layout.default_results_dir)
        assert out.name == "BENCHMARKS.md" and out.parent.parent == bench.REPO_ROOT / "results"
        assert out.parent.name.startswith("bench-") and out.parent.is_dir() and not any(out.parent.iterdir())
    else:
        assert out == (bench.REPO_ROOT / where if where == "BENCHMARKS.md" else Path(where))


def test_floor_reads_every_weight_file(tmp_path):
    from harness.bench import load

    (tmp_path / "a.safetensors").write_bytes(b"x" * 4096)
    (tmp_path / "b.safetensors").write_bytes(b"y" * 1000)
    (tmp_path / "config.json").write_text("{}")
    assert [f.name for f in benchmark.weight_files(tmp_path)] == ["a.safetensors", "b.safetensors"]
    assert benchmark.megabytes(tmp_path) == pytest.approx(5096 / 1e6)
    assert 0 < load.floor(tmp_path, repeats=2) < 1.0


def test_touch_reads_the_tensors_inside_a_quantized_parameter():
    import torch

    from harness.bench import load

    class Quantized:  # what load._plain asks of a tensor subclass such as torchao's Int8Tensor
        def __init__(self, qdata, scale):
            self.qdata, self.scale = qdata, scale

        def __tensor_flatten__(self):
            return ["qdata", "scale"], None

    w = Quantized(torch.ones(4, 4, dtype=torch.int8), torch.ones(4))
    assert [t.dtype for t in load._plain(w)] == [torch.int8, torch.float32]
    load._touch(torch.nn.Linear(4, 4))  # plain parameters: summed without error


def test_a_bench_run_keeps_the_hand_written_section_of_benchmarks_md():
    old = "# Benchmarks\n\nold figures\n\n---\n\n## Measured by hand\n\n| what | s |\n|---|---|\n| CI | 1861 |\n"
    kept = report.kept_by_hand(old)
    assert kept == "\n---\n\n## Measured by hand\n\n| what | s |\n|---|---|\n| CI | 1861 |\n"
    assert ("# Benchmarks\n\nnew figures\n" + kept).endswith("| CI | 1861 |\n")
    assert report.kept_by_hand("# Benchmarks\n\nno such section\n") == ""
    assert report.kept_by_hand((Path(__file__).parent.parent / "BENCHMARKS.md").read_text()).startswith(
        "\n---\n\n## Measured by hand")


def _portable_cells(*bounds: float):
    return [types.SimpleNamespace(id=f"c{i}", bounds=types.SimpleNamespace(load_time=b)) for i, b in enumerate(bounds)]


def test_a_portability_run_is_a_false_alarm_only_when_a_cells_fastest_child_is_over_its_bound():
    cells = _portable_cells(1.1, 1.2)
    by_cell = {"c0": {"runs": [[1.0], [1.15, 1.12], [1.15, 1.05], [0.85]], "error": None},
               "c1": {"runs": [[1.0], [1.0], [1.0], [1.0]], "error": None}}
    s = portability.summarize(cells, by_cell, runs=4)
    assert s["cells"]["c0"]["reported"] == [1.0, 1.12, 1.05, 0.85]
    assert (s["complete_runs"], s["false_alarm_runs"], s["improved_runs"]) == (4, 1, 1)
    assert (s["cells"]["c0"]["regressed"], s["cells"]["c0"]["improved"]) == (1, 1)


def test_a_portability_cell_run_over_in_every_child_gets_the_gates_later_look(monkeypatch):
    cells = _portable_cells(1.1)
    ratios = iter([1.5, 1.3, 1.4, 1.0, 1.05])  # run 1: over in all three children; run 2; the later look
    monkeypatch.setattr(detection, "cell_run", lambda cell, path, repeats: CellRun(cell.id, (next(ratios),), 1.0))
    said = []
    got = portability.time_runs(cells, {"c0": None}, {"c0": R.LoadInfo(seconds=1.0, phases={"calibration": 1.0})},
                                runs=2, echo=said.append, later_look_s=0.0)
    assert got["c0"]["runs"] == [[1.5, 1.3, 1.4, 1.05], [1.0]] and got["c0"]["later"] == [0]
    assert any("over its bound in every child of run 1" in line for line in said)
    s = portability.summarize(cells, got, runs=2)
    assert (s["false_alarm_runs"], s["cells"]["c0"]["later_looks"]) == (0, 1)
    assert "| 1.100 | 1 | 0 | 0 |" in "\n".join(report._portability_lines({"native": {"environment": {}, **s}}))


def test_a_cell_that_cannot_load_under_a_condition_is_reported_and_not_judged():
    cells = _portable_cells(1.1, 1.1)
    s = portability.summarize(cells, {"c0": {"runs": [], "error": "cannot load: inductor"},
                                      "c1": {"runs": [[1.0]] * 20, "error": None}}, runs=20)
    port = {"aten-default": {"environment": {}, **s}}
    assert (s["complete_runs"], s["false_alarm_runs"]) == (20, 0)
    assert report._portability_ok(port) is True
    assert "1 cell(s) not timed" in report._portability_detail(port)
    assert "| aten-default | c0 | 0 | cannot load: inductor |" in "\n".join(report._portability_lines(port))
    short = {"native": {"environment": {}, **portability.summarize(cells[1:], {"c1": {"runs": [[1.0]] * 5, "error": None}}, 5)}}
    assert report._portability_ok(short) is False  # fewer runs than the target asks for


def test_portability_times_the_cells_with_a_baseline_and_reports_the_others(monkeypatch):
    """vLLM's fp8-dynamic cell has no committed baseline (unsupported where they were recorded):
    on a machine where it runs, the bench measures the rest and says so of it."""
    cells = [types.SimpleNamespace(id=f"c{i}", tier="cpu-load", engine="reference",
                                   bounds=types.SimpleNamespace(load_time=1.1)) for i in range(2)]
    stored = {"c0": types.SimpleNamespace(load=R.LoadInfo(seconds=1.0))}
    monkeypatch.setattr(portability.resolver, "load_baseline_here", lambda root, tier, cell, here: stored.get(cell))
    for name in loadtime.ALLOCATION_ENV:
        monkeypatch.delenv(name, raising=False)
    timed = []

    def child(argv, **kw):
        timed.append((argv[argv.index("--later-look") + 1], argv[argv.index("--later-look") + 2:]))
        return types.SimpleNamespace(returncode=0, stdout=json.dumps({"c0": {"runs": [[1.0]] * 20, "error": None}}))
    monkeypatch.setattr(portability.subprocess, "run", child)
    said = []
    got = portability.measure(cells, {}, matrix_path="m.yaml", baselines_root="B", runs=20, only=["native"],
                              echo=said.append)["native"]
    assert timed == [(str(loadtime.LATER_LOOK_S), ["c0"])] and (got["complete_runs"], got["false_alarm_runs"]) == (20, 0)
    assert got["cells"]["c1"]["error"] == "no load-time baseline in B"
    assert "not timed, no load-time baseline in B: c1" in "\n".join(said)
    assert report._portability_ok({"native": got}) is True
    # a quick check with a shorter later look is reported, and is not what target 5 counts
    quick = portability.measure(cells, {}, matrix_path="m.yaml", baselines_root="B", runs=20, only=["native"],
                                echo=said.append, later_look_s=30.0)
    assert timed[-1] == ("30.0", ["c0"]) and report._portability_ok(quick) is False
    assert "later look 30 s, not the gate's" in report._portability_detail(quick)
    # runs under other memory allocation than the baselines' are reported, and not what target 5 counts
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    huge = portability.measure(cells, {}, matrix_path="m.yaml", baselines_root="B", runs=20, only=["native"],
                               echo=said.append)
    assert huge["native"]["other_allocation"] == ["c0"] and report._portability_ok(huge) is False
    assert ("timed under THP_MEM_ALLOC_ENABLE=1, not the memory allocation of 1 cell(s)' baselines"
            in report._portability_detail(huge))
    stored["c0"].load.allocation = {"THP_MEM_ALLOC_ENABLE": "1"}  # baselines of one's own, timed under it
    assert report._portability_ok(portability.measure(cells, {}, matrix_path="m.yaml", baselines_root="B", runs=20,
                                                      only=["native"], echo=said.append)) is True
    monkeypatch.setattr(portability.resolver, "load_baseline_here", lambda root, tier, cell, here: None)
    with pytest.raises(ValueError, match="no load-time baseline for c0, c1"):
        portability.measure(cells, {}, matrix_path="m.yaml", baselines_root="B", runs=20, echo=said.append)


@pytest.mark.slow("a bench portability child under aten-default kernels, importing torch")
def test_a_portability_child_chooses_its_baselines_by_the_kernels_it_times_on(tmp_path):
    """The child's load baselines are chosen for the kernels its loads run on, torch's capability
    among them, which a CPU description taken before torch is imported does not know (it would then
    take this CPU's native baseline over the condition's own). Its stderr, the bench's progress,
    carries none of the libraries' own messages."""
    import subprocess
    cell = M.load(M.DEFAULT_PATH).cells(tier="cpu-load")[0].id
    chosen = ("import json\nfrom harness.bench import portability\n"
              "def chosen(root, tier, cell, here): print(json.dumps(here)); sys.exit(0)\n"
              "portability.resolver.load_baseline_here = chosen\n")
    env = {**cpu.condition_env(cpu.KERNEL_CONDITIONS["aten-default"]), "HARNESS_LOG": str(tmp_path / "libraries.log")}
    p = subprocess.run([sys.executable, "-c", portability.CHILD.replace("from harness.bench.portability import main",
                                                                         chosen + "from harness.bench.portability import main"),
                        "--matrix", str(M.DEFAULT_PATH), "--baselines", "B", "--runs", "1", cell],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout.strip().splitlines()[-1])["capability"] == "default"
    assert p.stderr == "" and (tmp_path / "libraries.log").exists()


def test_bench_reads_slowdowns_and_conditions(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--parts", "detection", "--slowdowns", "0.2,x"])
    assert e.value.code == 2 and "give fractions" in capsys.readouterr().err
    assert cli.main(["bench", "--parts", "detection", "--baseline-children", "15"]) == 2  # with 9 choice runs
    assert "--choice-runs 9: the detection part needs at least --baseline-children + 2 = 17" in capsys.readouterr().err
    assert cli.main(["bench", "--parts", "portability", "--conditions", "avx9"]) == 2
    assert "unknown condition 'avx9' (known: native, aten-default, libraries-avx2, avx2-machine)" in capsys.readouterr().err
    assert cli.main(["bench", "--parts", "portability", "--later-look", "-1"]) == 2
    assert "--later-look -1: give a number of seconds, 0 or more" in capsys.readouterr().err


def test_the_bench_writes_into_this_checkout():
    """Its default output, baselines and git commands are the checkout's (loadtime.REPO_ROOT)."""
    assert (loadtime.REPO_ROOT / "pyproject.toml").is_file() and (loadtime.REPO_ROOT / "harness").is_dir()


def test_building_the_harness_parser_imports_no_engine():
    """Every command builds the whole parser, bench's options among them: importing torch there
    cost each command about 2 s of start (harness.bench.options)."""
    code = "import sys; from harness import cli; cli.parser(); print(sorted({'torch', 'vllm'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=loadtime.REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_portability_part_runs_only_when_named():
    """It times every cpu-load cell under three conditions (about 15 minutes): a measurement, not a default."""
    from harness.bench import main, options

    assert "portability" in options.PARTS and "portability" not in options.DEFAULT_PARTS
    parser = argparse.ArgumentParser()
    options.add_arguments(parser)
    assert main._parts(parser.parse_args([])) == list(options.DEFAULT_PARTS)


def test_the_memory_pass_reads_the_file_into_buffers_it_reuses(small_calibration):
    """Fresh buffers would time their page faults, which depend on what the process freed before."""
    import numpy as np

    path = loadtime.calibration_file()
    loadtime.memory_pass(path)
    raw, wide = loadtime.memory_buffers(path.stat().st_size)
    wide.fill_(0)
    loadtime.memory_pass(path)
    assert loadtime.memory_buffers(path.stat().st_size)[1] is wide
    assert np.array_equal(wide.numpy(), np.fromfile(path, dtype=np.float16).astype(np.float32))


def test_the_pairs_part_counts_a_clean_candidate_and_catches_a_slowed_one(monkeypatch):
    """harness.bench.pairs through loadtime.paired, with children that load in a fixed time (a
    little noise, and a calibration that would mislead), 20% slower for a slowed candidate, 40% for
    one with the mutation of the one cell it applies to."""
    cells = [types.SimpleNamespace(id=f"c{i}", engine=engine, scheme=scheme, bounds=types.SimpleNamespace(load_time=1.113))
             for i, (engine, scheme) in enumerate([("reference", "torchao-int8wo"), ("vllm", "torchao-int8wo")])]
    timed = []

    def cell_run(cell, path, repeats, slow=0.0, mutation=None):
        timed.append((cell.id, slow, mutation))
        seconds = 1.0 + slow + (0.4 if mutation else 0.0) + 0.01 * (len(timed) % 3)
        return CellRun(cell.id, (seconds,), 1.0 + slow, slow)

    monkeypatch.setattr(detection, "cell_run", cell_run)
    monkeypatch.setattr(detection, "preload", lambda cells, paths: None)
    out = pairs.measure(cells, {c.id: None for c in cells}, clean_runs=4, slowed_runs=3, slowdowns=(0.2,), echo=lambda _: None)
    assert out["clean"]["flagged_runs"] == 0 and out["clean"]["runs"] == 4
    assert out["slowdown_20"]["flagged_runs"] == 3
    # every pair-run's children: one round when clean, a confirming second when over
    assert len(timed) == 2 * loadtime.CANDIDATE_PAIRS * (4 * 2 + 2 * (3 * 2 + 3))
    assert out["slowdown_20"]["cells"]["c0"]["second_rounds"] == 3 and out["clean"]["cells"]["c0"]["second_rounds"] == 0
    mutated = out["torchao-full-size-dummy"]
    assert list(mutated["cells"]) == ["c1"] and mutated["flagged_runs"] == 3
    assert {m for _, _, m in timed if m} == {"torchao-full-size-dummy"}
    predicted = out["predicted_false_alarm"]
    assert predicted is not None and predicted["least"] <= predicted["most"] < 0.01
    assert out["slowdown_20"]["cells"]["c0"]["first_ratios"] == pytest.approx([1.2] * 3, rel=0.03)
    fig = {"pairs": out}
    target = next(t for t in report.targets(fig) if t["target"].startswith("6 "))
    assert target["ok"] is True and "slowdown_20: 3 of 3 runs flagged" in target["detail"]
    assert "| slowdown_20 | c0 | 3 |" in report.markdown(fig)


def test_the_pairs_target_needs_the_catches_and_few_enough_clean_flags():
    def fig(clean_flagged, clean_runs, caught, predicted=0.001):
        return {"pairs": {"clean": {"runs": clean_runs, "flagged_runs": clean_flagged, "cells": {}},
                          "slowdown_20": {"runs": 20, "flagged_runs": caught, "cells": {}},
                          "predicted_false_alarm": {"least": predicted ** 2, "most": predicted}}}

    ok = lambda f: next(t for t in report.targets(f) if t["target"].startswith("6 "))["ok"]  # noqa: E731
    assert ok(fig(0, 30, 20)) is True
    assert ok(fig(0, 30, 18)) is False  # 90% caught
    assert ok(fig(1, 30, 20)) is False
    assert ok(fig(0, 30, 20, predicted=0.05)) is False  # too few runs to show < 1%, and the model's upper end says more
    assert ok(fig(0, 100, 20, predicted=0.05)) is True
    assert ok({"pairs": None}) is None


def test_detection_weighs_its_rule_against_the_same_children_without_the_calibration(monkeypatch):
    """A machine whose speed drifts between runs, loads and calibration alike: the calibrated rule
    bears it, the rule in seconds flags clean runs; both are reported from one measurement."""
    rng, drift = random.Random(11), iter(1.0 + 0.3 * (i % 2) for i in range(10_000))

    def child(cell, path, repeats, slow=0.0, mutation=None):
        speed = next(drift)
        return CellRun(cell.id, tuple(speed * (1 + slow) * math.exp(rng.gauss(0, 0.005)) for _ in range(repeats)),
                       speed, slow)

    monkeypatch.setattr(detection, "preload", lambda cells, paths: None)
    monkeypatch.setattr(detection, "cell_run", child)
    cells = [types.SimpleNamespace(id=c, engine="reference", scheme="bnb-nf4") for c in CELLS[:2]]
    d = detection.measure(cells, {c.id: None for c in cells}, choice_runs=8, held_out_runs=6, slowed_runs=4,
                          slowdowns=(0.2,), echo=lambda _: None, loads=1)
    assert d.rule.calibrated and d.rates["false_alarm"] == 0.0 and d.rates["slowdown_20"] == 1.0
    assert d.uncalibrated["false_alarm"] > 0.0
    det = {**d.rates, "rule": d.rule.describe(), "clean_runs": d.clean_runs, "uncalibrated": d.uncalibrated,
           "false_alarm_runs": 0, "later_look": d.later_look, "predicted_false_alarm": d.predicted_false_alarm}
    line = "".join(report._uncalibrated_lines(det))
    assert "Without the calibration" in line and "in seconds" in line and "clean runs with a false alarm 0 of 6" in line


@pytest.mark.slow("two harness runs of one reference cell, each with its fork server")
def test_the_candidate_part_times_a_candidate_run_beside_a_plain_one(tmp_path):
    """Both runs are real ``harness run``s; the ledger tells the candidate build's children and fork
    server from the base's by their interpreter (a stand-in build: this venv's, under another path)."""
    from tests.stand_in_build import stand_in_build

    build = stand_in_build(tmp_path / "build", {})
    fig = candidate.measure(f"reference={build}", "whisper.unquantized.reference", "cpu-tiny", echo=lambda _: None)
    plain, both = fig["plain"], fig["with_candidate"]
    assert (plain["exit"], both["exit"]) == (0, 0), (plain["summary"], both["summary"])
    assert (plain["base"]["cells"], plain["candidate"]["cells"], both["base"]["cells"], both["candidate"]["cells"]) == (1, 0, 1, 1)
    assert plain["ledger"]["base"]["children"] == {"cell": 1} and plain["ledger"]["candidate"]["children"] == {}
    assert both["ledger"]["base"]["children"] == {"cell": 1} and both["ledger"]["candidate"]["children"] == {"cell": 1}
    assert both["ledger"]["candidate"]["fork_servers"] == 1 and both["ledger"]["base"]["fork_servers"] == 1
    assert "candidate cost: wall" in both["summary"] and "its own environment" in both["summary"]
    assert fig["build_s"] is None and fig["wall_ratio"] == both["wall_s"] / plain["wall_s"]
    text = "\n".join(candidate.lines(fig))
    assert "the candidate's environment: an existing environment" in text
    assert "| the candidate's cells: count, own time | - | 1, " in text and "Target 7: " in text
