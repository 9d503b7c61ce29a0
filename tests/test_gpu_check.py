"""scripts/gpu-check, as far as a machine without a GPU can take it: the carried folder (fixtures,
the bitsandbytes wheel's pruning), the CPU smoke run of the cuda-check cells end to end (records,
report, machine description and archive in one folder, the carried fixture installed under this
machine's cache key instead of being rebuilt), and the dry run. The CUDA run itself has not run
anywhere yet (docs/gpu-check.md)."""
from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from harness import matrix as M
from harness import selection

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu-check"


def gpu_check_module():
    loader = importlib.machinery.SourceFileLoader("gpu_check", str(SCRIPT))
    spec = importlib.util.spec_from_loader("gpu_check", loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def script(*args, env_extra=None, timeout=600) -> subprocess.CompletedProcess:
    import os

    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_the_cuda_check_cells_are_their_own_environments():
    gc = gpu_check_module()
    data = gc.matrix_data(ROOT / "models.yaml")
    models = gc.cuda_models(data)
    assert models == ["llama-cuda", "whisper-cuda"]
    cells = [c for c in M.load(ROOT / "models.yaml").cells() if c.model in models]
    assert cells and all(c.environment == gc.ENVIRONMENT and c.tier == "gpu-tiny" and c.hardware.gpus == 1 for c in cells)
    assert {c.engine for c in cells} == {"reference", "transformers"}
    env = M.load(ROOT / "models.yaml").environments[gc.ENVIRONMENT]
    assert env.env == {"HARNESS_DEVICE": "cuda"} and env.engines["transformers"] == "5.17.0"
    # the selection names exactly those cells
    assert {c.id for c in selection.select(M.load(ROOT / "models.yaml").cells(), gc.selection(models, None))} == {c.id for c in cells}


def test_wheel_unpacking_keeps_only_the_cpu_and_chosen_cuda_libraries(tmp_path):
    gc = gpu_check_module()
    wheel = tmp_path / "bitsandbytes-0-py3-none-manylinux_2_24_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name in ("cpu", "cuda118", "cuda128", "cuda130", "cuda132", "rocm64", "xpu2025"):
            z.writestr(f"bitsandbytes/libbitsandbytes_{name}.so", b"x" * 10)
        z.writestr("bitsandbytes/__init__.py", b"")
        z.writestr("bitsandbytes-0.dist-info/METADATA", b"Name: bitsandbytes\n")
        z.writestr("pkg-0.data/purelib/extra.py", b"")
        z.writestr("pkg-0.data/scripts/tool", b"")
    site = tmp_path / "site"
    gc._unpack(wheel, site, ("130", "132"))
    kept = sorted(p.relative_to(site).as_posix() for p in site.rglob("*") if p.is_file())
    assert kept == ["bitsandbytes-0.dist-info/METADATA", "bitsandbytes/__init__.py", "bitsandbytes/libbitsandbytes_cpu.so",
                    "bitsandbytes/libbitsandbytes_cuda130.so", "bitsandbytes/libbitsandbytes_cuda132.so", "extra.py"]


def baseline_files() -> dict[str, float]:
    """The repository's baseline files with their modification times."""
    return {p.as_posix(): p.stat().st_mtime for p in (ROOT / "baselines").rglob("*") if p.is_file()}


@pytest.mark.slow("scripts/gpu-check prepare, then a CPU smoke run of two cuda-check cells with engine children")
def test_smoke_run_carries_a_fixture_and_writes_everything_into_one_folder(tmp_path, cache_dir):
    repository_baselines = baseline_files()
    carried = tmp_path / "carried"
    out = script("prepare", "--skip-wheels", "--dir", carried, "-k", "llama-bnb-nf4")
    assert out.returncode == 0, out.stdout + out.stderr
    assert (carried / "fixtures" / "llama-bnb-nf4" / "manifest.json").exists()
    assert "MiB would travel with a device command" in out.stdout
    # a fresh fixture cache (another machine's): the carried copy is installed, not rebuilt
    fresh = tmp_path / "fixture-cache"
    res = tmp_path / "out"
    out = script("run", "--smoke-cpu", "--dir", carried, "--out", res, "--fixture-cache", fresh, "-k", "llama-cuda.bnb-nf4.",
                 "--archive", tmp_path / "gpu-check.tar.gz")
    assert "fixture llama-bnb-nf4: installed the carried copy" in out.stdout, out.stdout + out.stderr
    assert "building llama-bnb-nf4" not in (res / "results" / "logs" / "llama-cuda.bnb-nf4.reference.log").read_text()
    # no baselines for these cells: missing-baseline (exit 1), after both engines ran and agreed
    assert out.returncode == 1, out.stdout + out.stderr
    summary = json.loads((res / "gpu-check.json").read_text())
    assert summary["verdicts"] == {"llama-cuda.bnb-nf4.reference": "missing-baseline",
                                   "llama-cuda.bnb-nf4.transformers": "missing-baseline"}
    tf = json.loads((res / "results" / "llama-cuda.bnb-nf4.transformers.json").read_text())
    assert tf["status"] == "ok" and tf["engine_info"]["environment"] == "cuda-check"
    assert {(c["kind"], c["against"]): c["ok"] for c in tf["checks"]}[("teacher-forced", "reference")] is True
    assert (res / "results" / "report" / "report.html").exists() and (res / "results" / "summary.txt").exists()
    machine = json.loads((res / "environment.json").read_text())
    assert machine["torch"] and machine["python"] == sys.version.split()[0]
    # the commit is the one prepare saw, and this tree is still that source
    prepared = json.loads((carried / "source.json").read_text())
    assert machine["source"]["commit"] == prepared["commit"] and len(prepared["commit"]) == 40
    assert machine["source"]["matches_prepare"] is True
    with tarfile.open(tmp_path / "gpu-check.tar.gz") as tar:
        names = tar.getnames()
    assert "out/gpu-check.json" in names and "out/results/llama-cuda.bnb-nf4.transformers.json" in names
    # never a baseline of the repository: the smoke run's obtained files stay in its own folder
    assert baseline_files() == repository_baselines


def test_a_run_says_when_its_source_differs_from_what_was_prepared(tmp_path):
    gc = gpu_check_module()
    carried = tmp_path / "carried"
    carried.mkdir()
    (carried / "source.json").write_text(json.dumps({"commit": "0" * 40, "uncommitted_changes": False, "digest": "stale"}))
    said = gc.source_of_run(carried)
    assert said["commit"] == "0" * 40 and said["matches_prepare"] is False and said["digest_here"] == gc.source_digest()
    assert gc.source_of_run(tmp_path)["matches_prepare"] is None  # never prepared: no commit claimed


def test_a_run_stopped_by_its_time_limit_still_writes_its_summary_and_archive(tmp_path, cache_dir):
    """A device command has a hard limit: the first device run that recorded baselines reached it
    and came back with nothing but its log."""
    res = tmp_path / "out"
    out = script("run", "--smoke-cpu", "--out", res, "--fixture-cache", tmp_path / "fixture-cache",
                 "-k", "llama-cuda.bnb-nf4.", "--time-limit", "0.5", "--archive", tmp_path / "gpu-check.tar.gz")
    assert "stopping the run: --time-limit 0.5 s reached" in out.stdout, out.stdout + out.stderr
    summary = json.loads((res / "gpu-check.json").read_text())
    # 143: harness run's own SIGTERM handler ended it; -15: the signal came before it was installed
    assert summary["stopped"] == "--time-limit 0.5 s reached" and summary["exit_status"] in (143, -15)
    with tarfile.open(tmp_path / "gpu-check.tar.gz") as tar:
        assert "out/gpu-check.json" in tar.getnames() and "out/run.log" in tar.getnames()


def test_dry_run_lists_the_cuda_cells_without_loading(tmp_path):
    out = script("run", "--dry-run", "--out", tmp_path / "out", env_extra={"HARNESS_GPUS": "none"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "llama-cuda.fp8-static-kv.transformers" in out.stdout and "whisper-cuda.bnb-nf4.reference" in out.stdout
    assert "here: unsupported: needs 1 GPU(s); this machine has 0" in out.stdout
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


def test_recorded_baselines_go_to_the_named_folder_not_the_repository(tmp_path):
    out = script("run", "--dry-run", "--out", tmp_path / "out", "--record-baselines", tmp_path / "recorded",
                 "-k", "llama-cuda.bnb-nf4.", env_extra={"HARNESS_GPUS": "none"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"baseline: missing ({tmp_path / 'recorded' / 'gpu-tiny' / 'llama-cuda.bnb-nf4.reference.json'})" in out.stdout
    assert str(ROOT / "baselines") not in out.stdout


def test_only_the_matrix_environment_puts_an_engine_on_the_gpu(monkeypatch):
    """HARNESS_DEVICE from the caller's shell never reaches an engine child: only an environment
    that sets it (cuda-check) runs on CUDA, so no other environment's results come from a GPU."""
    from harness import supervise

    monkeypatch.setenv("HARNESS_DEVICE", "cuda")
    assert "HARNESS_DEVICE" not in supervise.child_env({}, 1)
    assert supervise.child_env({"HARNESS_DEVICE": "cuda"}, 1)["HARNESS_DEVICE"] == "cuda"
