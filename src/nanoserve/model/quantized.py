"""Weights kept in llama.cpp's GGUF block formats on the CPU (the kernels' QUANT_TYPES): the
matmul by such a matrix, the embedding lookup from one, row concatenation (for the fused q/k/v and
gate/up: parts in different formats stay in their own, QuantizedParts), placement of their bytes,
and quantizing a float checkpoint's matrices at load (`--quantization`). Activations stay float32.
Owns nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import groupby
from typing import TypeAlias

import torch

from nanoserve.kernels import (
    QUANT_TYPES,
    QuantizedParts,
    QuantizedWeight,
    dequantize,
    quantize,
    quantized_linear,
)

Blocks: TypeAlias = QuantizedWeight | QuantizedParts  # a matrix kept in GGUF blocks
Weight: TypeAlias = torch.Tensor | Blocks


class QuantLinear:
    """x @ weight.T with the weight in GGUF blocks: one C call, integer dot products."""

    gemv = False  # not the float GEMV (the one-call decode step takes the blocks as they are)
    packed = None

    def __init__(self, weight: Blocks) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return quantized_linear(x.float().contiguous(), self.weight)


def embed_rows(table: QuantizedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of an embedding kept in blocks, de-quantized (float32)."""
    return dequantize(table, rows=ids)


def cat_rows(parts: Sequence[Weight]) -> Weight:
    """Matrices stacked by rows: the blocks' bytes when every part has the same block format;
    each part in its own blocks (QuantizedParts) when they are in blocks of different formats;
    otherwise the floats (a part in blocks de-quantized to the float parts' dtype: a file that
    mixes floats and blocks in one fused matrix, which llama.cpp's quantizer does not write)."""
    blocks = [p for p in parts if isinstance(p, QuantizedWeight)]
    if len(blocks) == len(parts):
        runs = [list(run) for _, run in groupby(blocks, key=lambda p: p.kernel_qtype)]
        joined = tuple(_joined(run) for run in runs)  # neighbours of one format share a part
        return joined[0] if len(joined) == 1 else QuantizedParts(joined)
    floats = [p for p in parts if isinstance(p, torch.Tensor)]
    dtype = floats[0].dtype if floats else torch.float32
    return torch.cat([as_float(p, dtype) for p in parts])


def _joined(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Blocks of one format stacked by rows: their bytes (a view where they already lie one
    after the other, as a GGUF's parts do in huge pages)."""
    if len(parts) == 1:
        return parts[0]
    first, rows = parts[0].data, sum(p.data.shape[0] for p in parts)
    storage = first.untyped_storage().data_ptr()
    ends = [p.data.data_ptr() + p.data.nbytes for p in parts[:-1]]
    if all(
        end == p.data.data_ptr() and p.data.untyped_storage().data_ptr() == storage
        for end, p in zip(ends, parts[1:], strict=True)
    ):  # one after the other in one buffer
        data = first.as_strided((rows, first.shape[1]), first.stride())
    else:
        data = torch.cat([p.data for p in parts])
    return QuantizedWeight(data, parts[0].qtype, (rows, parts[0].shape[1]), parts[0].repacked)


def as_float(w: Weight, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(w, QuantizedParts):
        return torch.cat([dequantize(p).to(dtype) for p in w.parts])
    return dequantize(w).to(dtype) if isinstance(w, QuantizedWeight) else w


def placed(
    weights: list[Weight], place: Callable[[list[torch.Tensor]], list[torch.Tensor]]
) -> list[Weight]:
    """`place` (copies of tensors, e.g. into huge pages) applied to floats and blocks alike."""
    tensors = [t for w in weights for t in _tensors(w)]
    moved = iter(place(tensors))
    out: list[Weight] = []
    for w in weights:
        if isinstance(w, QuantizedParts):
            out.append(QuantizedParts(tuple(_moved(p, next(moved)) for p in w.parts)))
        else:
            out.append(_moved(w, next(moved)) if isinstance(w, QuantizedWeight) else next(moved))
    return out


def _tensors(w: Weight) -> list[torch.Tensor]:
    if isinstance(w, QuantizedParts):
        return [p.data for p in w.parts]
    return [w.data if isinstance(w, QuantizedWeight) else w]


def _moved(w: QuantizedWeight, data: torch.Tensor) -> QuantizedWeight:
    return QuantizedWeight(data, w.qtype, w.shape, w.repacked)


def quantize_matrices(raw: dict[str, torch.Tensor], qtype: str) -> dict[str, Weight]:
    """Every matrix of a float checkpoint (Hugging Face names) quantized to `qtype`, as llama.cpp
    quantizes a file: the embedding and the output projection too, and a GGUF's stacked experts
    tensor [experts, rows, columns] as one run of blocks [experts * rows, columns] (the blocks of
    each expert's matrix, expert after expert); norms stay float."""
    if qtype not in QUANT_TYPES:
        raise ValueError(f"quantization must be one of {', '.join(QUANT_TYPES)}, got {qtype!r}")
    out: dict[str, Weight] = {}
    for name in list(raw):
        t = raw.pop(name)
        out[name] = quantize(t.float().flatten(0, -2), qtype) if t.dim() in (2, 3) else t
    return out


def formats(weights: Sequence[Weight]) -> dict[str, int]:
    """How many matrices are in each block format, and how many are float ("float"); a fused
    matrix of parts in different formats counts each part."""
    counts: dict[str, int] = {}
    for w in weights:
        for m in w.parts if isinstance(w, QuantizedParts) else (w,):
            key = m.qtype if isinstance(m, QuantizedWeight) else "float"
            if isinstance(m, QuantizedWeight) or m.dim() == 2:
                counts[key] = counts.get(key, 0) + 1
    return counts
