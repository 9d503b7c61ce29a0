"""Deliberately degraded models fail the accuracy gate (docs/design.md, "Accuracy"), run end to end
by `harness run` against the committed baselines (a copy), with the test-only faults of
harness/hooks/faults.py in the engine child:

| cell | fault | logprob checks | accuracy |
|---|---|---|---|
| llama.unquantized (reference and transformers) | embedding rows of every token the cell's scored sequences never use, negated | pass, bit for bit | regressed |
| llama.bnb-nf4-dq.reference | double quant decoded without its offset | (whatever they say) | regressed |
| llama.fp8-dynamic.reference | one down_proj's weight_scale dropped | (whatever they say) | regressed |
| llama.online-bnb-nf4.reference | skip rules ignored: lm_head quantized too | (whatever they say) | regressed |

The first is the subtle one: the cell's own prompts never read those rows, so its logprob verdict
on its own prompts cannot see the damage; the tiny tasks, which read most of the vocabulary, do.
"""
import json
import shutil
from pathlib import Path

import pytest

from harness import baselines as B
from harness import cli
from harness import records as R

ROOT = Path(__file__).resolve().parent.parent
BASELINES = ROOT / "baselines"
EMBED = "model.embed_tokens.weight"


def unused_token_ranges(cell: str, vocab: int = 512) -> str:
    """LO-HI,... of the token ids that no scored sequence of the cell's committed baseline holds
    (the only embedding rows its logprob prompts read)."""
    data = json.loads((BASELINES / "cpu-tiny" / f"{cell}.json").read_text())
    used = {row["token"] for s in data["sequences"] for row in s["scored"]}
    used |= {row["token"] for s in data["sequences"] for row in s["greedy"]}
    spans, start = [], None
    for t in range(vocab + 1):
        free = t < vocab and t not in used
        if free and start is None:
            start = t
        elif not free and start is not None:
            spans.append(f"{start}-{t - 1}")
            start = None
    return ",".join(spans)


pytestmark = pytest.mark.slow("every test reads the module's harness run of 5 degraded cells, accuracy tasks included")


@pytest.fixture(scope="module")
def degraded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("degraded")
    baselines = tmp / "baselines"
    shutil.copytree(BASELINES, baselines)
    hooks = ";".join([
        f"fault=rows:{EMBED}:{unused_token_ranges('llama.unquantized.reference')}:-1@llama.unquantized.*",
        "fault=bnb-dq-no-offset@llama.bnb-nf4-dq.reference",
        "fault=fp8-scale-dropped:model.layers.5.mlp.down_proj.weight@llama.fp8-dynamic.reference",
        "fault=skip-ignored@llama.online-bnb-nf4.reference",
    ])
    mp = pytest.MonkeyPatch()
    mp.setenv("HARNESS_TEST_HOOK", hooks)
    try:
        code = cli.main(["run", "-k", "(llama.unquantized. or llama.bnb-nf4-dq.reference or llama.fp8-dynamic.reference "
                         "or llama.online-bnb-nf4.reference) and not mllama", "--engine", "reference,transformers",
                         "--baselines", str(baselines), "--results", str(tmp / "r"), "-j", "2"])
    finally:
        mp.undo()
    return code, {p.stem: R.load(p) for p in (tmp / "r").glob("*.json")}


def _failing(rec: R.Record) -> set[str]:
    return {c.name for c in rec.checks if not c.ok}


def test_the_degraded_run_exits_1(degraded):
    code, records = degraded
    assert code == 1
    assert set(records) == {"llama.unquantized.reference", "llama.unquantized.transformers",
                            "llama.bnb-nf4-dq.reference", "llama.fp8-dynamic.reference",
                            "llama.online-bnb-nf4.reference"}


@pytest.mark.parametrize("cell", ["llama.unquantized.reference", "llama.unquantized.transformers"])
def test_embedding_rows_the_prompts_never_read_pass_the_logprob_checks_and_fail_the_accuracy_gate(degraded, cell):
    rec = degraded[1][cell]
    assert rec.verdict == "regressed", rec.verdict_reason
    checks = {c.name: c for c in rec.checks}
    # the logprob verdict on the cell's own prompts alone would pass: exactly the baseline's numbers
    # on the baseline's own kernels, within the family bound on others
    assert checks["teacher-forced:baseline"].ok
    if not B.other_kernels(rec, B.read(BASELINES, "cpu-tiny", cell)):
        assert checks["teacher-forced:baseline"].data["max_abs_delta"] == 0.0
        assert checks["greedy:baseline"].detail == "greedy tokens equal to baseline's"
    assert checks["greedy:baseline"].ok
    failing = _failing(rec)
    # what the prompts never read is still loaded: the embedding's state differs from the baseline's
    assert checks["loaded-state:baseline"].data["differing"] == [EMBED.rpartition(".")[0]], checks["loaded-state:baseline"]
    accuracy = failing - {"loaded-state:baseline"}
    assert accuracy and all(name.startswith("accuracy/") and name.endswith(":baseline") for name in accuracy), failing
    assert "accuracy/llama-choice:baseline" in failing
    # both engines were degraded alike: they still agree with each other
    assert not any(name.endswith((":reference", ":transformers")) for name in failing)


@pytest.mark.parametrize("cell", ["llama.bnb-nf4-dq.reference", "llama.fp8-dynamic.reference",
                                  "llama.online-bnb-nf4.reference"])
def test_gross_degradations_fail_the_accuracy_gate(degraded, cell):
    rec = degraded[1][cell]
    assert rec.verdict == "regressed", rec.verdict_reason
    assert any(name.startswith("accuracy/") for name in _failing(rec)), _failing(rec)
