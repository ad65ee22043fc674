"""The Llama forward pass (Llama 3.x: RMSNorm, RoPE with llama3 scaling, GQA, SwiGLU) over packed
tokens of many sequences and the paged KV cache, as straight-line tensor code in four pieces that
the runner composes: `embed`, the decoder `layers`, the final `norm` and the `logits` (the CPU's
one-call decode step can stand in for the layers). Weights come fused and packed from the loader;
RMSNorm and RoPE are nanoserve.kernels calls (one C call each on the CPU). Under tensor parallelism
each rank runs its own heads and vocabulary slice, with the collectives of model/parallel.py.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from nanoserve.kernels import rms_norm, rope_
from nanoserve.model.attention import AttentionMetadata, attention
from nanoserve.model.config import ModelConfig, RopeConfig
from nanoserve.model.loader import LlamaWeights
from nanoserve.model.parallel import SINGLE, Parallel
from nanoserve.model.quantized import QuantizedWeight, embed_rows

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class Llama:
    def __init__(
        self,
        config: ModelConfig,
        weights: LlamaWeights,
        max_positions: int,
        parallel: Parallel = SINGLE,
    ) -> None:
        """`weights`: this rank's slices (model/parallel.py) when `parallel.size` > 1."""
        self.config = config
        self.weights = weights
        self.parallel = parallel
        self.num_heads = config.num_heads // parallel.size  # this rank's
        self.num_kv_heads = config.num_kv_heads // parallel.size
        device, dtype = weights.norm.device, weights.norm.dtype
        cos, sin = rope_cos_sin(config.rope, config.head_dim, max_positions)
        self.cos, self.sin = cos.to(device, dtype), sin.to(device, dtype)
        self.scale = 1.0 / math.sqrt(config.head_dim)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings [len(ids), hidden]: a fresh tensor the layers may update."""
        table = self.weights.embed
        if isinstance(table, QuantizedWeight):  # one process (blocks are not sharded)
            return embed_rows(table, ids)
        return self.parallel.embed(table, ids)

    def layers(
        self, h: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Every decoder layer over h [num_tokens, hidden]: new keys and values go into their
        cache slots; returns the hidden states after the last layer."""
        c, heads, kv_heads, reduce = self.config, self.num_heads, self.num_kv_heads, self.parallel
        q_size, kv_size = heads * c.head_dim, kv_heads * c.head_dim
        eps = c.rms_norm_eps
        for layer, (k_cache, v_cache) in zip(self.weights.layers, kv_caches, strict=True):
            qkv = layer.qkv(rms_norm(h, layer.input_norm, eps))
            rope_(qkv, heads + kv_heads, positions, self.cos, self.sin)
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = q.reshape(-1, heads, c.head_dim).contiguous()
            k = k.reshape(-1, kv_heads, c.head_dim).contiguous()
            v = v.reshape(-1, kv_heads, c.head_dim).contiguous()
            a = attention(q, k, v, k_cache, v_cache, meta, self.scale)
            # o and down are row-parallel: each rank's product is a partial sum of the whole.
            h = h + reduce.all_reduce(layer.o(a.view(-1, q_size)))
            gate, up = layer.gate_up(rms_norm(h, layer.post_norm, eps)).chunk(2, dim=-1)
            h = h + reduce.all_reduce(layer.down(F.silu(gate) * up))
        return h

    def norm(self, h: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm of hidden states (the rows whose logits are wanted)."""
        return rms_norm(h, self.weights.norm, self.config.rms_norm_eps)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] float32. Under tensor parallelism a collective: every rank must call it
        with the same number of rows, and only rank 0 gets the whole vocabulary."""
        local = self.weights.lm_head(h)
        return self.parallel.gather_logits(local, self.config.vocab_size).float()


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.freq_factors is not None:
        return inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float32)
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
