"""The layer rules (pyproject.toml's import-linter contracts) hold: kernels import nothing of
nanoserve, the model knows no engine, the engine no Trio or HTTP, the server reaches the engine
through its public surface only, and no imports go round in a cycle, bench/ included."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def installed_layout(folder: Path) -> Path:
    """nanoserve in folder as an install lays it out: src/nanoserve with kernels/python as its
    kernels/ (linked). grimp finds a package's modules by reading its folder, and an editable
    install keeps nanoserve.kernels outside src/nanoserve."""
    package = folder / "nanoserve"
    shutil.copytree(
        REPO / "src" / "nanoserve", package, ignore=shutil.ignore_patterns("__pycache__")
    )
    (package / "kernels").symlink_to(REPO / "kernels" / "python", target_is_directory=True)
    return folder


def test_import_contracts_are_kept(tmp_path):
    # Beside this interpreter first (a virtual environment that is not activated), then on PATH.
    beside = Path(sys.executable).parent / "lint-imports"
    lint = str(beside) if beside.exists() else shutil.which("lint-imports")
    assert lint, "import-linter is a test dependency"
    path = os.pathsep.join(
        filter(None, [str(installed_layout(tmp_path)), os.environ.get("PYTHONPATH")])
    )
    env = {**os.environ, "PYTHONPATH": path}
    result = subprocess.run([lint, "--no-cache"], cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout
