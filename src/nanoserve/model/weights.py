"""The model's weights, each described once: `LayerWeights` and `LlamaWeights` declare every
tensor as a field whose `Tensor` says where a checkpoint keeps it (Hugging Face and GGUF names; a
fused matrix lists its parts, stacked by rows), its shape in terms of the config, how tensor
parallelism cuts it and what it is (a matrix or an embedding, in floats or GGUF blocks; a norm; a
bias), and for a family's option (a bias, Qwen3's q/k norms, Gemma 3's extra norms) which
config flag makes it present (and which flag renames it, where a family names it otherwise).
The loader, the sharder, the GGUF reader and the one-call C step (whose struct layer_weights has
the same fields, an absent option a null pointer) iterate `LAYER` and `MODEL` rather than
spelling the order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import torch

from nanoserve.model.config import ModelConfig
from nanoserve.model.linear import Linear
from nanoserve.model.moe import Experts
from nanoserve.model.quantized import QuantLinear, Weight

Matrix = Linear | QuantLinear
# column: whole heads of each part's output rows; row: the matching input columns; vocab: a range
# of the vocabulary's rows; experts: a range of the experts (each rank's whole); replicated: whole
# on every rank (model/parallel.py).
Shard = Literal["column", "row", "vocab", "experts", "replicated"]
# matrix: multiplied by (a Linear; a QuantLinear when in GGUF blocks); embedding: rows looked up
# (floats or GGUF blocks, as they come); norm, bias: a vector, always floats (a bias is added to a
# matrix's product: a row-parallel one once, after the all-reduce); experts: one matrix per
# expert, stacked into one 3-D tensor (or one run of GGUF blocks, expert after expert), kept as
# model/moe.py's `Experts`; expert_bias: a vector per expert, stacked [experts, rows] (gpt-oss).
# An experts tensor's Hugging Face names hold "{e}", the expert's index: one name per expert in a
# checkpoint, the name without ".{e}" for the stacked tensor (GGUF's; gpt-oss's, which only
# stacked names have).
Kind = Literal["matrix", "embedding", "norm", "bias", "experts", "expert_bias"]
Shapes = Callable[[ModelConfig], list[tuple[int, ...]]]


@dataclass(frozen=True)
class Tensor:
    """Where one weight comes from and how it is kept."""

    hf: tuple[str, ...]  # Hugging Face names without the suffix (a layer's after "model.layers.N.")
    gguf: tuple[str, ...]  # llama.cpp's names of the same parts (a layer's after "blk.N.")
    shard: Shard
    kind: Kind
    # Each part's shape, checked at load; None: not checked (a vocabulary may be padded).
    parts: Shapes | None = None
    tied_to: str | None = None  # the field it is when the checkpoint has none and ties them
    suffix: str = "weight"  # of its names in both formats: "weight" or "bias"
    when: str | None = None  # the ModelConfig flag that makes it present; None: always present
    # (ModelConfig flag, Hugging Face names where it is set): a family that calls it otherwise.
    renamed: tuple[str, tuple[str, ...]] | None = None

    def present(self, config: ModelConfig) -> bool:
        return self.when is None or bool(getattr(config, self.when))

    def hf_names(self, config: ModelConfig) -> tuple[str, ...]:
        if self.renamed is not None and getattr(config, self.renamed[0]):
            return self.renamed[1]
        return self.hf

    def stacked_names(self, config: ModelConfig) -> tuple[str, ...]:
        """An experts tensor's names without the expert's index: the stacked tensor's."""
        return tuple(h.replace(".{e}", "") for h in self.hf_names(config))

    def rows(self, config: ModelConfig) -> list[int]:
        """Each part's rows: where a column-parallel cut takes its slice of every part."""
        assert self.parts is not None, "only a layer's tensors have shapes"
        return [shape[0] for shape in self.parts(config)]


def _tensor(**spec: Any) -> Any:
    """A field of a weights dataclass, described by `Tensor(**spec)`."""
    return field(metadata={"tensor": Tensor(**spec)})


def _optional(**spec: Any) -> Any:
    """A field for a tensor only some configs have (None where absent)."""
    return field(default=None, metadata={"tensor": Tensor(**spec)})


def _q(c: ModelConfig) -> int:
    return c.num_heads * c.head_dim


def _kv(c: ModelConfig) -> int:
    return c.num_kv_heads * c.head_dim


