"""Decode attention and the KV store over a cache whose dtype differs from the query's (float32
activations over a bfloat16 or float16 cache), and the C kernel's split of long contexts into
partitions (split-K): against the float64 reference of test_kernels, bitwise row invariance
(alone, in a batch, under 1 or 2 threads), the store's rounding against torch's, and the errors
for the combinations that are not taken.
"""

from dataclasses import replace

import pytest
import test_kernels
import test_quant_kernels
import torch
from test_kernels import ATOL, make_case, reference

import nanoserve.kernels as kernels

gen = test_kernels.gen  # the seeded generator fixture (NANOSERVE_KERNEL_SEED=n reproduces a run)

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# (q dtype, cache dtype): float32 q over any cache, or q of the cache's dtype.
PAIRS = [(F32, F32), (F32, BF16), (F32, F16), (BF16, BF16), (F16, F16)]
PAIR_IDS = [f"q{str(q)[6:]}-cache{str(c)[6:]}" for q, c in PAIRS]
# 1 token; a partial block; one partition; three partitions (the C kernel's are 512 tokens), the
# last partial; five, the last partial.
LENS = [1, 17, 300, 1100, 2500]
CONFIGS = [  # (num_q_heads, num_kv_heads, head_dim, block_size)
    pytest.param(4, 4, 64, 16, id="mha-d64-b16"),
    pytest.param(8, 2, 40, 8, id="gqa4-d40-b8"),
]


def mixed_case(gen, lens, num_q_heads, num_kv_heads, head_dim, block_size, q_dtype, cache_dtype):
    """test_kernels.make_case's cache of cache_dtype, with queries drawn in q_dtype."""
    case = make_case(gen, lens, num_q_heads, num_kv_heads, head_dim, block_size, cache_dtype)
    q = torch.randn(case.q.shape, generator=gen).to(q_dtype)
    return replace(case, q=q)


def decode(case, backend: str, window: int = 0) -> torch.Tensor:
    out = torch.full_like(case.q, float("nan"))  # an element the kernel fails to write stays NaN
    kernels.paged_attention_decode(*case.args(), out=out, backend=backend, window=window)
    return out


