"""``harness bench``: the performance benchmarks of issue 13 (README, "Benchmarks";
docs/bench.md).

Parts, each selectable with ``--parts``: ``load`` (harness.bench.load, on the sizes of
harness.fixtures.benchmark), ``decode`` (harness.bench.decode), ``detection`` (harness.bench.detection,
on models.yaml's cpu-load cells), ``portability`` (harness.bench.portability: stored cpu-load
baselines under each kernel condition; only when named), ``pairs`` (harness.bench.pairs: a
candidate build's load-time gate against the pinned build, pair by pair; only when named), ``candidate``
(harness.bench.candidate: where a ``harness run --candidate`` check's time goes; only when named) and ``matrix`` (harness.bench.matrix_run, ``--before REF`` vs
HEAD). ``--quick`` runs the S size only, and by default the load and decode parts
(harness.bench.options: the command line). The figures go to BENCHMARKS.md (``--output``) and,
with ``--json``, to stdout (harness.bench.report).
"""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from harness import cpu
from harness.bench import candidate, decode, detection, load, matrix_run, pairs, portability, report
from harness.errors import UsageError
from harness.fixtures import benchmark
from harness.layout import default_results_dir
from harness.loadtime import REPO_ROOT
from harness.files import atomic_write_text
from harness.bench.options import DEFAULT_PARTS, PARTS, QUICK_PARTS

