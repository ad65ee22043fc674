"""GGUF files written from Hugging Face checkpoints, as llama.cpp's converter writes them (the Q
and K rows interleaved for its rotary layout, Llama 3.1 RoPE as a `rope_freqs` tensor, a "gpt2"
byte-level BPE vocabulary), in float32 or a quantized type. For tests of the GGUF loader and for
the llama.cpp column of the benchmarks.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import torch

from nanoserve.model.config import ModelConfig
from nanoserve.model.loader import read_checkpoint
from nanoserve.model.weights import LAYER


def write_gguf(
    model_dir: Path,
    out: Path,
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    architecture: str = "llama",
) -> Path:
    """Write `model_dir` (a Hugging Face Llama checkpoint) to `out` as a GGUF file whose matrices
    are of `qtype` (norms stay float32)."""
    cfg = ModelConfig.from_dir(model_dir)
    w = gguf.GGUFWriter(str(out), architecture)
    _add_hyperparameters(w, cfg)
    _add_tokenizer(w, model_dir, cfg.vocab_size)
    for name, t in _tensors(read_checkpoint(model_dir, torch.float32), cfg).items():
        values = t.contiguous().numpy()
        if values.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(f"{name}.weight", gguf.quants.quantize(values, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(f"{name}.weight", values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _add_hyperparameters(w: gguf.GGUFWriter, cfg: ModelConfig) -> None:
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope.theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)


# Hugging Face name (after "model.layers.N.") -> GGUF name (after "blk.N."), from model/weights.py.
LAYER_NAMES = {h: g for _, t in LAYER if t.when is None for h, g in zip(t.hf, t.gguf, strict=True)}


def _tensors(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face tensors under llama.cpp's names (without ".weight"), Q and K rows permuted."""
    tensors = {
        "token_embd": hf.pop("model.embed_tokens.weight"),
        "output_norm": hf.pop("model.norm.weight"),
    }
    if not cfg.tie_word_embeddings:  # tied: llama.cpp reuses token_embd as the output head
        tensors["output"] = hf.pop("lm_head.weight")
    if cfg.rope.rope_type == "llama3":
        tensors["rope_freqs"] = _llama3_rope_factors(cfg)
    for i in range(cfg.num_layers):
        for hf_name, name in LAYER_NAMES.items():
            t = hf.pop(f"model.layers.{i}.{hf_name}.weight")
            if name == "attn_q":
                t = _interleave_rope_rows(t, cfg.num_heads)
            elif name == "attn_k":
                t = _interleave_rope_rows(t, cfg.num_kv_heads)
            tensors[f"blk.{i}.{name}"] = t
    if hf:
        raise ValueError(f"tensors left unconverted: {sorted(hf)}")
    return tensors


def _interleave_rope_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """HF rotates the two halves of each head ([x0..x(d/2-1)] with [x(d/2)..]); llama.cpp rotates
    adjacent pairs. Reorder each head's output rows 0, d/2, 1, d/2+1, ... so they line up."""
    rows, cols = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _llama3_rope_factors(cfg: ModelConfig) -> torch.Tensor:
    """Per-frequency divisors of Llama 3.1 RoPE scaling, as llama.cpp's `rope_freqs` tensor."""
    r = cfg.rope
    factors = []
    for i in range(0, cfg.head_dim, 2):
        wavelen = 2 * math.pi * r.theta ** (i / cfg.head_dim)
        if wavelen < r.original_max_position_embeddings / r.high_freq_factor:
            factors.append(1.0)
        elif wavelen > r.original_max_position_embeddings / r.low_freq_factor:
            factors.append(r.factor)
        else:
            smooth = (r.original_max_position_embeddings / wavelen - r.low_freq_factor) / (
                r.high_freq_factor - r.low_freq_factor
            )
            factors.append(1 / ((1 - smooth) / r.factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def _add_tokenizer(w: gguf.GGUFWriter, model_dir: Path, vocab_size: int) -> None:
    """A "gpt2" (byte-level BPE) vocabulary from tokenizer.json, padded to the model's vocab."""
    spec = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    for token, i in spec["model"]["vocab"].items():
        tokens[i], types[i] = token, gguf.TokenType.NORMAL
    for added in spec["added_tokens"]:
        kind = gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED
        tokens[added["id"]], types[added["id"]] = added["content"], kind
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("bos_token_id") is not None:
        w.add_bos_token_id(config["bos_token_id"])
        w.add_add_bos_token(True)
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    eos = spec_ids(spec).get(tok_config.get("eos_token"))
    if eos is not None:
        w.add_eos_token_id(eos)
    if tok_config.get("chat_template"):
        w.add_chat_template(tok_config["chat_template"])


def spec_ids(spec: dict) -> dict[str, int]:
    """Token -> id of a tokenizer.json, added tokens included."""
    ids = dict(spec["model"]["vocab"])
    ids.update({added["content"]: added["id"] for added in spec["added_tokens"]})
    return ids
