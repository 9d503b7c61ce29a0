"""Cells the committed baselines are known not to hold on some kind of CPU (docs/decisions.md,
2026-12-03), read by this suite and by tests/test_portability.py. On such a CPU the cell may be
`regressed` against a baseline from other kernels with the rounding-flip rule unconvinced; the
test is then an expected failure that says why. Anything else red still fails. The fix is a noise
condition with torch's AVX2 kernels, measured when the FP8 baselines are re-written on an AVX-512
machine (docs/design.md, "Portability across CPUs")."""
from harness import cpu


def _no_avx512(flags: frozenset[str]) -> bool:
    return "avx512f" not in flags


KNOWN_GAPS = {
    "qwen2_5_vl.fp8-dynamic.reference": (
        _no_avx512, "torch's AVX2 kernels move Qwen2.5-VL's dynamic-FP8 logprobs past the AMX Xeon's measured noise "
                    "(0.242 against 0.216 on an AVX2-only EPYC); the first module beyond noise is a residual add"),
    "llama.online-fp8.reference": (
        _no_avx512, "under a scalar torch on an AVX2-only EPYC, 0.44 at prompt p1; the flip rule's first module "
                    "beyond noise is model.layers.5.mlp.act_fn, a weightless leaf stored 10x finer than its input"),
}


def known_gaps() -> set[str]:
    """The cells whose baselines are known not to hold on this machine's CPU."""
    return {c for c, (applies, _) in KNOWN_GAPS.items() if applies(cpu.flags())}


def why_red(record: dict) -> str | None:
    """Why ``record`` (a record's JSON) is red as a known gap on this CPU; None when it is not one:
    another cell, another CPU, another verdict, or a flip rule that explained or never ran."""
    if record["cell"] not in known_gaps() or record["verdict"] != "regressed":
        return None
    flips = [(x.get("rounding_flip") or {}).get("detail", "") for x in record.get("localisation") or []
             if x.get("against") == "baseline"]
    if not any(f.startswith("not a rounding flip") for f in flips):
        return None
    return f"{record['cell']}: {KNOWN_GAPS[record['cell']][1]}"
