"""The q8_0 KV cache's kernels (llama.cpp's -ctk/-ctv q8_0): the torch reference's quantizer
against gguf's numpy port of ggml's (bit for bit, halves away from zero), the C store against the
torch reference, decode (split-K) over q8_0 rows against the float64 attention over the
de-quantized rows, bitwise row invariance, and the refusals. Prefill: test_prefill_attention (every
cache dtype); the one-call C step: test_kv_dtype (through the engine).
"""

import shutil
import subprocess
import sysconfig
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import test_kernels
import test_kv_dtype_kernels
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize
from test_kernels import ATOL, make_case, reference

import nanoserve.kernels as kernels

gen = test_kernels.gen  # the seeded generator fixture (NANOSERVE_KERNEL_SEED=n reproduces a run)

Q8 = kernels.KV_Q8_0
LENS = test_kv_dtype_kernels.LENS  # up to five of the C kernel's 512-token partitions
CONFIGS = [  # (num_q_heads, num_kv_heads, head_dim, block_size)
    pytest.param(4, 4, 64, 16, id="mha-d64-b16"),
    pytest.param(8, 2, 32, 8, id="gqa4-d32-b8"),
]


def q8_case(gen, lens, num_q_heads, num_kv_heads, head_dim, block_size, q_dtype=torch.float32):
    """test_kernels.make_case's float32 cache quantized to q8_0 rows, queries in q_dtype."""
    case = make_case(gen, lens, num_q_heads, num_kv_heads, head_dim, block_size, torch.float32)
    return replace(
        case,
        q=case.q.to(q_dtype),
        k_cache=kernels.q8_0_quantize(case.k_cache),
        v_cache=kernels.q8_0_quantize(case.v_cache),
    )


def widened(case):
    """The case over the float32 values its q8_0 rows hold: what the attention must attend to."""
    k, v = kernels.q8_0_dequantize(case.k_cache), kernels.q8_0_dequantize(case.v_cache)
    return replace(case, k_cache=k, v_cache=v)


def _probes(gen, rows: int, width: int) -> torch.Tensor:
    """float32 rows over many magnitudes, a block of zeros (d = 0), and values whose scaled value
    is a half (x / d = 62.5 with d = 1: 63 away from zero, 62 to even)."""
    x = torch.randn((rows, width), generator=gen)
    x *= torch.pow(10.0, torch.empty((rows, 1)).uniform_(-6, 4, generator=gen))
    x[0, :32] = 0.0
    x[1, :32] = torch.linspace(-1, 1, 32)
    x[1, 0], x[1, 1], x[1, 2], x[1, 3] = 127.0, 62.5, -62.5, 0.5
    return x


