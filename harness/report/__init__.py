"""The report: ``harness report RESULTS... -o DIR`` (also ``python -m harness.report``).

Reads result directories (``merge``), then writes into DIR:

- ``report.html``: one self-contained page (inline CSS, JS and SVG; nothing from the network),
  ``html.render``;
- ``junit.xml``: one test case per cell (and per candidate build's record), ``junit.render``;
- ``annotation.md`` and ``annotation-style.txt``: the Buildkite annotation (a markdown matrix
  summary) and its style by the worst verdict, ``annotation.render``.

Every output follows the verdict table (harness.verdicts). Exit status: 0; with ``--strict`` 1
when a cell fails the run by that table (a missing cell included, and a candidate build's record,
as in ``harness run --candidate``), or a record file is unreadable; 2 for usage errors.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from harness import verdicts
from harness.files import atomic_write_text
from harness.report.merge import cross_check, load_results, parse_expected
from harness.report.states import annotation_style, counts_of, state_of
from harness.verdicts import MISSING, STATES

__all__ = ["MISSING", "STATES", "Written", "annotation_style", "counts_of", "state_of", "write_reports"]


@dataclass
class Written:
    html: Path
    junit: Path
    annotation: Path
    style: str
    counts: dict[str, int]
    missing: list[str]
    problems: int
    notes: list[str]
    # a candidate build's records (harness run --candidate): counts per state, and its headline
    candidate_counts: dict[str, int] = field(default_factory=dict)
    candidates: str | None = None

    @property
    def bad(self) -> bool:
        """A cell fails the run (harness.verdicts), or a record file is unreadable: --strict exits 1."""
        return bool(self.problems) or any(n and verdicts.fails_run(s) for counts in (self.counts, self.candidate_counts)
                                          for s, n in counts.items())


def report_files(out_dir: str | Path) -> tuple[Path, Path, Path, Path]:
    """What write_reports writes in ``out_dir``: report.html, junit.xml, annotation.md, annotation-style.txt."""
    out = Path(out_dir)
    return out / "report.html", out / "junit.xml", out / "annotation.md", out / "annotation-style.txt"


def write_reports(results: Sequence[str | Path], out_dir: str | Path, *, expected: Iterable[str] = (),
                  matrix=None, title: str | None = None, baselines_root: str | Path | None = None) -> Written:
    """Read ``results`` and write report.html, junit.xml, annotation.md, annotation-style.txt.
    ``baselines_root``: where the page finds each cell's stored baseline for its provenance."""
    # lazy: yaml, jinja2, +330 ms (scripts/import-graph --costs)
    from harness.report import annotation, candidates, html, junit

    merged = load_results(results, expected)
    if matrix is not None:
        cross_check(merged, matrix)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    states = [state_of(e.record) for e in merged.current.values()] + [MISSING] * len(merged.missing)
    counts = counts_of(states)
    # a candidate's record fails the run as a base record does (harness run --candidate): the style follows both
    built = [state_of(e.record) for e in merged.candidates.values()]
    style = annotation_style(states + built, len(merged.problems))
    page = html.render(merged, matrix=matrix, title=title, baselines_root=baselines_root)
    *paths, style_path = report_files(out)
    atomic_write_text(paths[0], page)
    atomic_write_text(paths[1], junit.render(merged, matrix=matrix))
    atomic_write_text(paths[2], annotation.render(merged, matrix=matrix, report_path=f"{out.name}/report.html"))
    atomic_write_text(style_path, style + "\n")
    return Written(*paths, style=style, counts=counts, missing=merged.missing, problems=len(merged.problems),
                   notes=merged.notes, candidate_counts=counts_of(built) if built else {},
                   candidates=candidates.headline(merged.records(), merged.candidate_records()))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", nargs="+", metavar="RESULTS",
                   help="result directories (several: several runs; each cell shows its latest record and a trend)")
    p.add_argument("-o", "--output", required=True, metavar="DIR",
                   help="where report.html, junit.xml, annotation.md and annotation-style.txt go")
    p.add_argument("--expect", action="append", metavar="IDS",
                   help="cell ids expected to have a record (space- or comma-separated; repeatable); the "
                        "ones without a record are reported missing")
    p.add_argument("--matrix", metavar="FILE",
                   help="models.yaml, for the grid's order, bounds and known failures of the cross-engine "
                        "comparison (default: ./models.yaml when present)")
    p.add_argument("--title", help="page title")
    p.add_argument("--baselines", metavar="DIR",
                   help="baselines root, for the baseline's provenance in each cell's details (default: ./baselines "
                        "when present)")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 when a cell fails the run (regressed, failed, error, unexpected-pass, stale-baseline, "
                        "missing-baseline, missing; a candidate build's records too) or a record is unreadable")


def run(args: argparse.Namespace) -> int:
    # lazy: yaml, +140 ms (scripts/import-graph --costs)
    from harness.matrix import MatrixError, load

    matrix = None
    path = args.matrix or ("models.yaml" if Path("models.yaml").is_file() else None)
    if path:
        try:
            matrix = load(path)
        except MatrixError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    unreadable = next((r for r in args.results if not Path(r).is_dir()), None)
    if unreadable is not None:
        what = "is not a directory" if Path(unreadable).exists() else "no such directory"
        print(f"error: {unreadable}: {what} (RESULTS are result directories of `harness run`)", file=sys.stderr)
        return 2
    baselines = args.baselines or ("baselines" if Path("baselines").is_dir() else None)
    written = write_reports(args.results, args.output, expected=parse_expected(args.expect), matrix=matrix,
                            title=args.title, baselines_root=baselines)
    shown = [(s, n) for s, n in written.counts.items() if n]
    width = max([len(s) for s, _ in shown] + [7])
    print("\n".join(f"{s:<{width}}  {n}" for s, n in shown) or "no cells")
    if written.candidates:
        print(written.candidates)
    for note in written.notes:
        print(f"note: {note}")
    if written.missing:
        print(f"missing: {len(written.missing)} expected cell(s) have no record: {' '.join(written.missing)}")
    if written.problems:
        print(f"problems: {written.problems} unreadable record file(s); see the report", file=sys.stderr)
    print(f"report: {written.html}")
    return 1 if args.strict and written.bad else 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="harness report", description="Write the HTML report, JUnit XML and the "
                                "Buildkite annotation from result directories.")
    add_arguments(p)
    return run(p.parse_args(argv))
