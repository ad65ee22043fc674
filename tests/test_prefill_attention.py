"""Prefill attention over the paged KV cache (nanoserve.kernels.paged_attention_prefill): the C
kernel and the torch reference against a float64 dense causal softmax, sliding windows, every
(q dtype, cache dtype) pair, bitwise reproducibility across thread counts and prefill chunkings,
argument errors, and the model's attention layer taking the kernel on the CPU.

Inputs are drawn fresh each run; a failure prints the seed (NANOSERVE_KERNEL_SEED=n reproduces it).
"""

import os
import random
import re
from dataclasses import dataclass

import pytest
import torch

import nanoserve.kernels as kernels
from nanoserve.model import attention as attention_layer

BACKENDS = ["c", "torch"]
# float32 output: both backends sum in float32 (about 1e-6 from float64); bf16 output rounds to 8
# bits of mantissa.
ATOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.fixture
def gen() -> torch.Generator:
    seed = int(os.environ.get("NANOSERVE_KERNEL_SEED", random.SystemRandom().randrange(2**31)))
    print(f"NANOSERVE_KERNEL_SEED={seed}")
    return torch.Generator().manual_seed(seed)


@dataclass
class Case:
    q: torch.Tensor  # [tokens, q_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, kv_heads, block_size, head_dim]
    v_cache: torch.Tensor
    block_table: torch.Tensor  # [n] int32
    context_len: int
    scale: float

    @property
    def caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_cache, self.v_cache

    def args(self) -> tuple:
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_table,
            self.context_len,
            self.scale,
        )


