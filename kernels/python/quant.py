"""Matmuls on weights kept in llama.cpp's GGUF block formats, on the CPU.

A QuantizedWeight holds the bytes of a GGUF tensor [N, K]: rows of blocks of BLOCK_VALUES[qtype]
values along K (32, or a K-quant's super-block of 256), never de-quantized to a float matrix (a
K-quant's, MXFP4's, Q5_0's or Q5_1's rows repacked in groups of 16 for the SIMD kernels where
`repacked`: repack()). The formats (QUANT_TYPES, BLOCK_BYTES, BLOCK_VALUES) come from the C module's
one table of formats (kernels/csrc/quant.c); each format's block layout and arithmetic are in its
file, kernels/csrc/quant_<name>.c. quantize() makes one from float weights (the bytes
gguf.quants.quantize makes; not to the K-quants, NOT_QUANTIZED, whose files llama.cpp's quantizer
makes), dequantize() is the float reference, and quantized_linear(x, w) = x @ dequantize(w).T in one
C call.

quantized_linear quantizes each row of x per block of 32 to int16 (dx = max|x| / 32767) and takes
exact integer dot products with the weight blocks, scaled by d dx in float: so its result differs
from x @ dequantize(w).T by at most the sum over blocks of dx / 2 times the block's sum of |w|, plus
float rounding. int8 activations, llama.cpp's (dx = max|x| / 127), would double the products per
multiply instruction, but their error, 0.5-0.9% (relative norm) on SmolLM2-135M's matrices, flips
its greedy answers; int16's is ~250x smaller. A row's result is bitwise the same whatever the other
rows, M or the thread count; the instruction-set paths (cpu_isa()) differ by rounding only.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from . import c_backend
from .api import _check_tensor
from .errors import BackendUnavailableError

# the formats' names; () if never built
QUANT_TYPES = tuple(name for name, row in c_backend.BLOCK_FORMATS.items() if row[3] is None)
BLOCK_BYTES = {name: row[1] for name, row in c_backend.BLOCK_FORMATS.items()}
BLOCK_VALUES = {name: row[2] for name, row in c_backend.BLOCK_FORMATS.items()}  # along K
# The formats whose matrices are repacked at load (QuantizedWeight's repacked), by the C name of
# their repacked layout; a repacked matrix's rows are a multiple of REPACK_ROWS.
REPACKED = {row[3]: name for name, row in c_backend.BLOCK_FORMATS.items() if row[3] is not None}
REPACK_ROWS = 16
# The K-quants, kept and multiplied but not quantized to: llama.cpp's quantizer searches their
# scales (a plain rounding would be a worse file under the same name).
NOT_QUANTIZED = ("q4_k", "q5_k", "q6_k")
ISA_PATHS = ("portable", "avx2", "avx512")  # in order; NANOSERVE_ISA caps the choice
ALIGNMENT = 64  # bytes; where a QuantizedWeight's data starts
ACTIVATIONS = ("int16",)  # the integers quantized_linear rounds its input to


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A matrix [N, K] = shape of GGUF blocks of `qtype` (one of QUANT_TYPES).

    data: a contiguous uint8 CPU tensor [N, K / BLOCK_VALUES[qtype] * BLOCK_BYTES[qtype]], the
    bytes, starting on a 64-byte boundary (ALIGNMENT): a cache line of its own, as torch's
    allocator gives; aligned_bytes() copies data that does not (a view into a GGUF file, say) into
    a buffer that does. K must be a multiple of BLOCK_VALUES[qtype]. Checked on construction;
    ValueError/TypeError name the field at fault.
    """

    data: torch.Tensor
    qtype: str
    shape: tuple[int, int]
    # The rows interleaved in groups of REPACK_ROWS (kernels/csrc/quant_r16.c), as repack() and
    # the GGUF loader lay out a K-quant for the SIMD kernels: the same bytes, moved.
    repacked: bool = False

    def __post_init__(self) -> None:
        _require_c()  # the formats come from the C module's table
        if self.qtype not in QUANT_TYPES:
            raise ValueError(f"qtype must be one of {QUANT_TYPES}, got {self.qtype!r}")
        shape = _matrix_shape(self.shape, self.qtype)
        object.__setattr__(self, "shape", shape)
        _check_tensor("data", self.data, "[N, row_bytes]")
        if self.data.dtype != torch.uint8 or self.data.device.type != "cpu":
            raise TypeError(
                f"data must be a uint8 CPU tensor, got {self.data.dtype} on {self.data.device}"
            )
        expected = (shape[0], self.row_bytes)
        if tuple(self.data.shape) != expected:
            raise ValueError(
                f"data must be [N, K / {BLOCK_VALUES[self.qtype]} * {BLOCK_BYTES[self.qtype]}] = "
                f"{list(expected)} for "
                f"{self.qtype} of shape {list(shape)}, got {list(self.data.shape)}"
            )
        if self.data.numel() and self.data.data_ptr() % ALIGNMENT:
            raise ValueError(
                f"data must start on a {ALIGNMENT}-byte boundary; aligned_bytes(data) makes an "
                "aligned copy"
            )
        if self.repacked and (self.qtype not in REPACKED or shape[0] % REPACK_ROWS):
            raise ValueError(
                f"repacked must be False for {self.qtype} of {shape[0]} rows: only "
                f"{', '.join(REPACKED)} matrices of a multiple of {REPACK_ROWS} rows are"
            )

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of blocks."""
        return self.shape[1] // BLOCK_VALUES[self.qtype] * BLOCK_BYTES[self.qtype]

    @property
    def kernel_qtype(self) -> str:
        """The C module's name of the layout: qtype, or its repacked layout's."""
        return REPACKED[self.qtype] if self.repacked else self.qtype


def repackable(qtype: str, rows: int) -> bool:
    """Whether a matrix of `rows` rows in qtype can be repacked (REPACKED)."""
    return qtype in REPACKED and rows % REPACK_ROWS == 0


def repack_at_load(qtype: str, rows: int) -> bool:
    """Whether a loader repacks such a matrix: where repackable and the kernels take the AVX-512
    path (AVX2's 8-lane strips read each 64 bytes of a group twice: its GEMV ran 0.93-0.96x the
    file layout's on an AMD EPYC), unless the environment variable NANOSERVE_REPACK is 0 (read at
    each call: a benchmark's comparison of the layouts). Every path reads either layout."""
    wanted = os.environ.get("NANOSERVE_REPACK", "1") != "0" and cpu_isa() == "avx512"
    return wanted and repackable(qtype, rows)


def repack(w: QuantizedWeight) -> QuantizedWeight:
    """w in the repacked layout (a copy; w itself where it already is), where repackable."""
    if w.repacked:
        return w
    if not repackable(w.qtype, w.shape[0]):
        raise ValueError(f"{w.qtype} of {w.shape[0]} rows cannot be repacked")
    out = _aligned_empty(tuple(w.data.shape))
    block = BLOCK_BYTES[w.qtype]
    if out.numel():
        c_backend.copy_rows([(out.data_ptr(), w.data.data_ptr(), *w.data.shape, 0, block)])
    return QuantizedWeight(out, w.qtype, w.shape, repacked=True)


@dataclass(frozen=True, eq=False)
class QuantizedParts:
    """A matrix [N, K] whose row ranges are in different block formats, each part kept in its
    own: a fused q/k/v or gate/up matrix of a file that mixes formats (llama.cpp's Q4_K_M keeps q
    and k in Q4_K and v in Q6_K). The rows are the parts' in order; quantized_linear multiplies
    each part into its columns of one output, so a result is bitwise the part's own matmul's."""

    parts: tuple[QuantizedWeight, ...]

    def __post_init__(self) -> None:
        parts = tuple(self.parts)
        if len(parts) < 2 or not all(isinstance(p, QuantizedWeight) for p in parts):
            raise TypeError("parts must be two or more QuantizedWeights")
        if len({p.shape[1] for p in parts}) != 1:
            raise ValueError(f"parts must have one K, got shapes {[p.shape for p in parts]}")
        object.__setattr__(self, "parts", parts)

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]


