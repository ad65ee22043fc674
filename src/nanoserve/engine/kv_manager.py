"""The KV cache manager: the scheduler's one door to the KV blocks, in the shape of vLLM v1's
KVCacheManager. It finds a request's cached prefix, gives the request the blocks its next tokens
need or says they do not fit (then the scheduler preempts), publishes newly full blocks to the
prefix cache and frees a request's blocks. It owns the block pool and the watermark; it writes a
request's `block_table` and `block_hashes`, which the scheduler and the runner only read.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from nanoserve.engine.block_pool import BlockPool
from nanoserve.engine.kv_cache import cdiv
from nanoserve.engine.request import Request


@dataclass(frozen=True)
class ComputedBlocks:
    """A prefix-cache hit: the cached blocks holding a request's first tokens, in order, and
    their chain hashes."""

    block_ids: tuple[int, ...] = ()
    block_hashes: tuple[int, ...] = ()


class KVCacheManager:
    """Blocks for requests: `get_computed_blocks`, `allocate_slots`, `cache_blocks`, `free`, and
    `trim`, `audit` of the ledger; `num_free_blocks` for the stats."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
    ):
        self.block_pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Free blocks an allocation under the watermark leaves for the running requests to grow.
        self.watermark_blocks = int(watermark * num_blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free

    def get_computed_blocks(self, request: Request) -> tuple[ComputedBlocks, int]:
        """The longest cached prefix of a request that holds no blocks, and its length in tokens."""
        # At least one token is always computed: it yields the logits of the next one. Cached
        # blocks have no logits: a request that wants prompt logprobs computes its prompt.
        max_tokens = 0 if request.scores_prompt else request.num_tokens - 1
        blocks, hashes = self.block_pool.lookup(request.token_ids, max_tokens)
        return ComputedBlocks(tuple(blocks), tuple(hashes)), len(blocks) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: ComputedBlocks | None = None,
        watermark: bool = False,
    ) -> list[int] | None:
        """Make the request's block table hold its computed tokens, then `computed_blocks` (the
        cached prefix of a request that holds no blocks yet), then `num_new_tokens` more. Returns
        the newly allocated blocks, or None, with nothing taken, when they do not fit in the free
        blocks (less the watermark's, with `watermark`)."""
        cached = computed_blocks.block_ids if computed_blocks is not None else ()
        total = request.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        num_new = max(0, cdiv(total, self.block_size) - len(request.block_table) - len(cached))
        # Cached blocks nobody holds sit on the free list: taking them uses free blocks too.
        revived = sum(1 for b in cached if self.block_pool.ref_counts[b] == 0)
        reserve = self.watermark_blocks if watermark else 0
        if num_new + revived + reserve > self.block_pool.num_free:
            return None
        if computed_blocks is not None:
            for block in cached:  # before allocating: a revived block leaves the free list
                self.block_pool.share(block)
            request.block_table = list(cached)
            request.block_hashes = list(computed_blocks.block_hashes)
        new_blocks = [self.block_pool.allocate() for _ in range(num_new)]
        request.block_table += new_blocks
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish the request's blocks that its first `num_computed_tokens` tokens fill (and
        were not published yet) to the prefix cache, each under its chain hash."""
        bs = self.block_size
        for j in range(len(request.block_hashes), num_computed_tokens // bs):
            prev = request.block_hashes[-1] if request.block_hashes else None
            tokens = request.token_ids[j * bs : (j + 1) * bs]
            request.block_hashes.append(
                self.block_pool.register(request.block_table[j], prev, tokens)
            )

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the request's blocks past its first `num_tokens` tokens (a verification's
        rejected draft positions). Those blocks were allocated for the draft and never hashed:
        only blocks full of computed tokens are."""
        keep = cdiv(num_tokens, self.block_size)
        assert len(request.block_hashes) <= keep, "a hashed block past the kept tokens"
        self.block_pool.release(request.block_table[keep:])
        del request.block_table[keep:]

    def free(self, request: Request) -> None:
        """Give back the request's blocks; their cached contents stay findable until reused."""
        self.block_pool.release(request.block_table)
        request.block_table = []
        request.block_hashes = []

    def audit(self, requests: Iterable[Request]) -> None:
        """Raise if the pool's ledger disagrees with the block tables of `requests`, which must be
        every request that holds blocks."""
        self.block_pool.audit(r.block_table for r in requests)
