"""Microbenchmark of the matmuls on GGUF block weights (nanoserve.kernels.quantized_linear).

SmolLM2-135M's shapes (q and o 576x576, k and v 192x576, gate and up 1536x576, down 576x1536, and
the Q8_0 embedding / output 49152x576) at M = 1, 4, 32 and 256 rows: milliseconds per call and GB/s
of weight bytes read, for Q8_0, Q4_0 and Q4_1 on every instruction-set path this CPU runs (portable
C, AVX2, AVX-512 without and with VNNI), beside the float32 GEMV (kernels.small_linear, M <= 4) and
torch's F.linear on the float32 matrix, and torch's sum over 512 MiB as the machine's read
bandwidth. Prints a table and writes bench/results/quant_cpu.json.

--compare-dequant adds the alternative the kernels do not take: the weights de-quantized to
float32 instead of the activations quantized to int8 (kernels/csrc/experiments/dequant_f32.c,
compiled here with the system C compiler for -march=native and x86-64-v3: a GEMV for M <= 4, a
panel-de-quantizing GEMM above), and de-quantize-then-F.linear (MKL's GEMM on a float copy).

    python -m bench.bench_quant [--quick] [--compare-dequant] [--out bench/results]
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.machine import cpu_model
from nanoserve import kernels
from nanoserve.kernels import c_backend, quant

SHAPES = [  # N, K, what
    (576, 576, "q, o"),
    (192, 576, "k, v"),
    (1536, 576, "gate, up"),
    (576, 1536, "down"),
    (49152, 576, "embedding"),
]
ROWS = (1, 4, 32, 256)
RESULTS = Path(__file__).parent / "results"
EXPERIMENT = Path(kernels.__file__).parent / "csrc" / "experiments" / "dequant_f32.c"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="M = 1 and 32 only, shorter timings")
    p.add_argument("--compare-dequant", action="store_true", help="time float de-quantization too")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for quant_cpu.json")
    return p.parse_args()


def time_ms(fn, budget_s: float) -> float:
    """The median of warm calls of fn, in milliseconds: at least 3, more within budget_s."""
    fn()
    times: list[float] = []
    while len(times) < 3 or (sum(times) < budget_s * 1e3 and len(times) < 200):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def read_bandwidth() -> float:
    """GB/s of torch's sum over a 512 MiB float32 tensor: bytes read per second."""
    t = torch.ones((512 << 20) // 4)
    return max(t.numel() * 4 / time_ms(t.sum, 0.5) / 1e6 for _ in range(3))


@functools.cache
def paths() -> list[tuple[str, str, bool]]:
    """(label, path, VNNI) of every path this CPU runs."""
    found = [(p, p, False) for p in quant.ISA_PATHS if quant.isa_supported(p)]
    before = (quant.cpu_isa(), quant.uses_vnni())
    if quant.isa_supported("avx512") and quant.set_isa("avx512", True) and quant.uses_vnni():
        found.append(("avx512_vnni", "avx512", True))
    quant.set_isa(*before)
    return found


def dequant_libs() -> dict[str, ctypes.CDLL]:
    """The float de-quantization experiment, built for each -march that builds here."""
    libs, out = {}, Path(tempfile.mkdtemp(prefix="nanoserve_dequant_"))
    for march in ("native", "x86-64-v3"):
        so = out / f"dequant_{march}.so"
        cmd = ["cc", "-O3", f"-march={march}", "-fopenmp", "-std=c11", "-ffp-contract=fast"]
        cmd += ["-fPIC", "-shared", "-w", str(EXPERIMENT), "-o", str(so)]
        if subprocess.run(cmd, capture_output=True).returncode != 0:
            print(f"could not build {EXPERIMENT.name} for -march={march}", file=sys.stderr)
            continue
        lib = ctypes.CDLL(str(so))
        for fn in (lib.dq_gemv, lib.dq_gemm):
            fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_int] * 2
        libs[march] = lib
    return libs


