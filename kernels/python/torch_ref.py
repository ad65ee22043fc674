"""The torch backend: the readable reference (gather the blocks, softmax in float32).

Runs on any device torch supports; batched over sequences by padding to the longest context, so it
is a fair baseline for the benchmark rather than a Python loop. A q8_0 cache (uint8 rows of
llama.cpp's Q8_0 blocks) is quantized as stored and widened as read, by the reference of its format
(q8_0_quantize, q8_0_dequantize), which the C store and loads match bit for bit.
"""

import torch
import torch.nn.functional as F

# A q8_0 cache row: head_dim / 32 blocks of an fp16 scale d and 32 int8 values q (value q d).
Q8_0_VALUES, Q8_0_BYTES = 32, 34
KV_Q8_0 = torch.uint8  # the dtype of a q8_0 cache's tensors, whose last axis is bytes


def q8_0_quantize(x: torch.Tensor) -> torch.Tensor:
    """[..., n] floats (n a multiple of 32) as q8_0 rows [..., n / 32 * 34] uint8, as ggml's
    quantize_row_q8_0_ref: per block of 32, d = max|x| / 127 (stored as fp16) and q = x * (1 / d)
    (d before its fp16 rounding) rounded halves away from zero; d = 0 gives q = 0."""
    blocks = x.float().unflatten(-1, (-1, Q8_0_VALUES))
    d = blocks.abs().amax(-1, keepdim=True) / 127
    scaled = blocks * torch.where(d != 0, 1.0 / d, 0.0)
    # roundf's halves away from zero: torch.round takes them to even.
    whole = scaled.trunc()
    q = torch.where((scaled - whole).abs() == 0.5, whole + scaled.sign(), scaled.round())
    scale_bytes = d.to(torch.float16).view(torch.uint8)  # [..., blocks, 2]
    return torch.cat([scale_bytes, q.to(torch.int8).view(torch.uint8)], -1).flatten(-2)


def q8_0_dequantize(rows: torch.Tensor) -> torch.Tensor:
    """q8_0 rows [..., n / 32 * 34] uint8 as float32 [..., n]: q d, exactly as the C loads."""
    blocks = rows.unflatten(-1, (-1, Q8_0_BYTES))
    d = blocks[..., :2].contiguous().view(torch.float16).float()  # [..., blocks, 1]
    q = blocks[..., 2:].contiguous().view(torch.int8).float()
    return (q * d).flatten(-2)


def widen(rows: torch.Tensor) -> torch.Tensor:
    """Cache rows as float32: a float cache's converted, a q8_0 cache's de-quantized."""
    return q8_0_dequantize(rows) if rows.dtype == KV_Q8_0 else rows.float()


def as_cached(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Keys or values [..., head_dim] as a cache of cache_dtype stores them (floats rounded to
    nearest even, as .to(); q8_0 quantized)."""
    return q8_0_quantize(x) if cache_dtype == KV_Q8_0 else x.to(cache_dtype)


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> None:
    num_seqs, num_q_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    if num_seqs == 0:
        return
    lens = context_lens.long()
    max_ctx = int(lens.max())
    num_blocks = -(-max_ctx // block_size)
    # Entries past a sequence's own blocks are padding: point them at block 0 and mask the tokens.
    used = torch.arange(num_blocks, device=q.device) * block_size < lens[:, None]
    tables = torch.where(used, block_tables[:, :num_blocks].long(), 0)

    # The cache (of q's dtype, or 16-bit or q8_0 under float32 q) and q are widened to float32;
    # out's copy_ rounds the result to q's dtype.
    def gather(cache: torch.Tensor) -> torch.Tensor:
        blocks = cache[tables]  # [seqs, blocks, kv_heads, block_size, row width]
        rows = blocks.transpose(1, 2).reshape(num_seqs, num_kv_heads, -1, cache.shape[3])
        return widen(rows[:, :, :max_ctx])  # [seqs, kv_heads, max_ctx, head_dim]

    k, v = gather(k_cache), gather(v_cache)
    group = num_q_heads // num_kv_heads
    qf = q.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = (qf @ k.transpose(-1, -2)) * scale  # [seqs, kv_heads, group, max_ctx]
    padding = torch.arange(max_ctx, device=q.device) >= lens[:, None]
    if window:  # positions before the window: the query is at lens - 1
        padding |= torch.arange(max_ctx, device=q.device) < lens[:, None] - window
    scores.masked_fill_(padding[:, None, None, :], float("-inf"))
    sink = None if sinks is None else sinks.view(1, num_kv_heads, group, 1)
    probs = softmax_with_sinks(scores, sink)
    # The slots past a sequence's length were never written (the cache is uninitialized memory):
    # a NaN there times its zero probability would still be NaN.
    v.masked_fill_(padding[:, None, :, None], 0.0)
    out.copy_((probs @ v).view(num_seqs, num_q_heads, head_dim))


def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
    out: torch.Tensor,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> None:
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    blocks = block_table[: -(-context_len // block_size)].long()

    def gather(cache: torch.Tensor) -> torch.Tensor:  # [kv_heads, context_len, head_dim]
        rows = cache[blocks].transpose(0, 1).reshape(num_kv_heads, -1, cache.shape[3])
        return widen(rows[:, :context_len])

    k, v = gather(k_cache), gather(v_cache)
    group = num_q_heads // num_kv_heads
    # [kv_heads, group, tokens, head_dim]: the query heads that share a KV head, side by side.
    qf = q.float().view(num_tokens, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    scores = (qf @ k.unsqueeze(1).transpose(-1, -2)) * scale  # [kv_heads, group, tokens, ctx]
    rows = torch.arange(num_tokens, device=q.device).unsqueeze(1) + context_len - num_tokens
    cols = torch.arange(context_len, device=q.device).unsqueeze(0)
    hidden = cols > rows
    if window:
        hidden |= cols <= rows - window
    sink = None if sinks is None else sinks.view(num_kv_heads, group, 1, 1)
    probs = softmax_with_sinks(scores.masked_fill(hidden, float("-inf")), sink)
    out.copy_((probs @ v.unsqueeze(1)).permute(2, 0, 1, 3).reshape(out.shape))


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """The softmax over the last dimension, with each row's sink logit (broadcast to a column)
    in the denominator and no value of its own, as transformers' gpt-oss computes it."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    column = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    block_size = k_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    # Advanced indices around a slice: the indexed view is [tokens, kv_heads, head_dim], like key.
    # float32 keys for a 16-bit cache are rounded to it here, for a q8_0 one quantized (the C
    # store rounds alike).
    k_cache[blocks, :, offsets] = as_cached(key[keep], k_cache.dtype)
    v_cache[blocks, :, offsets] = as_cached(value[keep], v_cache.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    # In float32 then back, as the reference Llama does.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    torch.mul(weight, x32.to(x.dtype), out=out)


def route_experts(
    logits: torch.Tensor, top_k: int, normalize: bool, among_chosen: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    if among_chosen:
        top, experts = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=torch.float32), experts
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def gated_mul(gate_up: torch.Tensor, out: torch.Tensor, gelu: bool) -> None:
    gate, up = gate_up.chunk(2, dim=-1)
    f = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
    torch.mul(f, up, out=out)


def rope_(
    qk: torch.Tensor, heads: int, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    head_dim = cos.shape[1]
    x = qk[:, : heads * head_dim].unflatten(1, (heads, head_dim))
    half = head_dim // 2
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    x.copy_(x * c + rotated * s)
