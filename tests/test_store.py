"""One file mechanism for every baseline kind (harness.store): the logprob and the accuracy
baselines, and the obtained files beside them, are written and removed by the same code."""
import pytest

from harness import baselines as B
from harness import records as R
from harness import store
from harness.accuracy import store as accuracy_store

TIER, CELL = "cpu-tiny", "llama.unquantized.reference"

# each kind's own handle(), and where its files lie below the baselines' root
KINDS = {
    "logprob": (B.handle, f"{TIER}/{CELL}.json", f"{TIER}/{CELL}.obtained.json"),
    "accuracy": (accuracy_store.handle, f"{TIER}/accuracy/{CELL}.json", f"{TIER}/accuracy/{CELL}.obtained.json"),
}


def record(verdict, logprob=-1.0, value=0.8):
    seq = R.SequenceResult(prompt=R.PromptRef(id="p0", kind="text"), prompt_tokens=[1, 2],
                           scored=R.Scored(tokens=[1, 2, 3], logprobs=[logprob, -2.0], topk=[[(2, logprob)], [(3, -2.0)]]),
                           greedy=R.Greedy(tokens=[3], topk=[[(3, -2.0)]]))
    acc = R.Accuracy(task="choice", lm_eval_task="t", metric="acc", filter="none", value=value, stderr=0.02,
                     samples=200, task_hash="h1", gate={"test": "two-proportion", "alpha": 0.01}, seconds=1.0)
    return R.Record(cell=CELL, model="llama", scheme="unquantized", engine="reference", tier=TIER,
                    fixture=R.FixtureRef(name="llama-unquantized", identity="i"),
                    engine_info=R.EngineInfo(name="reference", version="0.1.0", platform="cpu-x86_64-avx512"),
                    status="ok", sequences=[seq], load=R.LoadInfo(seconds=0.1), accuracy=[acc],
                    started_at="2026-01-02T03:04:05Z", duration_s=1.0, verdict=verdict)


@pytest.fixture
def written(monkeypatch, tmp_path):
    """Every file harness.store writes below tmp_path, in order."""
    paths = []
    write = store.atomic_write_text

    def spy(path, text):
        paths.append(path.relative_to(tmp_path).as_posix())
        write(path, text)

    monkeypatch.setattr(store, "atomic_write_text", spy)
    return paths


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_writes_and_clears_its_files_through_the_store(tmp_path, written, kind):
    handle, base_rel, obtained_rel = KINDS[kind]
    base, obtained = tmp_path / base_rel, tmp_path / obtained_rel

    # without the flag no baseline is written: a mismatch leaves the obtained file, a pass clears it
    handle(tmp_path, record("missing-baseline"))
    assert obtained.exists() and not base.exists()
    handle(tmp_path, record("pass"))
    assert not obtained.exists()

    handle(tmp_path, record("pass"), update_baselines=True)
    stored = base.read_bytes()
    moved = record("regressed", logprob=-1.5, value=0.6)
    handle(tmp_path, moved)
    assert obtained.exists() and base.read_bytes() == stored
    assert obtained.read_text() != base.read_text()  # the obtained result, not a copy of the baseline

    # a refused record never becomes a baseline (only the logprob kind keeps its obtained file then)
    obtained.unlink()
    handle(tmp_path, moved.model_copy(update={"verdict": "failed"}), update_baselines=True)
    assert base.read_bytes() == stored and obtained.exists() == (kind == "logprob")

    # regenerating under the flag writes the baseline and removes the obtained file it answers
    handle(tmp_path, moved, update_baselines=True)
    assert base.read_bytes() != stored and not obtained.exists()

    # and every one of those files was written by harness.store
    assert written == [obtained_rel, base_rel, obtained_rel, *[obtained_rel] * (kind == "logprob"), base_rel]
