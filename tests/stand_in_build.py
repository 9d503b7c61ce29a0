"""A stand-in candidate build for ``harness run --candidate``: a Python environment whose
interpreter is this venv's, with variables of its own set (a test-only hook or mutation), so that
only the candidate's engine children carry them."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path


def stand_in_build(root: Path, env: dict[str, str | None]) -> Path:
    """``root`` made such an environment: each variable of ``env`` set there, or unset for None."""
    (root / "bin").mkdir(parents=True)
    python = root / "bin" / "python"
    settings = "".join(f"export {k}={shlex.quote(v)}\n" if v is not None else f"unset {k}\n" for k, v in env.items())
    python.write_text(f"#!/bin/sh\n{settings}exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    return root