def quant_points(w: torch.Tensor, m: int, qtype: str, budget: float) -> dict:
    """ms per call of each path on w quantized to qtype, x of m rows."""
    q = kernels.quantize(w, qtype)
    x = torch.randn(m, w.shape[1])
    out = torch.empty(m, w.shape[0])
    times = {}
    before = (quant.cpu_isa(), quant.uses_vnni())
    for label, path, vnni in paths():
        quant.set_isa(path, vnni)
        times[label] = time_ms(lambda: kernels.quantized_linear(x, q, out), budget)
    quant.set_isa(*before)
    return {"weight_bytes": q.data.numel(), "ms": times}


def dequant_points(w: torch.Tensor, m: int, qtype: str, libs: dict, budget: float) -> dict:
    """ms per call of the float de-quantization alternatives (see the module's docstring)."""
    q = kernels.quantize(w, qtype)
    x = torch.randn(m, w.shape[1])
    out = torch.empty(m, w.shape[0])
    n, k = w.shape
    code, threads = c_backend.QTYPE_CODES[qtype], torch.get_num_threads()
    times = {}
    for march, lib in libs.items():
        fn = lib.dq_gemv if m <= kernels.SMALL_LINEAR_MAX_ROWS else lib.dq_gemm
        args = (out.data_ptr(), x.data_ptr(), q.data.data_ptr(), m, n, k, code, threads)
        times[f"f32-dequant -march={march}"] = time_ms(functools.partial(fn, *args), budget)
    wd = kernels.dequantize(q)
    times["dequantize + F.linear"] = time_ms(lambda: kernels.dequantize(q), budget) + time_ms(
        lambda: F.linear(x, wd), budget
    )
    return times


def float_points(w: torch.Tensor, m: int, budget: float) -> dict:
    x = torch.randn(m, w.shape[1])
    times = {"F.linear": time_ms(lambda: F.linear(x, w), budget)}
    if m <= kernels.SMALL_LINEAR_MAX_ROWS:
        times["small_linear"] = time_ms(lambda: kernels.small_linear(x, w), budget)
    return {"weight_bytes": w.numel() * 4, "ms": times}


def measure(args: argparse.Namespace, libs: dict) -> list[dict]:
    rows = (1, 32) if args.quick else ROWS
    budget = 0.05 if args.quick else 0.25
    points = []
    for n, k, what in SHAPES:
        w = torch.randn(n, k) / k**0.5
        qtypes = ("q8_0",) if what == "embedding" else kernels.QUANT_TYPES
        for m in rows:
            base = {"n": n, "k": k, "what": what, "m": m}
            points.append({**base, "qtype": "float32", **float_points(w, m, budget)})
            print_point(points[-1])
            for qtype in qtypes:
                point = quant_points(w, m, qtype, budget)
                if libs:
                    point["ms"].update(dequant_points(w, m, qtype, libs, budget))
                points.append({**base, "qtype": qtype, **point})
                print_point(points[-1])
    return points


def print_point(p: dict) -> None:
    cells = " | ".join(
        f"{name} {ms:.3f} ms {p['weight_bytes'] / ms / 1e6:.1f} GB/s"
        for name, ms in p["ms"].items()
    )
    print(f"{p['n']:5d}x{p['k']:<4d} M={p['m']:<3d} {p['qtype']:7s} {cells}", flush=True)


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "quant_paths": [label for label, _, _ in paths()],
        "quant_path_default": quant.cpu_isa(),
        "load_average": os.getloadavg(),
    }


def main() -> int:
    args = parse_args()
    libs = dequant_libs() if args.compare_dequant else {}
    print(f"paths: {[label for label, _, _ in paths()]}; threads {torch.get_num_threads()}")
    bandwidth = read_bandwidth()
    print(f"read bandwidth (torch sum over 512 MiB): {bandwidth:.1f} GB/s", flush=True)
    points = measure(args, libs)
    result = {
        "benchmark": "quantized_linear",
        "machine": machine(),
        "read_gbps": round(bandwidth, 2),
        "units": "ms: median per call; GB/s: weight bytes (blocks, or float32) per second",
        "points": points,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quant_cpu.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out / 'quant_cpu.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
