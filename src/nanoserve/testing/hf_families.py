"""Tiny random checkpoints of each family nanoserve runs (and of configs it refuses), written by
transformers itself (`save_pretrained`), with the demo's byte-level BPE tokenizer; and SmolLM2
as a float checkpoint (`smollm2_checkpoint`), for llama.cpp's converter and quantizer. Weights are
redrawn with the demo's gains (biases and norms too, which transformers initializes to 0 and 1)
so that greedy decoding depends on every tensor. For the family oracle tests. And a Qwen3 chat
model and a gpt-oss one (Qwen's chat tokens or harmony's, a chat template of the caller's) that
`memorize` can train to write given answers: a random model does not write `<think>`,
`<tool_call>` or harmony's channels on its own.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import AddedToken, Tokenizer

from nanoserve.default_model import default_model_path
from nanoserve.demo import build_tokenizer, write_checkpoint

CONFIGS = {
    "llama": transformers.LlamaConfig,
    "mistral": transformers.MistralConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
    "gemma3_text": transformers.Gemma3TextConfig,
    "mixtral": transformers.MixtralConfig,
    "qwen3_moe": transformers.Qwen3MoeConfig,
    "gpt_oss": transformers.GptOssConfig,
}
SMALL = dict(
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1019,
    eos_token_id=1020,
)
GAINS = {"q_proj": 3.0, "o_proj": 8.0, "down_proj": 8.0}  # as nanoserve.demo draws them
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Tokens of their own in Qwen3's vocabulary, and not special: they stay in the decoded text.
QWEN_TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
             "</tool_response>"]  # fmt: skip
HARMONY_SPECIAL = ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                   "<|constrain|>", "<|return|>", "<|call|>"]  # fmt: skip


def write_family_checkpoint(path: Path, family: str, seed: int = 0, **config: Any) -> Path:
    """A random `family` model (a key of CONFIGS) of SMALL's sizes updated by `config`, saved by
    transformers to `path` in float32 with the demo tokenizer; returns `path`."""
    cfg = CONFIGS[family](**{**SMALL, **config})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _redraw(model, seed, gemma=family == "gemma3_text")
    model.save_pretrained(path)
    _copy_tokenizer(path)
    return path


@torch.no_grad()
def _redraw(model: torch.nn.Module, seed: int, gemma: bool = False) -> None:
    """gemma: norms scale by 1 + w (w drawn around 0), and embeddings by sqrt(hidden) (drawn
    that much smaller, so that the attention's output is not drowned in them)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if "norm" in name:
            p.copy_((0.0 if gemma else 1.0) + 0.1 * noise)
        elif gemma and "embed_tokens" in name:
            p.copy_(noise / math.sqrt(p.shape[-1]))
        elif name.endswith(".bias"):
            p.copy_(0.1 * noise)
        elif "embed_tokens" in name or "lm_head" in name:
            p.copy_(noise)
        else:
            gain = next((g for key, g in GAINS.items() if key in name), 1.0)
            p.copy_(gain / math.sqrt(p.shape[-1]) * noise)  # [experts,] out, in


def _copy_tokenizer(path: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        demo = write_checkpoint(tmp, hidden_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                                intermediate_size=8)  # fmt: skip
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(demo / name, path / name)


def smollm2_checkpoint(out: Path) -> Path:
    """SmolLM2-135M as a Hugging Face float32 checkpoint, from the default model's GGUF (so its
    values are the Q4_1 file's), with its tokenizer; returns `out`."""
    gguf_path = default_model_path()
    kw = {"gguf_file": gguf_path.name}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, dtype=torch.float32, **kw
    )
    # transformers will not save a model it read from a GGUF: the same weights in a plain one.
    config = model.config
    assert isinstance(config, transformers.LlamaConfig)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = transformers.LlamaForCausalLM(config)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(gguf_path.parent, **kw).save_pretrained(out)
    return out


def qwen3_tokenizer() -> Tokenizer:
    """The demo's byte-level BPE with Qwen's chat tokens added (QWEN_SPECIAL, QWEN_TAGS)."""
    tok = build_tokenizer()
    tok.add_special_tokens(QWEN_SPECIAL)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_TAGS])
    return tok


def write_qwen3_chat_checkpoint(path: Path, chat_template: str, seed: int = 0) -> Path:
    """A random Qwen3 model with `qwen3_tokenizer()` and `chat_template`, its turns ending with
    <|im_end|> (its EOS), as Qwen3's; returns `path`."""
    return _write_chat_checkpoint(
        path, "qwen3", qwen3_tokenizer(), chat_template, "<|endoftext|>", "<|im_end|>", seed,
        head_dim=32,
    )  # fmt: skip


def harmony_tokenizer() -> Tokenizer:
    """The demo's byte-level BPE with harmony's control tokens (HARMONY_SPECIAL), as gpt-oss's."""
    tok = build_tokenizer()
    tok.add_special_tokens(HARMONY_SPECIAL)
    return tok


def write_gpt_oss_chat_checkpoint(path: Path, chat_template: str, seed: int = 0) -> Path:
    """A random gpt-oss model with `harmony_tokenizer()` and `chat_template`; its EOS is
    <|return|> alone (gpt-oss's generation config adds <|call|>: here the chat route's harmony
    parser must stop there itself); returns `path`."""
    return _write_chat_checkpoint(
        path, "gpt_oss", harmony_tokenizer(), chat_template, "<|endoftext|>", "<|return|>", seed,
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
        sliding_window=8, rope_parameters={
            "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "original_max_position_embeddings": 512},
    )  # fmt: skip


def _write_chat_checkpoint(
    path: Path, family: str, tok: Tokenizer, chat_template: str, bos: str, eos: str, seed: int,
    **config: Any,
) -> Path:  # fmt: skip
    write_family_checkpoint(
        path, family, seed, vocab_size=tok.get_vocab_size(), bos_token_id=tok.token_to_id(bos),
        eos_token_id=tok.token_to_id(eos), **config,
    )  # fmt: skip
    (path / "tokenizer.json").write_text(tok.to_str(), encoding="utf-8")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "pad_token": bos,
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template,
    }
    text = json.dumps(tokenizer_config, indent=2)
    (path / "tokenizer_config.json").write_text(text, encoding="utf-8")
    return path


def memorize(path: Path, examples: list[tuple[list[int], list[int]]], steps: int = 400) -> None:
    """Train the checkpoint at `path`, in place, until greedy decoding after each example's
    prompt writes its answer (both token ids): a random model that writes what a test needs.
    Full-batch Adam on the answers' tokens, stopped once every one of them is the argmax."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(0)
    width = max(len(p) + len(a) for p, a in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    labels = torch.full_like(ids, -100)  # the prompts' positions teach nothing
    for row, (prompt, answer) in enumerate(examples):
        ids[row, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        labels[row, len(prompt) : len(prompt) + len(answer)] = torch.tensor(answer)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    taught = labels[:, 1:] != -100
    for _ in range(steps):
        logits = model(ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels[:, 1:])
        if (logits.argmax(-1)[taught] == labels[:, 1:][taught]).all() and loss < 0.05:
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    else:
        raise AssertionError(f"the answers were not learnt in {steps} steps (loss {loss:.3f})")
    model.save_pretrained(path)
