"""The Triton backend: split-KV ("flash decoding") paged-attention decode, and the KV-cache store.

Stage 1 runs one program per (sequence, KV head, split of TOKENS_PER_SPLIT tokens): the split's
attention for all query heads of that KV head, written as a normalised partial output plus its
log-sum-exp. Stage 2 merges a sequence's splits in order. A sliding window (window > 0) masks the
tokens before position context_len - window; splits wholly before it write nothing, and the merge
starts at the first split the window reaches. The split size is a constant, so the work
a sequence gets, and so its result, does not depend on the batch or on the GPU (batch invariance).
On CPU tensors the kernels run only in Triton's interpreter, which TRITON_INTERPRET=1 must switch on
before triton is first imported (triton.language's own helpers are jitted at import).
"""

import torch
import triton
import triton.language as tl

# Tokens of one sequence handled by one stage-1 program. A constant (not derived from the batch or
# the number of SMs) so a sequence is split the same way in every batch.
TOKENS_PER_SPLIT = 256
BLOCK_N = 64  # tokens per inner tile; tokens are gathered through the block table one by one
NUM_WARPS = 4
# Pipeline stages: the sweep's choice (bench_kernels --sweep; README, kernels_cuda_sweep.json).
NUM_STAGES = 2
# Whether triton was imported in interpreter mode: the only way these kernels run on CPU tensors.
INTERPRETED = not isinstance(tl.zeros, triton.runtime.JITFunction)


