"""CPU weights in transparent huge pages (Linux).

A decode step at small batch streams every weight from memory once. With 4 KiB pages the walk
through the weights misses the TLB every page; 2 MiB pages take 512 times fewer misses. An
anonymous private mapping advised MADV_HUGEPAGE gets huge pages when first touched wherever the
kernel's THP mode is "madvise" or "always".
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 * 2**20
ALIGN = 64


def pack(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of CPU `tensors` laid out in one huge-page mapping (a tensor listed twice is
    copied once); the tensors themselves where the platform has no MADV_HUGEPAGE."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return tensors
    unique = list({id(t): t for t in tensors}.values())
    size = sum(-(-t.nbytes // ALIGN) * ALIGN for t in unique) + HUGE_PAGE
    arena = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arena.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(arena, dtype=torch.uint8)  # holds the mapping while a view lives
    offset = -raw.data_ptr() % HUGE_PAGE
    copies = {}
    for t in unique:
        view = raw[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
        copies[id(t)] = view.copy_(t)
        offset += -(-t.nbytes // ALIGN) * ALIGN
    return [copies[id(t)] for t in tensors]
