"""Portable verdicts: FP8 rounding boundaries, fragile onsets, and the noise-aware comparison
against a baseline from other kernels (docs/design.md, "Portability across CPUs")."""

import json
from pathlib import Path

import pytest
import torch

from harness import cpu, judging, measure_noise
from harness import noise as N
from harness import noise_child
from harness import records as R
from harness.baselines import Baseline
from harness.quant.fp8 import rounding_boundaries
from tests.test_compare import BOUNDS, INFO, record, seq

CPU_A = R.CpuInfo(vendor="AuthenticAMD", model="AMD EPYC", flags=["avx2", "avx512f", "avx512_bf16"], capability="avx512")
CPU_B = R.CpuInfo(vendor="GenuineIntel", model="Intel Xeon", flags=["avx2", "avx512f"], capability="avx512")
LPS = tuple(-1.0 - 0.1 * i for i in range(8))
TOKENS = tuple(range(10, 19))  # none is the top-k filler id 9 of test_compare.seq


def test_rounding_boundaries_are_the_midpoints_between_fp8_values():
    b = rounding_boundaries()
    d = noise_child.distance_to_boundary(torch.tensor([34.0, 33.0, 448.0, 0.0]), b)
    # 32 and 36 are neighbours (spacing 4 in [32, 64)): 34 is a boundary; 448 is 16 from 432.
    assert d.tolist() == [0.0, 1.0, 16.0, pytest.approx(2.0 ** -10)]


def test_onset_is_the_first_fragile_position_with_its_evidence():
    b = rounding_boundaries()
    rows = torch.full((6, 4), 20.0)
    rows[3, 2] = 34.0 + 1e-4  # within its noise of the boundary at 34
    rows[5, 0] = 34.5  # 0.5 away: not fragile at this noise
    noise = torch.full((6, 4), 2e-4)
    onset = noise_child._onset([("model.layers.3.mlp.down_proj#0", True, rows)], [noise], b)
    assert (onset.position, onset.quantizer) == (3, "model.layers.3.mlp.down_proj#0")
    assert onset.value == pytest.approx(34.0001) and onset.distance == pytest.approx(1e-4, rel=1e-2)
    assert onset.noise == pytest.approx(2e-4)
    assert noise_child._onset([("x#0", True, rows)], [torch.zeros(6, 4)], b) is None


def test_an_encoder_activation_places_the_onset_at_the_first_position():
    b = rounding_boundaries()
    rows = torch.full((30, 4), 20.0)
    rows[29, 1] = 34.0
    onset = noise_child._onset([("model.encoder.layers.0.fc1#0", False, rows)], [torch.full((30, 4), 1e-6)], b)
    assert onset.position == 0
    assert noise_child._SEEN_BY_ALL_POSITIONS.search("model.decoder.layers.1.encoder_attn.k_proj")
    assert noise_child._SEEN_BY_ALL_POSITIONS.search("model.language_model.layers.3.cross_attn")
    assert not noise_child._SEEN_BY_ALL_POSITIONS.search("model.decoder.layers.1.encoder_attn.q_proj")
    assert not noise_child._SEEN_BY_ALL_POSITIONS.search("model.decoder.layers.1.self_attn")


def _noisy_baseline(onset_at=4, bound_after=0.5) -> Baseline:
    rec = record(engine_info=INFO.model_copy(update={"cpu": CPU_A}), sequences=[seq(lps=LPS, tokens=TOKENS)])
    b = Baseline.from_record(rec, commit="c0ffee")
    onset = N.Onset(position=onset_at, quantizer="model.layers.0.mlp.down_proj#0", value=34.0, distance=0.0, noise=1e-4)
    b.noise = N.Noise(kernels=["avx512", "default"], activation_noise=1e-4, simulated_runs=8,
                      prompts={"p0": N.PromptNoise(onset=onset, bound_after_onset=bound_after, logprob_noise=[1e-6] * 8)})
    return b


def _obtained(cpu: R.CpuInfo, shift_at: int, shift: float) -> R.Record:
    lps = list(LPS)
    lps[shift_at] += shift
    return record(engine_info=INFO.model_copy(update={"cpu": cpu}), sequences=[seq(lps=tuple(lps), tokens=TOKENS)])


def test_other_kernels_past_the_onset_are_held_to_the_measured_noise_bound():
    j = judging.verdict(_obtained(CPU_B, 6, 0.3), _noisy_baseline(), bounds=BOUNDS)
    assert j.verdict == "pass", j.reason
    assert "from other kernels: family bound on 50% of positions" in j.reason
    (tf,) = [c for c in j.checks if c.name == "teacher-forced:baseline"]
    assert tf.data["judged"]["p0"] == ["family"] * 4 + ["noise"] * 4
    assert tf.data["family_share"] == 0.5
    assert tf.data["onsets"]["p0"]["position"] == 4
    assert tf.data["noise_bound"]["p0"] == [None] * 4 + [0.5] * 4
    # Beyond the measured bound it is still regressed.
    assert judging.verdict(_obtained(CPU_B, 6, 0.6), _noisy_baseline(), bounds=BOUNDS).verdict == "regressed"


