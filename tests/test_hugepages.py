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
