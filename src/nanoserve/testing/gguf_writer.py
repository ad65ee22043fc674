"""GGUF files written from Hugging Face checkpoints, as llama.cpp's converter writes them (a llama's
Q and K rows interleaved for its rotary layout, qwen2's and qwen3's kept; Llama 3.1 RoPE as a
`rope_freqs` tensor, a "gpt2" byte-level BPE vocabulary), in float32 or a quantized type. For
tests of the GGUF loader and for the llama.cpp column of the benchmarks.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

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
    pre: str = "gpt-2",
    mixed: dict[str, gguf.GGMLQuantizationType] | None = None,
) -> Path:
    """Write `model_dir` (a Hugging Face Llama, Qwen2 or Qwen3 checkpoint) to `out` as a GGUF
    file whose matrices are of `qtype` (norms and biases stay float32); `pre`: the pre-tokenizer
    it names; `mixed`: another type for the matrices whose GGUF name has a part of that name
    (e.g. {"ffn_down": Q5_0}), as llama.cpp's mixed quantizations (Q4_K_M) make."""
    cfg = ModelConfig.from_dir(model_dir)
    w = gguf.GGUFWriter(str(out), architecture)
    _add_hyperparameters(w, cfg)
    _add_tokenizer(w, model_dir, cfg.vocab_size, pre)
    tensors = _tensors(read_checkpoint(model_dir, torch.float32), cfg, architecture == "llama")
    for name, t in tensors.items():
        values = t.contiguous().numpy()
        own = next((q for part, q in (mixed or {}).items() if part in name.split(".")), qtype)
        if values.ndim == 2 and own != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, gguf.quants.quantize(values, own), raw_dtype=own)
        else:
            w.add_tensor(name, values)
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


def _tensors(
    hf: dict[str, torch.Tensor], cfg: ModelConfig, permute: bool
) -> dict[str, torch.Tensor]:
    """Hugging Face tensors under llama.cpp's names, Q and K rows (and biases) permuted where
    `permute`."""
    tensors = {
        "token_embd.weight": hf.pop("model.embed_tokens.weight"),
        "output_norm.weight": hf.pop("model.norm.weight"),
    }
    if not cfg.tie_word_embeddings:  # tied: llama.cpp reuses token_embd as the output head
        tensors["output.weight"] = hf.pop("lm_head.weight")
    if cfg.rope.rope_type == "llama3":
        tensors["rope_freqs.weight"] = _llama3_rope_factors(cfg)
    present = [t for _, t in LAYER if t.present(cfg)]
    for i in range(cfg.num_layers):
        for t in present:
            for hf_name, name in zip(t.hf, t.gguf, strict=True):
                w = hf.pop(f"model.layers.{i}.{hf_name}.{t.suffix}")
                heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}.get(name)
                if permute and heads:
                    w = _interleave_rope_rows(w, heads)
                tensors[f"blk.{i}.{name}.{t.suffix}"] = w
    if hf:
        raise ValueError(f"tensors left unconverted: {sorted(hf)}")
    return tensors


def _interleave_rope_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """HF rotates the two halves of each head ([x0..x(d/2-1)] with [x(d/2)..]); llama.cpp rotates
    adjacent pairs. Reorder each head's output rows 0, d/2, 1, d/2+1, ... so they line up."""
    rows = weight.shape[0]
    halves = weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
    return halves.transpose(1, 2).reshape(weight.shape)


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


def _add_tokenizer(w: gguf.GGUFWriter, model_dir: Path, vocab_size: int, pre: str) -> None:
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
    w.add_tokenizer_pre(pre)
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


def rewrite_gguf(source: Path, out: Path, changes: dict[str, Any]) -> Path:
    """`source` copied to `out` with the metadata `changes` (key -> value; a new key's type
    follows its Python value), its tensors as they are: a file the converter would not write,
    for the loader's refusals."""
    reader = gguf.GGUFReader(source)
    changes = dict(changes)
    w = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the header's own, and what the writer writes itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, changes.pop(key, field.contents()), kind, sub_type=sub)
    for key, value in changes.items():
        w.add_key_value(key, value, gguf.GGUFValueType.get_type(value))
    for t in reader.tensors:
        shape = [int(d) for d in reversed(t.shape)]
        w.add_tensor(t.name, t.data, raw_shape=shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
