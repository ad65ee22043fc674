"""The torch backend: the readable reference (gather the blocks, softmax in float32).

Runs on any device torch supports; batched over sequences by padding to the longest context, so it
is a fair baseline for the benchmark rather than a Python loop.
"""

import torch
import torch.nn.functional as F


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    window: int = 0,
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

    # The cache (of q's dtype, or 16-bit under float32 q) and q are widened to float32; out's
    # copy_ rounds the result to q's dtype.
    def gather(cache: torch.Tensor) -> torch.Tensor:
        blocks = cache[tables]  # [seqs, blocks, kv_heads, block_size, head_dim]
        rows = blocks.transpose(1, 2).reshape(num_seqs, num_kv_heads, -1, head_dim)
        return rows[:, :, :max_ctx].float()  # [seqs, kv_heads, max_ctx, head_dim]

    k, v = gather(k_cache), gather(v_cache)
    group = num_q_heads // num_kv_heads
    qf = q.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = (qf @ k.transpose(-1, -2)) * scale  # [seqs, kv_heads, group, max_ctx]
    padding = torch.arange(max_ctx, device=q.device) >= lens[:, None]
    if window:  # positions before the window: the query is at lens - 1
        padding |= torch.arange(max_ctx, device=q.device) < lens[:, None] - window
    scores.masked_fill_(padding[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
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
) -> None:
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    blocks = block_table[: -(-context_len // block_size)].long()

    def gather(cache: torch.Tensor) -> torch.Tensor:  # [kv_heads, context_len, head_dim]
        rows = cache[blocks].transpose(0, 1).reshape(num_kv_heads, -1, head_dim)
        return rows[:, :context_len].float()

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
    probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
    out.copy_((probs @ v.unsqueeze(1)).permute(2, 0, 1, 3).reshape(out.shape))


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
    # float32 keys for a 16-bit cache are rounded to it here (the C store rounds alike).
    k_cache[blocks, :, offsets] = key[keep].to(k_cache.dtype)
    v_cache[blocks, :, offsets] = value[keep].to(v_cache.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    # In float32 then back, as the reference Llama does.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    torch.mul(weight, x32.to(x.dtype), out=out)


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
