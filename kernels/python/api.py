"""The public kernel API: argument checks, then dispatch to the torch, C or Triton backend.

Every user-visible error is raised here and names the argument at fault; the values of index
tables (positions, slots, block tables, context lengths) are checked by the C module, their one
home: the C kernels check them at C speed, and the torch and Triton paths on CPU tensors call the
same checks (c_backend.check_*). On CUDA tensors values are not checked (reading them would wait
for the device). Backends receive checked tensors (contiguous, but for rope_'s qk, whose rows may
be strided) and do no checks of their own.
"""

import importlib.util
import math
import numbers
from types import ModuleType

import torch

from . import c_backend, torch_ref
from .errors import BackendUnavailableError
from .torch_ref import KV_Q8_0, Q8_0_BYTES, Q8_0_VALUES

BACKENDS = ("auto", "torch", "c", "triton")
# KV_Q8_0 (uint8): a cache of q8_0 rows, head_dim / 32 * 34 bytes each (CPU: the torch and c
# backends).
CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, KV_Q8_0)
_Q_LAYOUT = "[num_seqs, num_q_heads, head_dim]"
_CACHE_LAYOUT = "[num_blocks, num_kv_heads, block_size, head_dim]"
_KV_LAYOUT = "[num_tokens, num_kv_heads, head_dim]"


def cache_row_width(head_dim: int, dtype: torch.dtype) -> int:
    """The last axis of a KV cache of dtype for rows of head_dim values: head_dim, or a q8_0
    cache's bytes (head_dim a multiple of 32)."""
    if dtype != KV_Q8_0:
        return head_dim
    if head_dim % Q8_0_VALUES:
        raise ValueError(f"a q8_0 KV cache needs head_dim a multiple of 32, got {head_dim}")
    return head_dim // Q8_0_VALUES * Q8_0_BYTES


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged KV cache; returns out.

    q [num_seqs, num_q_heads, head_dim]; k_cache, v_cache [num_blocks, num_kv_heads, block_size,
    head_dim] of one dtype, float32, bfloat16 or float16, or [..., head_dim / 32 * 34] uint8 of
    q8_0 rows (KV_Q8_0); q (and out) float32 or of the cache's dtype: float32 q with a bfloat16
    or float16 cache (float32 activations over a 16-bit cache) on the torch and c backends, q of
    the cache's dtype on every backend; float32 or bfloat16 q with a q8_0 cache on the torch and
    c backends. The cache is widened (de-quantized) to float32 as it is read, the softmax and
    sums are float32, out is rounded to q's dtype.
    block_tables [num_seqs, max_blocks_per_seq] int32, of which only the first
    ceil(context_lens[i] / block_size) entries of row i are read; context_lens [num_seqs] int32,
    tokens attended to, the current one included.
    backend: "auto" (triton for CUDA tensors, c for CPU tensors), "torch", "c" or "triton".
    window: a sliding window, > 0: the query (at position context_lens[i] - 1) attends to the
    last `window` positions only; 0: to all.
    sinks: None, or [num_q_heads] float32 attention sinks (gpt-oss): each head's learned logit
    joins its softmax's denominator and weights no value (torch and c backends).
    """
    _check_decode(q, k_cache, v_cache, block_tables, context_lens, scale, out)
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an int >= 0, got {window!r}")
    _check_sinks(sinks, q)
    if out is None:
        out = torch.empty_like(q)
    impl = _backend(backend, q.device)
    _check_backend_dtypes(impl, "q", q, k_cache)
    if impl is not c_backend and q.device.type == "cpu":
        c_backend.check_tables(block_tables, context_lens, k_cache.shape[0], k_cache.shape[2])
    extra: dict[str, object] = {"window": window} if window else {}
    if sinks is not None:
        if impl not in (c_backend, torch_ref):
            raise BackendUnavailableError("attention sinks (gpt-oss) have no Triton kernel")
        extra["sinks"] = sinks
    impl.paged_attention_decode(
        q, k_cache, v_cache, block_tables, context_lens, scale, out, **extra
    )
    return out


PREFILL_Q_DTYPES = (torch.float32, torch.bfloat16)


def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of one sequence's chunk of new tokens over its paged KV cache; returns out.

    q [num_tokens, num_q_heads, head_dim], float32 or bfloat16: the queries at positions
    context_len - num_tokens ... context_len - 1, each attending to the positions up to its own.
    Keys and values are read from k_cache, v_cache [num_blocks, num_kv_heads, block_size,
    head_dim] (float32, bfloat16 or float16, or q8_0 rows as in paged_attention_decode, whatever
    q's dtype: the softmax is in float32), which must already hold the chunk's own rows (store_kv
    first); block_table [n] int32, of which the first ceil(context_len / block_size) entries are
    read. window > 0: position p sees (p - window, p] only. out: like q. backend: "auto" (c for
    CPU tensors; torch, the gather-and-mask reference, for CUDA tensors, where the model's prefill
    uses torch SDPA instead), "c" or "torch". sinks: as in paged_attention_decode.
    """
    _check_prefill(q, k_cache, v_cache, block_table, context_len, scale, out, window)
    _check_sinks(sinks, q)
    if out is None:
        out = torch.empty_like(q)
    if backend == "triton":
        raise BackendUnavailableError("paged_attention_prefill has no Triton kernel: use 'torch'")
    impl = _backend("torch" if backend == "auto" and q.device.type != "cpu" else backend, q.device)
    if impl is not c_backend and q.device.type == "cpu":
        c_backend.check_prefill_table(
            block_table, context_len, q.shape[0], k_cache.shape[0], k_cache.shape[2]
        )
    if q.shape[0]:
        impl.paged_attention_prefill(
            q, k_cache, v_cache, block_table, context_len, scale, out, window=window, sinks=sinks
        )
    return out


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: str = "auto",
) -> None:
    """Writes key[i] and value[i] ([num_tokens, num_kv_heads, head_dim]) into cache slot
    slot_mapping[i] = block * block_size + offset; a negative slot is skipped.

    k_cache and v_cache of one dtype, float32, bfloat16 or float16, or q8_0 rows (KV_Q8_0);
    key and value of one dtype, float32 or the cache's: float32 keys are rounded to a 16-bit
    cache as stored (to nearest even, as key.to(k_cache.dtype)) on the torch and c backends;
    keys of the cache's dtype are copied on every backend. A q8_0 cache takes float32 or
    bfloat16 keys, quantized as stored (torch_ref.q8_0_quantize), on the torch and c backends."""
    _check_store(key, value, k_cache, v_cache, slot_mapping)
    impl = _backend(backend, key.device)
    _check_backend_dtypes(impl, "key", key, k_cache)
    if impl is not c_backend and key.device.type == "cpu" and slot_mapping.numel():
        c_backend.check_slots(slot_mapping, k_cache.shape[0] * k_cache.shape[2])
    impl.store_kv(key, value, k_cache, v_cache, slot_mapping)