@dataclass
class LayerWeights:
    """A decoder layer's weights, in the order the loader lists them."""

    input_norm: torch.Tensor = _tensor(
        hf=("input_layernorm",), gguf=("attn_norm",), shard="replicated", kind="norm",
        parts=lambda c: [(c.hidden_size,)],
    )  # fmt: skip
    qkv: Matrix = _tensor(
        hf=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        gguf=("attn_q", "attn_k", "attn_v"), shard="column", kind="matrix",
        parts=lambda c: [(_q(c), c.hidden_size), (_kv(c), c.hidden_size), (_kv(c), c.hidden_size)],
    )  # fmt: skip
    o: Matrix = _tensor(
        hf=("self_attn.o_proj",), gguf=("attn_output",), shard="row", kind="matrix",
        parts=lambda c: [(c.hidden_size, _q(c))],
    )  # fmt: skip
    post_norm: torch.Tensor = _tensor(  # before the MLP (Gemma 3 names it so)
        hf=("post_attention_layernorm",), gguf=("ffn_norm",), shard="replicated", kind="norm",
        parts=lambda c: [(c.hidden_size,)],
        renamed=("sandwich_norms", ("pre_feedforward_layernorm",)),
    )  # fmt: skip
    # The dense MLP, or a mixture of experts in its place (ModelConfig.moe).
    gate_up: Matrix | None = _optional(
        hf=("mlp.gate_proj", "mlp.up_proj"), gguf=("ffn_gate", "ffn_up"), shard="column",
        kind="matrix", when="dense", parts=lambda c: [(c.intermediate_size, c.hidden_size)] * 2,
    )  # fmt: skip
    down: Matrix | None = _optional(
        hf=("mlp.down_proj",), gguf=("ffn_down",), shard="row", kind="matrix", when="dense",
        parts=lambda c: [(c.hidden_size, c.intermediate_size)],
    )  # fmt: skip
    router: Matrix | None = _optional(  # [experts, hidden]: each expert's score of a token
        hf=("mlp.gate",), gguf=("ffn_gate_inp",), shard="replicated", kind="matrix", when="moe",
        parts=lambda c: [(c.num_experts, c.hidden_size)],
        renamed=("mixtral_names", ("block_sparse_moe.gate",)),
    )  # fmt: skip
    experts_gate: Experts | None = _optional(
        hf=("mlp.experts.{e}.gate_proj",), gguf=("ffn_gate_exps",), shard="experts",
        kind="experts", when="moe", parts=lambda c: [(c.expert_size, c.hidden_size)],
        renamed=("mixtral_names", ("block_sparse_moe.experts.{e}.w1",)),
    )  # fmt: skip
    experts_up: Experts | None = _optional(
        hf=("mlp.experts.{e}.up_proj",), gguf=("ffn_up_exps",), shard="experts",
        kind="experts", when="moe", parts=lambda c: [(c.expert_size, c.hidden_size)],
        renamed=("mixtral_names", ("block_sparse_moe.experts.{e}.w3",)),
    )  # fmt: skip
    experts_down: Experts | None = _optional(
        hf=("mlp.experts.{e}.down_proj",), gguf=("ffn_down_exps",), shard="experts",
        kind="experts", when="moe", parts=lambda c: [(c.hidden_size, c.expert_size)],
        renamed=("mixtral_names", ("block_sparse_moe.experts.{e}.w2",)),
    )  # fmt: skip
    # gpt-oss's (model/gpt_oss.py: its checkpoint's tensors under these names): a bias of the
    # router and of each expert's projections (stacked [experts, rows]), and attention sinks.
    router_bias: torch.Tensor | None = _optional(
        hf=("mlp.gate",), gguf=("ffn_gate_inp",), shard="replicated", kind="bias",
        suffix="bias", when="gpt_oss", parts=lambda c: [(c.num_experts,)],
    )  # fmt: skip
    experts_gate_bias: torch.Tensor | None = _optional(
        hf=("mlp.experts.{e}.gate_proj",), gguf=("ffn_gate_exps",), shard="experts",
        kind="expert_bias", suffix="bias", when="gpt_oss", parts=lambda c: [(c.expert_size,)],
    )  # fmt: skip
    experts_up_bias: torch.Tensor | None = _optional(
        hf=("mlp.experts.{e}.up_proj",), gguf=("ffn_up_exps",), shard="experts",
        kind="expert_bias", suffix="bias", when="gpt_oss", parts=lambda c: [(c.expert_size,)],
    )  # fmt: skip
    experts_down_bias: torch.Tensor | None = _optional(
        hf=("mlp.experts.{e}.down_proj",), gguf=("ffn_down_exps",), shard="experts",
        kind="expert_bias", suffix="bias", when="gpt_oss", parts=lambda c: [(c.hidden_size,)],
    )  # fmt: skip
    sinks: torch.Tensor | None = _optional(  # [heads]: each head's logit in its softmax's sum
        hf=("self_attn.sinks",), gguf=("attn_sinks",), shard="column", kind="bias",
        when="gpt_oss", parts=lambda c: [(c.num_heads,)],
    )  # fmt: skip
    # A family's options, None where its config leaves them out.
    qkv_bias: torch.Tensor | None = _optional(
        hf=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        gguf=("attn_q", "attn_k", "attn_v"), shard="column", kind="bias", suffix="bias",
        when="qkv_bias", parts=lambda c: [(_q(c),), (_kv(c),), (_kv(c),)],
    )  # fmt: skip
    o_bias: torch.Tensor | None = _optional(
        hf=("self_attn.o_proj",), gguf=("attn_output",), shard="replicated", kind="bias",
        suffix="bias", when="o_bias", parts=lambda c: [(c.hidden_size,)],
    )  # fmt: skip
    gate_up_bias: torch.Tensor | None = _optional(
        hf=("mlp.gate_proj", "mlp.up_proj"), gguf=("ffn_gate", "ffn_up"), shard="column",
        kind="bias", suffix="bias", when="mlp_bias",
        parts=lambda c: [(c.intermediate_size,)] * 2,
    )  # fmt: skip
    down_bias: torch.Tensor | None = _optional(
        hf=("mlp.down_proj",), gguf=("ffn_down",), shard="replicated", kind="bias",
        suffix="bias", when="mlp_bias", parts=lambda c: [(c.hidden_size,)],
    )  # fmt: skip
    q_norm: torch.Tensor | None = _optional(  # [head_dim]: the same for every head
        hf=("self_attn.q_norm",), gguf=("attn_q_norm",), shard="replicated", kind="norm",
        when="qk_norm", parts=lambda c: [(c.head_dim,)],
    )  # fmt: skip
    k_norm: torch.Tensor | None = _optional(
        hf=("self_attn.k_norm",), gguf=("attn_k_norm",), shard="replicated", kind="norm",
        when="qk_norm", parts=lambda c: [(c.head_dim,)],
    )  # fmt: skip
    attn_out_norm: torch.Tensor | None = _optional(  # of the attention's output (Gemma 3)
        hf=("post_attention_layernorm",), gguf=("post_attention_norm",), shard="replicated",
        kind="norm", when="sandwich_norms", parts=lambda c: [(c.hidden_size,)],
    )  # fmt: skip
    mlp_out_norm: torch.Tensor | None = _optional(  # of the MLP's output (Gemma 3)
        hf=("post_feedforward_layernorm",), gguf=("post_ffw_norm",), shard="replicated",
        kind="norm", when="sandwich_norms", parts=lambda c: [(c.hidden_size,)],
    )  # fmt: skip


