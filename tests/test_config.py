"""The settings' one source: every field of EngineConfig and ServerConfig is described (help,
limits), a value outside its limits is refused naming the field and the rule, the command line's
flags are made from the fields with their defaults, and the environment knobs nanoserve reads
itself are read in nanoserve.env."""

from pathlib import Path

import pytest

from nanoserve import env
from nanoserve.cli import UsageError, _config, _parser
from nanoserve.config import (
    ATTENTION_BACKENDS,
    EngineConfig,
    HfOverrides,
    ServerConfig,
    SettingError,
    described,
)
from nanoserve.kernels.api import BACKENDS


@pytest.mark.parametrize("config_class", [EngineConfig, ServerConfig])
def test_every_field_is_described(config_class):
    for f, s in described(config_class):
        assert s.help.strip(), f"{f.name} has no help"
        if f.default is None:
            assert s.unset, f"{f.name} does not say what None means"


@pytest.mark.parametrize(
    "config_class,name,value,rule",
    [
        (EngineConfig, "dtype", "float64", "one of float32, bfloat16, float16, auto"),
        (EngineConfig, "quantization", "q2_k", "one of auto, none, q8_0, q4_0, q4_1"),
        (EngineConfig, "quantization", None, "one of auto, none"),  # one spelling: "auto"
        (EngineConfig, "device", "cudaX", "cpu, cuda or cuda:N"),
        (EngineConfig, "block_size", 24, "a power of 2"),
        (EngineConfig, "num_kv_blocks", 0, "an integer >= 1 or None (from --kv-cache-memory"),
        (EngineConfig, "kv_cache_memory_gb", 0, "a number > 0"),
        (EngineConfig, "gpu_memory_utilization", 0, "a number in (0, 1]"),
        (EngineConfig, "max_num_seqs", 2.5, "an integer >= 1"),
        (EngineConfig, "max_num_seqs", None, "an integer >= 1"),  # None only where it is default
        (EngineConfig, "max_num_batched_tokens", 0, "an integer >= 1"),
        (EngineConfig, "max_model_len", -1, "an integer >= 1 or None (the model's"),
        (EngineConfig, "enable_prefix_caching", 1, "True or False"),
        (EngineConfig, "tensor_parallel_size", True, "an integer >= 1"),
        (EngineConfig, "watermark", 1.0, "a number in [0, 1)"),
        (EngineConfig, "attention_backend", "cuda", "one of auto, torch, c, triton"),
        (EngineConfig, "default_max_tokens", 0, "an integer >= 1"),
        (ServerConfig, "port", 65536, "an integer in 0..65535"),
        (ServerConfig, "max_queue", 0, "an integer >= 1 or None (no limit)"),
        (ServerConfig, "max_body_bytes", 0, "an integer >= 1"),
        (ServerConfig, "graceful_timeout", -1.0, "a number >= 0"),
        (ServerConfig, "log_level", "loud", "one of debug, info, warning, error"),
    ],
)
def test_a_value_outside_its_limits_names_the_field_and_the_rule(config_class, name, value, rule):
    with pytest.raises(SettingError, match=r"^" + name + " must be ") as e:
        config_class(**{name: value})
    assert rule in str(e.value) and str(e.value).endswith(f", got {value!r}")
    assert e.value.name == name and e.value.value == value


def test_float16_is_refused_on_the_cpu_only():
    with pytest.raises(SettingError, match="dtype must be float32, bfloat16 or auto on the CPU"):
        EngineConfig(dtype="float16")
    assert EngineConfig(dtype="float16", device="cuda:1").dtype == "float16"


def test_the_attention_backends_are_the_kernels():
    assert set(ATTENTION_BACKENDS) == set(BACKENDS)


@pytest.mark.parametrize("argv", [["serve"], ["chat"], ["generate", "--prompt", "x"]])
def test_the_flags_default_to_the_configs_defaults(argv):
    args = _parser().parse_args(argv)
    assert _config(EngineConfig, args) == EngineConfig()
    if argv == ["serve"]:
        assert _config(ServerConfig, args) == ServerConfig()


def test_the_flags_set_their_fields():
    args = _parser().parse_args(
        ["serve", "-tp", "2", "--kv-cache-memory", "0.5", "--no-prefix-caching",
         "--quantization", "none", "--max-request-bytes", "100", "--served-model-name", "m",
         "--default-max-tokens", "7", "--log-level", "debug"]
    )  # fmt: skip
    engine, server = _config(EngineConfig, args), _config(ServerConfig, args)
    assert (engine.tensor_parallel_size, engine.kv_cache_memory_gb) == (2, 0.5)
    assert not engine.enable_prefix_caching and engine.enable_chunked_prefill
    assert (engine.quantization, engine.default_max_tokens) == ("none", 7)
    assert (server.max_body_bytes, server.served_model_name) == (100, "m")
    assert server.log_level == "debug"


def test_settings_the_command_line_does_not_set_have_no_flag():
    args = vars(_parser().parse_args(["serve"]))
    for name in ("watermark", "attention_backend", "cuda_graphs", "graceful_timeout"):
        assert name not in args
    generate = vars(_parser().parse_args(["generate", "--prompt", "x"]))
    assert "default_max_tokens" not in generate  # each request has --max-tokens there


def test_the_environment_knobs(monkeypatch, tmp_path):
    monkeypatch.delenv("NANOSERVE_CACHE", raising=False)
    assert env.cache_dir() == Path.home() / ".cache" / "nanoserve"
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    assert env.cache_dir() == tmp_path
    monkeypatch.delenv("NANOSERVE_TP_TIMEOUT", raising=False)
    assert env.tp_timeout_s() == 60.0
    monkeypatch.setenv("NANOSERVE_TP_TIMEOUT", "2.5")
    assert env.tp_timeout_s() == 2.5
    for bad in ("soon", "0", "-1", "nan"):
        monkeypatch.setenv("NANOSERVE_TP_TIMEOUT", bad)
        with pytest.raises(ValueError, match=f"NANOSERVE_TP_TIMEOUT must be .* got '{bad}'"):
            env.tp_timeout_s()


def test_hf_overrides_flag_takes_vllms_json_for_the_original_qwen3_reranker():
    overrides = ('{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token":'
                 ' ["no", "yes"], "is_original_qwen3_reranker": true}')  # fmt: skip
    engine = _config(EngineConfig, _parser().parse_args(["serve", "--hf-overrides", overrides]))
    assert engine.hf_overrides == HfOverrides(("no", "yes"))
    args = _parser().parse_args(["serve", "--hf-overrides", '{"num_labels": 2}'])
    with pytest.raises(UsageError, match="--hf-overrides num_labels must be absent"):
        _config(EngineConfig, args)