SMALL_LINEAR_DTYPES = (torch.float32, torch.bfloat16)
SMALL_LINEAR_MAX_ROWS = c_backend.GEMV_ROWS  # the C GEMV takes up to this many rows


def small_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """out[m, n] = sum_k x[m, k] * w[n, k] (torch.nn.functional.linear without bias) for a few rows.

    x [M, K], w [N, K], float32 or bfloat16 (the same), CPU, contiguous; out [M, N] of x's dtype.
    For M <= SMALL_LINEAR_MAX_ROWS (4) the C kernel streams w at memory speed (MKL's GEMV does
    not), accumulating in float32 in an order that depends on neither M nor the thread count, so
    results are bitwise reproducible and batch invariant. For more rows (or with the C kernels
    switched off), F.linear.
    """
    _check_small_linear(x, w, out)
    if not 1 <= x.shape[0] <= SMALL_LINEAR_MAX_ROWS or not c_backend.enabled():
        result = torch.nn.functional.linear(x, w)
        return result if out is None else out.copy_(result)
    if out is None:
        out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype)
    c_backend.small_linear(x, w, out)
    return out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Llama's RMSNorm of each row: weight * (x / sqrt(mean(x^2) + eps)), computed in float32.

    x [rows, hidden], weight [hidden], both of one dtype, contiguous. CPU float32 and bfloat16 go
    to the C kernel (one call instead of six torch ops); anything else to torch.
    """
    _check_tensor("x", x, "[rows, hidden]")
    _check_tensor("weight", weight, "[hidden]")
    if weight.shape[0] != x.shape[1] or weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(
            f"weight must be [hidden] = [{x.shape[1]}] of x's dtype and device, got "
            f"{tuple(weight.shape)} {weight.dtype} on {weight.device}"
        )
    if out is None:
        out = torch.empty_like(x)
    elif (
        out.shape != x.shape
        or out.dtype != x.dtype
        or out.device != x.device
        or not out.is_contiguous()
    ):
        raise ValueError("out must be a contiguous tensor of x's shape, dtype and device")
    _cpu_ops(x).rms_norm(x, weight, eps, out)
    return out


def rope_(
    qk: torch.Tensor, heads: int, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Rotary embedding, in place, of the first `heads` heads of each row of qk; returns qk.

    qk [tokens, width] with rows of contiguous elements (a column slice of the fused q/k/v
    projection is fine), width >= heads * head_dim; positions [tokens] int64; cos and sin
    [max_positions, head_dim] tables of qk's dtype (rotate-half layout, as in transformers).
    """
    if qk.dim() != 2 or qk.stride(1) != 1:
        raise ValueError("qk must be [tokens, width] with contiguous rows")
    _check_tensor("cos", cos, "[max_positions, head_dim]")
    _check_tensor("sin", sin, "[max_positions, head_dim]")
    _check_tensor("positions", positions, "[tokens]")
    _check_dtype("positions", positions, (torch.int64,))
    head_dim = cos.shape[1]
    if sin.shape != cos.shape or cos.dtype != qk.dtype or sin.dtype != qk.dtype or head_dim % 2:
        raise ValueError("cos and sin must be [max_positions, even head_dim] of qk's dtype")
    width = heads * head_dim
    if heads < 1 or width > qk.shape[1] or positions.shape[0] != qk.shape[0]:
        raise ValueError(
            f"qk {tuple(qk.shape)} must hold {heads} heads of {head_dim} (at least one) for "
            f"each of {positions.shape[0]} positions"
        )
    if qk.shape[0] > 1 and qk.stride(0) < width:
        raise ValueError(f"qk rows overlap (row stride {qk.stride(0)} < {width})")
    _check_device(qk.device, positions=positions, cos=cos, sin=sin)
    impl = _cpu_ops(qk)
    if impl is torch_ref and qk.device.type == "cpu" and positions.numel():
        c_backend.check_positions(positions, cos.shape[0])
    impl.rope_(qk, heads, positions, cos, sin)
    return qk


