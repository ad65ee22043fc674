"""Microbenchmark of the matmuls on GGUF block weights (nanoserve.kernels.quantized_linear).

SmolLM2-135M's shapes (q and o 576x576, k and v 192x576, gate and up 1536x576, down 576x1536, and
the Q8_0 embedding / output 49152x576) at M = 1, 4, 32 and 256 rows: milliseconds per call and GB/s
of weight bytes read, for Q8_0, Q4_0 and Q4_1 (int16 activations) on every instruction-set path
this CPU runs (portable C, AVX2, AVX-512 without and with VNNI), beside the float32 GEMV
(kernels.small_linear, M <= 4) and torch's F.linear on the float32 matrix, and torch's sum over
512 MiB as the machine's read bandwidth. Then the decode sweep: all 30 layers' matrices of
SmolLM2-135M (fused qkv 960x576, o, fused gate_up 3072x576, down; 66 MB of Q4_1, more than the L2
caches hold) one after the other at M = 1 and 4, as a decode step reads them, beside small_linear
on their float32 values. Prints a table, the block matmuls beside the float32 ones, and writes
bench/results/quant_cpu.json. SmolLM2's K (576, 1536) is no multiple of a K-quant super-block
(256), so the K-quants run there only on the down projection's K = 1536; their decode GEMV is
measured at M = 1 on Llama-3.2-1B's MLP shapes (GEMV_SHAPES) beside Q4_1, Q8_0 and MXFP4, one
format after the other on the same shape (--gemv-only: that alone).

--compare-dequant adds the alternative the kernels do not take: the weights de-quantized to
float32 instead of the activations quantized to int16 (bench/experiments/dequant_f32.c,
compiled here with the system C compiler for -march=native and x86-64-v3: a GEMV for M <= 4, a
panel-de-quantizing GEMM above), and de-quantize-then-F.linear (MKL's GEMM on a float copy).

    python -m bench.bench_quant [--quick] [--gemv-only] [--compare-dequant] [--out bench/results]
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.machine import cpu_model, median_ms
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
# SmolLM2-135M's decoder layers as the decode step reads them: fused qkv, o, fused gate_up, down.
LAYERS, LAYER_SHAPES = 30, [(960, 576), (576, 576), (3072, 576), (576, 1536)]
SWEEP_ROWS = (1, 4)
# Llama-3.2-1B's gate / up (8192x2048) and down (2048x8192): its Q4_K_M file's are Q4_K and Q6_K.
GEMV_SHAPES = [(8192, 2048, "gate, up (1B)"), (2048, 8192, "down (1B)")]
GEMV_QTYPES = ("q4_k", "q6_k", "q4_1", "q8_0", "mxfp4")
RESULTS = Path(__file__).parent / "results"
EXPERIMENT = Path(__file__).parent / "experiments" / "dequant_f32.c"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="M = 1 and 32 only, shorter timings")
    p.add_argument("--gemv-only", action="store_true", help="only the M = 1 GEMV_SHAPES")
    p.add_argument("--compare-dequant", action="store_true", help="time float de-quantization too")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for quant_cpu.json")
    return p.parse_args()


def read_bandwidth() -> float:
    """GB/s of torch's sum over a 512 MiB float32 tensor: bytes read per second."""
    t = torch.ones((512 << 20) // 4)
    return max(t.numel() * 4 / median_ms(t.sum, 0.5) / 1e6 for _ in range(3))


@functools.cache
def paths() -> list[tuple[str, str, bool, bool]]:
    """(label, path, VNNI, AMX) of every path this CPU runs (AMX: GEMMs of 16 rows or more)."""
    found = [(p, p, False, False) for p in quant.ISA_PATHS if quant.isa_supported(p)]
    before = current_path()
    if quant.isa_supported("avx512") and quant.set_isa("avx512", True) and quant.uses_vnni():
        found.append(("avx512_vnni", "avx512", True, False))
        if quant.amx_supported():
            found.append(("avx512_amx", "avx512", True, True))
    quant.set_isa(*before)
    return found


def current_path() -> tuple[str, bool, bool]:
    """set_isa's arguments for the path in use, to restore it."""
    return quant.cpu_isa(), quant.uses_vnni(), quant.uses_amx()


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


def blocks_of(w: torch.Tensor, qtype: str) -> quant.QuantizedWeight:
    """w quantized to qtype; for the K-quants, which nanoserve does not quantize to, random valid
    blocks of w's scale instead (the kernels' time does not depend on the values)."""
    if qtype not in quant.NOT_QUANTIZED:
        return kernels.quantize(w, qtype)
    n, k = w.shape
    size, nb = quant.BLOCK_BYTES[qtype], k // quant.BLOCK_VALUES[qtype]
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (n, nb, size), dtype=torch.uint8, generator=g)
    d = torch.full((n, nb, 1), float(w.std()) / 16, dtype=torch.float16).view(torch.uint8)
    at = size - 2 if qtype == "q6_k" else 0  # Q6_K's d ends its block; the others' d, dmin lead
    raw[:, :, at : at + 2] = d
    if qtype != "q6_k":
        raw[:, :, 2:4] = d
    return quant.QuantizedWeight(quant.aligned_bytes(raw.view(n, nb * size)), qtype, (n, k))