def _matrix_shape(shape: object, qtype: str) -> tuple[int, int]:
    """shape as (N, K) of ints, N >= 0 and K a positive multiple of BLOCK_VALUES[qtype]."""
    try:
        n, k = (int(d) for d in shape)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        raise ValueError(f"shape must be (N, K), two ints, got {shape!r}") from None
    values = BLOCK_VALUES[qtype]
    if n < 0 or k < values or k % values:
        raise ValueError(
            f"shape must be (N, K) with N >= 0 and K a positive multiple of {values} for "
            f"{qtype}, got {(n, k)}"
        )
    return n, k


def aligned_bytes(data: torch.Tensor | np.ndarray) -> torch.Tensor:
    """data (uint8, any shape; a numpy array, a GGUF reader's memory map say) as a contiguous CPU
    uint8 tensor of the same shape starting on a 64-byte boundary: data itself when it is one,
    otherwise a copy."""
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8:
            raise TypeError(f"data must be uint8, got {data.dtype}")
        out = _aligned_empty(tuple(data.shape))
        out.numpy()[...] = data  # not torch.from_numpy: a read-only memory map would warn
        return out
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"data must be a torch.Tensor or numpy array, got {type(data).__name__}")
    if data.dtype != torch.uint8 or data.device.type != "cpu":
        raise TypeError(f"data must be a uint8 CPU tensor, got {data.dtype} on {data.device}")
    if data.is_contiguous() and data.data_ptr() % ALIGNMENT == 0:
        return data
    return _aligned_empty(tuple(data.shape)).copy_(data)