def make_case(
    gen: torch.Generator,
    tokens: int,
    cached: int,
    shape: tuple[int, int, int, int],
    q_dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype = torch.float32,
) -> Case:
    """A sequence of cached + tokens positions in shuffled, non-consecutive blocks of a cache whose
    other slots are NaN (never written: a kernel that read one would return NaN), with one spare
    table entry that is no block at all (-1: past the context, so never read). A q8_0 cache:
    float32 values quantized (a NaN row's scale is NaN)."""
    q_heads, kv_heads, head_dim, block_size = shape
    context = cached + tokens
    used = -(-context // block_size)
    num_blocks = 2 * used + 3
    table = torch.randperm(num_blocks, generator=gen)[:used].to(torch.int32)
    cache_shape = (num_blocks, kv_heads, block_size, head_dim)
    float_dtype = torch.float32 if cache_dtype == kernels.KV_Q8_0 else cache_dtype
    k_cache = torch.full(cache_shape, float("nan"), dtype=float_dtype)
    v_cache = torch.full(cache_shape, float("nan"), dtype=float_dtype)
    positions = torch.arange(context)
    blocks, offsets = table[positions // block_size].long(), positions % block_size
    rows = (context, kv_heads, head_dim)
    k_cache[blocks, :, offsets] = torch.randn(rows, generator=gen).to(float_dtype)
    v_cache[blocks, :, offsets] = torch.randn(rows, generator=gen).to(float_dtype)
    if cache_dtype == kernels.KV_Q8_0:
        k_cache, v_cache = kernels.q8_0_quantize(k_cache), kernels.q8_0_quantize(v_cache)
    q = torch.randn((tokens, q_heads, head_dim), generator=gen).to(q_dtype)
    spare = torch.tensor([-1], dtype=torch.int32)
    return Case(q, k_cache, v_cache, torch.cat([table, spare]), context, head_dim**-0.5)


def reference(case: Case, window: int = 0) -> torch.Tensor:
    """float64 dense causal attention over the context gathered position by position."""
    tokens, q_heads, _ = case.q.shape
    _, kv_heads, block_size, _ = case.k_cache.shape
    positions = torch.arange(case.context_len)
    blocks = case.block_table[positions // block_size].long()
    offsets = positions % block_size
    group = q_heads // kv_heads
    k, v = (_floats(c[blocks, :, offsets]).repeat_interleave(group, dim=1) for c in case.caches)
    logits = torch.einsum("thd,chd->htc", case.q.double(), k) * case.scale
    rows = torch.arange(tokens).unsqueeze(1) + case.context_len - tokens
    hidden = positions.unsqueeze(0) > rows
    if window:
        hidden |= positions.unsqueeze(0) <= rows - window
    weights = torch.softmax(logits.masked_fill(hidden, float("-inf")), dim=-1)
    return torch.einsum("htc,chd->thd", weights, v)


def _floats(rows: torch.Tensor) -> torch.Tensor:
    """Cache rows as float64 (q8_0 rows de-quantized)."""
    return (kernels.q8_0_dequantize(rows) if rows.dtype == kernels.KV_Q8_0 else rows).double()


def run(case: Case, backend: str, window: int = 0) -> torch.Tensor:
    out = torch.full_like(case.q, float("nan"))  # an element the kernel fails to write stays NaN
    result = kernels.paged_attention_prefill(*case.args(), out=out, backend=backend, window=window)
    assert result is out
    return out


SHAPES = [  # (q_heads, kv_heads, head_dim, block_size)
    pytest.param((4, 4, 64, 16), id="mha-d64-b16"),
    pytest.param((6, 2, 40, 8), id="gqa3-d40-b8"),
    pytest.param((8, 2, 64, 8), id="gqa4-d64-b8"),
    pytest.param((12, 4, 40, 16), id="gqa3-d40-b16"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tokens", [1, 5, 33, 200])
@pytest.mark.parametrize("cached", [0, 7, 100])
def test_prefill_matches_float64_reference(gen, backend, shape, tokens, cached):
    case = make_case(gen, tokens, cached, shape)
    out = run(case, backend)
    torch.testing.assert_close(out.double(), reference(case), atol=ATOL[torch.float32], rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "tokens,cached,window",
    [(33, 0, 5), (200, 0, 17), (200, 100, 64), (33, 100, 40), (5, 7, 1000), (200, 7, 207)],
)
def test_prefill_sliding_window(gen, backend, tokens, cached, window):
    """Windows smaller than the chunk, across the cached part, and larger than the context."""
    case = make_case(gen, tokens, cached, (6, 2, 40, 8))
    out = run(case, backend, window)
    expected = reference(case, window)
    torch.testing.assert_close(out.double(), expected, atol=ATOL[torch.float32], rtol=0)
    if window < case.context_len:  # the window changes the result
        assert (expected - reference(case)).abs().max() > 1e-3


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cache_dtype", kernels.CACHE_DTYPES, ids=str)
def test_every_dtype_pair(gen, backend, q_dtype, cache_dtype):
    """The cache's values are widened to float32 as read: the result is attention over exactly
    the values stored, rounded once to q's dtype."""
    case = make_case(gen, 33, 100, (8, 2, 64, 16), q_dtype, cache_dtype)
    out = run(case, backend, window=50)
    assert out.dtype == q_dtype
    torch.testing.assert_close(out.double(), reference(case, 50), atol=ATOL[q_dtype], rtol=0)


def test_c_and_torch_backends_agree(gen):
    case = make_case(gen, 200, 100, (12, 3, 64, 16))
    difference = (run(case, "c") - run(case, "torch")).abs().max().item()
    assert difference <= 1e-5


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, kernels.KV_Q8_0], ids=str)
def test_thread_count_does_not_change_a_bit(gen, cache_dtype):
    head_dim = 32 if cache_dtype == kernels.KV_Q8_0 else 40  # (q8_0: whole blocks of 32)
    case = make_case(gen, 200, 100, (8, 2, head_dim, 8), cache_dtype=cache_dtype)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(run(case, "c", window=70))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("window", [0, 45])
@pytest.mark.parametrize("cache_dtype", [torch.float32, kernels.KV_Q8_0], ids=str)
def test_chunked_prefill_gives_the_same_bits(gen, window, cache_dtype):
    """A row's result does not depend on the other rows of its call: prefilling 200 tokens in
    chunks of 37, 100 and 63 gives exactly the rows of one 200-token call."""
    case = make_case(gen, 200, 0, (9, 3, 64, 16), cache_dtype=cache_dtype)
    whole = run(case, "c", window)
    parts, start = [], 0
    for length in (37, 100, 63):
        part = Case(
            case.q[start : start + length].contiguous(),
            case.k_cache,
            case.v_cache,
            case.block_table,
            start + length,
            case.scale,
        )
        parts.append(run(part, "c", window))
        start += length
    assert torch.equal(torch.cat(parts), whole)


def _bad_cases(case: Case) -> list:
    """(changes to the arguments, error, words in the message)."""
    table = case.block_table
    return [
        (dict(q=case.q.double()), TypeError, "q dtype"),
        (dict(q=case.q.half()), TypeError, "q dtype"),
        (dict(q=case.q[:, :3].contiguous()), ValueError, "num_q_heads 3"),
        (dict(q=case.q[:, :, :32].contiguous()), ValueError, "q head_dim 32"),
        (dict(q=case.q[0]), ValueError, "q must be [num_tokens"),
        (dict(k_cache=case.k_cache.int()), TypeError, "k_cache dtype"),
        (dict(v_cache=case.v_cache.half()), TypeError, "v_cache dtype"),
        (dict(block_table=table.long()), TypeError, "block_table dtype"),
        (dict(block_table=table[:2].contiguous()), ValueError, "block_table has 2"),
        (dict(block_table=table + 1000), ValueError, "block_table[0] = "),
        (dict(context_len=4), ValueError, "context_len = 4 must be at least 1 and at least q's"),
        (dict(context_len=torch.tensor(40)), TypeError, "context_len must be a Python int"),
        (dict(scale=float("nan")), ValueError, "scale must be finite"),
        (dict(window=-1), ValueError, "window must be >= 0"),
        (dict(out=case.q.bfloat16()), TypeError, "out dtype"),
        (dict(out=case.q[:2].clone()), ValueError, "out shape"),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_rejects_bad_arguments(gen, backend):
    case = make_case(gen, 5, 35, (4, 2, 64, 16))
    names = ("q", "k_cache", "v_cache", "block_table", "context_len", "scale")
    for change, error, words in _bad_cases(case):
        args = {**dict(zip(names, case.args(), strict=True)), **change}
        with pytest.raises(error, match=re.escape(words)):
            kernels.paged_attention_prefill(**args, backend=backend)
    with pytest.raises(kernels.BackendUnavailableError, match="no Triton kernel"):
        kernels.paged_attention_prefill(*case.args(), backend="triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_take_the_torch_reference(gen):
    """No C or Triton kernel on a GPU: auto runs the torch reference, c is an error."""
    case = make_case(gen, 33, 100, (8, 2, 64, 16))
    cuda = Case(*(t.cuda() if isinstance(t, torch.Tensor) else t for t in case.args()))
    out = kernels.paged_attention_prefill(*cuda.args())
    torch.testing.assert_close(out.cpu().double(), reference(case), atol=2e-5, rtol=0)
    with pytest.raises(kernels.BackendUnavailableError, match="needs CPU tensors"):
        kernels.paged_attention_prefill(*cuda.args(), backend="c")


def _slots(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    return table[positions // block_size].long() * block_size + positions % block_size


def test_model_prefill_takes_the_kernel_on_the_cpu(gen, monkeypatch):
    """The attention layer's prefill chunks (20 tokens after 30 cached, and 9 fresh ones) go
    through the C kernel and agree with its SDPA path, which it takes with backend='torch'."""
    kv_heads, head_dim, block_size = 2, 64, 8
    first = attention_layer.PrefillChunk(0, 20, 50, torch.tensor([3, 9, 1, 12, 5, 7, 0]).int())
    second = attention_layer.PrefillChunk(20, 9, 9, torch.tensor([14, 2]).int())
    caches = torch.zeros((2, 16, kv_heads, block_size, head_dim))
    cached = torch.randn((2, 30, kv_heads, head_dim), generator=gen)
    cached_slots = _slots(first.block_table, torch.arange(30), block_size)
    kernels.store_kv(cached[0], cached[1], caches[0], caches[1], cached_slots)
    new_slots = torch.cat([
        _slots(first.block_table, torch.arange(30, 50), block_size),
        _slots(second.block_table, torch.arange(9), block_size),
    ])  # fmt: skip
    q = torch.randn((29, 6, head_dim), generator=gen)
    k = torch.randn((29, kv_heads, head_dim), generator=gen)
    v = torch.randn((29, kv_heads, head_dim), generator=gen)
    calls = []
    spy = kernels.paged_attention_prefill

    def counted(*args, **kwargs):
        calls.append(args[4])  # context_len
        return spy(*args, **kwargs)

    monkeypatch.setattr(attention_layer, "paged_attention_prefill", counted)
    outs = {}
    for backend in ("auto", "torch"):
        k_cache, v_cache = caches.clone().unbind(0)
        meta = attention_layer.AttentionMetadata(
            slot_mapping=new_slots,
            num_decode=0,
            decode_block_tables=torch.zeros((0, 1), dtype=torch.int32),
            decode_context_lens=torch.zeros((0,), dtype=torch.int32),
            prefills=(first, second),
            backend=backend,
        )
        outs[backend] = attention_layer.attention(q, k, v, k_cache, v_cache, meta, 0.125)
    assert calls == [50, 9]  # backend "auto" took the kernel, "torch" did not
    torch.testing.assert_close(outs["auto"], outs["torch"], atol=2e-5, rtol=0)
