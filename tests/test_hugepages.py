import gc
import mmap

import pytest
import torch

from nanoserve.model import hugepages


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
