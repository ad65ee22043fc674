"""nanoserve's kernels: paged attention, the CPU decode helpers and matmuls on GGUF blocks, one
API (api.py) over the torch reference, C with OpenMP (the _C module setup.py builds from
kernels/csrc) and Triton. Imports nothing of nanoserve.

- Paged attention: paged_attention_decode (a token per sequence) and paged_attention_prefill (a
  sequence's chunk of tokens, causal) read the paged KV cache ([num_blocks, num_kv_heads,
  block_size, head_dim]), of float32, bfloat16, float16 or, on the CPU, llama.cpp's q8_0 blocks
  (KV_Q8_0: uint8 rows of cache_row_width bytes; q8_0_quantize and q8_0_dequantize are their
  reference); store_kv writes new tokens into it. backend="auto" picks the C kernel
  for CPU tensors and, for CUDA tensors, Triton (decode) or the torch reference (prefill); a C
  module that was not built is an error (BackendUnavailableError), never a silent fallback.
- The CPU decode helpers: small_linear is F.linear for a few rows (the batch-1 decode GEMV) at
  memory speed; rms_norm, rope_ and gated_mul do RMSNorm, rotary embedding and the gated MLP's
  activation (SwiGLU or GELU-tanh) in one C call each; route_experts a mixture of experts'
  routing.
- Matmuls on GGUF blocks (quant.py): quantized_linear multiplies by a matrix kept in one of
  llama.cpp's block formats (QUANT_TYPES, the C module's table of formats) on the CPU's best
  instruction set (cpu_isa()), its input rounded to int16 (ACTIVATIONS); expert_linear does it
  for all of a mixture of experts' chosen experts in one call (llama.cpp's MUL_MAT_ID).
"""

from .api import (
    BACKENDS,
    CACHE_DTYPES,
    SMALL_LINEAR_MAX_ROWS,
    BackendUnavailableError,
    argmax,
    available_backends,
    cache_row_width,
    clamped_swiglu,
    gated_mul,
    paged_attention_decode,
    paged_attention_prefill,
    rms_norm,
    rope_,
    route_experts,
    small_linear,
    store_kv,
)
from .quant import (
    ACTIVATIONS,
    QUANT_TYPES,
    QuantizedParts,
    QuantizedWeight,
    aligned_bytes,
    cpu_isa,
    dequantize,
    expert_linear,
    quantize,
    quantized_linear,
)
from .torch_ref import KV_Q8_0, q8_0_dequantize, q8_0_quantize

__all__ = [
    "ACTIVATIONS",
    "BACKENDS",
    "CACHE_DTYPES",
    "KV_Q8_0",
    "SMALL_LINEAR_MAX_ROWS",
    "BackendUnavailableError",
    "QUANT_TYPES",
    "QuantizedParts",
    "QuantizedWeight",
    "aligned_bytes",
    "argmax",
    "available_backends",
    "cache_row_width",
    "clamped_swiglu",
    "cpu_isa",
    "dequantize",
    "expert_linear",
    "paged_attention_decode",
    "paged_attention_prefill",
    "q8_0_dequantize",
    "q8_0_quantize",
    "quantize",
    "quantized_linear",
    "rms_norm",
    "rope_",
    "route_experts",
    "gated_mul",
    "small_linear",
    "store_kv",
]
