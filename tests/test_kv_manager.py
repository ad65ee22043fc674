"""The KV cache manager's contract, without a model: an allocation that does not fit returns None
and takes nothing, `free` gives every block back, prefix hits are shared blocks counted in
tokens (never for a scoring request, never the last token), and the audit catches a leak."""

import pytest

from nanoserve.engine.kv_manager import ComputedBlocks, KVCacheManager
from nanoserve.engine.request import Request, Status
from nanoserve.engine.sampling import SamplingParams

BLOCK = 4


def _request(rid, tokens, prompt_logprobs=None):
    params = SamplingParams(max_tokens=4, prompt_logprobs=prompt_logprobs)
    return Request(rid, rid, 0, list(tokens), params, 0, 4, detokenizer=None)


def _compute(kv, request, computed=None):
    """Admit a waiting request with its cached prefix and compute its whole prompt."""
    computed, num_cached = computed or kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_cached, computed) is not None
    request.num_computed_tokens = request.num_tokens
    request.status = Status.RUNNING
    kv.cache_blocks(request, request.num_computed_tokens)


def test_an_allocation_that_does_not_fit_returns_none_and_takes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK, watermark=0.5)  # 2 blocks of watermark
    request = _request("a", range(10))  # 10 tokens: 3 blocks
    assert kv.allocate_slots(request, 10, ComputedBlocks(), watermark=True) is None
    assert request.block_table == [] and kv.num_free_blocks == 4
    new = kv.allocate_slots(request, 10, ComputedBlocks())
    assert new is not None and len(new) == 3 and request.block_table == new
    request.num_computed_tokens = 10
    assert kv.allocate_slots(request, 7) is None  # 17 tokens: 2 more blocks, 1 free
    assert len(request.block_table) == 3 and kv.num_free_blocks == 1
    assert kv.allocate_slots(request, 2) == []  # 12 tokens still fit in 3 blocks
    assert kv.allocate_slots(request, 3) is not None and kv.num_free_blocks == 0
    kv.audit([request])


def test_free_gives_every_block_back():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    first, second = _request("a", range(9)), _request("b", range(9))
    _compute(kv, first)
    _compute(kv, second)  # shares the first's two full blocks
    assert kv.num_free_blocks == 8 - 4
    kv.free(first)
    assert first.block_table == [] and kv.num_free_blocks == 8 - 3
    kv.audit([second])
    kv.free(second)
    assert kv.num_free_blocks == 8
    kv.audit([])


def test_prefix_hits_are_shared_blocks_counted_in_tokens():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    owner = _request("a", range(10))
    _compute(kv, owner)
    reader = _request("b", [*range(8), 99, 98])
    computed, num_cached = kv.get_computed_blocks(reader)
    assert num_cached == 8 and list(computed.block_ids) == owner.block_table[:2]
    _compute(kv, reader, (computed, num_cached))
    assert reader.block_table[:2] == owner.block_table[:2]
    assert reader.block_table[2] != owner.block_table[2]
    kv.audit([owner, reader])  # the shared blocks count two holders each
    # The last token is always computed: a prompt of exactly two cached blocks finds one.
    assert kv.get_computed_blocks(_request("c", range(8)))[1] == BLOCK
    # A scoring request computes its whole prompt: cached blocks have no logits.
    assert kv.get_computed_blocks(_request("d", range(10), prompt_logprobs=1))[1] == 0


def test_a_cached_block_nobody_holds_is_revived_from_the_free_blocks():
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK)
    owner = _request("a", range(9))  # 3 blocks, 2 of them full
    _compute(kv, owner)
    owner_table = list(owner.block_table)
    kv.free(owner)
    # 13 tokens: the 2 cached blocks nobody holds and 2 new ones, from 3 free blocks.
    too_long = _request("b", range(13))
    computed, num_cached = kv.get_computed_blocks(too_long)
    assert num_cached == 8 and list(computed.block_ids) == owner_table[:2]
    assert kv.allocate_slots(too_long, 5, computed) is None
    assert too_long.block_table == [] and kv.num_free_blocks == 3
    reader = _request("c", range(12))  # the 2 cached blocks and 1 new one
    computed, num_cached = kv.get_computed_blocks(reader)
    assert num_cached == 8
    assert kv.allocate_slots(reader, 4, computed) == [owner_table[2]]
    assert reader.block_table == owner_table and kv.num_free_blocks == 0
    kv.audit([reader])


def test_without_prefix_caching_nothing_is_found():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=False)
    _compute(kv, _request("a", range(10)))
    assert kv.get_computed_blocks(_request("b", range(10))) == (ComputedBlocks(), 0)


def test_the_audit_catches_a_leak():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    request = _request("a", range(6))
    _compute(kv, request)
    with pytest.raises(AssertionError, match="ref count 1, held by 0 tables"):
        kv.audit([])  # the request holds blocks that nobody accounts for
    kv.audit([request])
    request.block_table.append(request.block_table[0])  # one block held twice, counted once
    with pytest.raises(AssertionError, match="ref count 1, held by 2 tables"):
        kv.audit([request])
