"""The Llama forward pass (Llama 3.x: RMSNorm, RoPE with llama3, linear or YaRN scaling, GQA,
SwiGLU) over packed tokens of many sequences and the paged KV cache, as straight-line tensor code
in four pieces that the runner composes: `embed`, the decoder `layers`, the final `norm` and the
`logits` (the CPU's one-call decode step can stand in for the layers). The other families are its
options, present where their weights are (model/weights.py): biases of q/k/v, o and the MLP
(Qwen2; Llama's attention_bias, mlp_bias), an RMSNorm of each q and k head (Qwen3), and Gemma 3's:
(1 + w) norms (folded at load, kept in float32), the embedding scaled by sqrt(hidden), GELU-tanh,
norms of the attention's and the MLP's outputs, its attention scale, softcapped logits, and
sliding-window layers with their own RoPE tables (the window passed to attention). Weights
come fused and packed from the loader; RMSNorm and RoPE are nanoserve.kernels calls (one C call
each on the CPU). Under tensor parallelism each rank runs its own heads and vocabulary slice,
with the collectives of model/parallel.py.
"""

from __future__ import annotations

import math

import torch

from nanoserve.kernels import c_backend, gated_mul, rms_norm, rope_
from nanoserve.model import gpt_oss
from nanoserve.model.attention import AttentionMetadata, attention
from nanoserve.model.config import ModelConfig, RopeConfig
from nanoserve.model.linear import Linear
from nanoserve.model.loader import LlamaWeights
from nanoserve.model.moe import sparse_moe
from nanoserve.model.parallel import SINGLE, Parallel
from nanoserve.model.quantized import QuantizedWeight, embed_rows
from nanoserve.model.weights import LayerWeights

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
        device, dtype = weights.norm.device, _activation_dtype(weights)
        cos, sin = rope_cos_sin(config.rope, config.head_dim, max_positions)
        self.cos, self.sin = cos.to(device, dtype), sin.to(device, dtype)
        # Each layer's (window, cos, sin): a windowed layer's tables from the local RoPE.
        self.local = (self.cos, self.sin)
        if config.layer_windows and config.local_rope is not None:
            cos, sin = rope_cos_sin(config.local_rope, config.head_dim, max_positions)
            self.local = (cos.to(device, dtype), sin.to(device, dtype))
        windows = config.layer_windows or (0,) * config.num_layers
        self.per_layer = [(w, *(self.local if w else (self.cos, self.sin))) for w in windows]
        self.scale = config.attn_scale or 1.0 / math.sqrt(config.head_dim)
        # gpt-oss's attention sinks in float32, as the kernels take them in any model dtype.
        self.sinks = [None if x.sinks is None else x.sinks.float() for x in weights.layers]
        # A float router (1 MiB) beside experts in blocks: up to the C step's rows through the
        # GEMV, as the C step multiplies it, so that those steps may take it (model/cpu_step.py).
        for x in weights.layers:
            if isinstance(x.router, Linear) and x.router.gemv:
                x.router.gemv_rows = c_backend.STEP_ROWS

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings [len(ids), hidden]: a fresh tensor the layers may update."""
        table = self.weights.embed
        if isinstance(table, QuantizedWeight):  # one process (blocks are not sharded)
            h = embed_rows(table, ids)
        else:
            h = self.parallel.embed(table, ids)
        if self.config.embed_scale:  # Gemma: the scale rounded to the model dtype first
            h.mul_(torch.tensor(self.config.hidden_size**0.5, dtype=h.dtype))
        return h

    def layers(
        self, h: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Every decoder layer over h [num_tokens, hidden]: new keys and values go into their
        cache slots; returns the hidden states after the last layer."""
        c, heads, kv_heads, reduce = self.config, self.num_heads, self.num_kv_heads, self.parallel
        q_size, kv_size = heads * c.head_dim, kv_heads * c.head_dim
        eps = c.rms_norm_eps
        layers = zip(self.weights.layers, kv_caches, self.per_layer, self.sinks, strict=True)
        for layer, (k_cache, v_cache), (window, cos, sin), sinks in layers:
            qkv = _biased(layer.qkv(_rms(h, layer.input_norm, eps)), layer.qkv_bias)
            if layer.q_norm is not None:
                _norm_heads(qkv, q_size, layer.q_norm, 0, eps)
                _norm_heads(qkv, kv_size, layer.k_norm, q_size, eps)
            rope_(qkv, heads + kv_heads, positions, cos, sin)
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = q.reshape(-1, heads, c.head_dim).contiguous()
            k = k.reshape(-1, kv_heads, c.head_dim).contiguous()
            v = v.reshape(-1, kv_heads, c.head_dim).contiguous()
            a = attention(q, k, v, k_cache, v_cache, meta, self.scale, window, sinks)
            # o and down are row-parallel: each rank's product is a partial sum of the whole.
            # A row-parallel bias is added once, to the sum.
            o = _biased(reduce.all_reduce(layer.o(a.view(-1, q_size))), layer.o_bias)
            h = h + _normed(o, layer.attn_out_norm, eps)
            down = self._mlp(layer, _rms(h, layer.post_norm, eps))
            h = h + _normed(down, layer.mlp_out_norm, eps)
        return h

    def _mlp(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        """The gated MLP of x, or the mixture of experts in its place (model/moe.py; under tensor
        parallelism each rank's experts' share, all-reduced)."""
        c = self.config
        if c.gpt_oss:
            return self.parallel.all_reduce(self._gpt_oss_moe(layer, x))
        if layer.router is not None:
            assert layer.experts_gate and layer.experts_up and layer.experts_down
            # Mixtral's routing weights stay float32 (transformers'; llama.cpp's too), a GGUF
            # Mixtral's (architecture llama, with experts) as well as a Hugging Face one's.
            mixtral = c.family in ("mixtral", "llama")
            return self.parallel.all_reduce(sparse_moe(
                x, layer.router, layer.experts_gate, layer.experts_up, layer.experts_down,
                c.experts_per_token, c.norm_topk_prob, weights_in_float32=mixtral,
            ))  # fmt: skip
        assert layer.gate_up is not None and layer.down is not None, "a dense layer has its MLP"
        gate_up = _biased(layer.gate_up(x), layer.gate_up_bias)
        gated = gated_mul(gate_up, c.activation)  # the one-call C step's bits on a CPU
        return _biased(self.parallel.all_reduce(layer.down(gated)), layer.down_bias)

    def _gpt_oss_moe(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        assert layer.router is not None and layer.experts_gate and layer.experts_up
        assert layer.experts_down and layer.router_bias is not None
        assert layer.experts_gate_bias is not None and layer.experts_up_bias is not None
        assert layer.experts_down_bias is not None
        logits = _biased(layer.router(x), layer.router_bias)
        projections = (layer.experts_gate, layer.experts_up, layer.experts_down)
        biases = (layer.experts_gate_bias, layer.experts_up_bias, layer.experts_down_bias)
        return gpt_oss.experts_moe(
            x, logits, projections, biases, c.experts_per_token, c.swiglu_alpha, c.swiglu_limit
        )

    def norm(self, h: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm of hidden states (the rows whose logits are wanted)."""
        return _rms(h, self.weights.norm, self.config.rms_norm_eps)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] float32. Under tensor parallelism a collective: every rank must call it
        with the same number of rows, and only rank 0 gets the whole vocabulary."""
        local = self.weights.lm_head(h)
        logits = self.parallel.gather_logits(local, self.config.vocab_size).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:  # in float32 (transformers caps in the model dtype)
            logits = torch.tanh(logits / cap) * cap
        return logits


def _activation_dtype(weights: LlamaWeights) -> torch.dtype:
    """The hidden states' dtype: the norms' (Gemma's norms are float32 in any model dtype, so
    then the first layer's q/k/v matrix's; float32 for one in GGUF blocks)."""
    w = weights.layers[0].qkv.weight if weights.layers else weights.norm
    return w.dtype if isinstance(w, torch.Tensor) else torch.float32


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm; a float32 weight of a lower-precision x (Gemma's 1 + w) as transformers' Gemma
    computes it: all in float32, rounded once at the end."""
    if weight.dtype == x.dtype:
        return rms_norm(x, weight, eps)
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def _normed(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return x if weight is None else _rms(x, weight, eps)


def _biased(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x if bias is None else x.add_(bias)


def _norm_heads(
    qkv: torch.Tensor, width: int, weight: torch.Tensor | None, start: int, eps: float
) -> None:
    """RMSNorm, in place, of each head of columns [start, start + width) of qkv (Qwen3's q_norm and
    k_norm: one weight [head_dim] for every head)."""
    assert weight is not None, "q_norm and k_norm come together"
    part = qkv[:, start : start + width]
    normed = _rms(part.reshape(-1, weight.shape[0]).contiguous(), weight, eps)
    part.copy_(normed.view(part.shape))


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.freq_factors is not None:
        return inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float32)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, rope.theta**exponents, head_dim)
    if rope.rope_type != "llama3":
        return inv_freq
    # Llama 3.1 frequency scaling: long powers slowed by `factor`, short ones kept, a smooth
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


def _yarn_inv_freq(rope: RopeConfig, powers: torch.Tensor, head_dim: int) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are
    divided by `factor` (interpolated), those that turn more than beta_fast times kept, a linear
    ramp over the dimensions between (as transformers computes it)."""

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times
        turns = rope.original_max_position_embeddings / (rotations * 2 * math.pi)
        return head_dim * math.log(turns) / (2 * math.log(rope.theta))

    low, high = dim_of(rope.beta_fast), dim_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp
    return 1.0 / (rope.factor * powers) * (1 - kept) + 1.0 / powers * kept


def rope_cos_sin(
    rope: RopeConfig, head_dim: int, max_positions: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[max_positions, head_dim] float32 tables (YaRN's attention factor applied to both)."""
    inv_freq = rope_inv_freq(rope, head_dim)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
    if rope.rope_type == "yarn":
        return emb.cos() * rope.attention_factor, emb.sin() * rope.attention_factor
    return emb.cos(), emb.sin()
