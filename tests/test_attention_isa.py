"""The C decode attention on each instruction-set path: the SIMD block steps
(kernels/csrc/attention_simd.h, AVX2 and AVX-512) and the portable one, against the float64
reference of test_kernels, at head sizes and block sizes that take each path's every branch (a
head size the AVX-512 step cannot take falls to AVX2's, a group of query heads past the SIMD
steps' largest to the portable one), over every cache dtype, with sliding windows; rows past a
context's end hold NaN, so a step that read one would say so; and each path's rows bitwise the
same alone, in a batch and under 1 or 2 threads.
"""

from dataclasses import replace

import pytest
import test_kernels
import torch
from test_kernels import ATOL, make_case, reference

import nanoserve.kernels as kernels
from nanoserve.kernels import quant

gen = test_kernels.gen  # the seeded generator fixture (NANOSERVE_KERNEL_SEED=n reproduces a run)

F32, BF16, F16, Q8 = torch.float32, torch.bfloat16, torch.float16, kernels.KV_Q8_0
CACHES = {"f32": F32, "bf16": BF16, "f16": F16, "q8_0": Q8}
# 1 token; partial blocks; one 512-token partition; three, the last partial.
LENS = [1, 5, 17, 300, 1100]
SHAPES = [  # (num_q_heads, num_kv_heads, head_dim, block_size)
    pytest.param((9, 3, 64, 16), id="smollm2-g3-d64"),
    pytest.param((8, 1, 128, 16), id="g8-d128"),
    pytest.param((2, 1, 256, 16), id="g2-d256"),  # a key row in two chunks of 8 AVX-512 vectors
    pytest.param((4, 2, 96, 24), id="g2-d96-b24"),  # AVX-512: a vector past its 4; 24 rows: 2 x 16
    pytest.param((6, 2, 72, 5), id="g3-d72-b5"),  # 72: AVX2's step on the AVX-512 path
    pytest.param((17, 1, 64, 16), id="g17-portable"),  # a group past the SIMD steps' 16
    pytest.param((5, 5, 40, 8), id="mha-d40-b8"),
]


@pytest.fixture(params=quant.ISA_PATHS)
def isa(request):
    """Forces one path for the test, skipping it where this CPU lacks it."""
    if not quant.isa_supported(request.param):
        pytest.skip(f"this CPU does not run the {request.param} path")
    before = (quant.cpu_isa(), quant.uses_vnni(), quant.uses_amx())
    assert quant.set_isa(request.param) == request.param
    yield request.param
    quant.set_isa(*before)


def case_of(gen, lens, shape, cache: str):
    """make_case's float32 cache in the cache dtype (q8_0: quantized), float32 queries; the
    reference's case holds the values the cache holds; the rows past each context's end in its
    last block are NaN."""
    num_q_heads, num_kv_heads, head_dim, block_size = shape
    case = make_case(gen, lens, num_q_heads, num_kv_heads, head_dim, block_size, F32)
    past = torch.zeros(case.k_cache.shape[0] * block_size, dtype=torch.bool)
    for row, n in zip(case.block_tables.tolist(), lens, strict=True):
        for t in range(n, -(-n // block_size) * block_size):
            past[row[t // block_size] * block_size + t % block_size] = True
    slots = past.view(-1, 1, block_size, 1)
    k = case.k_cache.masked_fill(slots, float("nan"))
    v = case.v_cache.masked_fill(slots, float("nan"))
    if CACHES[cache] == Q8:
        k, v = kernels.q8_0_quantize(k), kernels.q8_0_quantize(v)
        held = (kernels.q8_0_dequantize(k), kernels.q8_0_dequantize(v))
    else:
        k, v = k.to(CACHES[cache]), v.to(CACHES[cache])
        held = (k.float(), v.float())
    return replace(case, k_cache=k, v_cache=v), replace(case, k_cache=held[0], v_cache=held[1])


def decode(case, window: int = 0, threads: int | None = None) -> torch.Tensor:
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        out = torch.full_like(case.q, float("nan"))  # an element the kernel fails to write: NaN
        kernels.paged_attention_decode(*case.args(), out=out, backend="c", window=window)
        return out
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", [0, 7, 600])
def test_decode_matches_float64_reference(gen, isa, shape, cache, window):
    if cache == "q8_0" and shape[2] % 32:
        pytest.skip("q8_0 rows are blocks of 32 values")
    case, held = case_of(gen, LENS, shape, cache)
    out = decode(case, window)
    torch.testing.assert_close(out.double(), reference(held, window), atol=ATOL[F32], rtol=0)


@pytest.mark.parametrize("cache", ["f16", "q8_0"])
@pytest.mark.parametrize("shape", SHAPES[:2] + SHAPES[3:5])
def test_rows_are_bitwise_invariant(gen, isa, shape, cache):
    if cache == "q8_0" and shape[2] % 32:
        pytest.skip("q8_0 rows are blocks of 32 values")
    lens = [1100, 1, 513, 37, 300]
    case, _ = case_of(gen, lens, shape, cache)
    batch = decode(case, 100, threads=2)
    assert torch.equal(decode(case, 100, threads=1), batch)
    for i, n in enumerate(lens):
        alone = decode(case.select([i], own_blocks=True), 100, threads=1)
        assert torch.equal(alone[0], batch[i]), f"context {n}"


def test_paths_agree(gen):
    """The SIMD steps add in another order than the portable one: every path this CPU runs
    within float32 rounding of the others, over one float16 cache."""
    case, _ = case_of(gen, LENS, SHAPES[0].values[0], "f16")
    before = (quant.cpu_isa(), quant.uses_vnni(), quant.uses_amx())
    outs = {}
    try:
        for name in quant.ISA_PATHS:
            if quant.isa_supported(name):
                quant.set_isa(name)
                outs[name] = decode(case)
    finally:
        quant.set_isa(*before)
    for name, out in outs.items():
        torch.testing.assert_close(out, outs["portable"], atol=ATOL[F32], rtol=0, msg=name)
