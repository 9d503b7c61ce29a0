"""Baselines: reviewable text, explicit and atomic updates, refusals, obtained files."""
import json
import os
import subprocess
from pathlib import Path

import pytest

from harness import baselines as B
from harness import judging
from harness import matrix as M
from harness import resolver
from harness import records as R
from harness import store
from harness import verdicts as V

ROOT = Path(__file__).resolve().parent.parent
BOUNDS = M.Bounds(logprob=1e-3, topk=1e-3, load_time=1.5)
TIER, CELL = "cpu-tiny", "whisper.bnb-nf4.transformers"


def seq(pid="p0", lps=(-1.25, -2.0, -0.5), greedy=(5, 6)):
    toks = [1, 2, 3, 4]
    return R.SequenceResult(
        prompt=R.PromptRef(id=pid, kind="audio"),
        prompt_tokens=[1, 2],
        scored=R.Scored(tokens=toks, logprobs=list(lps), topk=[[(t, lp), (9, -3.0)] for t, lp in zip(toks[1:], lps)]),
        greedy=R.Greedy(tokens=list(greedy), topk=[[(t, -0.1), (7, -2.0)] for t in greedy]),
    )


def record(verdict="missing-baseline", version="5.19.0", **kw):
    base = dict(cell=CELL, model="whisper", scheme="bnb-nf4", engine="transformers", tier=TIER,
                fixture=R.FixtureRef(name="whisper-bnb-nf4", identity="1d"),
                engine_info=R.EngineInfo(name="transformers", version=version, environment="core", torch="2.13.0+cpu",
                                         platform="cpu-x86_64-avx2"),
                status="ok", sequences=[seq()], load=R.LoadInfo(seconds=0.02, phases={"read": 0.01}),
                computation=R.Computation(dtype="float32"), started_at="2026-01-02T03:04:05Z", duration_s=2.0,
                verdict=verdict)
    base.update(kw)
    return R.Record(**base)


def test_new_baseline_is_reviewable_text_and_reads_back(tmp_path):
    change = B.update(tmp_path, record(), commit="abc")
    path = tmp_path / TIER / f"{CELL}.json"
    assert change.kind == "new" and change.written and change.path == path
    assert "new baseline: 1 sequence(s), 4 scored positions, transformers 5.19.0 on cpu-x86_64-avx2" in str(change)
    text = path.read_text()
    lines = text.splitlines()
    # one sequence position per line, keys in a fixed order
    assert '        {"pos": 2, "token": 3, "logprob": -2.0, "topk": [[3, -2.0], [9, -3.0]]},' in lines
    assert '        {"step": 1, "token": 6, "topk": [[6, -0.1], [7, -2.0]]}' in lines
    data = json.loads(text)
    assert list(data) == ["schema_version", "cell", "tier", "provenance", "fixture", "source", "load", "sequences"]
    assert data["provenance"] == {"engine": "transformers", "engine_version": "5.19.0", "environment": "core",
                                  "torch": "2.13.0+cpu", "platform": "cpu-x86_64-avx2", "cpu": None,
                                  "date": "2026-01-02T03:04:05Z", "commit": "abc"}
    assert data["fixture"] == {"name": "whisper-bnb-nf4", "identity": "1d"}
    b = B.read(tmp_path, TIER, CELL)
    assert b.record_sequences() == record().sequences
    assert B.read(tmp_path, TIER, "whisper.nothing.transformers") is None
    # rewriting the same data is byte-identical
    assert B.Baseline.from_record(record(), commit="abc").to_text() == text


