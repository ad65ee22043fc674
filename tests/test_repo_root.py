"""Run from the repository root (`python -m bench.<name>`, `python -c`, a child pytest), Python
puts the root first on sys.path: no folder there may stand in for an installed package.
transformers imports Hugging Face's `kernels` package when it is installed, and the repository's
kernels/ (nanoserve.kernels' C and Python sources) has no __init__.py, so that it never wins."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Imports a model class as the benchmarks do (transformers probes `kernels` on the way), then
# says where `kernels` comes from: a namespace package of the repository's folder (no file) only
# where no package of that name is installed.
PROBE = """
import importlib.util
from transformers import LlamaForCausalLM
spec = importlib.util.find_spec("kernels")
print("kernels:", spec and spec.origin)
"""


def run_at_root(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)


def test_transformers_imports_from_the_repository_root():
    result = run_at_root("-c", PROBE)
    assert result.returncode == 0, result.stderr[-3000:]
    origin = result.stdout.split("kernels:")[1].strip()  # None for a namespace package
    assert not Path(origin).is_relative_to(REPO / "kernels"), origin


def test_a_benchmark_starts_from_the_repository_root():
    result = run_at_root("-m", "bench.bench_families", "--help")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "usage:" in result.stdout
