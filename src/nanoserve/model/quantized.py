"""Weights kept in llama.cpp's GGUF block formats on the CPU (the kernels' QUANT_TYPES): the
matmul by such a matrix, the embedding lookup from one, row concatenation (for the fused q/k/v and
gate/up), placement of their bytes, and quantizing a float checkpoint's matrices at load
(`--quantization`). Activations stay float32. Owns nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeAlias

import torch

from nanoserve.kernels import QUANT_TYPES, QuantizedWeight, dequantize, quantize, quantized_linear

Weight: TypeAlias = torch.Tensor | QuantizedWeight


class QuantLinear:
    """x @ weight.T with the weight in GGUF blocks: one C call, integer dot products."""

    gemv = False  # not the float GEMV (the one-call decode step takes the blocks as they are)
    packed = None

    def __init__(self, weight: QuantizedWeight) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return quantized_linear(x.float().contiguous(), self.weight)


def embed_rows(table: QuantizedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of an embedding kept in blocks, de-quantized (float32)."""
    return dequantize(table, rows=ids)


def cat_rows(parts: Sequence[Weight]) -> Weight:
    """Matrices stacked by rows: the blocks' bytes when every part has the same block format;
    otherwise the floats (a part in blocks de-quantized to the float parts' dtype)."""
    if all(isinstance(p, QuantizedWeight) for p in parts):
        qtypes = {p.qtype for p in parts}  # type: ignore[union-attr]
        if len(qtypes) == 1:
            data = torch.cat([p.data for p in parts])  # type: ignore[union-attr]
            rows = sum(p.shape[0] for p in parts)
            return QuantizedWeight(data, qtypes.pop(), (rows, parts[0].shape[1]))
    floats = [p for p in parts if isinstance(p, torch.Tensor)]
    dtype = floats[0].dtype if floats else torch.float32
    return torch.cat([as_float(p, dtype) for p in parts])


def as_float(w: Weight, dtype: torch.dtype) -> torch.Tensor:
    return dequantize(w).to(dtype) if isinstance(w, QuantizedWeight) else w


def placed(
    weights: list[Weight], place: Callable[[list[torch.Tensor]], list[torch.Tensor]]
) -> list[Weight]:
    """`place` (copies of tensors, e.g. into huge pages) applied to floats and blocks alike."""
    tensors = [w.data if isinstance(w, QuantizedWeight) else w for w in weights]
    moved = iter(place(tensors))
    out: list[Weight] = []
    for w in weights:
        t = next(moved)
        out.append(QuantizedWeight(t, w.qtype, w.shape) if isinstance(w, QuantizedWeight) else t)
    return out


def quantize_matrices(raw: dict[str, torch.Tensor], qtype: str) -> dict[str, Weight]:
    """Every matrix of a float checkpoint (Hugging Face names) quantized to `qtype`, as llama.cpp
    quantizes a file: the embedding and the output projection too; norms stay float."""
    if qtype not in QUANT_TYPES:
        raise ValueError(f"quantization must be one of {', '.join(QUANT_TYPES)}, got {qtype!r}")
    out: dict[str, Weight] = {}
    for name in list(raw):
        t = raw.pop(name)
        out[name] = quantize(t.float(), qtype) if t.dim() == 2 else t
    return out


def formats(weights: Sequence[Weight]) -> dict[str, int]:
    """How many matrices are in each block format, and how many are float ("float")."""
    counts: dict[str, int] = {}
    for w in weights:
        key = w.qtype if isinstance(w, QuantizedWeight) else "float"
        if isinstance(w, QuantizedWeight) or w.dim() == 2:
            counts[key] = counts.get(key, 0) + 1
    return counts
