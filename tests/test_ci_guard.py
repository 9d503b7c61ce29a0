"""A CI run in which no test passed must not look green."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _pytest(tmp_path, body: str, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text((ROOT / "conftest.py").read_text())
    (tmp_path / "test_sample.py").write_text(body)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          cwd=tmp_path, capture_output=True, text=True)


def test_nothing_collected_fails(tmp_path):
    assert _pytest(tmp_path, "def test_x():\n    pass\n", "-k", "no_such_test").returncode == 5


def test_everything_skipped_fails(tmp_path):
    run = _pytest(tmp_path, "import pytest\n\n@pytest.mark.skip\ndef test_x():\n    pass\n")
    assert run.returncode == 1 and "no test passed" in run.stdout


@pytest.mark.slow("two pytest subprocesses, each loading the root conftest and harness")
def test_a_real_failure_fails_and_a_pass_passes(tmp_path):
    assert _pytest(tmp_path, "def test_x():\n    assert False\n").returncode == 1
    assert _pytest(tmp_path, "def test_x():\n    pass\n").returncode == 0


def test_a_slow_marker_without_its_reason_is_a_usage_error(tmp_path):
    """make quick leaves out the tests marked slow; each says why, or the session does not start."""
    bare = _pytest(tmp_path, "import pytest\n\n@pytest.mark.slow\ndef test_x():\n    pass\n", "-m", "not slow")
    assert bare.returncode == 4 and 'test_x: @pytest.mark.slow needs a reason: slow("why")' in bare.stdout + bare.stderr
    said = _pytest(tmp_path, "import pytest\n\n@pytest.mark.slow('starts engines')\ndef test_x():\n    pass\n")
    assert said.returncode == 0, said.stdout
