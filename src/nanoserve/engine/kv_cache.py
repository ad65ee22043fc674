"""The paged KV cache's tensors and geometry: per-layer key/value tensors shaped in blocks, their
size in bytes, and the block arithmetic (`cdiv`, `slot`) that everything else uses. Which block
belongs to whom is the block pool's (engine/block_pool.py), behind the KV cache manager.

The tensors are allocated unwritten, then written whole (`take_cache`) once the engine has
checked that they fit in memory (engine/memory.py): on a CPU an unwritten page is not yet
memory, and a pool taken a page at a time under load runs out of memory hours after start. On a
CPU the whole pool is one anonymous mapping, so that the kernel can fault it in at once.
"""

from __future__ import annotations

import ctypes
import errno
import math
import mmap
import os
import sys
from collections.abc import Sequence

import torch

# madvise's advice to fault a range in writable, as a write to each page would (Linux 5.14+);
# called through ctypes, which lets go of the GIL meanwhile (mmap.madvise holds it).
MADV_POPULATE_WRITE = 23
# A call holds the process's memory map locked, and another thread's allocations wait: a chunk
# at a time, they wait at most a chunk's worth.
POPULATE_CHUNK = 64 * 2**20
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


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
    """Per layer, keys and values shaped [num_blocks, num_kv_heads, block_size, head_dim]; on a
    CPU, views of one anonymous mapping."""
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
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
    """Write every page of the cache, so that the memory is the process's from now on: the
    kernel faults a CPU pool's mapping in (MADV_POPULATE_WRITE, a chunk at a time), its pages the
    kernel's zeros; elsewhere, or on an older kernel, torch writes zeros on its intra-op threads.
    Faulting in takes about half the time of writing, and where memory runs out it is an error,
    not the OOM killer. Nothing reads the zeros (a slot is read only after its token was
    stored), but no uninitialized NaN is left either."""
    if _populated(caches):
        return
    for keys, values in caches:
        keys.zero_()
        values.zero_()


def _mapped(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An unwritten tensor filling an anonymous private mapping of its own (which its storage
    holds while any view of it lives)."""
    nbytes = math.prod(shape) * dtype.itemsize
    pages = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)


def _populated(caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether the kernel faulted in the one mapping that all of `caches` are views of; False
    where they are not (another device, or not allocate_cache's) or the kernel cannot."""
    tensors = [t for pair in caches for t in pair]
    if _LIBC is None or not tensors or tensors[0].device.type != "cpu":
        return False
    storage = tensors[0].untyped_storage()
    if any(t.untyped_storage().data_ptr() != storage.data_ptr() for t in tensors):
        return False
    for start in range(0, storage.nbytes(), POPULATE_CHUNK):
        size = min(POPULATE_CHUNK, storage.nbytes() - start)
        at = ctypes.c_void_p(storage.data_ptr() + start)
        if _LIBC.madvise(at, ctypes.c_size_t(size), MADV_POPULATE_WRITE) != 0:
            err = ctypes.get_errno()
            if err != errno.ENOMEM:  # EINVAL: a kernel older than 5.14
                return False
            raise MemoryError(f"the KV cache's {storage.nbytes() / 2**30:.2f} GiB could not be "
                              f"taken: {os.strerror(err)}")  # fmt: skip
    return True
