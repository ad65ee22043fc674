"""The K-quants, MXFP4, Q5_0, Q5_1 and Q8_0 repacked at load (kernels/csrc/quant_r16.c): each
group of 16 rows' blocks interleaved 4 bytes at a time, so that the SIMD kernels load what they
used to transpose. The same bytes, moved; every reader gives what it gives on the file's layout,
bit for bit."""

import numpy as np
import pytest
import torch
from test_quant_kernels import KQUANTS, ROWS, _kquant_weight, isa  # noqa: F401 (isa: a fixture)

from nanoserve import kernels
from nanoserve.kernels import QuantizedWeight, c_backend, quant

REPACKABLE = [*KQUANTS, "mxfp4", "q5_0", "q5_1", "q8_0"]


def _weight(qtype: str, n: int, k: int, seed: int) -> QuantizedWeight:
    """Random valid blocks: the K-quants' random bytes under a model's scales, the others
    quantized from normal values (MXFP4's one-byte scales stay finite)."""
    if qtype in KQUANTS:
        return _kquant_weight(qtype, n, k, seed)
    g = torch.Generator().manual_seed(seed)
    return kernels.quantize(torch.randn(n, k, generator=g) * 0.05, qtype)


@pytest.mark.parametrize("qtype", REPACKABLE)
def test_repacking_moves_the_bytes_and_dequantize_reads_them_back(qtype):
    w = _weight(qtype, 48, 512, seed=1)
    r = quant.repack(w)
    assert r.repacked and r.kernel_qtype == f"{qtype}_r16" and r.shape == w.shape
    assert not torch.equal(r.data, w.data)
    assert torch.equal(r.data.flatten().sort().values, w.data.flatten().sort().values)
    # Row 17's first block: its first 4 bytes (after MXFP4's scale byte, Q5_0's and Q8_0's d)
    # lead group 1's block, row 1 of it; the rows' leading bytes follow the words there.
    group, lead = r.data[16:32].flatten(), {"mxfp4": 1, "q5_0": 2, "q8_0": 2}.get(qtype, 0)
    assert torch.equal(group[4:8], w.data[17, lead : lead + 4])
    tails = 64 * (quant.BLOCK_BYTES[qtype] // 4)
    assert torch.equal(group[tails + lead : tails + 2 * lead], w.data[17, :lead])
    assert torch.equal(kernels.dequantize(r), kernels.dequantize(w))
    rows = torch.tensor([47, 0, 17, 17, 31])
    assert torch.equal(kernels.dequantize(r, rows=rows), kernels.dequantize(w, rows=rows))
    assert quant.repack(r) is r


@pytest.mark.parametrize("qtype", REPACKABLE)
def test_the_repacked_matmul_is_bitwise_the_files(isa, qtype):  # noqa: F811
    """Every path (the portable kernel, AVX2's half groups, AVX-512, the VNNI byte GEMV, AMX's
    GEMM where the CPU has it), every M from the GEMV to the GEMM, 1 to 3 threads (their shares
    fall on groups of 16)."""
    w = _weight(qtype, 16 * 37, 512, seed=2)
    r = quant.repack(w)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, 512, generator=g)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            for m in ROWS:
                assert torch.equal(
                    kernels.quantized_linear(x[:m], r), kernels.quantized_linear(x[:m], w)
                ), (t, m)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("qtype", REPACKABLE)
def test_repacked_experts_are_bitwise_the_files(isa, qtype):  # noqa: F811
    """expert_linear over 4 experts of 32 rows each, their groups of pairs from 1 to 20 rows."""
    experts, n, k = 4, 32, 512
    gate, up = (_weight(qtype, experts * n, k, seed=s) for s in (4, 5))
    g = torch.Generator().manual_seed(6)
    x = torch.randn(40, k, generator=g)
    groups = torch.tensor([[0, 0, 1], [2, 1, 20], [3, 21, 3]], dtype=torch.int64)
    rows = torch.randint(0, 40, (24,), generator=g)
    files = kernels.expert_linear(x, [gate, up], experts, groups, rows)
    repacked = kernels.expert_linear(
        x, [quant.repack(gate), quant.repack(up)], experts, groups, rows
    )
    for a, b in zip(files, repacked, strict=True):
        assert torch.equal(a, b)


def test_what_cannot_be_repacked_is_refused_by_name():
    w = _kquant_weight("q4_k", 24, 256, seed=7)
    with pytest.raises(ValueError, match="cannot be repacked"):
        quant.repack(w)
    with pytest.raises(ValueError, match="repacked must be False for q4_k of 24 rows"):
        QuantizedWeight(w.data, "q4_k", w.shape, repacked=True)
    q4 = kernels.quantize(torch.randn(16, 64), "q4_0")
    with pytest.raises(ValueError, match="repacked must be False for q4_0"):
        QuantizedWeight(q4.data, "q4_0", q4.shape, repacked=True)
    assert not quant.repackable("q4_0", 16) and quant.repackable("q8_0", 32)
    out = torch.empty_like(w.data)
    with pytest.raises(ValueError, match="repacked in blocks of 144"):
        c_backend.copy_rows([(out.data_ptr(), w.data.data_ptr(), 24, w.row_bytes, 0, 144)])
    with pytest.raises(ValueError, match="repacked in blocks of 19"):  # 4 w + 3: no layout
        c_backend.copy_rows([(out.data_ptr(), w.data.data_ptr(), 16, 19 * 4, 0, 19)])
    x, y = torch.randn(1, 256), torch.empty(1, 24)
    with pytest.raises(ValueError, match="out of range"):  # the C module checks it too
        c_backend.quant_linear(x, w.data, "q4_k_r16", y)
    r = quant.repack(_kquant_weight("q4_k", 64, 256, seed=8))
    with pytest.raises(ValueError, match="8 experts' matrices"):  # 8 rows each
        kernels.expert_linear(x, [r], 8, torch.zeros((0, 3), dtype=torch.int64))


def test_the_loader_repacks_on_the_avx512_path_unless_told_not_to(monkeypatch):
    avx512 = quant.cpu_isa() == "avx512"
    assert quant.repack_at_load("q4_k", 2048) == avx512 and not quant.repack_at_load("q4_k", 2040)
    assert not quant.repack_at_load("q4_0", 2048)
    monkeypatch.setenv("NANOSERVE_REPACK", "0")
    assert not quant.repack_at_load("q4_k", 2048)
    if avx512:
        monkeypatch.setenv("NANOSERVE_REPACK", "1")
        before = (quant.cpu_isa(), quant.uses_vnni(), quant.uses_amx())
        quant.set_isa("avx2")
        try:
            assert not quant.repack_at_load("q4_k", 2048)
        finally:
            quant.set_isa(*before)


def test_repacking_a_large_matrix_keeps_every_row():
    """A matrix of 4096 rows and 9 super-blocks a row: each row's values come back."""
    w = _kquant_weight("q6_k", 4096, 256 * 9, seed=9)
    r = quant.repack(w)
    rows = torch.from_numpy(np.random.default_rng(10).integers(0, 4096, 64))
    assert torch.equal(kernels.dequantize(r, rows=rows), kernels.dequantize(w, rows=rows))