def test_update_reports_what_changed_and_skips_noise(tmp_path):
    B.update(tmp_path, record(), commit="abc")
    path = tmp_path / TIER / f"{CELL}.json"
    before = path.read_text()
    # same numbers, other date / commit / load time, verdict pass: left untouched
    same = record(verdict="pass", started_at="2026-02-02T00:00:00Z", load=R.LoadInfo(seconds=0.03))
    change = B.update(tmp_path, same, commit="def")
    assert change.kind == "unchanged" and not change.written and path.read_text() == before
    # new engine version, moved logprob, different greedy token
    moved = record(verdict="stale-baseline", version="5.20.0",
                   sequences=[seq(lps=(-1.25, -2.0, -0.75), greedy=(5, 8))])
    moved.sequences[0].greedy.topk[1] = [(8, -0.1), (6, -0.2)]
    change = B.update(tmp_path, moved, commit="def")
    assert change.kind == "updated"
    msgs = "\n".join(change.messages)
    assert "provenance: engine version 5.19.0 -> 5.20.0" in msgs
    assert "prompt p0: max |Δlogprob| vs old 0.25 at position 3" in msgs
    assert "prompt p0: greedy tokens changed at step 1: 6 -> 8" in msgs
    assert "provenance: commit abc -> def" in msgs
    assert B.read(tmp_path, TIER, CELL).provenance.engine_version == "5.20.0"
    change = B.update(tmp_path, record(verdict="regressed", sequences=[seq(greedy=(5, 6, 7))]).model_copy(
        update={"sequences": [R.SequenceResult(prompt=R.PromptRef(id="p0", kind="audio"), prompt_tokens=[1, 2],
                                               scored=R.Scored(tokens=[1, 2, 3, 9], logprobs=[-1.25, -2.0, -0.5],
                                                               topk=[[], [], []]),
                                               greedy=R.Greedy(tokens=[], topk=[]))]}), commit="x")
    assert "prompt p0: scored tokens changed at position 3" in "\n".join(change.messages)


def test_a_load_time_rewritten_under_other_memory_allocation_says_so(tmp_path):
    """A load time over its bound rewrites the baseline (``rewrite``: the runner says so from the
    checks against the stored one), a load time alone does not; where the new load was timed under
    other memory allocation, which no calibration carries, the change names both (docs/design.md,
    "Memory allocation")."""
    B.update(tmp_path, record(), commit="abc")
    huge_pages = R.LoadInfo(seconds=0.05, allocation={"THP_MEM_ALLOC_ENABLE": "1"})
    assert B.update(tmp_path, record(verdict="pass", load=huge_pages), commit="abc").kind == "unchanged"
    change = B.update(tmp_path, record(verdict="pass", load=huge_pages), commit="abc", rewrite=True)
    assert change.kind == "updated"
    assert ("load 0.02 s -> 0.05 s, timed under THP_MEM_ALLOC_ENABLE=1 (the defaults before)"
            in change.messages)
    same_allocation = huge_pages.model_copy(update={"seconds": 0.04})
    change = B.update(tmp_path, record(verdict="pass", load=same_allocation), commit="abc", rewrite=True)
    assert change.messages == ["load 0.05 s -> 0.04 s"]


@pytest.mark.parametrize("verdict", ["failed", "error", "unsupported", None])
def test_update_refuses_bad_verdicts_and_leaves_the_file(tmp_path, verdict):
    B.update(tmp_path, record(), commit="abc")
    path = tmp_path / TIER / f"{CELL}.json"
    before = path.read_text()
    bad = record(verdict=verdict, sequences=[seq(lps=(-9.0, -9.0, -9.0))])
    with pytest.raises(B.BaselineRefused, match=f"{CELL}: refusing to update the baseline"):
        B.update(tmp_path, bad)
    assert path.read_text() == before
    # through handle(): the refusal is reported, and the obtained result is kept for review
    out = B.handle(tmp_path, bad, update_baselines=True)
    assert out.refused and out.change is None and out.obtained.exists()
    assert path.read_text() == before


def test_update_refuses_records_without_results(tmp_path):
    err = record(verdict="missing-baseline", status="error", sequences=[], load=None,
                 error=R.ErrorInfo(type="RuntimeError", message="boom"))
    with pytest.raises(B.BaselineRefused, match="status is error"):
        B.update(tmp_path, err)
    assert not (tmp_path / TIER).exists()


def _tree(d: Path) -> dict:
    return {p.name: p.read_text() for p in d.iterdir()}


def test_write_is_atomic_when_replace_fails(tmp_path, monkeypatch):
    B.update(tmp_path, record(), commit="abc")
    d = tmp_path / TIER
    before = _tree(d)

    def broken_replace(src, dst):
        raise OSError("disk vanished")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk vanished"):
        B.update(tmp_path, record(verdict="regressed", sequences=[seq(lps=(-5.0, -5.0, -5.0))]), commit="abc")
    assert _tree(d) == before  # old file intact, no temp file left behind


