"""The settings a user gives: `EngineConfig` (how the engine runs) and `ServerConfig` (how the
HTTP server runs). Each field carries its `Setting`: its help, its limits and, where they differ,
its command-line flag; the command line's flags are made from these, and the limits are checked
here when a config is built. Both frozen. Imports no torch, so that `--help` answers at once.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16", "float16")
# The formats weights may be kept in (the C kernels' table, in its order): what `quantization` may
# quantize to, but the K-quants (kernels.quant.NOT_QUANTIZED: made by llama.cpp's quantizer,
# refused here).
BLOCK_FORMATS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "f16", "bf16",
                 "mxfp4")  # fmt: skip
QUANTIZATIONS = ("auto", "none", *BLOCK_FORMATS)
ATTENTION_BACKENDS = ("auto", "torch", "c", "triton")  # nanoserve.kernels' BACKENDS
LOG_LEVELS = ("debug", "info", "warning", "error")
# How a reasoning model's thinking is told apart from its answer (server/reasoning.py): vLLM's
# names, deepseek_r1 and qwen3, are the same <think>...</think> parser as think.
REASONING_PARSERS = ("think", "deepseek_r1", "qwen3", "openai_gptoss", "none")


@dataclass(frozen=True)
class Limit:
    """What a setting's value must be: `rule` says it ("an integer >= 1"), `test` checks it."""

    rule: str
    test: Callable[[Any], bool]


@dataclass(frozen=True)
class Setting:
    """One field's description. `help`: what it sets (for a boolean that defaults to True, what
    its flag does: it turns it off); `flag`: its command-line name when it is not --field-name;
    `unset`: what None means, for a field whose default is None; `cli`: False for a field the
    command line does not set."""

    help: str
    flag: str | None = None
    aliases: tuple[str, ...] = ()
    choices: tuple[str, ...] = ()
    limit: Limit | None = None
    unset: str | None = None
    cli: bool = True

    def rule(self) -> str | None:
        """What a value must be, or None for a setting without limits."""
        if self.choices:
            return f"one of {', '.join(self.choices)}"
        return self.limit.rule if self.limit else None

    def accepts(self, value: Any) -> bool:
        if self.choices:
            return value in self.choices
        return self.limit is None or self.limit.test(value)


class SettingError(ValueError):
    """A setting outside its limits: names the field, its rule and the value given."""

    def __init__(self, name: str, value: Any, rule: str, unset: str | None = None):
        self.name, self.value, self.rule, self.unset = name, value, rule, unset
        alternative = f" or None ({unset})" if unset else ""
        super().__init__(f"{name} must be {rule}{alternative}, got {value!r}")


def setting(default: Any, help: str, **description: Any) -> Any:
    """A dataclass field with its `Setting` (keyword arguments as Setting's) in its metadata."""
    return field(default=default, metadata={"setting": Setting(help, **description)})


def described(config_class: type) -> list[tuple[Field[Any], Setting]]:
    """The fields of a config class with their Settings, in order."""
    return [(f, f.metadata["setting"]) for f in fields(config_class)]


def check(config: Any) -> None:
    """Raise SettingError for the first field of `config` outside its limits."""
    for f, s in described(type(config)):
        value = getattr(config, f.name)
        if value is None and f.default is None:
            continue
        rule = s.rule()
        if rule and not s.accepts(value):
            raise SettingError(f.name, value, rule, s.unset if f.default is None else None)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _integer(low: int, high: int | None = None) -> Limit:
    rule = f"an integer >= {low}" if high is None else f"an integer in {low}..{high}"
    return Limit(rule, lambda v: _is_int(v) and low <= v and (high is None or v <= high))


def _number(rule: str, test: Callable[[float], bool]) -> Limit:
    return Limit(rule, lambda v: _is_number(v) and test(v))