def quant_point(w: torch.Tensor, m: int, qtype: str, budget: float) -> dict:
    """ms per call of each path on w quantized to qtype, x of m rows."""
    q = blocks_of(w, qtype)
    x = torch.randn(m, w.shape[1])
    out = torch.empty(m, w.shape[0])
    times = {}
    before = current_path()
    for label, path, vnni, amx in paths():
        quant.set_isa(path, vnni, amx)
        times[label] = median_ms(functools.partial(kernels.quantized_linear, x, q, out), budget)
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
        times[f"f32-dequant -march={march}"] = median_ms(functools.partial(fn, *args), budget)
    wd = kernels.dequantize(q)
    times["dequantize + F.linear"] = median_ms(lambda: kernels.dequantize(q), budget) + median_ms(
        lambda: F.linear(x, wd), budget
    )
    return times


def float_points(w: torch.Tensor, m: int, budget: float) -> dict:
    x = torch.randn(m, w.shape[1])
    times = {"F.linear": median_ms(lambda: F.linear(x, w), budget)}
    if m <= kernels.SMALL_LINEAR_MAX_ROWS:
        times["small_linear"] = median_ms(lambda: kernels.small_linear(x, w), budget)
    return {"weight_bytes": w.numel() * 4, "ms": times}


def measure(args: argparse.Namespace, libs: dict) -> list[dict]:
    rows = (1, 32) if args.quick else ROWS
    budget = 0.05 if args.quick else 0.25
    points = []
    for n, k, what in SHAPES:
        w = torch.randn(n, k) / k**0.5
        qtypes = ("q8_0",) if what == "embedding" else kernels.QUANT_TYPES
        qtypes = tuple(q for q in qtypes if k % quant.BLOCK_VALUES[q] == 0)
        for m in rows:
            base = {"n": n, "k": k, "what": what, "m": m}
            points.append({**base, "qtype": "float32", **float_points(w, m, budget)})
            print_point(points[-1])
            for qtype in qtypes:
                point = quant_point(w, m, qtype, budget)
                points.append({**base, "qtype": qtype, "activations": "int16", **point})
                print_point(points[-1])
                if libs:  # the weights de-quantized to float: float32 activations
                    ms = dequant_points(w, m, qtype, libs, budget)
                    point = {"weight_bytes": points[-1]["weight_bytes"], "ms": ms}
                    points.append({**base, "qtype": qtype, "activations": "float32", **point})
                    print_point(points[-1])
    return points


def measure_gemv(budget: float) -> list[dict]:
    """M = 1 on GEMV_SHAPES, each of GEMV_QTYPES in turn on the same shape and paths."""
    points = []
    for n, k, what in GEMV_SHAPES:
        w = torch.randn(n, k) / k**0.5
        for qtype in GEMV_QTYPES:
            point = quant_point(w, 1, qtype, budget)
            points.append({"n": n, "k": k, "what": what, "m": 1, "qtype": qtype} | point)
            points[-1]["activations"] = "int16"
            print_point(points[-1])
    return points


def print_point(p: dict) -> None:
    cells = " | ".join(
        f"{name} {ms:.3f} ms {p['weight_bytes'] / ms / 1e6:.1f} GB/s"
        for name, ms in p["ms"].items()
    )
    label = f"{p['qtype']} {p.get('activations', '')}"
    print(f"{p['n']:5d}x{p['k']:<4d} M={p['m']:<3d} {label:13s} {cells}", flush=True)