def test_write_is_atomic_when_interrupted_mid_write(tmp_path, monkeypatch):
    B.update(tmp_path, record(), commit="abc")
    d = tmp_path / TIER
    before = _tree(d)
    real_fdopen = os.fdopen

    class HalfWriter:
        """Writes half of what it is given, then dies (as a killed process or full disk would)."""

        def __init__(self, f):
            self.f = f

        def write(self, text):
            self.f.write(text[: len(text) // 2])
            self.f.flush()
            raise KeyboardInterrupt

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def __getattr__(self, name):
            return getattr(self.f, name)

    monkeypatch.setattr(os, "fdopen", lambda fd, *a, **k: HalfWriter(real_fdopen(fd, *a, **k)))
    with pytest.raises(KeyboardInterrupt):
        B.update(tmp_path, record(verdict="regressed", sequences=[seq(lps=(-5.0, -5.0, -5.0))]), commit="abc")
    assert _tree(d) == before
    assert B.read(tmp_path, TIER, CELL).record_sequences() == record().sequences


def test_obtained_written_on_mismatch_and_ignored_by_git(tmp_path):
    B.update(tmp_path, record(), commit="abc")
    regressed = record(verdict="regressed", sequences=[seq(lps=(-1.25, -2.5, -0.5))])
    out = B.handle(tmp_path, regressed, update_baselines=False)
    obtained = tmp_path / TIER / f"{CELL}.obtained.json"
    assert out.obtained == obtained and out.change is None and out.refused is None
    # same format as the baseline, so a plain diff shows the moved position
    base_lines = (tmp_path / TIER / f"{CELL}.json").read_text().splitlines()
    obt_lines = obtained.read_text().splitlines()
    diff = [(a, b) for a, b in zip(base_lines, obt_lines) if a != b and '"commit"' not in a]
    assert len(diff) == 1 and '"pos": 2' in diff[0][0] and "-2.5" in diff[0][1]
    assert B.read(tmp_path, TIER, CELL).sequences[0].scored[2].logprob == -2.0  # baseline untouched
    # a later pass clears it; an update removes it as well
    B.handle(tmp_path, record(verdict="pass"))
    assert not obtained.exists()
    store.write_obtained(B.Baseline, tmp_path, regressed)
    B.handle(tmp_path, regressed, update_baselines=True)
    assert not obtained.exists()
    # git ignores obtained files under baselines/
    rel = f"baselines/{TIER}/{CELL}.obtained.json"
    res = subprocess.run(["git", "check-ignore", "-q", rel], cwd=ROOT, capture_output=True)
    assert res.returncode == 0, "add baselines/**/*.obtained.json to .gitignore"
    res = subprocess.run(["git", "check-ignore", "-q", f"baselines/{TIER}/{CELL}.json"], cwd=ROOT, capture_output=True)
    assert res.returncode == 1


def test_hand_altered_baseline_file_makes_the_cell_regressed(tmp_path):
    B.update(tmp_path, record(), commit="abc")
    path = tmp_path / TIER / f"{CELL}.json"
    text = path.read_text()
    altered = text.replace('{"pos": 2, "token": 3, "logprob": -2.0,', '{"pos": 2, "token": 3, "logprob": -2.01,')
    assert altered != text
    path.write_text(altered)
    j = judging.verdict(record(verdict=None), B.read(tmp_path, TIER, CELL), bounds=BOUNDS)
    assert j.verdict == "regressed" and "position 2" in j.reason
    assert V.summarize([j.verdict]).exit_code == 1


def test_corrupt_or_foreign_baseline_is_a_clear_error(tmp_path):
    p = tmp_path / TIER / f"{CELL}.json"
    p.parent.mkdir(parents=True)
    p.write_text("{")
    with pytest.raises(B.BaselineError, match=r"\.json: not JSON"):
        B.read(tmp_path, TIER, CELL)
    p.write_text(json.dumps({"schema_version": 7}))
    with pytest.raises(B.BaselineError, match="baseline schema_version 7 is not supported"):
        B.read(tmp_path, TIER, CELL)
    good = json.loads(B.Baseline.from_record(record()).to_text())
    good["sequences"][0]["scored"][1]["pos"] = 5
    p.write_text(json.dumps(good))
    with pytest.raises(B.BaselineError, match="scored row 1 has pos 5"):
        B.read(tmp_path, TIER, CELL)
    # update replaces an unreadable baseline and says so
    p.write_text("{")
    change = B.update(tmp_path, record(), commit="abc")
    assert change.kind == "updated" and change.messages[0].startswith("old baseline unreadable")


@pytest.mark.parametrize("path, value, problem", [
    (("sequences", 0, "prompt_tokens", 0), "1", 'sequences[0].prompt_tokens[0]: must be an integer (got "1")'),
    (("sequences", 0, "scored", 1, "token"), True, "sequences[0].scored[1].token: must be an integer (got true)"),
    (("sequences", 0, "scored", 1, "logprob"), "-1.25", 'sequences[0].scored[1].logprob: must be a number (got "-1.25")'),
    (("sequences", 0, "scored", 1, "topk", 0), {"2": -1.0}, "sequences[0].scored[1].topk[0]: must be a list (got dict)"),
    (("provenance", "engine"), ["reference"], "provenance.engine: must be a string (got list)"),
    (("schema_version",), True, "baseline schema_version True is not supported (this harness reads 1)"),
])
def test_a_field_of_the_wrong_json_type_is_refused_not_coerced(tmp_path, path, value, problem):
    """Read strictly: pydantic's lax mode would take "1" and true for the integer 1."""
    doc = json.loads(B.Baseline.from_record(record()).to_text())
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    p = tmp_path / TIER / f"{CELL}.json"
    p.parent.mkdir(parents=True)
    p.write_text(json.dumps(doc))
    with pytest.raises(B.BaselineError) as e:
        B.read(tmp_path, TIER, CELL)
    assert str(e.value) == f"{p}: {problem}"


def test_an_unchanged_minus_infinity_logprob_is_no_change(tmp_path):
    """Image placeholders score -inf; the same -inf again is not a material change."""
    rec = record()
    seq = rec.sequences[0]
    lps = list(seq.scored.logprobs)
    lps[0] = float("-inf")
    rec = rec.model_copy(update={"sequences": [seq.model_copy(update={"scored": seq.scored.model_copy(update={"logprobs": lps})})]})
    B.update(tmp_path, rec, commit="abc")
    again = rec.model_copy(update={"started_at": "2026-01-03T03:04:05Z"})
    assert B.update(tmp_path, again, commit="def").kind == "unchanged"


# The cpu-load cells recorded on the AMX Xeon (2026-12-04), and why one is not: models.yaml's known
# failure makes it `unsupported` there, so no baseline could be written.
NOT_RECORDED = {"llama-m-fp8-dynamic.fp8-dynamic.vllm": "scoring does not finish on AMX (models.yaml)"}


# Each kernel set's own cpu-load baselines (README, "Updating baselines"), held to the same rule.
KERNEL_SETS = sorted(p.parent.name for p in (ROOT / "baselines" / "kernels").glob("*/cpu-load"))


@pytest.mark.parametrize("kernel_set", [None, *KERNEL_SETS])
def test_the_committed_cpu_load_baselines_are_recorded_as_the_gate_compares_them(tmp_path, kernel_set):
    """Each is the median of the recording children, steady enough to hold the bound, and
    calibrated by the workload its engine times now: a workload changed without recording them again
    would have the gate compare plain ratios (docs/troubleshooting.md, "Load time on cpu-load"). A kernel set holds those it
    recorded."""
    from harness import loadtime
    from harness.engines import base
    from harness.registry import FORMATS

    root = ROOT / "baselines" if kernel_set is None else ROOT / "baselines" / "kernels" / kernel_set
    cells = M.expand(M.load(ROOT / "models.yaml"), tier="cpu-load")
    assert NOT_RECORDED.keys() <= {c.id for c in cells}
    if kernel_set is not None:  # each file is a cpu-load cell's, none left from a removed one
        recorded = {p.name.removesuffix(".json") for p in (root / "cpu-load").glob("*.json")
                    if not p.name.endswith(".obtained.json")}
        assert recorded and recorded <= {c.id for c in cells}, sorted(recorded - {c.id for c in cells})
    for cell in cells:
        stored = B.read(root, cell.tier, cell.id)
        if kernel_set is None and cell.id in NOT_RECORDED:
            assert stored is None, cell.id
            continue
        if kernel_set is not None and stored is None:
            continue
        assert stored is not None and stored.load is not None, f"{cell.id}: no committed cpu-load baseline"
        load = stored.load
        assert len(load.children) == loadtime.BASELINE_CHILDREN and load.phases["calibration"] > 0, cell.id
        assert loadtime.unsteady_baseline(load, cell.bounds.load_time) is None, cell.id
        checkpoint = tmp_path / cell.id
        checkpoint.mkdir()
        # the quant_method its checkpoint declares: the first of its format's (harness.registry)
        fmt = FORMATS.get(cell.family)
        config = {"quantization_config": {"quant_method": fmt.methods[0].name}} if fmt else {}
        (checkpoint / "config.json").write_text(json.dumps(config))
        engine = base.engine_class(cell.engine)(cell)
        assert load.calibration_workload == engine.calibration_workload(base.Checkpoint(checkpoint)), cell.id


def _on(cpu_model: str, capability: str = "avx512", **kernel_env) -> R.EngineInfo:
    cpu = R.CpuInfo(vendor="AuthenticAMD", model=cpu_model, flags=["avx2", "avx512f"], capability=capability,
                    kernel_env=kernel_env)
    return R.EngineInfo(name="transformers", version="5.19.0", platform="cpu-x86_64-avx512", cpu=cpu)


def _load_baseline(root, record):
    found = resolver.resolve(root, record)
    return found.load_baseline, found.load_root


def test_a_load_is_judged_against_this_cpus_own_under_any_kernel_condition(tmp_path):
    """harness.resolver, the load time's baseline: the cell's baseline where it is from this kind of CPU; else the
    load recorded on this CPU under another kernel condition, its own kernels first; else the
    cell's baseline, from another CPU."""
    elsewhere = record(verdict="pass", engine_info=_on("Intel Xeon"), load=R.LoadInfo(seconds=1.0))
    B.update(tmp_path, elsewhere, commit="abc")
    here = record(engine_info=_on("AMD EPYC", "default", MKL_ENABLE_INSTRUCTIONS="AVX2"))
    own = B.read(tmp_path, TIER, CELL)
    assert _load_baseline(tmp_path, here) == (own, None)

    def kernels_of(engine_info: R.EngineInfo, seconds: float) -> Path:
        root = resolver.kernels_root(tmp_path, record(engine_info=engine_info))
        B.update(root, record(verdict="pass", engine_info=engine_info, load=R.LoadInfo(seconds=seconds)), commit="abc")
        return root

    lowered = kernels_of(_on("AMD EPYC", "avx2"), 3.0)
    native = kernels_of(_on("AMD EPYC"), 2.0)
    kernels_of(_on("AMD EPYC", MKL_ENABLE_INSTRUCTIONS="AVX2"), 4.0)
    kernels_of(_on("Other EPYC"), 5.0)
    chosen, root = _load_baseline(tmp_path, here)
    assert root == native and chosen.load.seconds == 2.0
    assert resolver.load_baseline_here(tmp_path, TIER, CELL, here.engine_info.cpu.model_dump()).load.seconds == 2.0  # harness bench
    (native / TIER / f"{CELL}.json").unlink()
    chosen, root = _load_baseline(tmp_path, here)
    assert root == lowered and chosen.load.seconds == 3.0
    on_xeon = record(engine_info=_on("Intel Xeon", "default"))
    assert _load_baseline(tmp_path, on_xeon) == (own, None)
    (tmp_path / TIER / f"{CELL}.json").unlink()  # no baseline of its own: this CPU's is the whole baseline
    found = resolver.resolve(tmp_path, here)
    assert (found.baseline, found.root) == (B.read(lowered, TIER, CELL), lowered)


def test_a_run_says_once_which_gated_loads_have_no_baseline_of_this_kind_of_cpu(tmp_path):
    """Before a gated run times anything: the cells whose load time can only be judged against a
    baseline recorded on another kind of CPU, which vLLM's loads do not carry (docs/design.md,
    "Load-time baselines per kind of CPU"), in one line that says how to record this kind's."""
    # as `harness run` describes its CPU: torch is not imported in the parent, so no capability
    xeon, epyc = ({**_on(m).cpu.model_dump(), "capability": None} for m in ("Intel Xeon", "AMD EPYC"))
    cells = [M.Cell.model_construct(id=CELL, tier=TIER), M.Cell.model_construct(id="other.cell.vllm", tier=TIER)]
    B.update(tmp_path, record(verdict="pass", engine_info=_on("Intel Xeon")), commit="abc")
    assert resolver.loads_of_another_cpu(tmp_path, cells, xeon) is None  # and one with no baseline says so itself
    line = resolver.loads_of_another_cpu(tmp_path, cells, epyc)
    assert line.startswith(f"1 gated cell(s) have no load-time baseline recorded on this kind of CPU (AMD EPYC): {CELL}")
    assert "harness run --tier cpu-tiny --update-kernel-baselines" in line
    under_avx2 = _on("AMD EPYC", "avx2")
    B.update(resolver.kernels_root(tmp_path, record(engine_info=under_avx2)), record(verdict="pass", engine_info=under_avx2),
             commit="abc")
    assert resolver.loads_of_another_cpu(tmp_path, cells, epyc) is None  # this kind's, under any kernel condition
