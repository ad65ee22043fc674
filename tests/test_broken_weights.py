"""A checkpoint whose model.safetensors is truncated or corrupt: `nanoserve generate` and
`nanoserve serve` end with one line naming the file and exit status 2, not a traceback."""

import shutil
import subprocess
import sys

import pytest


def _run(*args, cache):
    env = {"NANOSERVE_CACHE": str(cache), "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-m", "nanoserve.cli", *args],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda data: data[: len(data) // 2], id="truncated"),
        pytest.param(lambda data: data[:20], id="cut-in-the-header"),
        pytest.param(lambda data: b"\xff" * 64 + data[64:], id="corrupt-header-length"),
    ],
)
def test_a_broken_safetensors_file_is_one_line_naming_it(tiny_model_dir, tmp_path, damage):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    expected = f"nanoserve: {weights}: not a readable safetensors file ("

    result = _run("generate", str(broken), "--prompt", "x", cache=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(expected), result.stderr

    result = _run("serve", str(broken), "--port", "0", cache=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1].startswith(expected), result.stderr
