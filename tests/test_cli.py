"""`nanoserve generate` prints a completion, on the built-in demo model and on a checkpoint."""

import subprocess
import sys

from nanoserve import LLM, SamplingParams


def _run(*args, env_cache):
    env = {"NANOSERVE_CACHE": str(env_cache), "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-m", "nanoserve.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_generate_on_a_checkpoint_prints_prompt_and_greedy_completion(tiny_model_dir, tmp_path):
    result = _run(
        "generate",
        str(tiny_model_dir),
        "--prompt",
        "Hello",
        "--max-tokens",
        "8",
        env_cache=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    expected = LLM(str(tiny_model_dir)).generate(
        "Hello", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
    )[0]
    assert result.stdout == "Hello" + expected.outputs[0].text + "\n"


def test_generate_without_a_model_builds_and_uses_the_demo(tmp_path):
    result = _run("generate", "--prompt", "Once upon a time", env_cache=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Once upon a time")
    assert any(p.name.startswith("demo-") for p in tmp_path.iterdir())


def test_generate_reports_bad_arguments_without_a_traceback(tiny_model_dir, tmp_path):
    result = _run(
        "generate", str(tiny_model_dir), "--prompt", "x", "--top-p", "2", env_cache=tmp_path
    )
    assert result.returncode == 2
    assert "top_p must be" in result.stderr and "Traceback" not in result.stderr
    result = _run("generate", str(tmp_path / "nowhere"), "--prompt", "x", env_cache=tmp_path)
    assert result.returncode == 2 and "config.json" in result.stderr
