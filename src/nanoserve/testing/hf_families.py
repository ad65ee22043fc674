"""Tiny random checkpoints of each family nanoserve runs (and of configs it refuses), written by
transformers itself (`save_pretrained`), with the demo's byte-level BPE tokenizer; and SmolLM2
as a float checkpoint (`smollm2_checkpoint`), for llama.cpp's converter and quantizer. Weights are
redrawn with the demo's gains (biases and norms too, which transformers initializes to 0 and 1)
so that greedy decoding depends on every tensor. For the family oracle tests.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import transformers

from nanoserve.default_model import default_model_path
from nanoserve.demo import write_checkpoint

CONFIGS = {
    "llama": transformers.LlamaConfig,
    "mistral": transformers.MistralConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
    "gemma3_text": transformers.Gemma3TextConfig,
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
            p.copy_(noise / math.sqrt(p.shape[1]))
        elif name.endswith(".bias"):
            p.copy_(0.1 * noise)
        elif "embed_tokens" in name or "lm_head" in name:
            p.copy_(noise)
        else:
            gain = next((g for key, g in GAINS.items() if key in name), 1.0)
            p.copy_(gain / math.sqrt(p.shape[1]) * noise)


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
