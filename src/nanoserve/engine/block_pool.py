"""The block pool: which KV blocks are free, who holds each one (ref counts), and the prefix-cache
map (a chain hash of each full block's tokens, confirmed against the token ids on a hit). A freed
block keeps its hash, and stays findable, until it is handed out again. Only the KV cache manager
(engine/kv_manager.py) uses it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


def chain_hash(prev: int | None, tokens: Sequence[int]) -> int:
    return hash((prev, tuple(tokens)))


class BlockPool:
    """Free list in least-recently-freed order, ref counts, and the prefix-cache map."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Prefix cache: block -> (hash, its tokens, previous block's hash); hash -> block.
        self.block_keys: dict[int, tuple[int, tuple[int, ...], int | None]] = {}
        self.cached: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self) -> int:
        block, _ = self.free.popitem(last=False)
        self._forget(block)
        self.ref_counts[block] = 1
        return block

    def release(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None

    def share(self, block: int) -> None:
        """Take one more reference to a block found in the prefix cache."""
        if self.ref_counts[block] == 0:
            del self.free[block]
        self.ref_counts[block] += 1

    def lookup(self, token_ids: Sequence[int], max_tokens: int) -> tuple[list[int], list[int]]:
        """The cached blocks holding the longest prefix of `token_ids[:max_tokens]` (full blocks
        only), and the chain hashes of those blocks."""
        blocks: list[int] = []
        hashes: list[int] = []
        if not self.enable_prefix_caching:
            return blocks, hashes
        prev = None
        bs = self.block_size
        for start in range(0, max_tokens - bs + 1, bs):
            tokens = tuple(token_ids[start : start + bs])
            h = chain_hash(prev, tokens)
            block = self.cached.get(h)
            if block is None or self.block_keys[block][1:] != (tokens, prev):
                break
            blocks.append(block)
            hashes.append(h)
            prev = h
        return blocks, hashes

    def register(self, block: int, prev: int | None, tokens: Sequence[int]) -> int:
        """Record a newly filled block in the prefix cache; returns its chain hash."""
        h = chain_hash(prev, tokens)
        if self.enable_prefix_caching and block not in self.block_keys:
            self.block_keys[block] = (h, tuple(tokens), prev)
            self.cached.setdefault(h, block)
        return h

    def _forget(self, block: int) -> None:
        key = self.block_keys.pop(block, None)
        if key is not None and self.cached.get(key[0]) == block:
            del self.cached[key[0]]

    def audit(self, tables: Iterable[Sequence[int]]) -> None:
        """Check the ledger against the block tables of every live request: each block's ref
        count equals the number of tables holding it, no referenced block is free, free + used is
        the whole pool, and the prefix-cache map points only at blocks that carry that hash."""
        holders = [0] * self.num_blocks
        for table in tables:
            for block in table:
                holders[block] += 1
        problems = [
            f"block {b}: ref count {self.ref_counts[b]}, held by {holders[b]} tables"
            for b in range(self.num_blocks)
            if self.ref_counts[b] != holders[b]
        ]
        problems += [f"block {b} is free but referenced" for b in self.free if self.ref_counts[b]]
        used = sum(1 for c in self.ref_counts if c > 0)
        if used + self.num_free != self.num_blocks:
            problems.append(f"{used} used + {self.num_free} free != {self.num_blocks} blocks")
        problems += [
            f"prefix map: hash {h} -> block {b} which carries another hash"
            for h, b in self.cached.items()
            if self.block_keys.get(b, (None,))[0] != h
        ]
        if problems:
            raise AssertionError("KV block ledger is inconsistent: " + "; ".join(problems[:10]))