def test_quantize_equals_ggml_bit_for_bit(gen):
    x = _probes(gen, 40, 128)
    ours = kernels.q8_0_quantize(x)
    assert ours.dtype == torch.uint8 and ours.shape == (40, 128 // 32 * 34)
    theirs = gguf_quantize(x.numpy(), GGMLQuantizationType.Q8_0)
    assert np.array_equal(ours.numpy(), theirs)
    # d = 1 (fp16 0x3c00), q = 127, 63, -63, 1: halves away from zero, as roundf
    assert ours[1, :2].tolist() == [0x00, 0x3C]
    assert ours[1, 2:6].view(torch.int8).tolist() == [127, 63, -63, 1]
    assert not ours[0, :34].any()  # d = 0: q = 0
    # De-quantized: within half a step of d, plus the fp16 rounding of d (127 steps of it).
    error = (kernels.q8_0_dequantize(ours) - x).abs().unflatten(-1, (-1, 32))
    d = x.abs().unflatten(-1, (-1, 32)).amax(-1, keepdim=True) / 127
    assert error.le((d * 0.5 + 127 * (d.half().float() - d).abs()) * 1.001).all()


@pytest.mark.parametrize("backend", ["c", "torch"])
@pytest.mark.parametrize("key_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_store_kv_quantizes_as_the_reference(gen, backend, key_dtype):
    """store_kv into a q8_0 cache equals `cache[slot] = q8_0_quantize(key)` bitwise; negative
    slots are skipped."""
    num_blocks, num_kv_heads, block_size, head_dim = 5, 2, 8, 96
    shape = (num_blocks, num_kv_heads, block_size, head_dim // 32 * 34)
    k_cache = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    v_cache = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:12]
    slots[[3, 9]] = -1
    key = _probes(gen, 24, head_dim).view(12, num_kv_heads, head_dim).to(key_dtype)
    value = torch.randn((12, num_kv_heads, head_dim), generator=gen).to(key_dtype)
    kernels.store_kv(key, value, k_cache, v_cache, slots, backend=backend)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expect_k[slot // block_size, :, slot % block_size] = kernels.q8_0_quantize(key[i])
            expect_v[slot // block_size, :, slot % block_size] = kernels.q8_0_quantize(value[i])
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)


def decode(case, backend: str, window: int = 0) -> torch.Tensor:
    return test_kv_dtype_kernels.decode(case, backend, window)


@pytest.mark.parametrize("backend", ["c", "torch"])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim,block_size", CONFIGS)
def test_decode_matches_float64_reference(
    gen, backend, q_dtype, num_q_heads, num_kv_heads, head_dim, block_size
):
    """Over the de-quantized rows: within the float32 sums' (or bfloat16 out's) rounding."""
    case = q8_case(gen, LENS, num_q_heads, num_kv_heads, head_dim, block_size, q_dtype)
    out = decode(case, backend, window=0)
    assert out.dtype == q_dtype
    expected = reference(widened(case))
    torch.testing.assert_close(out.double(), expected, atol=ATOL[q_dtype], rtol=0)
    windowed = decode(case, backend, window=600)
    expected = reference(widened(case), 600)
    torch.testing.assert_close(windowed.double(), expected, atol=ATOL[q_dtype], rtol=0)


@pytest.mark.parametrize("window", [0, 700])
def test_c_rows_are_bitwise_invariant(gen, window):
    """A row's output is the same bits alone, in a batch of mixed lengths, under 1 or 2 threads."""
    lens = [2500, 1, 513, 1100, 37, 1537]
    case = q8_case(gen, lens, 8, 2, 64, 16)
    run = test_kv_dtype_kernels._with_threads
    batch = run(2, lambda: decode(case, "c", window))
    assert torch.equal(run(1, lambda: decode(case, "c", window)), batch)
    for i in range(len(lens)):
        alone = case.select([i], own_blocks=True)
        for threads in (1, 2):
            got = run(threads, lambda alone=alone: decode(alone, "c", window))
            assert torch.equal(got[0], batch[i]), f"context {lens[i]}, {threads} threads"


def test_c_decode_reads_q8_0_as_it_reads_the_floats_it_holds(gen):
    """The C kernel over q8_0 rows gives the same bits as over the float32 rows they de-quantize
    to: the widening is exact, and the rest of the kernel is the float32 one."""
    case = q8_case(gen, [5, 600, 1100], 8, 2, 64, 16)
    assert torch.equal(decode(case, "c"), decode(widened(case), "c"))


def test_refusals_name_the_cause(gen):
    case = q8_case(gen, [5, 20], 4, 2, 64, 8)
    with pytest.raises(TypeError, match="q dtype must be one of float32, bfloat16"):
        kernels.paged_attention_decode(*replace(case, q=case.q.half()).args(), backend="c")
    odd = case.k_cache[..., :-1].contiguous()
    with pytest.raises(ValueError, match="whole blocks of 34 bytes"):
        kernels.paged_attention_decode(*replace(case, k_cache=odd, v_cache=odd).args())
    with pytest.raises(ValueError, match="head_dim a multiple of 32"):
        kernels.cache_row_width(40, Q8)


# Quantizes the float32 rows on stdin with the header's q8_0 code and writes the blocks, then
# their widening by ns_load_row, to stdout.
_ISA_PROGRAM = r"""
#include "nanoserve.h"
#include <stdio.h>
#include <stdlib.h>
int main(void) {
    static float x[1 << 16], y[1 << 16];
    static block_q8_0 b[(1 << 16) / 32];
    const size_t n = fread(x, sizeof(float), 1 << 16, stdin) / 32 * 32;
    ns_q8_0_quantize(b, x, (Py_ssize_t)n);
    ns_load_row(y, b, (Py_ssize_t)n, NS_Q8_0);
    fwrite(b, sizeof(block_q8_0), n / 32, stdout);
    fwrite(y, sizeof(float), n, stdout);
    return 0;
}
"""
# The -march whose build takes each path of ns_q8_0_load, and the CPU flag it needs.
_ISA_BUILDS = {"avx512": ("skylake-avx512", "avx512f"), "avx2": ("haswell", "avx2"),
               "scalar": ("x86-64", "sse2")}  # fmt: skip


@pytest.mark.parametrize("isa", list(_ISA_BUILDS))
def test_c_quantize_and_load_equal_the_reference_on_each_isa(gen, tmp_path, isa):
    """The C module is built for one -march; the header's q8_0 code compiled for each path (its
    AVX-512, AVX2 and scalar loads) gives the reference's bits on each."""
    march, flag = _ISA_BUILDS[isa]
    cpuinfo = Path("/proc/cpuinfo")
    if shutil.which("gcc") is None or not cpuinfo.exists():
        pytest.skip("needs gcc and /proc/cpuinfo")
    if flag not in cpuinfo.read_text().split():
        pytest.skip(f"this CPU has no {flag}")
    source = tmp_path / "q8.c"
    source.write_text(_ISA_PROGRAM)
    include = sysconfig.get_paths()["include"]
    csrc = Path(__file__).resolve().parents[1] / "kernels" / "csrc"
    binary = tmp_path / "q8"
    subprocess.run(
        ["gcc", "-O3", f"-march={march}", "-std=c11", "-ffp-contract=fast", f"-I{include}",
         f"-I{csrc}", str(source), "-o", str(binary), "-lm"], check=True,
    )  # fmt: skip
    x = _probes(gen, 64, 256)
    out = subprocess.run([str(binary)], input=x.numpy().tobytes(), capture_output=True, check=True)
    blocks = torch.frombuffer(bytearray(out.stdout[: x.numel() // 32 * 34]), dtype=torch.uint8)
    floats = torch.frombuffer(bytearray(out.stdout[x.numel() // 32 * 34 :]), dtype=torch.float32)
    expected = kernels.q8_0_quantize(x)
    assert torch.equal(blocks, expected.view(-1))
    assert torch.equal(floats, kernels.q8_0_dequantize(expected).view(-1))
