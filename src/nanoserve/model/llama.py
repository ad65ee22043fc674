"""The Llama forward pass (Llama 3.x: RMSNorm, RoPE with llama3 scaling, GQA, SwiGLU) over packed
tokens of many sequences and the paged KV cache. Owns the weights; q/k/v and gate/up projections
are fused at load time so each layer does four matmuls (model/linear.py picks how). RMSNorm and
RoPE come from nanoserve.kernels (one C call each on the CPU, torch elsewhere). A CPU decode step
of up to 4 sequences runs every layer in one C call instead (model/cpu_step.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanoserve import hugepages
from nanoserve.attention import AttentionMetadata, attention
from nanoserve.config import ModelConfig, RopeConfig
from nanoserve.kernels import rms_norm, rope_
from nanoserve.model.cpu_step import CpuDecodeStep
from nanoserve.model.linear import Linear


@dataclass
class Layer:
    input_norm: torch.Tensor
    qkv: Linear  # [(heads + 2 * kv_heads) * head_dim, hidden]
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear  # [2 * intermediate, hidden]
    down: Linear


class Llama:
    def __init__(
        self, config: ModelConfig, weights: dict[str, torch.Tensor], max_positions: int
    ) -> None:
        """Takes the tensors out of `weights` (the caller's dict is emptied), so that the separate
        q/k/v and gate/up matrices are freed once fused. The huge-page copy still briefly needs
        twice the weights' memory, and the oneDNN packed copies stay beside them (linear.py)."""
        self.config = config
        lm_head = weights.pop("lm_head.weight", None)
        if lm_head is None and not config.tie_word_embeddings:
            raise ValueError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
        embed = weights.pop("model.embed_tokens.weight")
        top = [embed, embed if lm_head is None else lm_head, weights.pop("model.norm.weight")]
        layers = [_layer_tensors(weights, i) for i in range(config.num_layers)]
        if embed.device.type == "cpu":  # every weight in one huge-page mapping
            flat = hugepages.pack(top + [t for layer in layers for t in layer.values()])
            top, rest = flat[:3], iter(flat[3:])
            layers = [{name: next(rest) for name in layer} for layer in layers]
        self.embed, self.norm = top[0], top[2]
        self.lm_head = Linear(top[1])
        self.layers = [_layer(t) for t in layers]
        cos, sin = rope_cos_sin(config.rope, config.head_dim, max_positions)
        self.cos = cos.to(device=embed.device, dtype=embed.dtype)
        self.sin = sin.to(device=embed.device, dtype=embed.dtype)
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self.c_step = CpuDecodeStep(self) if CpuDecodeStep.supported(self) else None

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # rows whose next-token logits are needed
    ) -> torch.Tensor:
        h = self.embed[input_ids]  # [num_tokens, hidden], a copy
        if self.c_step is not None and self.c_step.applies(positions, meta):
            self.c_step(h, positions, kv_caches, meta)  # every layer in one C call, h in place
        else:
            h = self._layers(h, positions, kv_caches, meta)
        h = rms_norm(h[logits_indices], self.norm, self.config.rms_norm_eps)
        return self.lm_head(h).float()  # [len(logits_indices), vocab]

    def _layers(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        c = self.config
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        eps = c.rms_norm_eps
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            qkv = layer.qkv(rms_norm(h, layer.input_norm, eps))
            rope_(qkv, c.num_heads + c.num_kv_heads, positions, self.cos, self.sin)
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = q.reshape(-1, c.num_heads, c.head_dim).contiguous()
            k = k.reshape(-1, c.num_kv_heads, c.head_dim).contiguous()
            v = v.reshape(-1, c.num_kv_heads, c.head_dim).contiguous()
            a = attention(q, k, v, k_cache, v_cache, meta, self.scale)
            h = h + layer.o(a.view(-1, q_size))
            gate, up = layer.gate_up(rms_norm(h, layer.post_norm, eps)).chunk(2, dim=-1)
            h = h + layer.down(F.silu(gate) * up)
        return h


def _layer(t: dict[str, torch.Tensor]) -> Layer:
    return Layer(
        input_norm=t["input_norm"],
        qkv=Linear(t["qkv"]),
        o=Linear(t["o"]),
        post_norm=t["post_norm"],
        gate_up=Linear(t["gate_up"]),
        down=Linear(t["down"]),
    )


def _layer_tensors(weights: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    """Layer i's weights under Layer's field names, q/k/v and gate/up concatenated."""
    p = f"model.layers.{i}."

    def w(name: str) -> torch.Tensor:
        return weights.pop(p + name)

    return dict(
        input_norm=w("input_layernorm.weight"),
        qkv=torch.cat([w(f"self_attn.{n}_proj.weight") for n in "qkv"]),
        o=w("self_attn.o_proj.weight"),
        post_norm=w("post_attention_layernorm.weight"),
        gate_up=torch.cat([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")]),
        down=w("mlp.down_proj.weight"),
    )


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type != "llama3":
        return inv_freq
    # Llama 3.1 frequency scaling: long wavelengths slowed by `factor`, short ones kept, a smooth
    # blend between the two bands.
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(
    rope: RopeConfig, head_dim: int, max_positions: int
) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = rope_inv_freq(rope, head_dim)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
    return emb.cos(), emb.sin()
