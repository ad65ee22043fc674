"""Two builds of the C module side by side: the quantized matmul of build A and of build B timed
in one process, call by call in turn (A B A B ...), per format, Llama-3.2-1B MLP shape, rows M
and path; the median of each, the ratio A/B and its geometric mean. For a kernel change: copy
each build's _C*.so somewhere first.

The weights are laid out as a model's are: the K-quants repacked as the loader repacks them for
the AVX-512 kernels (q4_k_r16, ...), in huge pages, and `--copies` matrices multiplied in turn, so
that a call streams W from memory as a decode step does (one 8192 x 2048 Q4_K matrix is 9.4 MB,
which a 32 MiB L3 holds).

    python -m bench.ab_quant A.so B.so [--threads 2] [--formats q4_k,q6_k] [--rows 1,8]
        [--shapes 1536x576,576x1536]
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import math
import statistics
import time
from types import ModuleType

import torch

from bench.bench_quant import blocks_of
from nanoserve.kernels import quant
from nanoserve.model.hugepages import pack

FORMATS = ("q4_0", "q4_1", "q5_0", "q8_0", "q4_k", "q5_k", "q6_k", "f16")
SHAPES = ((8192, 2048), (2048, 8192))  # N, K: gate/up and down of Llama-3.2-1B
ROWS = (1, 4, 8, 32)
PATHS = (("avx2", False), ("avx512", True))


def load(path: str) -> ModuleType:
    """A build's module, loaded from its file beside any other build."""
    loader = importlib.machinery.ExtensionFileLoader("_C", path)
    spec = importlib.util.spec_from_file_location("_C", path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def weights(name: str, n: int, k: int, copies: int) -> tuple[str, list[torch.Tensor]]:
    """The C name of the layout and `copies` random matrices in it, in huge pages: the K-quants
    repacked (as a loader does on the AVX-512 path), f16 as it is."""
    if name == "f16":
        return name, pack([torch.randn(n, k).half() for _ in range(copies)])
    ws = [blocks_of(torch.randn(n, k) / k**0.5, name) for _ in range(copies)]
    if quant.repackable(name, n):
        ws = [quant.repack(w) for w in ws]
    return ws[0].kernel_qtype, pack([w.data for w in ws])


def timed_pair(a: ModuleType, b: ModuleType, calls: list[dict], reps: int) -> tuple[float, float]:
    """Medians of A's and B's rounds of calls, taken in turn (the first of each dropped)."""
    times: dict[int, list[float]] = {0: [], 1: []}
    for r in range(reps):
        for which in (0, 1) if r % 2 == 0 else (1, 0):
            start = time.perf_counter()
            for call in calls:
                (a, b)[which].quant_linear(**call)
            times[which].append(time.perf_counter() - start)
    return statistics.median(times[0][1:]), statistics.median(times[1][1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--rows", default=",".join(map(str, ROWS)))
    p.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES), help="NxK,...")
    p.add_argument("--copies", type=int, default=8, help="matrices a round multiplies")
    args = p.parse_args()
    a, b = load(args.a), load(args.b)
    names, best = [name for name, _ in PATHS], a.cpu_quant_isa()[0]  # the paths this CPU runs
    paths = PATHS[: names.index(best) + 1] if best in names else ()
    ratios: dict[tuple[str, int], list[float]] = {}
    for name in args.formats.split(","):
        for n, k in (map(int, s.split("x")) for s in args.shapes.split(",")):
            layout, ws = weights(name, n, k, args.copies)
            for m in map(int, args.rows.split(",")):
                x, out = torch.randn(m, k), torch.empty(m, n)
                calls = [dict(out=out.data_ptr(), x=x.data_ptr(), w=w.data_ptr(), M=m, N=n, K=k,
                              qtype=a.BLOCK_FORMATS[layout][0], num_threads=args.threads, ldo=n)
                         for w in ws]  # fmt: skip
                for isa, vnni in paths:
                    a.set_quant_isa(isa=isa, vnni=vnni)
                    b.set_quant_isa(isa=isa, vnni=vnni)
                    ta, tb = timed_pair(a, b, calls, 20 if m < 32 else 6)
                    ratios.setdefault((isa, m), []).append(ta / tb)
                    gb = sum(w.nbytes for w in ws) / 1e9
                    print(f"{layout:8} {n}x{k} M={m:<3} {isa:7} A {ta * 1e3:7.3f} ms "
                          f"({gb / ta:5.1f} GB/s)  B {tb * 1e3:7.3f} ms ({gb / tb:5.1f} GB/s)  "
                          f"A/B {ta / tb:.3f}", flush=True)  # fmt: skip
    for (isa, m), rs in sorted(ratios.items()):
        mean = math.exp(sum(map(math.log, rs)) / len(rs))
        print(f"{isa:7} M={m:<3} A/B geomean {mean:.3f} (min {min(rs):.3f}, max {max(rs):.3f})")


if __name__ == "__main__":
    main()
