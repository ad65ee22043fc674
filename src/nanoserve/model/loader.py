"""From a checkpoint's tensors to the forward pass's weights: fuses q/k/v and gate/up into one
matrix each, ties the output projection to the embedding where the checkpoint does, keeps this
rank's slices under tensor parallelism (model/parallel.py), and wraps every matrix in a `Linear`
(which packs it for the device's fastest matmul) or, for a matrix kept in GGUF blocks, a
`QuantLinear`. Where the weights live is the caller's choice (`place`). Also reads a Hugging Face
checkpoint's safetensors (single file or shards). Owns nothing after loading.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from nanoserve.model.config import CheckpointError, ModelConfig, read_json
from nanoserve.model.linear import Linear
from nanoserve.model.parallel import SINGLE, Parallel, shard
from nanoserve.model.quantized import QuantizedWeight, QuantLinear, Weight, cat_rows, placed

# Each layer's tensors in `fuse`'s flat list, in this order.
LAYER_TENSORS = ("input_norm", "qkv", "o", "post_norm", "gate_up", "down")


Matrix = Linear | QuantLinear


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Matrix  # [(heads + 2 * kv_heads) * head_dim, hidden]
    o: Matrix
    post_norm: torch.Tensor
    gate_up: Matrix  # [2 * intermediate, hidden]
    down: Matrix


@dataclass
class LlamaWeights:
    embed: Weight  # [vocab, hidden], floats or GGUF blocks
    norm: torch.Tensor
    lm_head: Matrix  # the embedding itself when tied
    layers: list[LayerWeights]


Placement = Callable[[list[torch.Tensor]], list[torch.Tensor]]


def load_weights(
    raw: dict[str, Weight],
    config: ModelConfig,
    place: Placement | None = None,
    parallel: Parallel = SINGLE,
) -> LlamaWeights:
    """The model's weights from its tensors under Hugging Face names (`raw` is emptied): fused,
    cut to this rank's slices, moved by `place` (copies of the tensors, in order; a tensor listed
    twice is the same copy twice), then packed."""
    tensors = shard(fuse(raw, config), config, parallel)
    if place is not None:
        tensors = placed(tensors, place)
    return pack(tensors, config.num_layers)


def read_checkpoint(
    path: str | Path, dtype: torch.dtype, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint under their Hugging Face names, cast to `dtype` on `device`."""
    weights: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(path):
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    weights[name] = f.get_tensor(name).to(device=device, dtype=dtype)
        except SafetensorError as e:  # a truncated or corrupt file
            raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None
    return weights


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory: a single file, or the shards its index
    names (FileNotFoundError naming the directory or the missing shard)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: weight_map is missing or empty")
        files = [path / str(name) for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"{file}: missing (named in {index.name})")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"{path}: no model.safetensors or model.safetensors.index.json "
        "(nanoserve loads Hugging Face checkpoints in safetensors format)"
    )


def fuse(weights: dict[str, Weight], config: ModelConfig) -> list[Weight]:
    """[embed, lm_head, norm, then LAYER_TENSORS of every layer], q/k/v and gate/up fused. Takes
    the tensors out of `weights` (emptied), so that the separate matrices are freed once fused."""
    lm_head = weights.pop("lm_head.weight", None)
    if lm_head is None and not config.tie_word_embeddings:
        raise ValueError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
    embed = weights.pop("model.embed_tokens.weight")
    tensors = [embed, embed if lm_head is None else lm_head, weights.pop("model.norm.weight")]
    for i in range(config.num_layers):
        p = f"model.layers.{i}."

        def take(name: str, p: str = p) -> Weight:
            return weights.pop(p + name)

        tensors += [
            take("input_layernorm.weight"),
            cat_rows([take(f"self_attn.{n}_proj.weight") for n in "qkv"]),
            take("self_attn.o_proj.weight"),
            take("post_attention_layernorm.weight"),
            cat_rows([take("mlp.gate_proj.weight"), take("mlp.up_proj.weight")]),
            take("mlp.down_proj.weight"),
        ]
    return tensors


def pack(tensors: list[Weight], num_layers: int) -> LlamaWeights:
    """The flat list from `fuse` as LlamaWeights, every matrix a Linear (or QuantLinear)."""
    embed, lm_head, norm, *rest = tensors
    layers = []
    for i in range(num_layers):
        t = dict(zip(LAYER_TENSORS, rest[i * 6 : (i + 1) * 6], strict=True))
        layers.append(
            LayerWeights(
                input_norm=_float(t["input_norm"]),
                qkv=matrix(t["qkv"]),
                o=matrix(t["o"]),
                post_norm=_float(t["post_norm"]),
                gate_up=matrix(t["gate_up"]),
                down=matrix(t["down"]),
            )
        )
    return LlamaWeights(embed=embed, norm=_float(norm), lm_head=matrix(lm_head), layers=layers)


def matrix(w: Weight) -> Matrix:
    return QuantLinear(w) if isinstance(w, QuantizedWeight) else Linear(w)


def _float(w: Weight) -> torch.Tensor:
    assert isinstance(w, torch.Tensor), "norms are never quantized"
    return w
