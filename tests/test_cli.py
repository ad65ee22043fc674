"""`nanoserve` on the command line: `generate` prints a completion (on the demo model and on a
checkpoint), and every mistake a user can make is one line on stderr with exit status 2."""

import json
import re
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.demo import demo_model_dir


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


def test_generate_with_ngram_speculation_prints_the_same_completion(tiny_model_dir, tmp_path):
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}'
    args = ("generate", str(tiny_model_dir), "--prompt", "a b a b a b", "--max-tokens", "24")
    plain = _run(*args, env_cache=tmp_path)
    result = _run(*args, "--speculative-config", spec, env_cache=tmp_path)
    assert result.returncode == plain.returncode == 0, result.stderr
    assert result.stdout == plain.stdout


def test_generate_demo_builds_and_uses_the_demo_model(tmp_path, monkeypatch):
    result = _run("generate", "demo", "--prompt", "Once upon a time", env_cache=tmp_path)
    assert result.returncode == 0, result.stderr
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    (demo,) = [p for p in tmp_path.iterdir() if p.name.startswith("demo-")]
    assert demo == demo_model_dir()  # built by the command, found again here
    expected = LLM(str(demo)).generate(
        "Once upon a time", SamplingParams(temperature=0, max_tokens=32), use_tqdm=False
    )[0]
    assert result.stdout == "Once upon a time" + expected.outputs[0].text + "\n"


def test_generate_reports_bad_arguments_without_a_traceback(tiny_model_dir, tmp_path):
    result = _run(
        "generate", str(tiny_model_dir), "--prompt", "x", "--top-p", "2", env_cache=tmp_path
    )
    assert result.returncode == 2
    _one_line_error(result, "top_p must be")


def _one_line_error(result, *words):
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nanoserve: "), result.stderr
    assert all(w in lines[0] for w in words), lines[0]


