"""The C backend: hands data pointers, sizes and a dtype code to the compiled module _C, each
argument by name.

_C is built from the files in kernels/csrc/ by `pip install` (setup.py), which fails if it cannot
build it. A source tree that was never built has no _C: every CPU kernel call then raises
BackendUnavailableError with BUILD_HINT, never falling back to slower code in silence.
"""

import torch

from .errors import BackendUnavailableError

try:
    from . import _C  # type: ignore[attr-defined]  # the compiled module
except ImportError as e:
    _C = None
    _IMPORT_ERROR = str(e)
else:
    _IMPORT_ERROR = ""

BUILD_HINT = (
    f"the C kernels nanoserve.kernels._C are not built ({_IMPORT_ERROR or 'not found'}); build "
    "them with gcc installed: `pip install -e .` from the repository root"
)
# The CPU ops take the C kernels while this is True; tests set it to False to run the torch
# paths that a GPU takes, on the CPU.
ENABLED = True


def enabled() -> bool:
    """True when CPU ops go to C; raises if they should but the module was never built."""
    if ENABLED and _C is None:
        raise BackendUnavailableError(BUILD_HINT)
    return ENABLED


# The dtype codes of the C module (enum ns_dtype in kernels/csrc/nanoserve.h); uint8 is a KV
# cache's of q8_0 rows (torch_ref.KV_Q8_0).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.uint8: 3}
# The most rows decode_layers takes where every matrix is in GGUF blocks (NS_STEP_ROWS).
STEP_ROWS: int = _C.STEP_ROWS if _C is not None else 4
# The most rows small_linear and decode_layers take (NS_GEMV_ROWS in kernels/csrc/nanoserve.h). The
# 4 is only for a source tree that was never built, whose C kernels cannot run anyway.
GEMV_ROWS: int = _C.GEMV_ROWS if _C is not None else 4
# The GGUF block formats the C kernels take, {name: (GGML type id, bytes of a block, values of a
# block along K: 32, or 256 for a K-quant's super-block)}, from their one table
# (kernels/csrc/quant.c, a row in each format's file); empty in a source tree that was never built.
# name: (GGML type id, block bytes, block values, the file's format of an r16 one or None)
BLOCK_FORMATS: dict[str, tuple[int, int, int, str | None]] = (
    dict(_C.BLOCK_FORMATS) if _C is not None else {}
)


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
    num_blocks, num_kv_heads, block_size, _ = k_cache.shape  # (a q8_0 cache's rows are bytes)
    head_dim = q.shape[2]
    # The C module checks context_lens and the used block_tables entries before reading the cache.
    _C.paged_attention_decode(
        out=out.data_ptr(),
        q=q.data_ptr(),
        k_cache=k_cache.data_ptr(),
        v_cache=v_cache.data_ptr(),
        block_tables=block_tables.data_ptr(),
        context_lens=context_lens.data_ptr(),
        num_seqs=q.shape[0],
        num_q_heads=q.shape[1],
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        num_blocks=num_blocks,
        max_blocks_per_seq=block_tables.shape[1],
        scale=float(scale),
        window=window,
        sinks=_address(sinks),
        dtype_code=DTYPE_CODES[q.dtype],
        cache_dtype_code=DTYPE_CODES[k_cache.dtype],
        num_threads=torch.get_num_threads(),  # one thread setting for torch and the kernel
    )


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
    num_blocks, num_kv_heads, block_size, _ = k_cache.shape
    head_dim = q.shape[2]
    # The C module checks context_len and the used block_table entries before reading the cache.
    _C.paged_attention_prefill(
        out=out.data_ptr(),
        q=q.data_ptr(),
        k_cache=k_cache.data_ptr(),
        v_cache=v_cache.data_ptr(),
        block_table=block_table.data_ptr(),
        num_tokens=q.shape[0],
        num_q_heads=q.shape[1],
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        num_blocks=num_blocks,
        table_len=block_table.shape[0],
        context_len=context_len,
        scale=float(scale),
        q_dtype=DTYPE_CODES[q.dtype],
        cache_dtype=DTYPE_CODES[k_cache.dtype],
        num_threads=torch.get_num_threads(),
        window=window,
        sinks=_address(sinks),
    )


