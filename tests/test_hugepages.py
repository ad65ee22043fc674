import mmap

import pytest
import torch

from nanoserve import hugepages


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE here")
def test_pack_copies_into_one_aligned_mapping_and_keeps_aliases():
    a = torch.randn(300, 7)
    b = torch.randn(5, 3).to(torch.bfloat16)
    packed_a, packed_b, packed_a_again = hugepages.pack([a, b, a])
    assert packed_a is packed_a_again  # a tied lm_head stays the embedding
    assert torch.equal(packed_a, a) and torch.equal(packed_b, b)
    assert packed_b.dtype == torch.bfloat16 and packed_b.shape == (5, 3)
    assert packed_a.data_ptr() % hugepages.HUGE_PAGE == 0
    assert packed_a.data_ptr() != a.data_ptr()
    del a, b
    assert float(packed_a.sum()) == pytest.approx(float(packed_a_again.sum()))  # mapping alive
