"""The `harness` command."""
import argparse
import sys

from harness.errors import CheckpointError


def _load(args) -> int:
    from harness import reference

    loaded = reference.load(args.path)
    print(loaded.report.to_json() if args.json else loaded.report.summary())
    return 0


def _fixtures(args) -> int:
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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="harness", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    load = sub.add_parser("load", help="load a checkpoint with the reference loader and print its load report")
    load.add_argument("path", help="checkpoint directory")
    load.add_argument("--json", action="store_true", help="print the report as JSON")
    load.set_defaults(func=_load)

    fx = sub.add_parser("fixtures", help="list the tiny synthetic fixtures, or build them")
    fx.add_argument("--build", nargs="+", metavar="NAME", help="build these fixtures ('all' for every one)")
    fx.set_defaults(func=_fixtures)

    # report and pipeline: their arguments and logic live in harness.report and harness.buildkite
    from harness import buildkite, report

    rp = sub.add_parser("report", help="write the HTML report, JUnit XML and Buildkite annotation from result directories")
    report.add_arguments(rp)
    rp.set_defaults(func=report.run)

    pl = sub.add_parser("pipeline", help="write the Buildkite pipeline (YAML) for the matrix to stdout")
    buildkite.add_arguments(pl)
    pl.set_defaults(func=buildkite.run)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
