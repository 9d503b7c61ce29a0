"""The package's layers (docs/design.md, "Layers"): the import contract of pyproject.toml holds,
and scripts/import-graph counts 0 import cycles, 0 modules in no layer and 0 function-level harness
imports without a reason."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_import_contract_holds():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint is not None, "import-linter is not installed (scripts/bootstrap installs it)"
    out = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "1 kept, 0 broken" in out.stdout


def test_no_cycle_no_module_outside_the_layers_no_unexplained_lazy_import():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "import-graph")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines()[:3] == [
        "import cycles: 0",
        "modules in no layer: 0",
        "function-level harness imports without a '# lazy:' reason: 0",
    ]
