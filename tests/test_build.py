"""The C kernels are part of the install: a compiler error fails the build, loudly."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_c_build_failure_fails_the_build_with_the_compilers_message(tmp_path):
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, tmp_path)
    ignore = shutil.ignore_patterns("*.so", "__pycache__")
    shutil.copytree(REPO / "kernels", tmp_path / "kernels", ignore=ignore)
    shutil.copytree(REPO / "src", tmp_path / "src", ignore=ignore)
    env = {**os.environ, "NANOSERVE_MARCH": "no-such-cpu"}
    command = [sys.executable, "setup.py", "build_ext", "--build-lib", "out", "--build-temp", "tmp"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode != 0
    assert "no-such-cpu" in result.stdout + result.stderr  # gcc's own words about the flag
    assert not list((tmp_path / "out").rglob("*.so"))