def sweep(budget: float) -> list[dict]:
    """ms per decode sweep over SmolLM2-135M's layer matrices (LAYER_SHAPES, LAYERS times; random
    values of its scale) in Q4_1 on each path, and small_linear on the floats."""
    g = torch.Generator().manual_seed(0)
    shapes = LAYER_SHAPES * LAYERS
    floats = [torch.randn(s, generator=g) / s[1] ** 0.5 for s in shapes]
    blocks = [kernels.quantize(w, "q4_1") for w in floats]
    nbytes = sum(b.data.numel() for b in blocks)
    points = []
    for m in SWEEP_ROWS:
        xs = {k: torch.randn(m, k, generator=g) for _, k in LAYER_SHAPES}
        calls = [functools.partial(kernels.small_linear, xs[w.shape[1]], w) for w in floats]
        ms = median_ms(lambda calls=calls: [c() for c in calls], budget)
        points.append(sweep_point(m, "float32", None, sum(w.numel() * 4 for w in floats), ms))
        before = current_path()
        for label, path, vnni, amx in paths():
            quant.set_isa(path, vnni, amx)
            calls = [functools.partial(kernels.quantized_linear, xs[b.shape[1]], b) for b in blocks]
            ms = median_ms(lambda calls=calls: [c() for c in calls], budget)
            points.append(sweep_point(m, "q4_1 int16", label, nbytes, ms))
        quant.set_isa(*before)
    return points


def sweep_point(m: int, what: str, path: str | None, nbytes: int, ms: float) -> dict:
    point = {"m": m, "what": what, "path": path, "weight_bytes": nbytes, "ms": ms}
    print(
        f"sweep M={m} {what:11s} {path or 'small_linear':12s} {ms:7.3f} ms "
        f"{nbytes / ms / 1e6:5.1f} GB/s",
        flush=True,
    )
    return point


def summary(points: list[dict], sweeps: list[dict]) -> list[dict]:
    """The block matmul's ms per shape, M, format and path beside the float32 matmuls' ms on the
    same shape; and per decode sweep."""
    floats = {(p["n"], p["k"], p["m"]): p["ms"] for p in points if p["qtype"] == "float32"}
    rows = []
    for p in points:
        if p.get("activations") != "int16":
            continue
        for path, t in p["ms"].items():
            row = {"n": p["n"], "k": p["k"], "m": p["m"], "qtype": p["qtype"], "path": path}
            row |= {"ms": t} | {
                f"float32 {f}_ms": v for f, v in floats[p["n"], p["k"], p["m"]].items()
            }
            rows.append(row)
    sweep_ms = {(p["m"], p["path"], p["what"]): p["ms"] for p in sweeps}
    for (m, path, what), t in sweep_ms.items():
        if what == "q4_1 int16":
            row = {"sweep": True, "m": m, "path": path, "ms": t}
            rows.append(row | {"float32 small_linear_ms": sweep_ms[m, None, "float32"]})
    return rows


def print_summary(rows: list[dict]) -> None:
    print("\nblocks (int16 activations) beside float32:")
    for r in rows:
        where = "sweep" if r.get("sweep") else f"{r['n']}x{r['k']} {r['qtype']}"
        floats = [(f, r.get(f"float32 {f}_ms")) for f in ("F.linear", "small_linear")]
        extra = "".join(f" | {f} {t:.3f} ms = {r['ms'] / t:.2f}x" for f, t in floats if t)
        print(f"  {where:16s} M={r['m']:<3d} {r['path']:12s} {r['ms']:.3f} ms{extra}")


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "quant_paths": [label for label, *_ in paths()],
        "quant_path_default": quant.cpu_isa(),
        "load_average": os.getloadavg(),
    }


def main() -> int:
    args = parse_args()
    libs = dequant_libs() if args.compare_dequant else {}
    print(f"paths: {[label for label, *_ in paths()]}; threads {torch.get_num_threads()}")
    bandwidth = read_bandwidth()
    print(f"read bandwidth (torch sum over 512 MiB): {bandwidth:.1f} GB/s", flush=True)
    gemv = measure_gemv(0.05 if args.quick else 0.25)
    if args.gemv_only:
        return 0
    points = measure(args, libs)
    sweeps = sweep(0.1 if args.quick else 0.5)
    rows = summary(points, sweeps)
    print_summary(rows)
    result = {
        "benchmark": "quantized_linear",
        "machine": machine(),
        "read_gbps": round(bandwidth, 2),
        "units": "ms: median per call (per sweep of all layers for sweeps); GB/s: weight bytes "
        "(blocks, or float32) per second",
        "points": points,
        "gemv": gemv,
        "sweeps": sweeps,
        "summary": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quant_cpu.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out / 'quant_cpu.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