def _parts(args) -> list[str]:
    parts = [p.strip() for p in (args.parts or ",".join(QUICK_PARTS if args.quick else DEFAULT_PARTS)).split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise UsageError(f"--parts: unknown part {', '.join(map(repr, bad))} (known: {', '.join(PARTS)})")
    if "candidate" in parts and not args.candidate:
        raise UsageError("--parts candidate: name the build to try, --candidate ENGINE=SPEC (as harness run takes it)")
    if "detection" in parts and args.choice_runs < args.baseline_children + 2:
        raise UsageError(f"--choice-runs {args.choice_runs}: the detection part needs at least --baseline-children + 2 "
                         f"= {args.baseline_children + 2} (the baseline, and two runs to measure the spread on)")
    return parts


def _sizes(args) -> list[str]:
    sizes = ["S"] if args.quick else [s.strip() for s in (args.sizes or ",".join(benchmark.SIZES)).split(",") if s.strip()]
    bad = [s for s in sizes if s not in benchmark.SIZES]
    if bad:
        raise UsageError(f"--sizes: unknown size {', '.join(map(repr, bad))} (known: {', '.join(benchmark.SIZES)})")
    return sizes


# ------------------------------------------------------------------------------------- parts


def _median_of(results: list) -> object:
    return sorted(results, key=lambda r: r.load_s)[len(results) // 2]


def load_part(sizes: list[str], repeats: int, echo: Callable[[str], None]) -> tuple[list[dict], dict]:
    rows, kept = [], {}
    for size in sizes:
        for fmt in benchmark.FORMATS:
            path = benchmark.build(size, fmt, echo)
            floor = load.floor(path)
            row = {"size": size, "format": fmt, "checkpoint_mb": benchmark.megabytes(path), "floor_s": floor}
            for engine in load.ENGINES:
                r = _median_of([load.measure(engine, path) for _ in range(max(1, repeats))])
                kept[(size, fmt, engine)] = r
                row |= {f"{engine}_s": r.load_s, f"{engine}_forward_s": r.load_forward_s,
                        f"{engine}_peak_mb": r.peak_mb, f"{engine}_peak_extra_mb": r.peak_extra_mb,
                        f"{engine}_library_mb": r.library_mb}
            echo(f"  load {size} {fmt}: {row['checkpoint_mb']:.0f} MB, floor {floor:.3f} s, reference "
                 f"{row['reference_s']:.3f} s, transformers {row['transformers_s']:.3f} s")
            rows.append(row)
    return rows, kept


def load_profile(rows: list[dict], kept: dict) -> tuple[str, str]:
    """(title, text): the reference's load phases of every case and a cProfile of the slowest
    (reference over transformers)."""

    worst = max(rows, key=lambda r: r["reference_s"] / r["transformers_s"])
    phases = [f"{r['size']} {r['format']}: " + ", ".join(f"{k} {v:.3f}" for k, v in
                                                     kept[(r['size'], r['format'], 'reference')].phases.items())
              for r in rows]
    prof = load.measure("reference", benchmark.build(worst["size"], worst["format"], lambda _: None), profile=True)
    return (f"reference load ({worst['size']} {worst['format']}, the slowest against transformers)",
            "reference load phases, seconds:\n" + "\n".join(phases) + "\n\n" + (prof.profile or ""))


def decode_part(echo: Callable[[str], None]) -> list[dict]:
    rows = []
    for fmt in benchmark.FORMATS:
        r = decode.measure(fmt, benchmark.build("S", fmt, echo))
        echo(f"  decode {fmt}: {1e3 * r.decode_s:.2f} ms, fill {1e3 * r.fill_s:.2f} ms ({r.ratio:.2f}x)")
        rows.append({"format": fmt, "shape": list(r.shape), "decode_s": r.decode_s, "fill_s": r.fill_s, "ratio": r.ratio,
                     "decodes": r.decodes})
    return rows


def decode_profile(rows: list[dict]) -> tuple[str, str]:
    import cProfile
    import io
    import pstats

    worst = max(report.decoded(rows), key=lambda r: r["ratio"])
    profiler = cProfile.Profile()
    profiler.runcall(decode.measure, worst["format"], benchmark.build("S", worst["format"], lambda _: None))
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(15)
    return f"decode ({worst['format']}, the slowest against fill)", out.getvalue()


def _load_time_cells(args, echo: Callable[[str], None], needed_by: str | None) -> tuple[list, dict]:
    """The cpu-load cells ``--detection-k`` selects, their checkpoints built, and their paths;
    none is a usage error for the part ``needed_by`` (None: the part reports an empty set)."""
    # lazy: yaml, +60 ms (scripts/import-graph --costs)
    from harness import matrix, selection

    m = matrix.load(args.matrix)
    cells = selection.select(m.cells(tier="cpu-load"), args.detection_k)
    if not cells and needed_by:
        raise UsageError(f"{args.matrix}: no cpu-load cells{' match ' + repr(args.detection_k) if args.detection_k else ''}: "
                         f"the {needed_by} part needs the load-time set")
    benchmark.ensure_for_cells(m, cells, echo)
    return cells, {c.id: (m._dir / c.path).resolve() for c in cells}


def detection_part(args, echo: Callable[[str], None]) -> dict:
    cells, paths = _load_time_cells(args, echo, "detection")
    d = detection.measure(cells, paths, choice_runs=args.choice_runs, held_out_runs=args.held_out_runs,
                          slowed_runs=args.slowed_runs, echo=echo, loads=args.detection_loads,
                          slowdowns=args.slowdowns, baseline_children=args.baseline_children)
    return {**d.rates, "rule": d.rule.describe(), "baseline_children": args.baseline_children, "repeats": d.rule.repeats, "statistic": d.rule.statistic,
            "confirmations": d.rule.confirmations, "threshold": d.rule.threshold, "injected": d.injected,
            "injected_by_cell": d.injected_by_cell, "clean_level": d.clean_level,
            "selected": args.detection_k, "cell_ids": [c.id for c in cells],
            "confirmation_children": d.confirmation_children, "cells": len(cells), "clean_runs": d.clean_runs,
            "false_alarm_runs": round((d.rates["false_alarm"] or 0) * d.clean_runs),
            "clean_cell_runs": d.clean_cell_runs, "clean_cell_false_alarms": d.clean_cell_false_alarms,
            "cell_rates": d.cell_rates, "slowed_runs": d.slowed_runs, "slowed_cell_runs": d.slowed_cell_runs,
            "predicted_false_alarm": d.predicted_false_alarm, "mutations": d.mutations, "candidates": [vars(c) for c in d.candidates],
            "later_look": d.later_look, "uncalibrated": d.uncalibrated, "seconds": d.seconds, "raw": d.raw}


def portability_part(args, echo: Callable[[str], None]) -> dict:
    only = [c.strip() for c in args.conditions.split(",")] if args.conditions else None
    unknown = [c for c in only or [] if c not in portability.conditions()]
    if unknown:
        raise UsageError(f"--conditions: unknown condition {', '.join(map(repr, unknown))} "
                         f"(known: {', '.join(portability.conditions())})")
    if not args.later_look >= 0:
        raise UsageError(f"--later-look {args.later_look:g}: give a number of seconds, 0 or more")
    cells, paths = _load_time_cells(args, echo, None)
    try:
        return portability.measure(cells, paths, matrix_path=args.matrix, baselines_root=args.baselines,
                                   runs=args.portability_runs, only=only, echo=echo, later_look_s=args.later_look)
    except ValueError as e:
        raise UsageError(str(e)) from None


def pairs_part(args, echo: Callable[[str], None]) -> dict:
    cells, paths = _load_time_cells(args, echo, "pairs")
    t0 = time.perf_counter()
    out = pairs.measure(cells, paths, clean_runs=args.held_out_runs, slowed_runs=args.slowed_runs,
                        slowdowns=args.slowdowns, echo=echo)
    return {**out, "selected": args.detection_k, "seconds": time.perf_counter() - t0}


def matrix_part(before: str, select: str | None, echo: Callable[[str], None]) -> tuple[dict, str]:
    b, a = matrix_run.measure(before, echo, select)
    slowest = "\n".join(f"{cell}: {s:.1f} s" for cell, s in a.slowest)
    return ({"before_s": b.seconds, "after_s": a.seconds, "before": f"{b.ref} {b.commit[:10]}",
             "after": f"HEAD {a.commit[:10]}", "before_exit": b.exit_code, "after_exit": a.exit_code, "select": select},
            f"the slowest cells after (cell duration):\n{slowest}")


# ----------------------------------------------------------------------------------- the run


def _output(args, parts: list[str], sizes: list[str]) -> Path:
    """--output; else BENCHMARKS.md when the run measures all it holds (every default part, every
    size), and a new results/bench-<UTC time>/BENCHMARKS.md for a smaller run, which would
    otherwise replace the full run's figures with "not measured"."""
    if args.output:
        return Path(args.output)
    if set(DEFAULT_PARTS) <= set(parts) and sizes == list(benchmark.SIZES):
        return REPO_ROOT / "BENCHMARKS.md"
    return default_results_dir(REPO_ROOT / "results", prefix="bench-") / "BENCHMARKS.md"


def run(args) -> int:
    # lazy: torch, +1.6 s (scripts/import-graph --costs)
    from harness.quant import native

    parts, sizes = _parts(args), _sizes(args)
    echo = lambda line: print(line, file=sys.stderr, flush=True)  # stdout is for --json
    # native.describe() builds the C decoders (once per machine) before any timed child could pay for it
    fig: dict = {"load": None, "decode": None, "detection": None, "portability": None, "pairs": None,
                 "candidate": None, "matrix": None,
                 "machine": cpu.describe(),
                 "decoders": native.describe(), "cores": os.cpu_count(), "profiles": {}, "notes": []}
    t0 = time.perf_counter()
    if "load" in parts:
        echo(f"bench: load, sizes {','.join(sizes)}")
        fig["load"], kept = load_part(sizes, args.repeats, echo)
        fig["load_repeats"] = max(1, args.repeats)
    if "decode" in parts:
        echo("bench: decode")
        fig["decode"] = decode_part(echo)
    if "detection" in parts:
        echo("bench: detection (cpu-load cells)")
        fig["detection"] = detection_part(args, echo)
    if "portability" in parts:
        echo(f"bench: portability (the cpu-load baselines in {args.baselines}, per kernel condition)")
        fig["portability"] = portability_part(args, echo)
    if "pairs" in parts:
        echo("bench: pairs (a candidate build's load-time gate against the pinned build, cpu-load cells)")
        fig["pairs"] = pairs_part(args, echo)
    if "candidate" in parts:
        echo(f"bench: candidate (harness run --candidate {args.candidate} beside a plain run)")
        fig["candidate"] = candidate.measure(args.candidate, args.candidate_k, args.candidate_tier, echo)
    if "matrix" in parts:
        echo(f"bench: matrix, {args.before} vs HEAD")
        fig["matrix"], slowest = matrix_part(args.before, args.matrix_k, echo)
    fig["notes"] += [f"{p}: not measured (not among --parts {','.join(parts)})" for p in PARTS if p not in parts]
    if "load" in parts and sizes != list(benchmark.SIZES):
        fig["notes"].append(f"load: sizes {','.join(sizes)} only (of {','.join(benchmark.SIZES)})")
    fig["targets"] = report.targets(fig)
    missed = {t["target"][0] for t in fig["targets"] if t["ok"] is False}
    for target, profile in (("1", lambda: load_profile(fig["load"], kept)), ("2", lambda: decode_profile(fig["decode"]))):
        if target in missed:
            title, text = profile()
            fig["profiles"][title] = text
    if "4" in missed:
        fig["profiles"]["matrix (after)"] = slowest
    out = _output(args, parts, sizes)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, report.markdown(fig) + report.kept_by_hand(out.read_text() if out.exists() else ""))
    echo(f"bench: done in {time.perf_counter() - t0:.0f} s; {out}")
    for t in fig["targets"]:
        echo(f"  {'n/a ' if t['ok'] is None else 'pass' if t['ok'] else 'MISS'}  {t['target']} ({t['detail']})")
    if args.json:
        print(report.to_json(fig))
    return 0
