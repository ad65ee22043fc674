"""The paged KV cache's tensors and geometry: per-layer key/value tensors shaped in blocks, their
size in bytes, and the block arithmetic (`cdiv`, `slot`) that everything else uses. Which block
belongs to whom is the block pool's (engine/block_pool.py), behind the KV cache manager.

The tensors are allocated unwritten, then written whole (`take_cache`) once the engine has
checked that they fit in memory (engine/memory.py): on a CPU an unwritten page is not yet
memory, and a pool taken a page at a time under load runs out of memory hours after start. On a
CPU the whole pool is one anonymous mapping, which one write a page takes.
"""

from __future__ import annotations

import math
import mmap
import sys
import weakref
from collections.abc import Sequence

import torch

from nanoserve.kernels import cache_row_width

_FRESH: set[int] = set()  # storages of allocate_cache's mappings not yet taken: all zeros


def cdiv(a: int, b: int) -> int:
    """a / b rounded up: the blocks that `a` tokens take, at `b` tokens a block."""
    return -(-a // b)


def slot(block_table: Sequence[int], position: int, block_size: int) -> int:
    """The cache slot (block * block_size + row) that holds token `position` of a sequence."""
    return block_table[position // block_size] * block_size + position % block_size


def block_bytes(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes across all layers, keys and values (a q8_0 cache: 34 bytes per 32
    values)."""
    row = cache_row_width(head_dim, dtype) * dtype.itemsize
    return 2 * num_layers * num_kv_heads * block_size * row


def allocate_cache(
    num_layers: int,
    num_blocks: int,
    num_kv_heads: int,
    block_size: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str | torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, keys and values shaped [num_blocks, num_kv_heads, block_size, head_dim] (a q8_0
    cache's last axis: bytes, nanoserve.kernels.cache_row_width); on a CPU, views of one
    anonymous mapping."""
    shape = (num_blocks, num_kv_heads, block_size, cache_row_width(head_dim, dtype))
    # Not written yet: the engine checks that the pool fits before take_cache writes it.
    if torch.device(device).type == "cpu" and hasattr(mmap, "MAP_ANONYMOUS"):
        pool = _mapped((2 * num_layers, *shape), dtype)
        return [(pool[2 * i], pool[2 * i + 1]) for i in range(num_layers)]
    return [
        (
            torch.empty(shape, dtype=dtype, device=device),
            torch.empty(shape, dtype=dtype, device=device),
        )
        for _ in range(num_layers)
    ]


def take_cache(caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Write every page of the cache, so that the memory is the process's from now on. A CPU
    pool fresh from allocate_cache is one anonymous mapping whose pages the kernel hands out as
    zeros: one write a page holds it, a zero at the start of each (torch's strided fill, on its
    intra-op threads), which is faster than writing every byte, the pages' zeroing being the
    kernel's. Any other cache is written whole with zeros. Nothing reads the zeros (a slot is
    read only after its token was stored), but no uninitialized NaN is left either."""
    pages = _fresh_pages(caches)
    if pages is not None:
        pages.zero_()
        return
    for keys, values in caches:
        keys.zero_()
        values.zero_()


_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" else 0)


def _mapped(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An unwritten tensor filling an anonymous private mapping of its own (which its storage
    holds while any view of it lives)."""
    nbytes = math.prod(shape) * dtype.itemsize
    # Not charged against the commit limit when mapped: the engine checks that the pool fits in
    # what may be taken before it writes a page, and that check, not the kernel's heuristic
    # refusal of a mapping larger than the machine (an OSError), is what names the setting.
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
    pages = mmap.mmap(-1, max(nbytes, 1), flags=flags)
    raw = torch.frombuffer(pages, dtype=torch.uint8)
    _FRESH.add(raw.data_ptr())
    weakref.finalize(pages, _FRESH.discard, raw.data_ptr())
    return raw[:nbytes].view(dtype).view(shape)


def _fresh_pages(caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
    """The first byte of each page of the fresh mapping that all of `caches` are views of (no
    longer fresh once this returns), or None where they are not all views of one."""
    tensors = [t for pair in caches for t in pair]
    if not tensors or tensors[0].device.type != "cpu":
        return None
    storage = tensors[0].untyped_storage()
    ptr = storage.data_ptr()
    if ptr not in _FRESH or any(t.untyped_storage().data_ptr() != ptr for t in tensors):
        return None
    _FRESH.discard(ptr)
    raw = torch.empty(0, dtype=torch.uint8).set_(storage)
    return raw[:: mmap.PAGESIZE]
