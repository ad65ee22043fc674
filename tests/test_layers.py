"""The layer rules (pyproject.toml's import-linter contracts) hold: kernels import nothing of
nanoserve, the model knows no engine, the engine no Trio or HTTP, the server reaches the engine
through its public surface only, and no imports go round in a cycle, bench/ included."""

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    # Beside this interpreter first (a virtual environment that is not activated), then on PATH.
    beside = Path(sys.executable).parent / "lint-imports"
    lint = str(beside) if beside.exists() else shutil.which("lint-imports")
    assert lint, "import-linter is a test dependency"
    result = subprocess.run([lint, "--no-cache"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout
