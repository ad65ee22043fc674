"""Tiny Llama checkpoints in the Hugging Face layout, built deterministically with no downloads.

`write_checkpoint` writes config, generation config, safetensors weights (single or sharded), a
byte-level BPE tokenizer trained on an embedded corpus and a Llama-3-style chat template.
`demo_model_dir` builds the built-in demo model once into a cache directory and reuses it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from nanoserve.env import cache_dir

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
EOT = "<|eot_id|>"
SPECIAL_TOKENS = [BOS, EOS, "<|start_header_id|>", "<|end_header_id|>", EOT]

LLAMA3_ROPE_SCALING: Mapping[str, Any] = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# Llama 3's template, less tools and the date header: string or OpenAI-style list content.
CHAT_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['content'] is string %}\n"
    "        {%- set content = message['content'] %}\n"
    "    {%- else %}\n"
    "        {%- set content = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') %}\n"
    "    {%- endif %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + content | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

CORPUS = """\
The lighthouse keeper woke before the gulls, as she did every morning, and climbed the
ninety-one steps to the lamp room. From there she could see the whole bay: the fishing boats
coming home, the ferry leaving for the islands, and the small café on the pier where the
owner was already setting out chairs. She wrote the weather in her notebook, the wind from
the north-west, the sea calm, the sky clear, and then she made coffee.

A naïve reader might think that nothing ever happens in a lighthouse. In fact the work never
stops. Lenses must be cleaned, brass must be polished, engines must be tested, and every
ship that passes must be counted and named. The keeper kept a list of them all: cargo ships
from Rotterdam and Hamburg, a research vessel from Japan (日本) with a red hull, yachts from
Zürich whose crews waved, and once a tall ship with white sails that looked like a memory.

In the evenings she read. She liked books about engines and books about the sea, and she
liked letters best of all. Her brother wrote from Montréal about the snow, about his résumé
and his new job, and about a jalapeño soup he had learned to cook. Her friend in Kyoto wrote
about gardens, about 東京 and 大阪, and about the quiet of temples at dawn. Each letter was a
window: a small square of someone else's day, held up to the light.

Computers arrived at the lighthouse late, and they arrived in pieces. The first one had a
keyboard with a sticky letter e and a screen that hummed. She learned to write small
programs: a loop that counted ships, a function that converted knots to kilometres per hour,
a table of tides for the whole year. def tide(hour): return 2.5 * sin(hour / 12.42 * 2 * pi).
She printed the numbers 0, 1, 2, 3, 5, 8, 13, 21, 34, 55 and 89 just to see them line up.

Some words are hard to translate. The Greek word λόγος means word, reason and account at
once. The Russian слово means word, and the German Übersetzung means translation, which is
itself a kind of crossing over. The keeper collected such words the way other people collect
shells, and she wrote them on cards: über, déjà vu, naïveté, smörgåsbord, façade, 🙂 and ☕.

When the storm came in November, the power failed for three days. The keeper ran the old
diesel engine, trimmed the wicks of the spare lamps, and did not sleep much. Ships called on
the radio and she answered each one: "Lighthouse here. You are clear to the east. Keep the
red buoy to port." On the fourth morning the sea went flat and grey, and the gulls came back,
and she wrote in the notebook: storm passed, all ships safe, coffee finished.

Years later a student asked her what she had learned. She thought for a long time. "Pay
attention," she said. "Write things down. Check the lamp twice. Be kind on the radio, because
the person on the other end is tired and afraid. And always keep a second pot of coffee."
The student laughed, wrote it down, and asked whether she would do it all again. Yes, she said.
Every single day of it.
"""


def build_tokenizer(vocab_size: int = 1024) -> Tokenizer:
    """Train a byte-level BPE on CORPUS; special tokens take the last ids, as in Llama 3.

    When the corpus supports fewer merges than asked, reserved special tokens fill the gap.
    """
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)}, got {vocab_size}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    num_reserved = vocab_size - len(SPECIAL_TOKENS) - tok.get_vocab_size()
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(num_reserved)]
    tok.add_special_tokens(SPECIAL_TOKENS + reserved)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS}:1 $B:1", special_tokens=[(BOS, bos_id)]
    )
    return tok


def write_checkpoint(
    path: str | os.PathLike[str],
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    head_dim: int | None = None,
    vocab_size: int | None = None,
    tokenizer_vocab_size: int = 1024,
    max_position_embeddings: int = 2048,
    rope_theta: float = 500000.0,
    rope_scaling: Mapping[str, Any] | None = LLAMA3_ROPE_SCALING,
    config_layout: Literal["rope_theta", "rope_parameters"] = "rope_theta",
    tie_word_embeddings: bool = True,
    dtype: Literal["float32", "bfloat16", "float16"] = "float32",
    shard_bytes: int | None = None,
    chat_template_jinja: bool = False,
    seed: int = 0,
    init_std: float = 1.0,
) -> Path:
    """Write a random Llama checkpoint to `path` (created if missing) and return it.

    `vocab_size` (the model's) defaults to the tokenizer's and may exceed it (padded embeddings).
    `config_layout="rope_parameters"` writes the transformers-5 style config (`rope_parameters`,
    `dtype`); the default writes the published Llama 3.2 style (`rope_theta`, `rope_scaling`,
    `torch_dtype`). `init_std` is the embedding std; projections scale with 1/sqrt(fan_in).
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(tokenizer_vocab_size)
    vocab_size = vocab_size or tok.get_vocab_size()
    if vocab_size < tok.get_vocab_size():
        raise ValueError(f"vocab_size {vocab_size} < tokenizer's {tok.get_vocab_size()}")
    config = _model_config(
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        head_dim=head_dim or hidden_size // num_heads,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(EOS),
    )
    config.update(_rope_config(config_layout, rope_theta, rope_scaling, dtype))
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", _generation_config(tok))
    _write_tokenizer(out, tok, max_position_embeddings, chat_template_jinja)
    weights = _random_weights(config, seed, init_std)
    _write_weights(out, {k: v.to(getattr(torch, dtype)) for k, v in weights.items()}, shard_bytes)
    return out


def _model_config(**fields: Any) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-5,
        "use_cache": True,
        **fields,
    }


