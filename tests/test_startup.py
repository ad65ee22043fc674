"""What `nanoserve serve` does before it serves: the port and the checkpoint's config are checked
before torch is imported, and the first log line says what loads before torch does. Also the
settings it starts with: OpenMP threads that sleep when idle, and the engine's default for a
request without max_tokens."""

import re
import shutil
import socket
import subprocess
import sys

import pytest

from nanoserve.config import EngineConfig
from nanoserve.engine import Engine, RequestRejected, SamplingParams

# Runs `nanoserve` in a fresh interpreter that writes a marker line to stderr when torch is first
# imported, so that a test sees what came before torch without timing anything.
SPY = """
import sys

class TorchSpy:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            print("SPY: torch is imported", file=sys.stderr, flush=True)
            sys.meta_path.remove(self)

sys.meta_path.insert(0, TorchSpy())
from nanoserve.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _spied(*args, cache):
    env = {"NANOSERVE_CACHE": str(cache), "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-c", SPY, *args], capture_output=True, text=True, timeout=120, env=env
    )


def test_a_port_in_use_is_refused_before_torch_is_imported(tiny_model_dir, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _spied("serve", str(tiny_model_dir), "--port", str(port), cache=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"nanoserve: 127.0.0.1:{port} is in use; pass --port\n"


def test_a_broken_config_is_refused_before_torch_is_imported(tiny_model_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    result = _spied("serve", str(broken), "--port", "0", cache=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"nanoserve: {broken / 'config.json'}: hidden_size is missing\n"


def test_serve_says_what_it_loads_before_torch_is_imported(tiny_model_dir, tmp_path):
    """The first log line comes before torch's import; a checkpoint without a tokenizer then
    stops the start-up after the import, with one error line."""
    broken = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "tokenizer.json").unlink()
    result = _spied("serve", str(broken), "--port", "0", cache=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    loading = f"INFO nanoserve: loading {broken.name} from {broken}, to serve on 127.0.0.1:"
    assert loading in lines[0]
    assert lines[1] == "SPY: torch is imported"
    assert "torch imported in" in lines[2]
    assert lines[-1] == f"nanoserve: {broken}: no tokenizer.json " + (
        "(nanoserve reads Hugging Face fast tokenizers)"
    )


def _openmp_settings(**env):
    """The settings torch's OpenMP runtime started with, once nanoserve was imported."""
    env = {"PATH": "/usr/bin:/bin", "OMP_DISPLAY_ENV": "verbose", **env}
    code = "import nanoserve.cli, torch"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    if "OPENMP DISPLAY ENVIRONMENT" not in result.stderr:
        pytest.skip("this torch does not run on GNU OpenMP")
    return dict(re.findall(r"(\w+) = '([^']*)'", result.stderr))


def test_idle_openmp_threads_spin_briefly_then_sleep():
    """Spinning threads lose their cores to other work on a shared machine (see __init__.py)."""
    settings = _openmp_settings()
    assert settings["GOMP_SPINCOUNT"] == "100000"


def test_a_wait_policy_the_user_set_is_kept():
    settings = _openmp_settings(OMP_WAIT_POLICY="active")
    assert settings["OMP_WAIT_POLICY"] == "ACTIVE" and settings["GOMP_SPINCOUNT"] != "0"


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine(tiny_model_dir, EngineConfig(default_max_tokens=5, max_model_len=64))


def test_a_request_without_max_tokens_stops_at_the_default(engine):
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    engine.add_request("a", [1, 2, 3], params)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert len(outputs[-1].outputs[0].token_ids) == 5
    assert outputs[-1].outputs[0].finish_reason == "length"


def test_without_max_tokens_the_context_still_bounds_the_request(engine):
    params = SamplingParams(max_tokens=None)
    assert engine.admit(list(range(1, 61)), params).output_limit == 4  # 64 - 60 < 5


def test_min_tokens_above_the_default_is_refused_like_an_explicit_max_tokens(engine):
    with pytest.raises(ValueError, match="min_tokens must be"):
        SamplingParams(max_tokens=5, min_tokens=10**9)
    with pytest.raises(
        RequestRejected, match="min_tokens must be <= max_tokens, got 1000000000"
    ) as e:
        engine.admit([1, 2, 3], SamplingParams(max_tokens=None, min_tokens=10**9))
    assert e.value.param == "min_tokens"
    assert "at most 5 tokens" in str(e.value)


def test_the_default_max_tokens_must_be_positive():
    with pytest.raises(ValueError, match="default_max_tokens must be an integer >= 1, got 0"):
        EngineConfig(default_max_tokens=0)