# The CPU's KV cache when kv_cache_memory_gb is not given: its pages are written at start, so a
# small model gets no more than its sequences can fill.
DEFAULT_KV_CACHE_GB = 1.0
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")
POSITIVE = _integer(1)
POWER_OF_2 = Limit("a power of 2", lambda v: _is_int(v) and v > 0 and v & (v - 1) == 0)
DEVICE = Limit("cpu, cuda or cuda:N", lambda v: isinstance(v, str) and bool(_DEVICE.fullmatch(v)))
BOOLEAN = Limit("True or False", lambda v: isinstance(v, bool))
TEMPLATE = Limit(
    "a readable file or a Jinja template ({{ or {% in it)",
    lambda v: isinstance(v, str) and (os.path.isfile(v) or "{{" in v or "{%" in v),
)


def chat_template_source(value: str) -> str:
    """The template a chat_template setting names: the file's text, or the setting itself."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    return value


RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed")
SPEC_METHODS = ("ngram", "draft_model")
NGRAM_KEYS = ("prompt_lookup_max", "prompt_lookup_min")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, in vLLM's `speculative_config` shape. `method` "ngram" (prompt
    lookup) proposes up to `num_speculative_tokens` tokens a step, those that followed the
    latest earlier occurrence of the sequence's last n tokens (n from `prompt_lookup_max` down to
    `prompt_lookup_min`); "draft_model" (the method when `model` is given) has a smaller model,
    a checkpoint directory or GGUF file with the target's tokenizer, propose them greedily. The
    target model verifies them all in one step."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig:
        """From a dict, or its JSON text (the command line's); SettingError names the bad key."""
        name = "speculative_config"
        if isinstance(value, SpeculativeConfig):
            return value
        keys = {f.name for f in fields(cls)}
        values = _json_object(name, value)
        unknown = sorted(set(values) - keys)
        if unknown:
            raise SettingError(
                f"{name}.{unknown[0]}", values[unknown[0]], "absent: the known keys are "
                + ", ".join(sorted(keys)),
            )  # fmt: skip
        values.setdefault("method", "draft_model" if "model" in values else "ngram")
        if values["method"] not in SPEC_METHODS:
            raise SettingError(name + ".method", values["method"], " or ".join(SPEC_METHODS))
        if values["method"] == "ngram" and "model" in values:
            raise SettingError(
                name + ".model", values["model"], 'absent with method "ngram" (a draft model '
                'is method "draft_model")',
            )  # fmt: skip
        if values["method"] == "draft_model":
            model = values.get("model")
            if not isinstance(model, str) or not model:
                raise SettingError(name + ".model", model, "a checkpoint directory or GGUF file")
            for key in NGRAM_KEYS:
                if key in values:
                    raise SettingError(
                        f"{name}.{key}", values[key], 'absent with method "draft_model"'
                    )
        for key in ("num_speculative_tokens", *NGRAM_KEYS):
            if key in values and not POSITIVE.test(values[key]):
                raise SettingError(f"{name}.{key}", values[key], POSITIVE.rule)
        spec = cls(**values)
        if spec.prompt_lookup_min > spec.prompt_lookup_max:
            raise SettingError(
                name + ".prompt_lookup_min", spec.prompt_lookup_min,
                f"<= prompt_lookup_max ({spec.prompt_lookup_max})",
            )  # fmt: skip
        return spec


# What --hf-overrides may say: vLLM's keys for serving the original Qwen3-Reranker (a causal LM)
# as a one-label classifier, its weight the "yes" row of the LM head less the "no" row.
QWEN3_RERANKER = "Qwen3ForSequenceClassification"


@dataclass(frozen=True)
class HfOverrides:
    """vLLM's `hf_overrides`, the one use implemented: `{"architectures": [QWEN3_RERANKER],
    "classifier_from_token": [FALSE, TRUE], "is_original_qwen3_reranker": true}` (the score is
    sigmoid(logit(TRUE) - logit(FALSE)) at the last token). Any other key or value is refused."""

    classifier_from_token: tuple[str, str]

    @classmethod
    def parse(cls, value: Any) -> HfOverrides:
        """From a dict, or its JSON text (the command line's); SettingError names the bad key."""
        if isinstance(value, HfOverrides):
            return value
        name, values = "hf_overrides", _json_object("hf_overrides", value)
        known = ("architectures", "classifier_from_token", "is_original_qwen3_reranker")
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise SettingError(f"{name}.{unknown[0]}", values[unknown[0]], "absent: the "
                               "implemented keys are " + ", ".join(known))  # fmt: skip
        if values.get("architectures") != [QWEN3_RERANKER]:
            raise SettingError(name + ".architectures", values.get("architectures"),
                               f'["{QWEN3_RERANKER}"]')  # fmt: skip
        if values.get("is_original_qwen3_reranker") is not True:
            raise SettingError(name + ".is_original_qwen3_reranker",
                               values.get("is_original_qwen3_reranker"), "true")  # fmt: skip
        tokens = values.get("classifier_from_token")
        if not (isinstance(tokens, list) and len(tokens) == 2
                and all(isinstance(t, str) and t for t in tokens)):  # fmt: skip
            raise SettingError(name + ".classifier_from_token", tokens,
                               'two tokens, the false one first: ["no", "yes"]')  # fmt: skip
        return cls((tokens[0], tokens[1]))


def _json_object(name: str, value: Any) -> dict[str, Any]:
    """A setting's dict, given as one or as its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise SettingError(name, value, f"a JSON object ({e})") from None
    if not isinstance(value, dict):
        raise SettingError(name, value, "a JSON object (a dict)")
    return dict(value)


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs: dtype, device, cache geometry, batch budgets and how many processes
    (tensor parallelism) share the model. Fields are in the order `--help` lists their flags."""

    # A small model asked an open question can otherwise loop until its context is full.
    default_max_tokens: int = setting(
        2048, "tokens a request without max_tokens generates at most (never past the context)",
        limit=POSITIVE,
    )  # fmt: skip
    dtype: str = setting(
        "float32", "of activations and float weights (and by default the KV cache); auto: the "
        "fastest correct one here", choices=(*DTYPES, "auto"),
    )  # fmt: skip
    kv_cache_dtype: str = setting(
        "auto", "of the KV cache: auto is the activations' dtype, but float16 where a float32 "
        "model's matrices are GGUF blocks (as llama.cpp's cache); a 16-bit cache holds twice the "
        "tokens of a float32 one in the same memory, q8_0 (llama.cpp's -ctk/-ctv q8_0 blocks: 34 "
        "bytes per 32 values; CPU, head_dim a multiple of 32) 1.88x a 16-bit one (CUDA: the "
        "activations' dtype only)", choices=(*DTYPES, "q8_0", "auto"),
    )  # fmt: skip
    quantization: str = setting(
        "auto", "auto: a GGUF's matrices stay in their own formats where the kernels take them "
        "(Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, F16, BF16; CPU, float32, one process); "
        "none: de-quantize them; q8_0 ... bf16: keep a float checkpoint's matrices in that format "
        "(quantized at load; CPU, float32; q4_k/q5_k/q6_k are refused: llama.cpp's quantizer "
        "makes those)", choices=QUANTIZATIONS,
    )  # fmt: skip
    device: str = setting("cpu", "cpu, or cuda[:N]", limit=DEVICE)
    block_size: int = setting(16, "tokens per KV block (a power of 2)", limit=POWER_OF_2)
    num_kv_blocks: int | None = setting(
        None, "KV cache blocks", limit=POSITIVE,
        unset="from --kv-cache-memory, or from free GPU memory",
    )  # fmt: skip
    kv_cache_memory_gb: float | None = setting(
        None, "CPU: GiB for the KV cache", flag="--kv-cache-memory",
        limit=_number("a number > 0", lambda v: v > 0),
        unset=f"{DEFAULT_KV_CACHE_GB:g} GiB, or what max_num_seqs sequences of max_model_len "
        "tokens fill where that is less",
    )  # fmt: skip
    gpu_memory_utilization: float = setting(
        0.9, "CUDA: share of device memory for weights and KV cache",
        limit=_number("a number in (0, 1]", lambda v: 0 < v <= 1),
    )  # fmt: skip
    max_num_seqs: int = setting(64, "most sequences in one step", limit=POSITIVE)
    max_num_batched_tokens: int = setting(2048, "most tokens in one step", limit=POSITIVE)
    max_model_len: int | None = setting(
        None, "context length", limit=POSITIVE,
        unset="the model's, or what the cache holds if less",
    )  # fmt: skip
    enable_prefix_caching: bool = setting(
        True, "do not reuse the KV blocks of earlier prompts", flag="--no-prefix-caching",
        limit=BOOLEAN,
    )  # fmt: skip
    enable_chunked_prefill: bool = setting(
        True, "run each prompt whole instead of in chunks of the token budget",
        flag="--no-chunked-prefill", limit=BOOLEAN,
    )  # fmt: skip
    tensor_parallel_size: int = setting(
        1, "processes the model is split across: one device each on CUDA; on a CPU they share "
        "its threads", aliases=("-tp",), limit=POSITIVE,
    )  # fmt: skip
    chat_template: str | None = setting(
        None, "a Jinja chat template (a file, or the template itself) instead of the model's",
        limit=TEMPLATE, unset="the model's own",
    )  # fmt: skip
    reasoning_parser: str | None = setting(
        None, "how a reasoning model's thinking is told apart from its answer: think (<think> "
        "... </think>; vLLM's deepseek_r1 and qwen3 are the same parser), openai_gptoss "
        "(gpt-oss's harmony channels: analysis is the thinking, final the answer, commentary "
        "the tool calls), or none (the thinking stays in the content)", choices=REASONING_PARSERS,
        unset="openai_gptoss where the chat template writes harmony's <|channel|> and "
        "<|message|>, think where it has <think> and </think>, else none",
    )  # fmt: skip
    thinking_token_budget: int | None = setting(
        None, "a reasoning model's thinking budget for requests that give none (vLLM's request "
        "field of that name, whose value wins; also the Responses and Messages APIs'): once "
        "spent, </think> is forced", limit=_integer(0), unset="no budget",
    )  # fmt: skip
    grammar_compile_seconds: float = setting(
        0.8, "longest a structured-output constraint may take to compile; a longer one is "
        "refused (400)", limit=_number("a number > 0", lambda v: v > 0),
    )  # fmt: skip
    watermark: float = setting(
        0.01, "share of the KV blocks a new prompt leaves free for the running sequences",
        limit=_number("a number in [0, 1)", lambda v: 0 <= v < 1), cli=False,
    )  # fmt: skip
    attention_backend: str = setting(
        "auto", "the attention kernels: auto (c on a CPU, triton on CUDA), torch, c or triton",
        choices=ATTENTION_BACKENDS, cli=False,
    )  # fmt: skip
    cuda_graphs: bool = setting(
        True, "CUDA: replay decode steps from captured graphs (not with TP > 1)", limit=BOOLEAN,
        cli=False,
    )  # fmt: skip
    runner: str = setting(
        "auto", "what the model serves, as vLLM's --runner: generate (completions, chat) or "
        "pooling (/v1/embeddings; /v1/rerank and /v1/score for a cross-encoder); auto: pooling "
        "for a BERT encoder, else generate", choices=RUNNERS,
    )  # fmt: skip
    convert: str = setting(
        "auto", "as vLLM's --convert: embed serves a decoder's final hidden states as "
        "embeddings (last-token pooling, normalized, unless its sentence-transformers files say "
        "otherwise; implies --runner pooling)", choices=CONVERTS,
    )  # fmt: skip
    hf_overrides: HfOverrides | None = setting(
        None, "as vLLM's --hf-overrides (JSON), for the original Qwen3-Reranker only: "
        '{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", '
        '"yes"], "is_original_qwen3_reranker": true} serves it on /v1/rerank and /v1/score '
        "(implies --runner pooling)", unset="none",
    )  # fmt: skip
    speculative_config: SpeculativeConfig | None = setting(
        None, 'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": K, '
        '"prompt_lookup_max": N, "prompt_lookup_min": M}, or a draft model: {"model": PATH, '
        '"num_speculative_tokens": K}; the output is the same as without it', unset="off",
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.speculative_config is not None:  # a dict or JSON text becomes the typed config
            spec = SpeculativeConfig.parse(self.speculative_config)
            object.__setattr__(self, "speculative_config", spec)
        if self.hf_overrides is not None:
            object.__setattr__(self, "hf_overrides", HfOverrides.parse(self.hf_overrides))
        check(self)
        if self.device == "cpu" and self.dtype == "float16":
            raise SettingError("dtype", self.dtype, "float32, bfloat16 or auto on the CPU")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """The KV cache's dtype, once resolved (model.resolve_dtype)."""
        import torch

        if self.kv_cache_dtype == "auto":
            raise ValueError("kv_cache_dtype 'auto' is resolved with the model (resolve_dtype)")
        if self.kv_cache_dtype == "q8_0":  # rows of Q8_0 blocks' bytes (nanoserve.kernels.KV_Q8_0)
            return torch.uint8
        return getattr(torch, self.kv_cache_dtype)


# smg's policies (server/replicas.py): cache_aware keeps a conversation's prefix on one replica.
ROUTER_POLICIES = ("cache_aware", "round_robin", "least_load", "power_of_two", "random")


@dataclass(frozen=True)
class ServerConfig:
    """How the HTTP server runs: where it listens, whom it admits, how much it queues, what it
    logs. Fields are in the order `--help` lists their flags."""

    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8000, "port to listen on (0: any)", limit=_integer(0, 65535))
    served_model_name: str | None = setting(
        None, "the model's id in the API (requests may also name the model MODEL, as given)",
        unset="MODEL's file name without .gguf, its directory's name, or SmolLM2-135M-Instruct",
    )  # fmt: skip
    api_key: str | None = setting(
        None, "require 'Authorization: Bearer KEY' on every route but /health",
        unset="none required",
    )  # fmt: skip
    max_queue: int | None = setting(
        None, "answer 503 with Retry-After once this many requests wait", limit=POSITIVE,
        unset="no limit",
    )  # fmt: skip
    max_body_bytes: int = setting(
        4 * 2**20, "largest request body accepted (413 above)", flag="--max-request-bytes",
        limit=POSITIVE,
    )  # fmt: skip
    responses_store_size: int = setting(
        256, "responses the Responses API keeps for previous_response_id and GET (in memory; "
        "the oldest dropped first)", limit=POSITIVE,
    )  # fmt: skip
    graceful_timeout: float = setting(
        3.0, "seconds open requests get to finish after SIGINT/SIGTERM",
        limit=_number("a number >= 0", lambda v: v >= 0), cli=False,
    )  # fmt: skip
    log_level: str = setting(
        "info", "logging threshold (info logs one line per request)", choices=LOG_LEVELS
    )
    data_parallel_size: int = setting(
        1, "replicas of the server, each a process on its own CPUs (or GPU), behind the smg "
        "router on --host and --port (pip install 'nanoserve[router]')", aliases=("-dp",),
        limit=POSITIVE,
    )  # fmt: skip
    router_policy: str = setting(
        "cache_aware", "how the router picks a replica, with --data-parallel-size",
        choices=ROUTER_POLICIES,
    )  # fmt: skip

    def __post_init__(self) -> None:
        check(self)