def _rope_config(
    layout: str, theta: float, scaling: Mapping[str, Any] | None, dtype: str
) -> dict[str, Any]:
    if layout == "rope_theta":
        return {
            "rope_theta": theta,
            "rope_scaling": dict(scaling) if scaling else None,
            "torch_dtype": dtype,
        }
    if layout == "rope_parameters":
        params = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
        return {"rope_parameters": params, "dtype": dtype}
    raise ValueError(f"config_layout must be 'rope_theta' or 'rope_parameters', got {layout!r}")


def _generation_config(tok: Tokenizer) -> dict[str, Any]:
    return {
        "bos_token_id": tok.token_to_id(BOS),
        "eos_token_id": [tok.token_to_id(EOS), tok.token_to_id(EOT)],
    }


def _write_tokenizer(out: Path, tok: Tokenizer, max_len: int, template_file: bool) -> None:
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOT,
            "clean_up_tokenization_spaces": False,
            "model_input_names": ["input_ids", "attention_mask"],
            "model_max_length": max_len,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    if template_file:
        (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# Init gains, tuned by generating with transformers. Blocks must outweigh the embedding in the
# residual stream, or a tied lm_head predicts the current token again forever; a large q makes
# attention sharp, so positions (hence RoPE) change the logits.
_OUT_GAIN = 8.0
_Q_GAIN = 3.0


def _weight_specs(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...], float]]:
    """(name, shape, std) in drawing order; std 0 marks a norm weight (1 + small noise)."""
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    specs: list[tuple[str, tuple[int, ...], float]] = [
        ("model.embed_tokens.weight", (cfg["vocab_size"], h), 1.0)
    ]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [
            (p + "input_layernorm.weight", (h,), 0.0),
            (p + "self_attn.q_proj.weight", (q, h), _Q_GAIN / math.sqrt(h)),
            (p + "self_attn.k_proj.weight", (kv, h), 1.0 / math.sqrt(h)),
            (p + "self_attn.v_proj.weight", (kv, h), 1.0 / math.sqrt(h)),
            (p + "self_attn.o_proj.weight", (h, q), _OUT_GAIN / math.sqrt(q)),
            (p + "post_attention_layernorm.weight", (h,), 0.0),
            (p + "mlp.gate_proj.weight", (inter, h), 1.0 / math.sqrt(h)),
            (p + "mlp.up_proj.weight", (inter, h), 1.0 / math.sqrt(h)),
            (p + "mlp.down_proj.weight", (h, inter), _OUT_GAIN / math.sqrt(inter)),
        ]
    specs.append(("model.norm.weight", (h,), 0.0))
    if not cfg["tie_word_embeddings"]:
        specs.append(("lm_head.weight", (cfg["vocab_size"], h), 1.0))
    return specs


def _random_weights(cfg: dict[str, Any], seed: int, init_std: float) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape, std in _weight_specs(cfg):
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        if std == 0.0:
            weights[name] = 1.0 + 0.1 * noise
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            weights[name] = init_std * noise
        else:
            weights[name] = std * noise
    return weights


def _write_weights(out: Path, weights: dict[str, torch.Tensor], shard_bytes: int | None) -> None:
    meta = {"format": "pt"}
    if shard_bytes is None:
        save_file(weights, out / "model.safetensors", metadata=meta)
        return
    shards = _pack_shards(weights, shard_bytes)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / fname, metadata=meta)
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out / "model.safetensors.index.json", index)


def _pack_shards(weights: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    """Greedy in order: a shard closes when the next tensor would push it past `limit` bytes."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in weights.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


DEMO_MODEL: Mapping[str, Any] = {
    "hidden_size": 256,
    "num_layers": 4,
    "num_heads": 8,
    "num_kv_heads": 2,
    "intermediate_size": 768,
    "max_position_embeddings": 2048,
    "dtype": "float32",
    "chat_template_jinja": False,
}


def demo_model_dir() -> Path:
    """The built-in demo model, built on first use under $NANOSERVE_CACHE (or ~/.cache/nanoserve).

    The directory name hashes the build parameters and this module's source, so a change to either
    builds a fresh model. The build goes to a temporary directory renamed into place, so concurrent
    callers never see a half-written model.
    """
    root = cache_dir()
    digest = hashlib.sha256(json.dumps(DEMO_MODEL, sort_keys=True).encode())
    digest.update(Path(__file__).read_bytes())
    final = root / f"demo-{digest.hexdigest()[:16]}"
    if (final / "config.json").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-build-", dir=root))
    try:
        write_checkpoint(tmp, **DEMO_MODEL)
        os.rename(tmp, final)
    except OSError:
        if not (final / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
