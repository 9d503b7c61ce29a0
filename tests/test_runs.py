"""A run owns its results directory (harness.runs), and runs side by side share the baselines
safely (harness.store.locked): docs/design.md, "Runs side by side". Processes here are forked
and released together at a barrier, so that they really ask at the same moment; the whole-command
test is suites/faults/test_side_by_side.py."""
from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys

import pytest

from harness import baselines as B
from harness import runs, store
from test_store import record

START_METHOD = "fork"  # the start method: a forked child inherits the test's imports (no interpreter start)
RACERS = 6


@pytest.fixture(autouse=True)
def no_run_left():
    yield
    for path in list(runs._held):
        runs.release(path)


def _at_once(target, args_of) -> list:
    """Run ``target(*args_of(i), barrier, queue)`` in RACERS forked processes; their results."""
    ctx = multiprocessing.get_context(START_METHOD)
    barrier, queue = ctx.Barrier(RACERS), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args_of(i), barrier, queue)) for i in range(RACERS)]
    for p in procs:
        p.start()
    out = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return out


def _create(base, barrier, queue):
    run = runs.Run.new("racer")
    barrier.wait()
    queue.put((run.id, str(runs.create(run, base))))


def _claim(path, barrier, queue):
    run = runs.Run.new("racer")
    barrier.wait()
    try:
        runs.claim(path, run)
        queue.put(("claimed", run.id))
    except runs.Refused as e:
        queue.put(("refused", str(e)))


def test_runs_started_in_one_second_get_a_directory_each(tmp_path):
    made = _at_once(_create, lambda i: (tmp_path,))
    dirs = [d for _, d in made]
    assert len(set(dirs)) == RACERS, dirs
    for run_id, d in made:
        assert runs.owner_of(tmp_path / d.rsplit("/", 1)[-1]).id == run_id


def test_one_directory_claimed_by_several_runs_at_once_has_one_owner(tmp_path):
    outcomes = _at_once(_claim, lambda i: (tmp_path / "r",))
    claimed = [who for what, who in outcomes if what == "claimed"]
    assert len(claimed) == 1, outcomes
    assert runs.owner_of(tmp_path / "r").id == claimed[0]
    assert all(f"{tmp_path / 'r'}: " in line and claimed[0] in line for what, line in outcomes if what == "refused")
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == [runs.MARK], "a temporary mark left behind"


def test_a_directory_of_another_run_is_refused_saying_whose_and_how_to_reuse_it(tmp_path):
    live = runs.Run.new("harness run -k 'a'")
    runs.claim(tmp_path / "live", live)  # held by this process: alive
    with pytest.raises(runs.Refused) as e:
        runs.claim(tmp_path / "live", runs.Run.new("harness run"))
    assert str(e.value) == (f"{tmp_path}/live: {live.describe()} is writing its results here; give another "
                            "--results directory, or leave --results out for a new one")
    ended = subprocess.run([sys.executable, "-c", "import sys; from harness import runs; r = runs.Run.new('pytest'); "
                            "runs.claim(sys.argv[1], r); print(r.id)", str(tmp_path / "ended")],
                           capture_output=True, text=True, check=True).stdout.strip()
    with pytest.raises(runs.Refused) as e:
        runs.claim(tmp_path / "ended", runs.Run.new("harness run"))
    assert f"{tmp_path}/ended: holds the results of run {ended} (pytest, pid " in str(e.value)
    assert str(e.value).endswith(f"(to reuse this one on purpose, remove it first: rm -r {tmp_path}/ended)")


def test_files_no_run_claimed_are_refused_and_an_empty_directory_is_taken(tmp_path):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "llama.unquantized.reference.json").write_text("{}")
    with pytest.raises(runs.Refused, match=r"old: holds files that no run claimed \(llama.unquantized.reference.json\)"):
        runs.claim(tmp_path / "old", runs.Run.new("harness run"))
    assert not (tmp_path / "old" / runs.MARK).exists()
    (tmp_path / "empty").mkdir()
    run = runs.Run.new("harness run")
    runs.claim(tmp_path / "empty", run)
    runs.claim(tmp_path / "empty", run)  # again: the same run's
    assert runs.current_id() == run.id


def test_a_worker_joins_its_sessions_run_and_no_other(tmp_path):
    run = runs.Run.new("pytest")
    runs.claim(tmp_path / "r", run)
    runs.release(tmp_path / "r")
    runs.join(tmp_path / "r", run.id)
    assert runs.current_id() == run.id
    with pytest.raises(runs.Refused, match="not claimed by this session's run other but by run "):
        runs.join(tmp_path / "r", "other")


def test_a_directory_left_unused_is_removed_and_only_then(tmp_path):
    run = runs.Run.new("pytest")
    path = runs.create(run, tmp_path, prefix="pytest-")
    runs.discard_if_unused(path, runs.Run.new("another"))  # not its run: left
    assert path.is_dir()
    runs.discard_if_unused(path, run)
    assert not path.exists() and runs.current_id() is None
    used = runs.create(run, tmp_path)
    (used / "raw").mkdir()
    runs.discard_if_unused(used, run)
    assert used.is_dir()


def _update(root, results, barrier, queue):
    run = runs.Run.new("racer")
    runs.claim(results, run)
    barrier.wait()
    lines = []
    for i in range(5):  # each racer its own logprobs: whose file stands is readable in it
        outcome = B.handle(root, record("pass", logprob=-1.0 - 0.01 * (int(results.name) * 10 + i)), update_baselines=True)
        lines.append(str(outcome.change).splitlines()[0])
    queue.put((run.id, lines))


def test_runs_updating_one_baseline_at_once_leave_one_whole_file_and_say_who_wrote_it(tmp_path):
    root = tmp_path / "b"
    said = _at_once(_update, lambda i: (root, tmp_path / str(i)))
    path = B.path_for(root, "cpu-tiny", record("pass").cell)
    stored = B.read(root, "cpu-tiny", record("pass").cell)  # whole: it reads
    assert stored is not None and json.loads(path.read_text())["cell"] == record("pass").cell
    writers = {run_id for run_id, lines in said for line in lines if line.startswith(f"{path}: updated by run {run_id}")
               or line.startswith(f"{path}: new by run {run_id}")}
    assert writers, said
    first = [line for _, lines in said for line in lines if ": new by run " in line]
    assert len(first) == 1, "two runs both found no baseline: the second did not see the first's"
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name], "a temporary file left behind"


def _count(path, barrier, queue):
    barrier.wait()
    for _ in range(50):
        with store.locked(path):
            n = int(path.read_text()) if path.exists() else 0
            path.write_text(str(n + 1))
    queue.put(None)


def test_the_baseline_lock_loses_no_update(tmp_path):
    path = tmp_path / "tier" / "counter"
    _at_once(_count, lambda i: (path,))
    assert int(path.read_text()) == 50 * RACERS