def test_a_port_in_use_is_one_line_before_the_model_loads(tiny_model_dir, tmp_path):
    """The server's socket is bound before the model loads: a port in use ends the command
    with one line (no model-loading log before it) and exit status 2."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _run("serve", str(tiny_model_dir), "--port", str(port), env_cache=tmp_path)
    _one_line_error(result, f"127.0.0.1:{port} is in use; pass --port")


def test_a_chat_template_that_does_not_compile_stops_the_start(tiny_model_dir, tmp_path):
    """Compiled once the tokenizer is built, after the weights: the last line names it."""
    result = _run("generate", str(tiny_model_dir), "--prompt", "x", "--chat-template",
                  "{% for %}", env_cache=tmp_path)  # fmt: skip
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("nanoserve: chat_template must be a Jinja template that compiles")


@pytest.mark.parametrize(
    "args,words",
    [
        (["--block-size", "3"], ["--block-size must be a power of 2, got 3"]),
        (["--dtype", "float16"], ["--dtype must be float32, bfloat16 or auto on the CPU"]),
        (["--max-queue", "-1"], ["--max-queue must be an integer >= 1 (default: no limit)"]),
        (["--max-queue", "0"], ["--max-queue must be an integer >= 1", "got 0"]),
        (["--num-kv-blocks", "0"], ["--num-kv-blocks must be", "(default: from --kv-cache"]),
        (["--default-max-tokens", "0"], ["--default-max-tokens must be an integer >= 1, got 0"]),
        (["--kv-cache-memory", "0"], ["--kv-cache-memory must be a number > 0", "got 0.0"]),
        (["--gpu-memory-utilization", "1.5"], ["--gpu-memory-utilization must be", "(0, 1]"]),
        (["-tp", "0"], ["--tensor-parallel-size must be an integer >= 1, got 0"]),
        (["--device", "gpu"], ["--device must be cpu, cuda or cuda:N, got gpu"]),
        (["--chat-template", "no-such.jinja"], ["--chat-template must be a readable file"]),
        (["--max-request-bytes", "0"], ["--max-request-bytes must be an integer >= 1"]),
        (["--port", "80800"], ["--port must be an integer in 0..65535, got 80800"]),
        (["--port", "http"], ["--port", "invalid int value: 'http'"]),
        (["--quantization", "q2_k"], ["--quantization", "invalid choice: 'q2_k'"]),
        (["--reasoning-parser", "r1"], ["--reasoning-parser", "invalid choice: 'r1'", "qwen3"]),
        (
            ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
            ["--speculative-config num_speculative_tokens must be an integer >= 1, got 0"],
        ),
        (
            ["--speculative-config", '{"method": "ngram", "lookahead": 2}'],
            ["--speculative-config lookahead must be absent", "prompt_lookup_max"],
        ),
        (
            ["--speculative-config", '{"model": "draft.gguf", "prompt_lookup_max": 3}'],
            ['--speculative-config prompt_lookup_max must be absent with method "draft_model"'],
        ),
        (["--speculative-config", "ngram"], ["--speculative-config must be a JSON object"]),
    ],
)
def test_bad_settings_are_one_line(tiny_model_dir, tmp_path, args, words):
    result = _run("serve", str(tiny_model_dir), "--port", "0", *args, env_cache=tmp_path)
    _one_line_error(result, *words)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_on_a_machine_without_it_is_one_line(tiny_model_dir, tmp_path):
    result = _run(
        "generate", str(tiny_model_dir), "--prompt", "x", "--device", "cuda", env_cache=tmp_path
    )
    _one_line_error(result, "--device cuda", "no CUDA device")


@pytest.mark.parametrize(
    "args,words",
    [
        (["--temprature", "0"], ["unrecognized arguments: --temprature 0", "--temperature?"]),
        (["--max-tokns=4"], ["did you mean --max-tokens?"]),
        (["--top-pp", "0.5"], ["did you mean --top-p?"]),
    ],
)
def test_a_mistyped_flag_suggests_the_right_one(tiny_model_dir, tmp_path, args, words):
    result = _run("generate", str(tiny_model_dir), "--prompt", "x", *args, env_cache=tmp_path)
    _one_line_error(result, *words)


def test_a_hub_name_says_that_nothing_is_downloaded(tmp_path):
    for command in (["serve", "--port", "0"], ["chat"], ["generate", "--prompt", "x"]):
        result = _run(*command, "HuggingFaceTB/SmolLM2-135M-Instruct", env_cache=tmp_path)
        _one_line_error(result, "HuggingFaceTB/SmolLM2-135M-Instruct", "downloads nothing",
                        "local path")  # fmt: skip


def test_a_missing_model_is_one_line(tmp_path):
    for command in (["serve", "--port", "0"], ["generate", "--prompt", "x"]):
        result = _run(*command, str(tmp_path / "nowhere"), env_cache=tmp_path)
        _one_line_error(result, "no model at", "nowhere")
        result = _run(*command, str(tmp_path), env_cache=tmp_path)
        _one_line_error(result, "no config.json")


def test_help_imports_no_torch_and_describes_every_flag():
    """--help parses without importing torch (what made it take seconds); every option has a
    description, and every option with a value shows its default."""
    code = (
        "import contextlib, io, sys\n"
        "from nanoserve.cli import main\n"
        "for argv in ([], ['serve'], ['generate']):\n"
        "    out = io.StringIO()\n"
        "    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
        "        main(argv + ['--help'])\n"
        "    print(out.getvalue())\n"
        "    print('=====')\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    *helps, torch_loaded = result.stdout.split("=====\n")
    assert torch_loaded.strip() == "False"
    top, serve, generate = helps
    assert "serve" in top and "generate" in top and "--version" in top
    for text in (serve, generate):
        options = text.split("options:", 1)[1]
        entries = re.split(r"\n  (?=-)", options)[1:]
        assert len(entries) > 10
        for entry in entries:
            flag, _, description = entry.partition("  ")
            assert description.strip(), f"{flag} has no description"
            takes_value = " " in flag.split(",")[-1].strip()
            if takes_value and "--prompt" not in flag:
                assert "(default:" in entry, f"{flag} shows no default"


def test_version(tmp_path):
    result = _run("--version", env_cache=tmp_path)
    assert result.returncode == 0 and re.fullmatch(r"nanoserve \d+\.\d+\.\d+\n", result.stdout)


def test_generate_without_a_model_runs_smollm2(tmp_path):
    result = _run("generate", "--prompt", "The capital of France is", "--max-tokens", "8",
                  env_cache=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("The capital of France is") and "Paris" in result.stdout


def _broken_copy(model_dir, tmp_path, config=None, remove=()):
    """A copy of `model_dir` with config.json replaced by `config` (JSON text) and files removed."""
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    if config is not None:
        (broken / "config.json").write_text(config)
    for name in remove:
        (broken / name).unlink()
    return broken


def _config_with(model_dir, **changes):
    config = json.loads((model_dir / "config.json").read_text())
    config.update(changes)
    return json.dumps({k: v for k, v in config.items() if v is not None})


@pytest.mark.parametrize(
    "make_config,words",
    [
        (lambda d: "[]", ["expected a JSON object, got []"]),
        (lambda d: "null", ["expected a JSON object, got null"]),
        (lambda d: "{", ["not valid JSON"]),
        (lambda d: '{"architectures": ["LlamaForCausalLM"]}', ["hidden_size is missing"]),
        (lambda d: _config_with(d, num_attention_heads=0), ["num_attention_heads", "got 0"]),
        (lambda d: _config_with(d, hidden_size="64"), ["hidden_size", "integer > 0", "'64'"]),
        (lambda d: _config_with(d, num_key_value_heads=3), ["multiple of num_key_value_heads"]),
        (lambda d: _config_with(d, head_dim=None, hidden_size=66), ["hidden_size (66)"]),
        (lambda d: _config_with(d, rms_norm_eps=-1), ["rms_norm_eps must be a number > 0"]),
        (lambda d: _config_with(d, tie_word_embeddings="yes"), ["tie_word_embeddings"]),
        (lambda d: _config_with(d, eos_token_id="</s>"), ["eos_token_id"]),
        (lambda d: _config_with(d, rope_scaling={"rope_type": "llama3"}), ["rope_scaling.factor"]),
    ],
)
def test_a_broken_config_json_is_one_line_naming_the_file(
    tiny_model_dir, tmp_path, make_config, words
):
    broken = _broken_copy(tiny_model_dir, tmp_path, config=make_config(tiny_model_dir))
    for command in (["serve", "--port", "0"], ["generate", "--prompt", "x"]):
        result = _run(*command, str(broken), env_cache=tmp_path)
        _one_line_error(result, f"nanoserve: {broken / 'config.json'}: ", *words)


@pytest.mark.parametrize(
    "missing,words",
    [
        ("tokenizer.json", ["no tokenizer.json"]),
        ("model.safetensors", ["no model.safetensors or model.safetensors.index.json"]),
    ],
)
def test_a_checkpoint_without_tokenizer_or_weights_is_one_line(
    tiny_model_dir, tmp_path, missing, words
):
    broken = _broken_copy(tiny_model_dir, tmp_path, remove=[missing])
    result = _run("generate", str(broken), "--prompt", "x", env_cache=tmp_path)
    _one_line_error(result, f"nanoserve: {broken}: ", *words)
