"""A GGUF file's header in one pass: its metadata (key -> value, as gguf's `field.contents()`
gives it) and its tensor table.

gguf.GGUFReader builds a numpy view for every item of every array, and a vocabulary with its merges
has hundreds of thousands of items; here strings are sliced from a memory map and number arrays read
with one np.frombuffer each. The layout (GGUF versions 2 and 3, little-endian): the magic "GGUF",
the version (u32), the tensor and key counts (u64), the keys (a string, a value type (u32), the
value), the tensor infos (a name, the dimension count (u32), the dimensions (u64 each, innermost
first), the type (u32), the offset (u64) from the data section, which starts at the next multiple of
general.alignment (32 when absent)). A string is its length (u64) and its bytes. ValueError for
anything else, or a file that ends early.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nanoserve.model.ggml_types import BLOCK_SIZES, GGMLType

# Value type -> struct format; 8 is a string, 9 an array (an item type, a count, the items).
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}  # fmt: skip
STRING, ARRAY = 8, 9
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    tensor_type: GGMLType
    shape: tuple[int, ...]  # innermost first, as the file lists them
    data_offset: int  # from the start of the file
    n_bytes: int


class _Cursor:
    def __init__(self, data: mmap.mmap) -> None:
        self.data, self.pos = data, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        return self.strings(1)[0]

    def strings(self, count: int) -> list[str]:
        """`count` strings, each its length (u64) and its bytes, in one loop of local names (a
        vocabulary is 49k-256k of them, so the per-string cost is what counts)."""
        data, pos, end = self.data, self.pos, len(self.data)
        out: list[str] = []
        length, append = _U64.unpack_from, out.append
        for _ in range(count):
            (n,) = length(data, pos)
            pos += 8
            if pos + n > end:
                raise ValueError("a string runs past the end of the file")
            append(data[pos : pos + n].decode("utf-8", errors="replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, kind: int) -> Any:
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item in SCALARS and item != 7:
                dtype = np.dtype(SCALARS[item])
                if self.pos + count * dtype.itemsize > len(self.data):
                    raise ValueError("an array runs past the end of the file")
                values = np.frombuffer(self.data, dtype, count, self.pos).tolist()
                self.pos += count * dtype.itemsize
                return values
            if item == STRING:
                return self.strings(count)
            return [self.value(item) for _ in range(count)]
        if kind not in SCALARS:
            raise ValueError(f"unknown value type {kind}")
        return self.scalar(SCALARS[kind])


def read_header(path: Path) -> tuple[dict[str, Any], list[TensorInfo]]:
    """(metadata, tensors) of the GGUF file at path; ValueError where it is not one."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        try:
            return _parse(_Cursor(data))
        except struct.error as e:
            raise ValueError(f"the header ends early ({e})") from None


def _parse(c: _Cursor) -> tuple[dict[str, Any], list[TensorInfo]]:
    if c.data[:4] != b"GGUF":
        raise ValueError("no GGUF magic")
    c.pos = 4
    version = c.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (nanoserve reads 2 and 3, little-endian)")
    n_tensors, n_keys = c.scalar("<Q"), c.scalar("<Q")
    meta: dict[str, Any] = {}
    for _ in range(n_keys):
        key = c.string()
        meta[key] = c.value(c.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        dims = tuple(c.scalar("<Q") for _ in range(c.scalar("<I")))
        infos.append((name, dims, GGMLType(c.scalar("<I")), c.scalar("<Q")))
    alignment = int(meta.get("general.alignment", 32))
    start = -(-c.pos // alignment) * alignment
    tensors = []
    for name, dims, qtype, offset in infos:
        block, type_bytes = BLOCK_SIZES[qtype]
        n_bytes = math.prod(dims) // block * type_bytes
        tensors.append(TensorInfo(name, qtype, dims, start + offset, n_bytes))
    return meta, tensors
