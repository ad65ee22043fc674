"""The C backend: hands data pointers, sizes and a dtype code to the compiled module _C.

_C is built from the files in csrc/ by `pip install` (setup.py), which fails if it cannot build
it. A source tree that was never built has no _C: every CPU kernel call then raises
BackendUnavailableError with BUILD_HINT, never falling back to slower code in silence.
"""

import torch

from .errors import BackendUnavailableError

try:
    from . import _C
except ImportError as e:
    _C = None
    _IMPORT_ERROR = str(e)
else:
    _IMPORT_ERROR = ""

BUILD_HINT = (
    f"the C kernels nanoserve.kernels._C are not built ({_IMPORT_ERROR or 'not found'}); build "
    "them with gcc installed: `pip install -e .` from the repository root"
)
# The CPU ops take the C kernels while this is True; tests set it to False to run the torch
# paths that a GPU takes, on the CPU.
ENABLED = True


def enabled() -> bool:
    """True when CPU ops go to C; raises if they should but the module was never built."""
    if ENABLED and _C is None:
        raise BackendUnavailableError(BUILD_HINT)
    return ENABLED


DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    num_blocks, num_kv_heads, block_size, head_dim = k_cache.shape
    # The C module checks context_lens and the used block_tables entries before reading the cache.
    _C.paged_attention_decode(
        out.data_ptr(),
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        context_lens.data_ptr(),
        q.shape[0],
        q.shape[1],
        num_kv_heads,
        head_dim,
        block_size,
        num_blocks,
        block_tables.shape[1],
        float(scale),
        DTYPE_CODES[q.dtype],
        torch.get_num_threads(),  # one thread setting for torch and the kernel
    )


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_blocks, num_kv_heads, block_size, head_dim = k_cache.shape
    _C.store_kv(
        key.data_ptr(),
        value.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slot_mapping.data_ptr(),
        key.shape[0],
        num_kv_heads,
        head_dim,
        block_size,
        num_blocks,
        key.element_size(),
        int(slot_mapping.dtype == torch.int64),
    )


def small_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    _C.small_linear(
        out.data_ptr(),
        x.data_ptr(),
        w.data_ptr(),
        x.shape[0],
        w.shape[0],
        x.shape[1],
        DTYPE_CODES[x.dtype],
        torch.get_num_threads(),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    _C.rms_norm(
        out.data_ptr(),
        x.data_ptr(),
        weight.data_ptr(),
        x.shape[0],
        x.shape[1],
        float(eps),
        DTYPE_CODES[x.dtype],
        torch.get_num_threads(),
    )


def rope_(
    qk: torch.Tensor, heads: int, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    _C.rope(
        qk.data_ptr(),
        positions.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        qk.shape[0],
        heads,
        cos.shape[1],
        qk.stride(0),
        cos.shape[0],
        DTYPE_CODES[qk.dtype],
        torch.get_num_threads(),
    )


def decode_layers(
    h: torch.Tensor,
    layers: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    num_blocks: int,
    block_size: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    eps: float,
    scale: float,
) -> None:
    _C.decode_layers(
        h.data_ptr(),
        layers.data_ptr(),
        layers.shape[0],
        positions.data_ptr(),
        slots.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        cos.shape[0],
        block_tables.data_ptr(),
        context_lens.data_ptr(),
        block_tables.shape[1],
        block_size,
        num_blocks,
        h.shape[0],
        h.shape[1],
        heads,
        kv_heads,
        cos.shape[1],
        intermediate,
        float(eps),
        float(scale),
        DTYPE_CODES[h.dtype],
        torch.get_num_threads(),
    )
