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
