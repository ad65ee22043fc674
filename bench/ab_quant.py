"""Two builds of the C module side by side: the quantized matmul of build A and of build B timed
in one process, call by call in turn (A B A B ...), per format, Llama-3.2-1B MLP shape, rows M
and path; the median of each, the ratio A/B and its geometric mean. For a kernel change: copy
each build's _C*.so somewhere first.

    python -m bench.ab_quant A.so B.so [--threads 2]
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import math
import statistics
import time
from types import ModuleType

import numpy as np
import torch

FORMATS = ("q4_0", "q4_1", "q8_0", "q4_k", "q5_k", "q6_k", "f16")
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


def weight(name: str, code_bytes_values: tuple, n: int, k: int, rng) -> torch.Tensor:
    """Random blocks whose fp16 scale is small and finite (or f16 values)."""
    _, block_bytes, block_values = code_bytes_values
    if name == "f16":
        return torch.randn(n, k).half().view(torch.uint8).contiguous().reshape(-1)
    blocks = n * k // block_values
    raw = rng.integers(0, 256, (blocks, block_bytes), dtype=np.uint8)
    raw[:, 0:2] = (rng.standard_normal((blocks, 1)) * 0.01).astype(np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(-1).copy())


def timed_pair(a: ModuleType, b: ModuleType, args: tuple, reps: int) -> tuple[float, float]:
    """Medians of A's and B's calls, taken in turn (the first of each dropped)."""
    times: dict[int, list[float]] = {0: [], 1: []}
    for r in range(reps):
        for which in (0, 1) if r % 2 == 0 else (1, 0):
            start = time.perf_counter()
            (a, b)[which].quant_linear(*args)
            times[which].append(time.perf_counter() - start)
    return statistics.median(times[0][1:]), statistics.median(times[1][1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--formats", default=",".join(FORMATS))
    args = p.parse_args()
    a, b = load(args.a), load(args.b)
    names, best = [name for name, _ in PATHS], a.cpu_quant_isa()[0]  # the paths this CPU runs
    paths = PATHS[: names.index(best) + 1] if best in names else ()
    rng = np.random.default_rng(0)
    ratios: dict[tuple[str, int], list[float]] = {}
    for name in args.formats.split(","):
        for n, k in SHAPES:
            w = weight(name, a.BLOCK_FORMATS[name], n, k, rng)
            for m in ROWS:
                x, out = torch.randn(m, k), torch.empty(m, n)
                call = (out.data_ptr(), x.data_ptr(), w.data_ptr(), m, n, k,
                        a.BLOCK_FORMATS[name][0], args.threads)  # fmt: skip
                for isa, vnni in paths:
                    a.set_quant_isa(isa=isa, vnni=vnni)
                    b.set_quant_isa(isa=isa, vnni=vnni)
                    ta, tb = timed_pair(a, b, call, 20 if m < 32 else 6)
                    ratios.setdefault((isa, m), []).append(ta / tb)
                    print(f"{name:5} {n}x{k} M={m:<3} {isa:7} A {ta * 1e3:7.3f} ms  "
                          f"B {tb * 1e3:7.3f} ms  A/B {ta / tb:.3f}", flush=True)  # fmt: skip
    for (isa, m), rs in sorted(ratios.items()):
        mean = math.exp(sum(map(math.log, rs)) / len(rs))
        print(f"{isa:7} M={m:<3} A/B geomean {mean:.3f} (min {min(rs):.3f}, max {max(rs):.3f})")


if __name__ == "__main__":
    main()