@triton.jit
def _cache_rows(
    tables, tok, t_mask, kv_head, stride_k_block, stride_k_head, stride_k_tok, block_size
):
    """Offsets in the cache of the rows of tokens tok (where t_mask) of KV head kv_head, through
    tables, the sequence's row of the block table."""
    block = tl.load(tables + tok // block_size, mask=t_mask, other=0)
    return (
        block.to(tl.int64) * stride_k_block
        + kv_head * stride_k_head
        + (tok % block_size) * stride_k_tok
    )


@triton.jit
def _attend_tile(
    q,
    k_ptr,
    v_ptr,
    row,
    d,
    d_mask,
    t_mask,
    qk_scale,
    m,
    l_sum,
    acc,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One tile of keys and values (cache rows row, where t_mask) folded into the online softmax
    of the query group q [GROUP_PAD, BLOCK_D]: returns the new running max m, sum l_sum and
    unnormalised output acc, all in base 2. Masked tokens add nothing."""
    k_mask = t_mask[None, :] & d_mask[:, None]
    k = tl.load(k_ptr + row[None, :] + d[:, None], mask=k_mask, other=0.0).to(DOT_DTYPE)
    s = tl.dot(q, k, input_precision=PRECISION) * qk_scale  # [GROUP_PAD, BLOCK_N]
    s = tl.where(t_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    # Every token so far masked (before a sliding window): a finite shift keeps exp2 off -inf
    # minus -inf; where m_new is finite it is m_new itself.
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - shift)
    p = tl.exp2(s - shift[:, None])
    l_sum = l_sum * alpha + tl.sum(p, 1)
    v_mask = t_mask[:, None] & d_mask[None, :]
    v = tl.load(v_ptr + row[:, None] + d[None, :], mask=v_mask, other=0.0).to(DOT_DTYPE)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
    return m_new, l_sum, acc


# One program: the query heads of one KV head of one sequence over one split of its tokens. The
# tile loop has a constant trip count, not range(start, end): Triton 3.6's interpreter cannot take
# tensor loop bounds with NumPy >= 2.4. Tiles past the end are fully masked: no memory traffic, no
# effect. A split with no token to attend to (past the end of its sequence, or wholly before its
# window) returns at once and writes nothing: the grid comes from the table's width, which CUDA
# graphs fix at the longest context, so most programs of a decode step are such splits.
@triton.jit
def _partial_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    stride_q_seq,
    stride_q_head,
    stride_k_block,
    stride_k_head,
    stride_k_tok,
    stride_table_seq,
    stride_po_seq,
    stride_po_head,
    stride_po_split,
    stride_pl_seq,
    stride_pl_head,
    head_dim,
    block_size,
    window,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(lens_ptr + seq)
    first = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)  # the window's first token
    start = split * SPLIT
    end = tl.minimum(start + SPLIT, ctx)
    if (start >= ctx) | (end <= first):
        return
    g, d = tl.arange(0, GROUP_PAD), tl.arange(0, BLOCK_D)
    g_mask, d_mask = g < GROUP, d < head_dim
    q_head = kv_head * GROUP + g
    q_off = seq * stride_q_seq + q_head[:, None] * stride_q_head + d[None, :]
    q = tl.load(q_ptr + q_off, mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(DOT_DTYPE)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    tables = table_ptr + seq * stride_table_seq
    for tile in range(SPLIT // BLOCK_N):
        tok = start + tile * BLOCK_N + tl.arange(0, BLOCK_N)
        t_mask = (tok < end) & (tok >= first)
        row = _cache_rows(
            tables, tok, t_mask, kv_head, stride_k_block, stride_k_head, stride_k_tok, block_size
        )
        m, l_sum, acc = _attend_tile(
            q, k_ptr, v_ptr, row, d, d_mask, t_mask, qk_scale, m, l_sum, acc, DOT_DTYPE, PRECISION
        )

    live = (start < ctx) & (end > first)
    po_off = seq * stride_po_seq + q_head[:, None] * stride_po_head + split * stride_po_split
    po_mask = live & g_mask[:, None] & d_mask[None, :]
    tl.store(part_out_ptr + po_off + d[None, :], acc / l_sum[:, None], mask=po_mask)
    pl_off = seq * stride_pl_seq + q_head * stride_pl_head + split
    tl.store(part_lse_ptr + pl_off, m + tl.log2(l_sum), mask=live & g_mask)


@triton.jit
def _merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    lens_ptr,
    stride_po_seq,
    stride_po_head,
    stride_po_split,
    stride_pl_seq,
    stride_pl_head,
    stride_o_seq,
    stride_o_head,
    head_dim,
    window,
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    ctx = tl.load(lens_ptr + seq)
    num_splits = tl.cdiv(ctx, SPLIT)
    first = tl.where(window > 0, tl.maximum(ctx - window, 0), 0) // SPLIT  # its first split
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    po = part_out_ptr + seq * stride_po_seq + head * stride_po_head
    pl = part_lse_ptr + seq * stride_pl_seq + head * stride_pl_head

    # Splits are merged one after the other, in order: a fixed sequence of roundings. The loop runs
    # to the batch's MAX_SPLITS (a constant trip count, see _partial_kernel); iterations past this
    # sequence's own splits leave everything untouched, so the result does not depend on the batch.
    m = tl.load(pl + first)
    acc = tl.load(po + first * stride_po_split + d, mask=d_mask, other=0.0)
    total = tl.full([], 1.0, tl.float32)
    for i in range(1, MAX_SPLITS):
        split = first + i
        live = split < num_splits
        lse = tl.load(pl + split, mask=live, other=float("-inf"))
        part = tl.load(po + split * stride_po_split + d, mask=d_mask & live, other=0.0)
        m_new = tl.maximum(m, lse)
        a = tl.exp2(m - m_new)
        b = tl.exp2(lse - m_new)
        acc = tl.where(live, acc * a + part * b, acc)
        total = tl.where(live, total * a + b, total)
        m = m_new
    out = acc / total
    o_off = seq * stride_o_seq + head * stride_o_head + d
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_key_tok,
    stride_key_head,
    stride_c_block,
    stride_c_head,
    stride_c_tok,
    head_dim,
    block_size,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = (d < head_dim) & (slot >= 0)
    src = tok * stride_key_tok + head * stride_key_head + d
    block = slot // block_size
    dst = block * stride_c_block + head * stride_c_head + (slot % block_size) * stride_c_tok + d
    tl.store(k_cache_ptr + dst, tl.load(key_ptr + src, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(value_ptr + src, mask=mask), mask=mask)


def _dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """The operand type of tl.dot: the cache's, except bf16 in the interpreter, whose tl.dot
    (Triton 3.6) multiplies the raw bf16 bits; float32 there is exact for bf16 operands."""
    if dtype == torch.bfloat16:
        return tl.float32 if INTERPRETED else tl.bfloat16
    return tl.float16 if dtype == torch.float16 else tl.float32


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    window: int = 0,
    *,
    tokens_per_split: int = TOKENS_PER_SPLIT,
    block_n: int = BLOCK_N,
    num_warps: int = NUM_WARPS,
    num_stages: int = NUM_STAGES,
) -> None:
    """Writes the decode attention into out. Arguments are validated by the caller (api.py)."""
    num_seqs, num_q_heads, head_dim = q.shape
    if num_seqs == 0:
        return
    assert tokens_per_split % block_n == 0, "a split is a whole number of tiles"
    # Grid from the table's width, not from context_lens, so that no device sync is needed.
    max_splits = triton.cdiv(block_tables.shape[1] * k_cache.shape[2], tokens_per_split)
    part_out = torch.empty(
        (num_seqs, num_q_heads, max_splits, head_dim), dtype=torch.float32, device=q.device
    )
    part_lse = torch.empty(
        (num_seqs, num_q_heads, max_splits), dtype=torch.float32, device=q.device
    )
    block_d = max(16, triton.next_power_of_2(head_dim))
    _launch_partial(
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        scale,
        part_out,
        part_lse,
        window,
        block_d=block_d,
        tokens_per_split=tokens_per_split,
        block_n=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    _launch_merge(
        part_out, part_lse, out, context_lens, window, block_d=block_d,
        tokens_per_split=tokens_per_split,
    )  # fmt: skip


def _launch_partial(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    window: int,
    *,
    block_d: int,
    tokens_per_split: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
) -> None:
    """Stage 1: each split's normalised attention into part_out, its log-sum-exp into part_lse."""
    num_seqs, num_q_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    _partial_kernel[(num_seqs, num_kv_heads, part_out.shape[2])](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        part_out,
        part_lse,
        float(scale) * 1.4426950408889634,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        head_dim,
        block_size,
        window,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),  # tl.dot needs 16 rows
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        SPLIT=tokens_per_split,
        DOT_DTYPE=_dot_dtype(q.dtype),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )


def _launch_merge(
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    out: torch.Tensor,
    context_lens: torch.Tensor,
    window: int,
    *,
    block_d: int,
    tokens_per_split: int,
) -> None:
    """Stage 2: each sequence's splits merged, in order, into out."""
    num_seqs, num_q_heads, max_splits, head_dim = part_out.shape
    _merge_kernel[(num_seqs, num_q_heads)](
        part_out,
        part_lse,
        out,
        context_lens,
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        head_dim,
        window,
        BLOCK_D=block_d,
        SPLIT=tokens_per_split,
        MAX_SPLITS=triton.next_power_of_2(max_splits),  # few distinct values: few compilations
        num_warps=1 if block_d <= 128 else 2,
    )


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes each token's key and value rows into its slot; negative slots are skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens, num_kv_heads)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        head_dim,
        k_cache.shape[2],
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=1,
    )
