"""The AMX-INT8 GEMM (kernels/csrc/quant_amx.h) against the AVX-512 VNNI path it must equal bit for
bit: the same exact int32 dot of every block (q = 256 hi + lo on the tiles), scaled by the same
float operations in the same order. Every integer block format, odd N (not a multiple of a strip's
16 columns), M on both sides of the 16-row threshold and not a multiple of it, several K, 1 and 2
threads. Skipped where the CPU or OS lacks AMX-INT8."""

import os
import subprocess
import sys

import pytest
import torch
from test_quant_kernels import KQUANTS, _kquant_weight, _weight

from nanoserve import kernels
from nanoserve.kernels import quant

INTEGER_FORMATS = [name for name in kernels.QUANT_TYPES if name not in ("f16", "bf16")]
ROWS = [9, 15, 16, 17, 40]  # the VNNI GEMM below 16 rows, AMX from 16, tiles of 16 plus a part


@pytest.fixture
def amx():
    """The AVX-512 VNNI path, whose GEMMs AMX takes; skips where this machine cannot run AMX."""
    if not quant.amx_supported():
        pytest.skip("this CPU or OS does not run AMX-INT8 (amx_tile, amx_int8, XTILEDATA)")
    before = (quant.cpu_isa(), quant.uses_vnni(), quant.uses_amx())
    yield
    quant.set_isa(*before)


def _matrix(qtype: str, n: int, k: int, seed: int) -> kernels.QuantizedWeight:
    if qtype in KQUANTS:
        return _kquant_weight(qtype, n, k, seed=seed)
    return kernels.quantize(_weight(n, k, seed=seed), qtype)


def _on(amx: bool, x: torch.Tensor, w: kernels.QuantizedWeight) -> torch.Tensor:
    assert quant.set_isa("avx512", True, amx) == "avx512" and quant.uses_vnni()
    assert quant.uses_amx() == amx
    return kernels.quantized_linear(x, w)


@pytest.mark.parametrize("qtype", INTEGER_FORMATS)
def test_amx_equals_vnni_bitwise(amx, qtype):
    """Each format at two K (one and several blocks or super-blocks, odd counts of them) and N
    that leave a part strip and a single strip after the pairs AMX takes."""
    ks = (512, 256 * 7) if qtype in KQUANTS else (32, 32 * 7)
    threads = torch.get_num_threads()
    try:
        for k, n in zip(ks, (97, 35), strict=True):
            w = _matrix(qtype, n, k, seed=k)
            x_all = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(k)) * 3
            for t in (1, 2):
                torch.set_num_threads(t)
                for m in ROWS:
                    x = x_all[:m].contiguous()
                    vnni, tiles = _on(False, x, w), _on(True, x, w)
                    assert torch.equal(tiles, vnni), (k, n, t, m)
    finally:
        torch.set_num_threads(threads)


def test_amx_handles_zero_and_extreme_activations(amx):
    """Rows of zeros, of one huge value per block (q = +-32767: hi -128 and 127, lo 1 and 255) and
    of a block's values at both ends: the split's corners."""
    w = _matrix("q8_0", 40, 64, seed=5)
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(6))
    x[0] = 0
    x[1, ::32] = 1e6
    x[2, ::32] = -1e6
    x[3, :32], x[3, 32:] = 1.0, -1.0
    assert torch.equal(_on(True, x, w), _on(False, x, w))


def _amx_in_a_new_process(value: str) -> subprocess.CompletedProcess:
    code = "from nanoserve.kernels import quant; print(quant.uses_amx())"
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "NANOSERVE_AMX": value},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_nanoserve_amx_turns_it_off_and_refuses_other_values(amx):
    off, on, bad = (_amx_in_a_new_process(v) for v in ("0", "1", "yes"))
    assert off.returncode == 0 and off.stdout.strip() == "False", off.stderr
    assert on.returncode == 0 and on.stdout.strip() == "True", on.stderr
    assert bad.returncode != 0 and "NANOSERVE_AMX must be 0 or 1" in bad.stderr
