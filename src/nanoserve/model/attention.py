"""Attention over the paged KV cache.

A forward step packs decode tokens (one per sequence) first, then prefill chunks. New keys and
values are written to their cache slots; decode attention goes through the paged kernel API
(`nanoserve.kernels`), and so does prefill attention on the CPU (the C kernel, tiled over the
cache); elsewhere (CUDA, or the C kernels switched off) prefill takes torch SDPA over the
sequence's gathered blocks (a q8_0 cache's de-quantized by the kernels' reference).
A sliding-window layer (window w > 0) lets the token at position i see positions (i - w, i], as
transformers' sliding-window mask has it.
Owns nothing: `AttentionMetadata` is built fresh for every step (by the engine's input packer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanoserve.kernels import (
    KV_Q8_0,
    c_backend,
    paged_attention_decode,
    paged_attention_prefill,
    q8_0_dequantize,
    q8_0_quantize,
    store_kv,
)


@dataclass(frozen=True)
class PrefillChunk:
    """One sequence's new tokens in a step: rows [start, start + length) of the packed batch."""

    start: int
    length: int
    context_len: int  # tokens attended to by the chunk's last token (cached + new)
    block_table: torch.Tensor  # [blocks holding context_len tokens] int32


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    num_decode: int  # the first num_decode tokens are single-token decodes
    decode_block_tables: torch.Tensor  # [num_decode, max_blocks] int32, zero padded
    decode_context_lens: torch.Tensor  # [num_decode] int32
    prefills: tuple[PrefillChunk, ...]
    backend: str = "auto"


def attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim], any KV dtype
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,  # [num_heads] float32: gpt-oss's attention sinks
) -> torch.Tensor:
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping, backend=_store_backend(meta.backend))
    out = torch.empty_like(q)
    n = meta.num_decode
    if n:
        paged_attention_decode(
            q[:n],
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_context_lens,
            scale,
            out=out[:n],
            backend=meta.backend,
            window=window,
            sinks=sinks,
        )
    c_prefill = q.device.type == "cpu" and meta.backend in ("auto", "c") and c_backend.enabled()
    for chunk in meta.prefills:
        rows = slice(chunk.start, chunk.start + chunk.length)
        # Reads the chunk's own rows back from the cache, as decode will. SDPA has no sinks:
        # elsewhere they take the kernels' torch reference.
        if c_prefill or sinks is not None:
            paged_attention_prefill(
                q[rows], k_cache, v_cache, chunk.block_table, chunk.context_len, scale,
                out=out[rows], backend="c" if c_prefill else "torch", window=window, sinks=sinks,
            )  # fmt: skip
        else:
            out[rows] = _prefill(q[rows], k[rows], v[rows], k_cache, v_cache, chunk, scale, window)
    return out


def _store_backend(backend: str) -> str:
    return backend if backend in ("auto", "torch") else "auto"


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: PrefillChunk,
    scale: float,
    window: int,
) -> torch.Tensor:
    cached = chunk.context_len - chunk.length
    if cached == 0:
        # Nothing before this chunk: attend to the fresh keys directly, no gather, rounded as
        # the cache holds them (what a later chunk or decode step reads).
        keys, values, mask = _as_cached(k, k_cache), _as_cached(v, v_cache), None
    else:
        keys = _widen(_gather(k_cache, chunk), q.dtype)
        values = _widen(_gather(v_cache, chunk), q.dtype)
    if cached or (window and chunk.length > window):
        rows = torch.arange(chunk.length, device=q.device).unsqueeze(1) + cached
        cols = torch.arange(chunk.context_len, device=q.device).unsqueeze(0)
        mask = cols <= rows
        if window:
            mask &= cols > rows - window
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),  # [num_heads, length, head_dim]
        keys,  # [num_kv_heads, context_len, head_dim]
        values,
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


def _as_cached(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Fresh keys or values [tokens, kv_heads, head_dim] as [kv_heads, tokens, head_dim], rounded
    to the cache's dtype (or quantized to q8_0) and back."""
    if cache.dtype == KV_Q8_0:
        x = q8_0_dequantize(q8_0_quantize(x)).to(x.dtype)
    elif cache.dtype != x.dtype:
        x = x.to(cache.dtype).to(x.dtype)
    return x.transpose(0, 1)


def _gather(cache: torch.Tensor, chunk: PrefillChunk) -> torch.Tensor:
    """A sequence's first context_len cached rows as [num_kv_heads, context_len, row width]."""
    blocks = cache[chunk.block_table.long()]  # [n, kv_heads, block_size, head_dim]
    rows = blocks.transpose(0, 1).reshape(cache.shape[1], -1, cache.shape[3])
    return rows[:, : chunk.context_len]


def _widen(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cached rows as dtype (a q8_0 cache's de-quantized)."""
    return (q8_0_dequantize(rows) if rows.dtype == KV_Q8_0 else rows).to(dtype)
