"""The paged KV cache's tensors and geometry: per-layer key/value tensors shaped in blocks, their
size in bytes, and the block arithmetic (`cdiv`, `slot`) that everything else uses. Which block
belongs to whom is the block pool's (engine/block_pool.py), behind the KV cache manager.

The tensors are allocated unwritten, then written whole (`take_cache`) once the engine has
checked that they fit in memory (engine/memory.py): on a CPU an unwritten page is not yet
memory, and a pool taken a page at a time under load runs out of memory hours after start.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def cdiv(a: int, b: int) -> int:
    """a / b rounded up: the blocks that `a` tokens take, at `b` tokens a block."""
    return -(-a // b)


def slot(block_table: Sequence[int], position: int, block_size: int) -> int:
    """The cache slot (block * block_size + row) that holds token `position` of a sequence."""
    return block_table[position // block_size] * block_size + position % block_size


def block_bytes(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes across all layers, keys and values."""
    return 2 * num_layers * num_kv_heads * block_size * head_dim * dtype.itemsize


def allocate_cache(
    num_layers: int,
    num_blocks: int,
    num_kv_heads: int,
    block_size: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str | torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, keys and values shaped [num_blocks, num_kv_heads, block_size, head_dim]."""
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    # Not written yet: the engine checks that the pool fits before take_cache writes it.
    return [
        (
            torch.empty(shape, dtype=dtype, device=device),
            torch.empty(shape, dtype=dtype, device=device),
        )
        for _ in range(num_layers)
    ]


def take_cache(caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Write every page of the cache (zeros), so that the memory is the process's from now on.
    torch's fill runs on its intra-op threads; nothing reads the zeros (a slot is read only after
    its token was stored), but no uninitialized NaN is left either."""
    for keys, values in caches:
        keys.zero_()
        values.zero_()
