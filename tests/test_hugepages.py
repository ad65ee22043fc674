import gc
import mmap

import numpy as np
import pytest
import torch

from nanoserve.kernels import c_backend
from nanoserve.model import hugepages
from nanoserve.model.gguf_file import _unpermute


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE here")
def test_pack_copies_into_one_aligned_mapping_and_keeps_aliases():
    a = torch.randn(300, 7)
    b = torch.randn(5, 3).to(torch.bfloat16)
    expected_a, expected_b = a.clone(), b.clone()
    packed = hugepages.pack([a, b, a])
    assert packed[0] is packed[2]  # a tied lm_head stays the embedding
    assert packed[0].data_ptr() % hugepages.HUGE_PAGE == 0
    assert packed[0].data_ptr() != a.data_ptr()
    assert packed[1].dtype == torch.bfloat16 and packed[1].shape == (5, 3)
    del a, b
    gc.collect()  # the copies alone now hold the mapping
    packed_a, packed_b = packed[0], packed[1]
    del packed
    gc.collect()
    assert torch.equal(packed_a, expected_a) and torch.equal(packed_b, expected_b)


def test_an_arena_hands_out_aligned_pieces_that_pack_keeps_in_place():
    arena = hugepages.Arena(3 * 4096)
    a = arena.empty((100, 7))
    b = arena.empty((10,), torch.float32)
    assert a.data_ptr() % hugepages.HUGE_PAGE == 0
    assert b.data_ptr() == a.data_ptr() + 704  # 700 bytes, to the next 64-byte boundary
    assert hugepages.in_arena(a) and not hugepages.in_arena(torch.zeros(3))
    other = torch.randn(4)
    packed = hugepages.pack([a, other, b])
    assert packed[0] is a and packed[2] is b and packed[1].data_ptr() != other.data_ptr()
    with pytest.raises(MemoryError, match="has no room"):
        arena.empty((hugepages.HUGE_PAGE + 4 * 4096,))
    del arena, packed
    gc.collect()
    assert hugepages.in_arena(a)  # its views hold the mapping


def test_blocks_that_lie_one_after_the_other_are_stacked_as_a_view():
    """cat_rows of a GGUF's q, k, v read into one arena takes them where they lie; parts that
    are not neighbours in one buffer are copied. The bytes are torch.cat's either way."""
    from nanoserve.kernels import QuantizedWeight
    from nanoserve.model.quantized import cat_rows

    def blocks(n, arena=None):  # q8_0: 34 bytes a block of 32 values; 32 rows are 17 * 64 bytes
        t = arena.empty((n, 34)) if arena else torch.empty((n, 34), dtype=torch.uint8)
        t.copy_(torch.randint(0, 256, (n, 34), dtype=torch.uint8))
        return QuantizedWeight(t, "q8_0", (n, 32))

    arena = hugepages.Arena(8192)
    near = [blocks(32, arena), blocks(32, arena), blocks(32, arena)]
    gap = [blocks(2, arena), blocks(32, arena)]  # 68 bytes, then the next 64-byte boundary
    apart = [blocks(32), blocks(32)]
    for parts, is_view in ((near, True), (gap, False), (apart, False)):
        joined = cat_rows(parts)
        assert torch.equal(joined.data, torch.cat([p.data for p in parts]))
        assert joined.shape == (sum(p.shape[0] for p in parts), 32)
        assert (joined.data.data_ptr() == parts[0].data.data_ptr()) == is_view


def test_copy_rows_copies_and_puts_back_each_heads_rotary_halves():
    """One call for many jobs: plain rows, and a llama's Q rows unpermuted as gguf_file's
    _unpermute does on de-quantized values (row (h, i, j) of the file is row (h, j, i))."""
    g = torch.Generator().manual_seed(0)
    plain = torch.randint(0, 256, (5, 22), dtype=torch.uint8, generator=g)
    q = torch.randint(0, 256, (2 * 2 * 3, 18), dtype=torch.uint8, generator=g)  # 2 heads of 6
    arena = hugepages.Arena(4096)
    out_plain, out_q = arena.empty(tuple(plain.shape)), arena.empty(tuple(q.shape))
    c_backend.copy_rows([
        (out_plain.data_ptr(), plain.data_ptr(), 5, 22, 0),
        (out_q.data_ptr(), q.data_ptr(), 12, 18, 2),
    ])  # fmt: skip
    assert torch.equal(out_plain, plain)
    assert np.array_equal(out_q.numpy(), _unpermute(q.numpy(), 2))
    rows = q.reshape(2, 3, 2, 18)
    assert torch.equal(out_q.reshape(2, 2, 3, 18)[1, 0, 2], rows[1, 2, 0])
    with pytest.raises(ValueError, match="job 0 has 10 rows of 18 bytes in 2 heads"):
        c_backend.copy_rows([(out_q.data_ptr(), q.data_ptr(), 10, 18, 2)])