GATED = ("silu", "gelu_pytorch_tanh")  # activations of a gated MLP: SwiGLU's, Gemma's GELU-tanh


def gated_mul(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """f(gate) * up of gate_up [rows, 2 * inter] = [gate | up], as [rows, inter]; f is silu
    (SwiGLU) or GELU with the tanh approximation (Gemma), as named in GATED.

    CPU float32 and bfloat16 go to the C kernel, which the one-call C decode step uses too, so
    that a row's result is the same bits whichever path its step takes (torch's vectorised exp
    and tanh and libm's differ in the last bit for some inputs); anything else to torch.
    """
    _check_tensor("gate_up", gate_up, "[rows, 2 * inter]")
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must have an even width, got {gate_up.shape[1]}")
    if activation not in GATED:
        raise ValueError(f"activation must be one of {GATED}, got {activation!r}")
    out = torch.empty(
        (gate_up.shape[0], gate_up.shape[1] // 2), dtype=gate_up.dtype, device=gate_up.device
    )
    _cpu_ops(gate_up).gated_mul(gate_up, out, activation != "silu")
    return out


def route_experts(
    logits: torch.Tensor, top_k: int, normalize: bool, among_chosen: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixture of experts' routing of router logits [tokens, experts]: (weights [tokens, top_k]
    float32, experts [tokens, top_k] int64), the top k of the logits' softmax in float32 (at equal
    scores the experts torch.topk chooses), renormalized to sum to 1 where normalize; or
    (among_chosen, gpt-oss) the top k logits softmaxed among themselves.

    On a CPU the C kernel, which the one-call C decode step uses too (the same bits whichever path
    a row's step takes); anything else to torch.
    """
    _check_tensor("logits", logits, "[tokens, experts]")
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"top_k must be in [1, {logits.shape[1]}], got {top_k}")
    if logits.device.type != "cpu" or not c_backend.enabled():
        return torch_ref.route_experts(logits, top_k, normalize, among_chosen)
    logits = logits.float().contiguous()
    weights = torch.empty((logits.shape[0], top_k), dtype=torch.float32)
    experts = torch.empty((logits.shape[0], top_k), dtype=torch.int64)
    c_backend.route_experts(logits, top_k, normalize, weights, experts, among_chosen)
    return weights, experts


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation of gate_up [rows, 2 * inter] = [gate | up]: (up + 1) * gate *
    sigmoid(alpha * gate), gate clamped to at most limit and up to [-limit, limit].

    CPU float32 goes to the C kernel, which the one-call C decode step uses too (the same bits
    whichever path a row's step takes); anything else to torch.
    """
    _check_tensor("gate_up", gate_up, "[rows, 2 * inter]")
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must have an even width, got {gate_up.shape[1]}")
    cpu = gate_up.device.type == "cpu" and gate_up.dtype == torch.float32
    if not cpu or not c_backend.enabled():
        return torch_ref.clamped_swiglu(gate_up, alpha, limit)
    out = torch.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=torch.float32)
    c_backend.clamped_swiglu(gate_up, out, alpha, limit)
    return out


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax of each row of logits [rows, vocab], as an int64 [rows] tensor: the first
    largest value, or the first NaN where a row has one; any layout. CPU float32 goes to the C
    kernel (a greedy step's token; torch's reads a row one value at a time), anything else to
    torch."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[1] == 0:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits must be a tensor [rows, vocab] with vocab > 0, got {shape}")
    cpu = logits.device.type == "cpu" and logits.dtype == torch.float32
    if not cpu or not c_backend.enabled():
        return logits.argmax(dim=-1)
    logits = logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    c_backend.argmax_rows(logits, out)
    return out