def _address(t: torch.Tensor | None) -> int:
    """A tensor's data pointer, 0 (NULL in C) for None."""
    return 0 if t is None else t.data_ptr()


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_blocks, num_kv_heads, block_size, _ = k_cache.shape
    head_dim = key.shape[2]
    _C.store_kv(
        key=key.data_ptr(),
        value=value.data_ptr(),
        k_cache=k_cache.data_ptr(),
        v_cache=v_cache.data_ptr(),
        slot_mapping=slot_mapping.data_ptr(),
        num_tokens=key.shape[0],
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        num_blocks=num_blocks,
        dtype_code=DTYPE_CODES[key.dtype],  # rounded to the cache's dtype (or q8_0) as stored
        cache_dtype_code=DTYPE_CODES[k_cache.dtype],
        slots_are_int64=int(slot_mapping.dtype == torch.int64),
    )


def small_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    _C.small_linear(
        out=out.data_ptr(),
        x=x.data_ptr(),
        w=w.data_ptr(),
        M=x.shape[0],
        N=w.shape[0],
        K=x.shape[1],
        dtype_code=DTYPE_CODES[x.dtype],
        num_threads=torch.get_num_threads(),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    _C.rms_norm(
        out=out.data_ptr(),
        x=x.data_ptr(),
        w=weight.data_ptr(),
        rows=x.shape[0],
        hidden=x.shape[1],
        eps=float(eps),
        dtype_code=DTYPE_CODES[x.dtype],
        num_threads=torch.get_num_threads(),
    )


def rope_(
    qk: torch.Tensor, heads: int, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    _C.rope(
        qk=qk.data_ptr(),
        positions=positions.data_ptr(),
        cos=cos.data_ptr(),
        sin=sin.data_ptr(),
        rows=qk.shape[0],
        heads=heads,
        head_dim=cos.shape[1],
        row_stride=qk.stride(0),
        table_rows=cos.shape[0],
        dtype_code=DTYPE_CODES[qk.dtype],
        num_threads=torch.get_num_threads(),
    )


def gated_mul(gate_up: torch.Tensor, out: torch.Tensor, gelu: bool) -> None:
    _C.gated(
        act=out.data_ptr(),
        gate_up=gate_up.data_ptr(),
        rows=gate_up.shape[0],
        inter=out.shape[1],
        dtype_code=DTYPE_CODES[gate_up.dtype],
        gelu=gelu,
        num_threads=torch.get_num_threads(),
    )


# GGML's type ids of the GGUF block formats: the C module's qtype codes.
QTYPE_CODES = {name: row[0] for name, row in BLOCK_FORMATS.items()}


def quant_linear(
    x: torch.Tensor, data: torch.Tensor, qtype: str, out: torch.Tensor, col: int = 0, rows: int = 0
) -> None:
    """out[:, col : col + rows] = x @ the blocks' matrix.T (rows 0: out's width from col)."""
    n = rows or out.shape[1] - col
    _C.quant_linear(
        out=out.data_ptr() + col * out.element_size(),
        x=x.data_ptr(),
        w=data.data_ptr(),
        M=x.shape[0],
        N=n,
        K=x.shape[1],
        qtype=QTYPE_CODES[qtype],
        num_threads=torch.get_num_threads(),
        ldo=out.shape[1],
    )


def route_experts(
    logits: torch.Tensor,
    top_k: int,
    normalize: bool,
    weights: torch.Tensor,
    experts: torch.Tensor,
    among_chosen: bool,
) -> None:
    _C.moe_route(
        logits=logits.data_ptr(),
        T=logits.shape[0],
        E=logits.shape[1],
        k=top_k,
        normalize=normalize,
        weights=weights.data_ptr(),
        experts=experts.data_ptr(),
        among_chosen=among_chosen,
    )


def clamped_swiglu(gate_up: torch.Tensor, out: torch.Tensor, alpha: float, limit: float) -> None:
    _C.clamped_swiglu(
        act=out.data_ptr(),
        gate_up=gate_up.data_ptr(),
        rows=gate_up.shape[0],
        inter=out.shape[1],
        alpha=float(alpha),
        limit=float(limit),
    )


def quant_experts(
    outs: list[torch.Tensor],
    datas: list[torch.Tensor],
    qtype: str,
    num_experts: int,
    x: torch.Tensor,
    rows: torch.Tensor | None,
    groups: torch.Tensor,
) -> None:
    """outs[i][p] = x[rows[p]] @ expert e's matrix of datas[i].T for each group (e, start, count)
    and p in [start, start + count); outs of one row stride (views of one tensor, or alike)."""
    _C.quant_experts(
        outs=tuple(out.data_ptr() for out in outs),
        ws=tuple(data.data_ptr() for data in datas),
        x=x.data_ptr(),
        T=x.shape[0],
        rows=0 if rows is None else rows.data_ptr(),
        P=outs[0].shape[0],
        groups=groups.data_ptr(),
        G=groups.shape[0],
        E=num_experts,
        N=outs[0].shape[1],
        K=x.shape[1],
        qtype=QTYPE_CODES[qtype],
        num_threads=torch.get_num_threads(),
        ldo=outs[0].stride(0),
    )


def copy_rows(jobs: list[tuple[int, ...]]) -> None:
    """Each (dst, src, rows, row_bytes, heads, repack): rows of row_bytes bytes from address src
    to dst, each head's two rotary halves put back (llama.cpp's interleaved Q and K rows) where
    heads > 0, in the r16 layout of a K-quant whose blocks are `repack` bytes where repack > 0
    (kernels/csrc/quant_r16.c); all in one call that releases the GIL."""
    _C.copy_rows(jobs=jobs)


def argmax_rows(x: torch.Tensor, out: torch.Tensor) -> None:
    """out [rows] int64 = torch.argmax of each row of x [rows, n] (float32, contiguous)."""
    _C.argmax_rows(out=out.data_ptr(), x=x.data_ptr(), rows=x.shape[0], n=x.shape[1])


def quantize(weight: torch.Tensor, qtype: str, out: torch.Tensor) -> None:
    _C.quantize(
        out=out.data_ptr(),
        w=weight.data_ptr(),
        N=weight.shape[0],
        K=weight.shape[1],
        qtype=QTYPE_CODES[qtype],
        num_threads=torch.get_num_threads(),
    )


def dequantize(
    data: torch.Tensor, qtype: str, K: int, rows: torch.Tensor | None, out: torch.Tensor
) -> None:
    """out [R, K] = the rows `rows` (int64; all, in order, when None) of the block matrix data;
    the C module checks the row indices."""
    _C.dequantize(
        out=out.data_ptr(),
        w=data.data_ptr(),
        rows=0 if rows is None else rows.data_ptr(),
        num_rows=out.shape[0],
        N=data.shape[0],
        K=K,
        qtype=QTYPE_CODES[qtype],
        num_threads=torch.get_num_threads(),
    )


def check_tables(
    block_tables: torch.Tensor, context_lens: torch.Tensor, num_blocks: int, block_size: int
) -> None:
    """Paged attention's check of its table values (the C module's, its one home), for the paths
    that do not run in C; nothing in a source tree that was never built."""
    if _C is not None:
        _C.check_tables(
            block_tables=block_tables.data_ptr(),
            context_lens=context_lens.data_ptr(),
            num_seqs=context_lens.shape[0],
            max_blocks_per_seq=block_tables.shape[1],
            block_size=block_size,
            num_blocks=num_blocks,
        )


def check_prefill_table(
    block_table: torch.Tensor, context_len: int, num_tokens: int, num_blocks: int, block_size: int
) -> None:
    """Prefill attention's check of context_len and its block table (the C module's), as
    check_tables."""
    if _C is not None:
        _C.check_prefill_table(
            block_table=block_table.data_ptr(),
            table_len=block_table.shape[0],
            context_len=context_len,
            num_tokens=num_tokens,
            block_size=block_size,
            num_blocks=num_blocks,
        )


def check_slots(slot_mapping: torch.Tensor, num_slots: int) -> None:
    """The KV store's check of its slots (the C module's), as check_tables."""
    if _C is not None:
        _C.check_slots(
            slot_mapping=slot_mapping.data_ptr(),
            num_tokens=slot_mapping.shape[0],
            slots_are_int64=int(slot_mapping.dtype == torch.int64),
            num_slots=num_slots,
        )


def check_positions(positions: torch.Tensor, table_rows: int) -> None:
    """RoPE's check of its positions (the C module's), as check_tables."""
    if _C is not None:
        _C.check_positions(
            positions=positions.data_ptr(), num_positions=positions.shape[0], table_rows=table_rows
        )


def layer_table(
    layers: list[dict[str, tuple[int, int]]], cache_dtype: torch.dtype = torch.float32
) -> object:
    """decode_layers' layers: per layer a dict {field: (data pointer, format)} naming every field
    of the C step's struct layer_weights (kernels/csrc/decode_step.c): a layer's weights, as
    src/nanoserve/model/weights.py's LayerWeights names them, then k_cache and v_cache. Format 0:
    floats of the step's dtype (the caches: of cache_dtype, float32, bfloat16 or float16, which
    is the step's dtype or takes float32 activations, or uint8 rows of q8_0 under either); else
    a QTYPE_CODES value, a matrix of GGUF blocks (rows of blocks; qkv's rows are q's, k's and
    v's, gate_up's gate's and up's), which needs a float32 h (its matmul rounds it to int16 per
    block, as kernels.quant.quantized_linear). An opaque object, holding the pointers (not the
    tensors behind them)."""
    return _C.layer_table(layers=layers, cache_dtype_code=DTYPE_CODES[cache_dtype])


def decode_layers(
    h: torch.Tensor,
    layers: object,
    positions: torch.Tensor,
    slots: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    num_blocks: int,
    block_size: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    eps: float,
    scale: float,
    windows: torch.Tensor | None = None,
    local: tuple[torch.Tensor, torch.Tensor] | None = None,
    gelu: bool = False,
    moe: tuple[int, int, int, bool] = (0, 0, 0, False),
    gpt_oss: tuple[float, float] | None = None,
) -> None:
    """Every layer of a decode step on h ([rows, hidden], in place); layers: from layer_table.
    windows: [layers] int64, a layer's sliding window (0: none), whose layers rotate by local's
    (cos, sin), tables of cos's shape; gelu: GELU-tanh instead of SiLU; moe: the mixture of
    experts' (experts, top_k, expert_size, normalize) where layers have a router; gpt_oss: its
    SwiGLU's (alpha, limit), and its routing."""
    experts, top_k, expert_size, normalize = moe
    if windows is not None:
        assert local is not None and local[0].shape == cos.shape == local[1].shape
    lc, ls = local if local is not None else (None, None)
    _C.decode_layers(
        h=h.data_ptr(),
        layers=layers,
        positions=positions.data_ptr(),
        slots=slots.data_ptr(),
        cos=cos.data_ptr(),
        sin=sin.data_ptr(),
        table_rows=cos.shape[0],
        block_tables=block_tables.data_ptr(),
        context_lens=context_lens.data_ptr(),
        max_blocks_per_seq=block_tables.shape[1],
        block_size=block_size,
        num_blocks=num_blocks,
        rows=h.shape[0],
        hidden=h.shape[1],
        heads=heads,
        kv_heads=kv_heads,
        head_dim=cos.shape[1],
        intermediate=intermediate,
        eps=float(eps),
        scale=float(scale),
        dtype_code=DTYPE_CODES[h.dtype],
        num_threads=torch.get_num_threads(),
        windows=0 if windows is None else windows.data_ptr(),
        local_cos=0 if lc is None else lc.data_ptr(),
        local_sin=0 if ls is None else ls.data_ptr(),
        gelu=gelu,
        experts=experts,
        top_k=top_k,
        expert_size=expert_size,
        normalize=normalize,
        gpt_oss=gpt_oss is not None,
        swiglu_alpha=gpt_oss[0] if gpt_oss else 0.0,
        swiglu_limit=gpt_oss[1] if gpt_oss else 0.0,
    )
