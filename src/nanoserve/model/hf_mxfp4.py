"""Hugging Face's MXFP4 experts (gpt-oss's checkpoints, `quantization_config` of quant_method
"mxfp4") as GGUF's MXFP4 blocks, which the CPU kernels take as they are.

An experts matrix NAME (gate_up_proj, down_proj) is stored as NAME_blocks [experts, rows, K / 32,
16] of uint8 and NAME_scales [experts, rows, K / 32] of uint8, rows the matrix's output features:
each block of 32 values along K is 16 bytes of 4-bit FP4 codes (value 2b in byte b's low nibble,
2b + 1 in its high one) and an E8M0 exponent e (the block's scale 2^(e - 127)). GGUF's block is 17
bytes: e, then value j in byte j's low nibble and j + 16 in its high one; the codes and the
exponent mean the same (ggml's doubled FP4 values times 2^(e - 128)). So a block is its bytes'
nibbles put in another order, and the float checkpoint's layout of NAME, [experts, K, rows], is
the de-quantized blocks transposed.
"""

from __future__ import annotations

import torch

from nanoserve.kernels import QuantizedWeight, dequantize

PARTS = ("_blocks", "_scales")
BLOCK = 32  # values of a block
BLOCK_BYTES = 17  # GGUF's: the exponent, 16 bytes of codes
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # stored so (a layer's names)


def part_of(name: str) -> tuple[str, str] | None:
    """(the matrix's stored name, "_blocks" or "_scales") of one of an MXFP4 matrix's two
    tensors, or None."""
    for part in PARTS:
        if name.endswith(part) and name[: -len(part)].endswith(EXPERTS):
            return name[: -len(part)], part
    return None


def float_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The float checkpoint's shape of the matrix whose NAME_blocks has this shape (any other
    rank than 4 is kept as it is, for the shape check to name)."""
    if len(blocks_shape) != 4:
        return blocks_shape
    experts, rows, blocks, _ = blocks_shape
    return (experts, blocks * BLOCK, rows)


def as_ggml(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """GGUF's MXFP4 bytes [experts, rows, K / 32 * 17] of a matrix's NAME_blocks and
    NAME_scales."""
    codes = torch.stack((blocks & 15, blocks >> 4), dim=-1).flatten(-2)  # value j at j
    packed = codes[..., : BLOCK // 2] | (codes[..., BLOCK // 2 :] << 4)
    return torch.cat((scales.unsqueeze(-1), packed), dim=-1).flatten(-2)


def kept(ggml: torch.Tensor) -> QuantizedWeight:
    """Experts' GGUF bytes [experts, rows, row_bytes] as the kernels keep them: the experts' rows
    one after the other (copied into one contiguous, aligned buffer)."""
    experts, rows, row_bytes = ggml.shape
    data = ggml.reshape(experts * rows, row_bytes).contiguous()
    return QuantizedWeight(data, "mxfp4", (experts * rows, row_bytes // BLOCK_BYTES * BLOCK))


def as_floats(ggml: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float checkpoint's tensor [experts, K, rows] of dtype that the bytes hold."""
    experts, rows, _ = ggml.shape
    values = dequantize(kept(ggml)).view(experts, rows, -1)
    return values.transpose(1, 2).to(dtype).contiguous()