def _cpu_ops(x: torch.Tensor) -> ModuleType:
    """The C module for CPU float32/bfloat16 tensors; otherwise torch."""
    if x.device.type == "cpu" and x.dtype in SMALL_LINEAR_DTYPES and c_backend.enabled():
        return c_backend
    return torch_ref


def available_backends(device: str | torch.device = "cpu") -> list[str]:
    """The explicit backends that can run on tensors of this device here."""
    names = ["torch"]
    if torch.device(device).type == "cpu" and c_backend._C is not None:
        names.append("c")
    if _triton_runs_on(torch.device(device)):
        names.append("triton")
    return names


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton_runs_on(device: torch.device) -> bool:
    if device.type not in ("cpu", "cuda") or not _triton_installed():
        return False
    from . import triton_decode

    return device.type == "cuda" or triton_decode.INTERPRETED


def _backend(backend: str, device: torch.device) -> ModuleType:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if device.type == "cpu":
            return c_backend if c_backend.enabled() else torch_ref
        return _backend("triton", device) if device.type == "cuda" else torch_ref
    if backend == "c":
        if device.type != "cpu":
            raise BackendUnavailableError(f"backend='c' needs CPU tensors; they are on {device}")
        if c_backend._C is None:
            raise BackendUnavailableError(c_backend.BUILD_HINT)
        return c_backend
    if backend == "triton":
        if not _triton_installed():
            raise BackendUnavailableError(
                "backend='triton' needs triton: pip install triton==3.6.*"
            )
        if not _triton_runs_on(device):
            raise BackendUnavailableError(
                f"backend='triton' needs CUDA tensors (these are on {device}); CPU tensors run "
                "only in Triton's interpreter: set TRITON_INTERPRET=1 before triton is imported"
            )
        from . import triton_decode

        return triton_decode
    return torch_ref


