"""The results directory of a run (``--results``): where every file of it lives.

    <cell id>.json                   the judged result record of each cell (the report reads *.json)
    logs/<cell id>.log               the engine child's stdout and stderr
    raw/<cell id>.json               the unjudged record, shared between pytest-xdist workers
    raw/<cell id>.info.json          the engine identity, written by the child before it loads
    raw/<cell id>.job.json           the job the child was given
    raw/<model>.<scheme>.continuation.json   a continuation-only reference child's record
    raw/<cell id>.load<N>.json       a gated cell's load timed again in fresh child N (harness.records.LoadInfo;
                                     its log logs/<cell id>.load<N>.log, an error record beside it if it failed)
    candidate/                       a candidate build's files, laid out as these (harness run --candidate);
                                     raw/<cell id>.base.load<N>.json there: the pinned build's load timed
                                     in pairs with the candidate's
    witness/<cell id>.unfused.json   the reference executed unfused
    sequences/<model>.<scheme>.json  the scored sequences of a group computed in this run
    traces/<cell id>[.fused|.unfused].pt   module traces (harness.traces.jobs)
    summary.txt                      the verdict table (harness run)
    report/                          the HTML report, JUnit XML and annotation (harness run)
    .harness-run                     the run that owns the directory (harness.runs); no other run writes here
"""
from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path

SUBDIRS = ("raw", "logs", "witness", "sequences")


def default_results_dir(base: str | Path = "results", prefix: str = "") -> Path:
    """``results/<prefix><UTC timestamp>``, with a suffix ``-2``, ``-3``... when that name is taken,
    created here. Created, not only named: ``mkdir`` fails on a name that exists, so two processes
    asking in the same second never get the same directory (checking that the name is free and
    creating it later would let both pass the check; docs/design.md, "Runs side by side")."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    Path(base).mkdir(parents=True, exist_ok=True)
    n = 1
    while True:
        path = Path(base) / (f"{prefix}{stamp}" + (f"-{n}" if n > 1 else ""))
        try:
            path.mkdir()
            return path
        except FileExistsError:
            n += 1


def group_key(cell) -> str:
    """A cell's group: its (model, scheme), ``<model>.<scheme>``."""
    return f"{cell.model}.{cell.scheme}"


class Layout:
    """The paths of one results directory."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def record(self, cell_id: str) -> Path:
        return self.root / f"{cell_id}.json"

    def raw(self, cell_id: str) -> Path:
        return self.root / "raw" / f"{cell_id}.json"

    def info(self, record_path: Path) -> Path:
        """The engine identity beside an unjudged record (``raw/<name>.info.json``)."""
        return record_path.with_name(record_path.stem + ".info.json")

    def job(self, record_path: Path) -> Path:
        return record_path.with_name(record_path.stem + ".job.json")

    def continuation(self, key: str) -> Path:
        return self.root / "raw" / f"{key}.continuation.json"

    def load_child(self, cell_id: str, n: int) -> Path:
        return self.root / "raw" / f"{cell_id}.load{n}.json"

    def log(self, name: str) -> Path:
        return self.root / "logs" / f"{name}.log"

    def witness(self, cell_id: str) -> Path:
        return self.root / "witness" / f"{cell_id}.unfused.json"

    def sequences(self, key: str) -> Path:
        return self.root / "sequences" / f"{key}.json"

    def traces(self) -> Path:
        return self.root / "traces"

    def summary(self) -> Path:
        return self.root / "summary.txt"

    def report(self) -> Path:
        return self.root / "report"

    def candidate(self, name: str = "candidate") -> Layout:
        """Where a candidate build's records go (harness run --candidate): a results directory of
        its own inside this one, so that the same cell's base and candidate records never collide;
        ``name``: one per build where several run against the same base (harness bisect)."""
        return Layout(self.root / name)

    def directories(self) -> list[Path]:
        """Every directory a run writes files into."""
        return [self.root, *(self.root / sub for sub in SUBDIRS), self.traces(), self.report()]

    def cell_files(self, cell_id: str) -> list[Path]:
        """The files a run writes (or removes, from an earlier run) for one cell."""
        raw = self.raw(cell_id)
        return [self.record(cell_id), raw, self.info(raw), self.job(raw), self.log(cell_id), self.witness(cell_id)]

    def prepare(self, cell_ids: Iterable[str] = (), keys: Iterable[str] = ()) -> None:
        """Create the directory; forget what an earlier run into it left for these cells and groups."""
        for sub in SUBDIRS:
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        for cid in cell_ids:
            raw = self.raw(cid)
            for p in (raw, self.info(raw), self.witness(cid), self.record(cid)):
                p.unlink(missing_ok=True)
        for key in keys:
            self.sequences(key).unlink(missing_ok=True)
