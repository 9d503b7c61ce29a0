"""Fixtures shared by the harness's own tests."""
import os

import pytest


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """A fresh fixture cache for the session. Under pytest-xdist the workers share one (their
    basetemps share a parent): the file lock then makes exactly one worker build each fixture."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "fixture-cache"
    root.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HARNESS_FIXTURE_CACHE", str(root))
        yield root