def _check_tensor(name: str, t: object, layout: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.dim() != layout.count(",") + 1:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")
    return t


def _check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise TypeError(f"{name} dtype must be one of {names}, got {t.dtype}")


def _check_device(device: torch.device, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, but the other tensors are on {device}")


def _check_cache(k: object, v: object) -> tuple[int, ...]:
    """The cache's [num_blocks, num_kv_heads, block_size, head_dim] (a q8_0 cache's head_dim from
    its bytes)."""
    k_cache = _check_tensor("k_cache", k, _CACHE_LAYOUT)
    v_cache = _check_tensor("v_cache", v, _CACHE_LAYOUT)
    _check_dtype("k_cache", k_cache, CACHE_DTYPES)
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"v_cache dtype {v_cache.dtype} differs from k_cache dtype {k_cache.dtype}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache shape {tuple(v_cache.shape)} differs from k_cache {tuple(k_cache.shape)}"
        )
    for axis, size in zip(
        ("num_kv_heads", "block_size", "head_dim"), k_cache.shape[1:], strict=True
    ):
        if size < 1:
            raise ValueError(f"k_cache {axis} must be at least 1, got {size}")
    if k_cache.dtype != KV_Q8_0:
        return tuple(k_cache.shape)
    if k_cache.shape[3] % Q8_0_BYTES:
        raise ValueError(
            f"a q8_0 k_cache's rows must be whole blocks of {Q8_0_BYTES} bytes, got "
            f"{k_cache.shape[3]}"
        )
    return (*k_cache.shape[:3], k_cache.shape[3] // Q8_0_BYTES * Q8_0_VALUES)


def _check_activation_dtype(name: str, t: torch.Tensor, k_cache: torch.Tensor) -> None:
    """q or key: float32, or of the cache's dtype; float32 or bfloat16 with a q8_0 cache."""
    if k_cache.dtype == KV_Q8_0:
        _check_dtype(name, t, PREFILL_Q_DTYPES)
    elif t.dtype not in (torch.float32, k_cache.dtype):
        raise TypeError(
            f"{name} dtype {t.dtype} must be float32 or the kv cache dtype {k_cache.dtype}"
        )


def _check_backend_dtypes(
    impl: ModuleType, name: str, t: torch.Tensor, k_cache: torch.Tensor
) -> None:
    """Only the torch and C backends take float32 q or key with a 16-bit cache, and a q8_0
    cache."""
    if k_cache.dtype == KV_Q8_0 and impl not in (torch_ref, c_backend):
        raise TypeError(
            "backend='triton' does not read a q8_0 kv cache (the torch and c backends do)"
        )
    if t.dtype != k_cache.dtype and impl not in (torch_ref, c_backend):
        raise TypeError(
            f"backend='triton' needs {name} of the kv cache dtype {k_cache.dtype}, got {name} "
            f"dtype {t.dtype} (the torch and c backends take float32 {name} with a 16-bit cache)"
        )


def _check_decode(q, k_cache, v_cache, block_tables, context_lens, scale, out) -> None:
    _, num_kv_heads, _, head_dim = _check_cache(k_cache, v_cache)
    _check_tensor("q", q, _Q_LAYOUT)
    _check_tensor("block_tables", block_tables, "[num_seqs, max_blocks_per_seq]")
    _check_tensor("context_lens", context_lens, "[num_seqs]")
    _check_activation_dtype("q", q, k_cache)
    _check_dtype("block_tables", block_tables, (torch.int32,))
    _check_dtype("context_lens", context_lens, (torch.int32,))
    num_seqs, num_q_heads, q_head_dim = q.shape
    _check_heads(num_q_heads, q_head_dim, num_kv_heads, head_dim)
    for name, t in (("block_tables", block_tables), ("context_lens", context_lens)):
        if t.shape[0] != num_seqs:
            raise ValueError(f"{name} has {t.shape[0]} rows, q has {num_seqs} sequences")
    _check_scale(scale)
    tensors = dict(k_cache=k_cache, v_cache=v_cache, block_tables=block_tables)
    _check_device(q.device, **tensors, context_lens=context_lens)
    _check_out(out, q, _Q_LAYOUT)


def _check_prefill(q, k_cache, v_cache, block_table, context_len, scale, out, window) -> None:
    _, num_kv_heads, block_size, head_dim = _check_cache(k_cache, v_cache)
    layout = "[num_tokens, num_q_heads, head_dim]"
    _check_tensor("q", q, layout)
    _check_dtype("q", q, PREFILL_Q_DTYPES)
    _check_tensor("block_table", block_table, "[n]")
    _check_dtype("block_table", block_table, (torch.int32,))
    num_tokens, num_q_heads, q_head_dim = q.shape
    _check_heads(num_q_heads, q_head_dim, num_kv_heads, head_dim)
    _check_int("context_len", context_len)
    if context_len < max(num_tokens, 1):
        raise ValueError(
            f"context_len = {context_len} must be at least 1 and at least q's {num_tokens} "
            "tokens (the chunk's own tokens are part of its context)"
        )
    if context_len > block_table.shape[0] * block_size:
        raise ValueError(
            f"context_len = {context_len} needs {-(-context_len // block_size)} block_table "
            f"entries of {block_size} tokens, block_table has {block_table.shape[0]}"
        )
    _check_int("window", window)
    _check_scale(scale)
    _check_device(q.device, k_cache=k_cache, v_cache=v_cache, block_table=block_table)
    _check_out(out, q, layout)


def _check_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> None:
    """None, or one float32 logit per query head, contiguous, on q's device."""
    if sinks is None:
        return
    _check_tensor("sinks", sinks, "[num_q_heads]")
    _check_dtype("sinks", sinks, (torch.float32,))
    if sinks.shape[0] != q.shape[1]:
        raise ValueError(f"sinks has {sinks.shape[0]} entries, q has {q.shape[1]} heads")
    _check_device(q.device, sinks=sinks)


def _check_heads(num_q_heads: int, q_head_dim: int, num_kv_heads: int, head_dim: int) -> None:
    if q_head_dim != head_dim:
        raise ValueError(f"q head_dim {q_head_dim} differs from the cache head_dim {head_dim}")
    if num_q_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"q num_q_heads {num_q_heads} must be a positive multiple of num_kv_heads "
            f"{num_kv_heads}"
        )


def _check_out(out: torch.Tensor | None, q: torch.Tensor, layout: str) -> None:
    """An out tensor, where given: q's shape, dtype and device."""
    if out is None:
        return
    _check_tensor("out", out, layout)
    if out.shape != q.shape:
        raise ValueError(f"out shape {tuple(out.shape)} differs from q {tuple(q.shape)}")
    if out.dtype != q.dtype:
        raise TypeError(f"out dtype {out.dtype} differs from q dtype {q.dtype}")
    _check_device(q.device, out=out)


def _check_int(name: str, value: object) -> None:
    """A Python int >= 0 (not a bool, not a tensor)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a Python int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def _check_scale(scale: object) -> None:
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a Python float, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")


def _check_store(key, value, k_cache, v_cache, slot_mapping) -> None:
    _, num_kv_heads, _, head_dim = _check_cache(k_cache, v_cache)
    for name, t in (("key", key), ("value", value)):
        _check_tensor(name, t, _KV_LAYOUT)
        if tuple(t.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(
                f"{name} shape {tuple(t.shape)} does not match the cache's "
                f"(num_kv_heads, head_dim) = {(num_kv_heads, head_dim)}"
            )
    _check_activation_dtype("key", key, k_cache)
    if value.dtype != key.dtype:
        raise TypeError(f"value dtype {value.dtype} differs from key dtype {key.dtype}")
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} differs from key {tuple(key.shape)}")
    _check_tensor("slot_mapping", slot_mapping, "[num_tokens]")
    _check_dtype("slot_mapping", slot_mapping, (torch.int64, torch.int32))
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots, key has {key.shape[0]}")
    _check_device(
        key.device, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping
    )


def _check_small_linear(x, w, out) -> None:
    _check_tensor("x", x, "[M, K]")
    _check_tensor("w", w, "[N, K]")
    _check_dtype("x", x, SMALL_LINEAR_DTYPES)
    if w.dtype != x.dtype:
        raise TypeError(f"w dtype {w.dtype} differs from x dtype {x.dtype}")
    for name, t in (("x", x), ("w", w)):
        if t.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor, got one on {t.device}")
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"w has K = {w.shape[1]} columns, x has K = {x.shape[1]}")
    if out is not None:
        _check_tensor("out", out, "[M, N]")
        expected = (x.shape[0], w.shape[0])
        if tuple(out.shape) != expected:
            raise ValueError(f"out shape {tuple(out.shape)} differs from [M, N] = {expected}")
        if out.dtype != x.dtype:
            raise TypeError(f"out dtype {out.dtype} differs from x dtype {x.dtype}")
        if out.device.type != "cpu":
            raise ValueError(f"out must be a CPU tensor, got one on {out.device}")
