"""MXFP4 blocks (kernels/csrc/quant_mxfp4.c, gpt-oss's experts' format) as files hold them: every
scale byte E8M0 can take (2^-128, a subnormal, to 2^127) and every 4-bit code, de-quantized as
gguf does and multiplied on each instruction-set path against a float64 product; the rest of
the format's tests are test_quant_kernels.py's, which take every format of the kernels' table."""

import numpy as np
import pytest
import torch
from test_quant_kernels import _check_against_oracle, _oracle, isa  # noqa: F401 (a fixture)

from nanoserve import kernels
from nanoserve.kernels import QuantizedWeight, quant

gguf = pytest.importorskip("gguf")

BLOCK = 17  # the E8M0 byte, then 16 bytes of two 4-bit codes each


def _raw_blocks(n: int, k: int, scales: np.ndarray, seed: int) -> QuantizedWeight:
    """n rows of k / 32 random MXFP4 blocks whose scale bytes are drawn from `scales`."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // 32, BLOCK), dtype=np.uint8)
    raw[:, :, 0] = rng.choice(scales, size=(n, k // 32))
    data = kernels.aligned_bytes(torch.from_numpy(raw.reshape(n, -1)))
    return QuantizedWeight(data, "mxfp4", (n, k))


def test_the_format_is_ggmls():
    assert (quant.BLOCK_BYTES["mxfp4"], quant.BLOCK_VALUES["mxfp4"]) == (BLOCK, 32)
    assert "mxfp4" not in quant.NOT_QUANTIZED


@pytest.mark.filterwarnings("ignore:overflow encountered")  # gguf: 12 times 2^127 is inf
def test_every_scale_and_code_dequantizes_as_gguf_does():
    w = _raw_blocks(64, 32 * 8, np.arange(256, dtype=np.uint8), seed=0)
    w.data.view(-1, 8, BLOCK)[:, :, 0] = torch.arange(256 * 2, dtype=torch.uint8).view(64, 8)
    ours, theirs = kernels.dequantize(w).numpy(), _oracle(w).astype(np.float32)
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))  # bits: -0.0 and 2^-128


@pytest.mark.parametrize("k", [32, 32 * 5, 32 * 7])
@pytest.mark.parametrize("scales", ["tiny", "usual"])
def test_raw_blocks_multiply_within_the_bounds(isa, k, scales):  # noqa: F811
    """Scale bytes 0..8 (2^-128 .. 2^-120; 0 and 1 give subnormal scales, which a kernel that
    flushed them to zero would miss by the whole product) under activations of 2^60, so that
    d dx stays a normal float, or the bytes of gpt-oss's weights (around 2^-7 .. 2^4); M of the
    GEMV's and the GEMM's rows, odd N."""
    pool = np.arange(9) if scales == "tiny" else np.arange(120, 132)
    w = _raw_blocks(37, k, pool.astype(np.uint8), seed=k)
    x_all = torch.randn(20, k, generator=torch.Generator().manual_seed(k)) * 3
    if scales == "tiny":
        x_all *= 2.0**60
    for m in (1, 3, 8, 9, 20):
        x = x_all[:m].contiguous()
        _check_against_oracle(x, w, kernels.quantized_linear(x, w))