def quantize(weight: torch.Tensor, qtype: str) -> QuantizedWeight:
    """weight [N, K] (a float CPU tensor, taken as float32; K a multiple of 32) in GGUF blocks of
    qtype (not one of NOT_QUANTIZED): byte for byte what
    gguf.quants.quantize(weight.float().numpy(), ...) returns, but for the sign of a zero Q4_1 m
    where a block's least value is 0.0 and -0.0 both: numpy's min returns whichever its SIMD order
    meets last, ggml's C reference (and this) the first. The values are the same."""
    _check_tensor_2d("weight", weight, "[N, K]")
    if not weight.is_floating_point() or weight.device.type != "cpu":
        raise TypeError(f"weight must be a float CPU tensor, got {weight.dtype} on {weight.device}")
    _require_c()
    if qtype not in QUANT_TYPES:
        raise ValueError(f"qtype must be one of {QUANT_TYPES}, got {qtype!r}")
    if qtype in NOT_QUANTIZED:
        raise ValueError(
            f"nanoserve does not quantize float weights to {qtype}: make a {qtype.upper()} GGUF "
            "file with llama.cpp's quantizer (llama-quantize) and load that"
        )
    shape = tuple(weight.shape)
    values = BLOCK_VALUES[qtype]
    if shape[1] < values or shape[1] % values:
        raise ValueError(
            f"weight's K (columns) must be a positive multiple of {values} to quantize to "
            f"{qtype}, got weight of shape {list(shape)}"
        )
    weight = weight.to(torch.float32).contiguous()
    out = _aligned_empty((shape[0], shape[1] // values * BLOCK_BYTES[qtype]))
    if weight.numel():
        c_backend.quantize(weight, qtype, out)
    return QuantizedWeight(out, qtype, (shape[0], shape[1]))


def dequantize(w: QuantizedWeight, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 matrix [N, K] of w (the values gguf.quants.dequantize gives), or only its rows
    `rows` (an int64 CPU tensor of row indices: an embedding lookup), [len(rows), K]."""
    if not isinstance(w, QuantizedWeight):
        raise TypeError(f"w must be a QuantizedWeight, got {type(w).__name__}")
    if rows is not None:
        _check_tensor("rows", rows, "[R]")
        if rows.dtype != torch.int64 or rows.device.type != "cpu":
            raise TypeError(f"rows must be an int64 CPU tensor, got {rows.dtype} on {rows.device}")
    _require_c()
    n, k = w.shape
    out = torch.empty((n if rows is None else rows.shape[0], k), dtype=torch.float32)
    if out.numel():
        c_backend.dequantize(w.data, w.kernel_qtype, k, rows, out)
    return out


def quantized_linear(
    x: torch.Tensor,
    w: QuantizedWeight | QuantizedParts,
    out: torch.Tensor | None = None,
    *,
    activations: str = ACTIVATIONS[0],
) -> torch.Tensor:
    """x @ dequantize(w).T on x rounded per block of 32 to `activations` (one of ACTIVATIONS:
    "int16"; see the module's docstring): x [M, K] float32, contiguous, CPU; returns out [M, N]
    float32 (written in place when given). One C call, with the GIL released; threads:
    torch.get_num_threads()."""
    _check_quantized_linear(x, w, out)
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    _require_c()
    if out is None:
        out = torch.empty((x.shape[0], w.shape[0]), dtype=torch.float32)
    if out.numel():
        col = 0
        for part in w.parts if isinstance(w, QuantizedParts) else (w,):
            c_backend.quant_linear(x, part.data, part.kernel_qtype, out, col, part.shape[0])
            col += part.shape[0]
    return out


def expert_linear(
    x: torch.Tensor,
    weights: Sequence[QuantizedWeight],
    num_experts: int,
    groups: torch.Tensor,
    rows: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """A mixture of experts' matmul, all chosen experts in one C call (llama.cpp's MUL_MAT_ID):
    for each weight of `weights` (each the num_experts matrices [N, K] of a 3-D expert tensor,
    stored as one matrix [num_experts * N, K] of the same format), out [P, N] float32 whose row p
    is x[rows[p]] @ expert e's matrix.T for each group (e, start, count) of `groups` (int64
    [G, 3]) and p in [start, start + count): bitwise quantized_linear(x[rows[start:start +
    count]], e's rows). x [T, K] float32, contiguous, CPU, each of its rows quantized once;
    rows int64 [P] (None: x's rows are the P pairs). Rows in no group are left unwritten. out: a
    float32 CPU tensor [P, len(weights) * N] (rows of unit stride, any row stride) whose columns
    hold the outputs side by side; None: a new tensor each."""
    _check_tensor_2d("x", x, "[T, K]")
    if x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous():
        raise TypeError(f"x must be a contiguous float32 CPU tensor, got {x.dtype} on {x.device}")
    if not weights or len(weights) > 2 or not all(isinstance(w, QuantizedWeight) for w in weights):
        raise TypeError("weights must be one or two QuantizedWeights")
    first = weights[0]
    if any(w.kernel_qtype != first.kernel_qtype or w.shape != first.shape for w in weights):
        raise ValueError("weights must share one format and shape")
    if (
        num_experts < 1
        or first.shape[0] % num_experts
        or first.shape[1] != x.shape[1]
        or (first.repacked and first.shape[0] // num_experts % REPACK_ROWS)
    ):
        raise ValueError(
            f"weights of shape {list(first.shape)} are not {num_experts} experts' matrices of "
            f"K = {x.shape[1]} (x's columns)"
        )
    for name, t, layout in (("groups", groups, "[G, 3]"), ("rows", rows, "[P]")):
        if t is None:
            continue
        if t.dtype != torch.int64 or t.device.type != "cpu" or not t.is_contiguous():
            raise TypeError(f"{name} must be a contiguous int64 CPU tensor {layout}")
    if groups.dim() != 2 or groups.shape[1] != 3:
        raise ValueError(f"groups must be [G, 3], got {list(groups.shape)}")
    _require_c()
    pairs = x.shape[0] if rows is None else rows.shape[0]
    n = first.shape[0] // num_experts
    if out is None:
        outs = [torch.empty((pairs, n), dtype=torch.float32) for _ in weights]
    elif (
        out.shape != (pairs, len(weights) * n)
        or out.dtype != torch.float32
        or out.device.type != "cpu"
        or out.stride(1) != 1
    ):
        raise ValueError(
            f"out must be a float32 CPU tensor [{pairs}, {len(weights) * n}] of rows of unit "
            f"stride, got {list(out.shape)} {out.dtype} on {out.device}"
        )
    else:
        outs = list(out.split(n, dim=1))
    if pairs and groups.shape[0]:
        c_backend.quant_experts(
            outs, [w.data for w in weights], first.kernel_qtype, num_experts, x, rows, groups
        )
    return outs


def cpu_isa() -> str:
    """The instruction-set path the quantized kernels use: one of ISA_PATHS. Chosen at import,
    the best this CPU runs (AVX-512 needs F, BW and VL; AVX2 needs FMA and F16C too), capped by
    the environment variable NANOSERVE_ISA; set_isa() changes it."""
    _require_c()
    return str(c_backend._C.quant_isa()[0])


def uses_vnni() -> bool:
    """Whether the AVX-512 path is in use with AVX512-VNNI's vpdpwssd."""
    _require_c()
    return bool(c_backend._C.quant_isa()[1])


def uses_amx() -> bool:
    """Whether the quantized GEMMs (M >= 16 rows) run on AMX-INT8 tiles: on the VNNI path, where
    the CPU has AMX-INT8 and Linux grants the process its tiles, unless NANOSERVE_AMX=0 or
    set_isa(amx=False). Bitwise the same outputs as VNNI's."""
    _require_c()
    return bool(c_backend._C.quant_amx()[0])


def amx_supported() -> bool:
    """Whether this CPU and OS run the AMX-INT8 GEMM (whatever NANOSERVE_AMX says)."""
    _require_c()
    return bool(c_backend._C.quant_amx()[1])


def isa_supported(isa: str) -> bool:
    """Whether this CPU runs path `isa` (whatever NANOSERVE_ISA says)."""
    if isa not in ISA_PATHS:
        raise ValueError(f"isa must be one of {ISA_PATHS}, got {isa!r}")
    _require_c()
    return ISA_PATHS.index(isa) <= ISA_PATHS.index(c_backend._C.cpu_quant_isa()[0])


def set_isa(isa: str, vnni: bool = True, amx: bool = True) -> str:
    """Uses path `isa` (capped to what this CPU runs), with VNNI on the AVX-512 path if `vnni` and
    the CPU has it, and AMX-INT8 GEMMs with VNNI if `amx` and the CPU has it; returns the path now
    in use. For tests and benchmarks: not while another thread runs a quantized kernel."""
    if isa not in ISA_PATHS:
        raise ValueError(f"isa must be one of {ISA_PATHS}, got {isa!r}")
    _require_c()
    return str(c_backend._C.set_quant_isa(isa=isa, vnni=bool(vnni), amx=bool(amx))[0])


def _require_c() -> None:
    """The quantized kernels have no torch fallback: they need the built C module."""
    if c_backend._C is None:
        raise BackendUnavailableError(c_backend.BUILD_HINT)


def _aligned_empty(shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised uint8 tensor of `shape` starting on a 64-byte boundary."""
    n = int(np.prod(shape, dtype=np.int64))
    buffer = torch.empty(n + ALIGNMENT, dtype=torch.uint8)
    start = -buffer.data_ptr() % ALIGNMENT
    return buffer[start : start + n].view(shape)


def _check_tensor_2d(name: str, t: object, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be {layout}, got shape {list(t.shape)}")


def _check_quantized_linear(x: object, w: object, out: object) -> None:
    if not isinstance(w, QuantizedWeight | QuantizedParts):
        raise TypeError(f"w must be a QuantizedWeight or QuantizedParts, got {type(w).__name__}")
    x = _check_tensor("x", x, "[M, K]")
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise TypeError(f"x must be a float32 CPU tensor, got {x.dtype} on {x.device}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"x has K = {x.shape[1]} columns, w has K = {w.shape[1]}")
    if out is not None:
        out = _check_tensor("out", out, "[M, N]")
        expected = (x.shape[0], w.shape[0])
        if tuple(out.shape) != expected:
            raise ValueError(f"out shape {list(out.shape)} differs from [M, N] = {list(expected)}")
        if out.dtype != torch.float32 or out.device.type != "cpu":
            raise TypeError(f"out must be a float32 CPU tensor, got {out.dtype} on {out.device}")