@pytest.mark.parametrize("backend", ["c", "torch"])
@pytest.mark.parametrize("q_dtype,cache_dtype", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim,block_size", CONFIGS)
def test_decode_matches_float64_reference(
    gen, backend, q_dtype, cache_dtype, num_q_heads, num_kv_heads, head_dim, block_size
):
    """The cache widened exactly, float32 sums, out rounded to q's dtype: within that rounding
    of the float64 attention over the same (rounded) cache values."""
    case = mixed_case(
        gen, LENS, num_q_heads, num_kv_heads, head_dim, block_size, q_dtype, cache_dtype
    )
    out = decode(case, backend)
    assert out.dtype == q_dtype
    torch.testing.assert_close(out.double(), reference(case), atol=ATOL[q_dtype], rtol=0)


@pytest.mark.parametrize("backend", ["c", "torch"])
@pytest.mark.parametrize("q_dtype,cache_dtype", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("window", [100, 600, 1500])
def test_decode_sliding_window_skips_whole_partitions(gen, backend, q_dtype, cache_dtype, window):
    """A window inside one partition, across two, and across several: the blocks wholly before
    it are NaN, so a kernel that read one (or a partition before the window) would say so."""
    block_size = 16
    case = mixed_case(gen, LENS, 8, 2, 64, block_size, q_dtype, cache_dtype)
    before = torch.zeros(case.k_cache.shape[0] * block_size, dtype=torch.bool)
    for row, n in zip(case.block_tables.tolist(), LENS, strict=True):
        for t in range(max(n - window, 0) // block_size * block_size):
            before[row[t // block_size] * block_size + t % block_size] = True
    slots = before.view(-1, 1, block_size, 1)
    poisoned = replace(
        case,
        k_cache=case.k_cache.masked_fill(slots, float("nan")),
        v_cache=case.v_cache.masked_fill(slots, float("nan")),
    )
    out = decode(poisoned, backend, window)
    torch.testing.assert_close(out.double(), reference(case, window), atol=ATOL[q_dtype], rtol=0)


def _with_threads(threads: int, fn):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        return fn()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("q_dtype,cache_dtype", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("window", [0, 700])
def test_c_rows_are_bitwise_invariant(gen, q_dtype, cache_dtype, window):
    """A row's output is the same bits alone (its table trimmed to its own blocks), in a batch of
    mixed lengths, and under 1 or 2 threads: the partitions of a context depend on its length
    only, and they are merged in a fixed order."""
    lens = [2500, 1, 513, 1100, 512, 37, 1537]
    case = mixed_case(gen, lens, 8, 2, 64, 16, q_dtype, cache_dtype)
    batch = _with_threads(2, lambda: decode(case, "c", window))
    assert torch.equal(_with_threads(1, lambda: decode(case, "c", window)), batch)
    for i in range(len(lens)):
        alone = case.select([i], own_blocks=True)
        for threads in (1, 2):
            got = _with_threads(threads, lambda alone=alone: decode(alone, "c", window))
            assert torch.equal(got[0], batch[i]), f"context {lens[i]}, {threads} threads"
    pair = _with_threads(2, lambda: decode(case.select([6, 0]), "c", window))
    assert torch.equal(pair, batch[[6, 0]])


def _rounding_probes(gen, shape) -> torch.Tensor:
    """float32 values over many magnitudes: float16 subnormals (below 2^-14), ties of both
    roundings, and values past float16's range (which round to inf)."""
    values = torch.randn(shape, generator=gen)
    scale = torch.pow(10.0, torch.empty(shape).uniform_(-9, 6, generator=gen))
    values = values * scale
    flat = values.view(-1)
    flat[:4] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, 65520.0])  # ties, inf
    flat[4:8] = torch.tensor([2**-25, 3 * 2**-25, -(2**-24) * 1.5, 1e-45])  # subnormal ties
    return values


@pytest.mark.parametrize("backend", ["c", "torch"])
@pytest.mark.parametrize("key_dtype,cache_dtype", PAIRS, ids=PAIR_IDS)
def test_store_kv_rounds_as_torch(gen, backend, key_dtype, cache_dtype):
    """store_kv equals `cache[slot] = key.to(cache.dtype)` bitwise: round to nearest even,
    float16 subnormals and overflow to inf included; negative slots are skipped."""
    num_blocks, num_kv_heads, block_size, head_dim = 5, 2, 8, 40
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    v_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:12]
    slots[[3, 9]] = -1
    key = _rounding_probes(gen, (12, num_kv_heads, head_dim)).to(key_dtype)
    value = _rounding_probes(gen, (12, num_kv_heads, head_dim)).to(key_dtype)
    kernels.store_kv(key, value, k_cache, v_cache, slots, backend=backend)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expect_k[slot // block_size, :, slot % block_size] = key[i].to(cache_dtype)
            expect_v[slot // block_size, :, slot % block_size] = value[i].to(cache_dtype)
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)


def test_store_then_decode_over_a_16_bit_cache(gen):
    """float32 keys and values stored into a bfloat16 cache are what decode then attends to: the
    same bits as decoding over a cache of the keys rounded by torch."""
    case = mixed_case(gen, [5, 600], 4, 2, 64, 8, F32, BF16)
    num_blocks, kv_heads, block_size, head_dim = case.k_cache.shape
    tokens = (num_blocks * block_size, kv_heads, head_dim)  # token t into slot t
    key, value = torch.randn(tokens, generator=gen), torch.randn(tokens, generator=gen)
    k_cache, v_cache = torch.zeros_like(case.k_cache), torch.zeros_like(case.v_cache)
    kernels.store_kv(key, value, k_cache, v_cache, torch.arange(tokens[0]), backend="c")

    def as_cache(x: torch.Tensor) -> torch.Tensor:
        blocks = x.to(BF16).view(num_blocks, block_size, kv_heads, head_dim)
        return blocks.transpose(1, 2).contiguous()

    stored = decode(replace(case, k_cache=k_cache, v_cache=v_cache), "c")
    rounded = decode(replace(case, k_cache=as_cache(key), v_cache=as_cache(value)), "c")
    assert torch.equal(stored, rounded)


@pytest.mark.parametrize("backend", ["c", "torch"])
@pytest.mark.parametrize(
    "q_dtype,cache_dtype",
    [(F16, BF16), (BF16, F16), (BF16, F32), (F16, F32), (torch.float64, F32)],
    ids=str,
)
def test_other_pairs_are_refused_by_name(gen, backend, q_dtype, cache_dtype):
    case = mixed_case(gen, [5, 20], 4, 2, 64, 8, q_dtype, cache_dtype)
    with pytest.raises(TypeError, match="q dtype .* must be float32 or the kv cache dtype"):
        kernels.paged_attention_decode(*case.args(), backend=backend)
    key = torch.zeros((2, 2, 64), dtype=q_dtype)
    slots = torch.tensor([0, 1])
    with pytest.raises(TypeError, match="key dtype .* must be float32 or the kv cache dtype"):
        kernels.store_kv(key, key, case.k_cache, case.v_cache, slots, backend=backend)


@pytest.mark.parametrize("backend", ["c", "torch"])
def test_store_kv_refuses_value_of_another_dtype_than_key(backend):
    cache = torch.zeros((4, 2, 8, 64), dtype=BF16)
    key = torch.zeros((3, 2, 64))
    with pytest.raises(TypeError, match="value dtype torch.bfloat16 differs from key dtype"):
        kernels.store_kv(
            key, key.to(BF16), cache, cache.clone(), torch.tensor([0, 1, 2]), backend=backend
        )


def test_c_step_refuses_float32_caches_under_bfloat16_activations():
    """The one-call C decode step (decode_layers) takes caches of the activations' dtype, or
    16-bit ones under float32 activations: its own check, beside model/cpu_step.py's."""
    norms, _, floats, _keep = test_quant_kernels._mixed_model(seed=6)
    h = torch.randn(1, test_quant_kernels.HIDDEN).bfloat16()
    caches = test_quant_kernels._caches(1)  # float32, and layer_table's default cache dtype
    with pytest.raises(ValueError, match="KV caches of dtype code 0 need float32 activations"):
        test_quant_kernels._run_step(h, floats, norms, caches, 1)