def test_a_shift_before_the_onset_is_regressed_on_other_kernels():
    j = judging.verdict(_obtained(CPU_B, 2, -0.05), _noisy_baseline(), bounds=BOUNDS)
    assert j.verdict == "regressed"
    # what failed comes first, with its bound, even where a larger |Δ| lies within the noise bound
    assert "prompt p0 position 3 (topk) 0.05 against 0.001, the family bound, before the fragile onset; max" in j.reason
    shifted = _obtained(CPU_B, 2, -0.05)
    shifted.sequences[0].scored.logprobs[6] += 0.3
    assert "teacher-forced:baseline: exceeds bound: prompt p0 position 3 (topk)" in judging.verdict(
        shifted, _noisy_baseline(), bounds=BOUNDS).reason


def test_the_same_kernels_loosen_nothing():
    same = CPU_A.model_copy()
    assert judging.verdict(_obtained(same, 6, 0.3), _noisy_baseline(), bounds=BOUNDS).verdict == "regressed"
    # A lowered torch capability on the same CPU is other kernels.
    lowered = CPU_A.model_copy(update={"capability": "default"})
    assert judging.verdict(_obtained(lowered, 6, 0.3), _noisy_baseline(), bounds=BOUNDS).verdict == "pass"


def test_a_kernel_set_is_named_alike_exactly_where_the_kernels_are_the_same():
    from harness import cpu

    a = CPU_A.model_dump()
    others = [CPU_B.model_dump(), {**a, "capability": "default"}, {**a, "kernel_env": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}},
              {**a, "flags": ["avx2"]}]
    assert cpu.kernel_set(a) == cpu.kernel_set(CPU_A.model_copy().model_dump()) and cpu.same_kernels(a, dict(a))
    for other in others:
        assert not cpu.same_kernels(a, other) and cpu.kernel_set(a) != cpu.kernel_set(other), other
    assert cpu.kernel_set(a).startswith("amd-epyc-avx512-bf16-")


def test_a_baseline_without_measured_noise_is_judged_by_the_family_bound():
    b = _noisy_baseline()
    b.noise = None
    assert judging.verdict(_obtained(CPU_B, 6, 0.3), b, bounds=BOUNDS).verdict == "regressed"


def test_a_changed_fixture_identity_is_stale_on_any_platform():
    b = _noisy_baseline()
    b = b.model_copy(update={"provenance": b.provenance.model_copy(update={"platform": "cpu-x86_64-avx2"})})
    rec = _obtained(CPU_B, 0, 0.0).model_copy(update={"fixture": R.FixtureRef(name="llama-fp8-dynamic", identity="other")})
    assert judging.verdict(rec, b, bounds=BOUNDS).verdict == "stale-baseline"


def test_a_simulated_flip_moves_a_fragile_activation_to_the_other_neighbour():
    from harness.quant.fp8 import FP8

    b = rounding_boundaries()
    rows = torch.tensor([[34.0001, 34.0, 20.0, 34.5]])
    noise = torch.full_like(rows, 2e-4, dtype=torch.float64)
    before = rows.to(FP8).float().tolist()
    after = noise_child.flip_across(rows, noise, b, torch.ones_like(rows, dtype=torch.bool)).to(FP8).float().tolist()
    assert before == [[36.0, 32.0, 20.0, 36.0]]  # an exact tie rounds to the even neighbour, 32
    assert after == [[32.0, 36.0, 20.0, 36.0]]  # only the two within their noise of 34 flip
    unchosen = noise_child.flip_across(rows, noise, b, torch.zeros_like(rows, dtype=torch.bool))
    assert torch.equal(unchosen, rows)


def test_a_stored_bound_is_rounded_up():
    assert noise_child._three_up(0.36912) == 0.37 and noise_child._three_up(0.369) == 0.369 and noise_child._three_up(1.234e-5) == 1.24e-5
    assert noise_child._three_up(0.0) == 0.0


def test_noise_is_measured_against_every_other_kernel_set_the_machine_can_select():
    def sets(own):
        return [(label, {**({"ATEN_CPU_CAPABILITY": c} if c else {}), **env}) for label, c, env in measure_noise.other_kernels(own)]

    assert sets("avx512") == [("default", {"ATEN_CPU_CAPABILITY": "default"}),
                              ("avx512+libraries-avx2", {"ATEN_CPU_CAPABILITY": "avx512", **cpu.LIBRARIES_AVX2}),
                              ("avx2+libraries-avx2", cpu.AVX2_MACHINE)]
    # on torch's AVX2 kernels already, the libraries' AVX2 paths are the AVX2 machine: measured once
    assert sets("avx2") == [("default", {"ATEN_CPU_CAPABILITY": "default"}),
                            ("avx2+libraries-avx2", cpu.AVX2_MACHINE)]
    assert sets("default")[0] == ("avx2", {"ATEN_CPU_CAPABILITY": "avx2"})


def test_every_committed_baselines_noise_is_measured_as_the_noise_is_measured_now():
    """A baseline whose noise was measured against fewer kernel sets judges other machines by a
    narrower noise than its cell has: ``harness run --update-noise`` measures it again."""
    stale = {}
    for path in sorted((Path(__file__).resolve().parent.parent / "baselines").rglob("*.json")):
        noise = json.loads(path.read_text()).get("noise")
        if isinstance(noise, dict) and noise.get("activation_noise") is not None:
            own, *others = noise["kernels"]
            wanted = [label for label, _, _ in measure_noise.other_kernels(None if own == "?" else own)]
            if others != wanted:
                stale[path.name] = others
    assert not stale, stale
