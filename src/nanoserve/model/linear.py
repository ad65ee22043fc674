"""A weight matrix of the forward pass and the fastest way to multiply by it on each device.

On the CPU a matmul of up to 4 rows (decode at small batch) goes to the C GEMV, which streams the
weights at memory speed; more rows go to oneDNN with the weight prepacked into its blocked layout,
which it multiplies faster than F.linear does the plain one (bench/bench_kernels.py measures
both). The packed copy doubles the weights' memory on the CPU.
Elsewhere, or where oneDNN is missing, F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve.kernels import SMALL_LINEAR_MAX_ROWS, c_backend, small_linear

PACK_ROWS_HINT = 64  # oneDNN picks its blocking for about this many rows; any count works


class Linear:
    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight  # [out_features, in_features]
        cpu = (
            weight.device.type == "cpu"
            and weight.dtype in (torch.float32, torch.bfloat16)
            and weight.is_contiguous()
        )
        self.gemv = cpu and c_backend.enabled()  # the C GEMV for a few rows
        # The most rows that take the GEMV, SMALL_LINEAR_MAX_ROWS at a time (more: oneDNN). A
        # mixture of experts' router beside blocks takes up to the C step's 16 (model/llama.py).
        self.gemv_rows = SMALL_LINEAR_MAX_ROWS
        self.packed = _onednn_pack(weight) if cpu else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T for x [rows, in_features] of the weight's dtype and device."""
        rows = x.shape[0]
        if self.gemv and rows <= SMALL_LINEAR_MAX_ROWS:
            return small_linear(x.contiguous(), self.weight)
        if self.gemv and rows <= self.gemv_rows:
            out = torch.empty((rows, self.weight.shape[0]), dtype=x.dtype)
            for r in range(0, rows, SMALL_LINEAR_MAX_ROWS):
                n = min(SMALL_LINEAR_MAX_ROWS, rows - r)
                small_linear(x[r : r + n].contiguous(), self.weight, out[r : r + n])
            return out
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(
                x.contiguous(), self.packed, None, "none", [None], ""
            )
        return F.linear(x, self.weight)


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN takes weights of `dtype` here: float32 wherever oneDNN is built in; bfloat16
    only where oneDNN reports native bf16 support (AVX-512 BW/VL/DQ or AVX-NE-CONVERT, as capped
    by ONEDNN_MAX_CPU_ISA), because its reorder refuses bf16 elsewhere."""
    ops = torch.ops.mkldnn
    if not torch.backends.mkldnn.is_available() or not hasattr(ops, "_linear_pointwise"):
        return False
    if dtype == torch.bfloat16:
        return bool(ops._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in oneDNN's blocked layout, or None where oneDNN cannot take it."""
    if not onednn_packs(weight.dtype):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
