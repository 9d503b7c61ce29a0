"""Cells the committed baselines are known not to hold on some kernels (docs/decisions.md,
2026-12-03), read by this suite and by tests/test_portability.py. On such kernels the cell may be
`regressed` against a baseline from other kernels with the rounding-flip rule unconvinced; the
test is then an expected failure that says why. Anything else red still fails. The noise the AMX
Xeon measured under torch's and the libraries' AVX2 kernels (docs/decisions.md, 2026-12-05, fifth
session) holds on the Xeon, not on an AMD EPYC's AVX2 kernels (same, sixth session)."""
from harness import cpu


def _below_avx512(kernels: dict) -> bool:
    """Whether a record's kernels (its ``engine_info.cpu``) stop short of AVX-512: a CPU without
    it, torch at a lower capability, or MKL and oneDNN held to AVX2. An AMD EPYC with AVX-512 under
    the kernel conditions CI sets gives the AVX2-only EPYC's gaps (docs/decisions.md, 2026-12-05,
    sixth session); the AMX Xeon under the same conditions does not."""
    env = kernels.get("kernel_env") or {}
    return ("avx512f" not in (kernels.get("flags") or ()) or kernels.get("capability") != "avx512"
            or any(env.get(k) == v for k, v in cpu.LIBRARIES_AVX2.items()))


KNOWN_GAPS = {
    "qwen2_5_vl.fp8-dynamic.reference": (
        _below_avx512, "torch's or the libraries' AVX2 kernels move Qwen2.5-VL's dynamic-FP8 logprobs past the AMX "
                       "Xeon's measured noise (0.242 against 0.216 on an AVX2-only EPYC); the first module beyond "
                       "noise is a residual add"),
    "llama.online-fp8.reference": (
        _below_avx512, "under a scalar torch on an AMD EPYC, 0.44 at prompt p1 on an AVX2-only one; the flip rule's "
                       "first module beyond noise is model.layers.5.mlp.act_fn, a weightless leaf stored 10x finer "
                       "than its input"),
}


def is_gap(record: dict) -> bool:
    """Whether ``record`` (a record's JSON) is a cell its baseline is known not to hold on the
    kernels it ran on."""
    known = KNOWN_GAPS.get(record["cell"])
    return known is not None and known[0]((record.get("engine_info") or {}).get("cpu") or {})


def why_red(record: dict) -> str | None:
    """Why ``record`` is red as a known gap on its kernels; None when it is not one: another cell,
    other kernels, another verdict, or a flip rule that explained or never ran."""
    if not is_gap(record) or record["verdict"] != "regressed":
        return None
    flips = [(x.get("rounding_flip") or {}).get("detail", "") for x in record.get("localisation") or []
             if x.get("against") == "baseline"]
    if not any(f.startswith("not a rounding flip") for f in flips):
        return None
    return f"{record['cell']}: {KNOWN_GAPS[record['cell']][1]}"