@dataclass
class LlamaWeights:
    """The whole model's: its own tensors, then its layers'."""

    embed: Weight = _tensor(  # [vocab, hidden], floats or GGUF blocks
        hf=("model.embed_tokens",), gguf=("token_embd",), shard="vocab", kind="embedding"
    )
    lm_head: Matrix = _tensor(  # the embedding itself when tied
        hf=("lm_head",), gguf=("output",), shard="vocab", kind="matrix", tied_to="embed"
    )
    norm: torch.Tensor = _tensor(
        hf=("model.norm",), gguf=("output_norm",), shard="replicated", kind="norm",
        parts=lambda c: [(c.hidden_size,)],
    )  # fmt: skip
    layers: list[LayerWeights] = field(default_factory=list)


def _described(cls: type) -> tuple[tuple[str, Tensor], ...]:
    return tuple((f.name, f.metadata["tensor"]) for f in fields(cls) if "tensor" in f.metadata)


PER_EXPERT = ("experts", "expert_bias")  # the kinds with a tensor per expert
LAYER = _described(LayerWeights)  # (field, Tensor) of a layer's tensors, in order
MODEL = _described(LlamaWeights)  # (field, Tensor) of the model's own, in order


def listed(config: ModelConfig) -> list[tuple[str, str, Tensor]]:
    """(checkpoint name prefix, field, Tensor) of every tensor the config's model has, in the
    loader's order: MODEL's, then LAYER's of each layer (prefix "model.layers.N.")."""
    out = [("", name, t) for name, t in MODEL]
    layer = [(name, t) for name, t in LAYER if t.present(config)]
    for i in range(config.num_layers):
        out += [(f"model.layers.{i}.", name, t) for name, t in layer]
    return out


def names(prefix: str, t: Tensor, config: ModelConfig) -> list[str]:
    """The Hugging Face names of a tensor's parts, e.g. model.layers.0.self_attn.q_proj.bias; an
    experts tensor's, one per expert (model.layers.0.mlp.experts.3.up_proj.weight), or the
    stacked one (gpt-oss's)."""
    if t.kind in PER_EXPERT and config.gpt_oss:
        return [f"{prefix}{part}.{t.suffix}" for part in t.stacked_names(config)]
    if t.kind in PER_EXPERT:
        return [f"{prefix}{part.format(e=e)}.{t.suffix}"
                for part in t.hf_names(config) for e in range(config.num_experts)]  # fmt: skip
    return [f"{prefix}{part}.{t.suffix}" for part in t.hf_names(config)]


def part_shapes(t: Tensor, config: ModelConfig) -> list[tuple[int, ...]]:
    """The shape of each name `names` gives (an experts tensor's: each expert's matrix)."""
    assert t.parts is not None, "only a layer's tensors have shapes"
    if t.kind in PER_EXPERT and config.gpt_oss:
        return [(config.num_experts, *shape) for shape in t.parts(config)]
    return t.parts(config) * (config.num_experts if t.kind in PER_EXPERT else 1)


def matrices(layer: LayerWeights) -> list[Matrix]:
    """A layer's matrices (the dense ones: not its experts), in order."""
    return [getattr(layer, name) for name, t in LAYER
            if t.kind == "matrix" and getattr(layer, name) is not None]  # fmt: skip
