"""What int8 activations and an interleaved weight layout would give the K-quant decode GEMV
(M = 1), measured beside the module's kernel (int16 activations, GGUF rows transposed per block).
For Q4_K also 15-bit activations held as two int8 parts (x = 128 hi + lo, lo 0..127): two
vpdpbusd give the 15-bit dot exactly, at nearly the int16 path's accuracy.

int8_gemv.c (compiled here, -march=native; needs AVX-512 VNNI) multiplies Q4_K and Q6_K with x as
int8 per 32 values, reading W as GGUF rows or interleaved (16 rows' words side by side per
super-block). Shapes are Llama-3.2-1B's gate/up (8192 x 2048, 8 copies: 75 MB, past the L3) and
its tied output (49152 x 2048 Q6_K, 83 MB); outputs are checked against float64. Figures are GB/s
of W read, one thread timed by CPU time (time.process_time: it holds when other work shares the
cores) unless --threads says more (then wall-clock). Writes bench/results/int8_gemv.json.

    python -m bench.experiments.int8_gemv [--threads 1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from bench.bench_quant import blocks_of
from bench.machine import cpu_model
from nanoserve import kernels

HERE = Path(__file__).parent
RESULTS = HERE.parent / "results"
CASES = [("q4_k", 8192, 2048, 8), ("q6_k", 49152, 2048, 1)]
BYTES = {"q4_k": 144, "q6_k": 210}


def build(out: Path) -> ctypes.CDLL:
    lib = out / "int8_gemv.so"
    cmd = ["gcc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC",
           str(HERE / "int8_gemv.c"), "-o", str(lib)]  # fmt: skip
    subprocess.run(cmd, check=True)
    return ctypes.CDLL(str(lib))


def interleave(data: torch.Tensor, n: int, nb: int, size: int) -> torch.Tensor:
    """Each super-block's 16 rows' 4-byte words side by side; Q6_K's last 2 bytes (d) after."""
    a = data.view(torch.uint8).reshape(n // 16, 16, nb, size)
    body = a[..., : size // 4 * 4].reshape(n // 16, 16, nb, size // 4, 4).permute(0, 2, 3, 1, 4)
    tail = a[..., size // 4 * 4 :].permute(0, 2, 1, 3)
    return torch.cat([body.reshape(n // 16, nb, -1), tail.reshape(n // 16, nb, -1)], 2).contiguous()


def int8_activations(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """x as int8 per 32 values (round to nearest, scale amax / 127), with what the kernels need."""
    blocks = x.reshape(-1, 32).double()
    dx = (blocks.abs().amax(1) / 127).clamp_min(1e-30)
    q = torch.round(blocks / dx[:, None]).clamp(-127, 127)
    return {
        "xq": q.to(torch.int8).reshape(-1).contiguous(),
        "dx": dx.float().contiguous(),
        "sx": (dx * q.sum(1)).float().contiguous(),
        "bsum16": q.reshape(-1, 16).sum(1).to(torch.int32).contiguous(),
    }


def split_activations(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """x as 15-bit integers per 32 values (scale amax / 16383), each held as 128 hi + lo (hi
    int8, lo 0..127): two int8 dots give the 15-bit dot exactly."""
    blocks = x.reshape(-1, 32).double()
    dx = (blocks.abs().amax(1) / 16383).clamp_min(1e-30)
    q = torch.round(blocks / dx[:, None]).clamp(-16383, 16383).to(torch.int32)
    return {
        "xq": torch.div(q, 128, rounding_mode="floor").to(torch.int8).reshape(-1).contiguous(),
        "xlo": torch.remainder(q, 128).to(torch.int8).reshape(-1).contiguous(),
        "dx": dx.float().contiguous(),
        "sx": (dx * q.sum(1)).float().contiguous(),
        "q": q.reshape(-1),
    }


def call(lib: ctypes.CDLL, qtype: str, out: torch.Tensor, a: dict, w: torch.Tensor, inter: int):
    p = ctypes.c_void_p
    n, k = out.numel(), a["xq"].numel()
    if qtype == "q4_k":
        lo = p(a["xlo"].data_ptr()) if "xlo" in a else None
        lib.q4k_gemv_int8(p(out.data_ptr()), p(a["xq"].data_ptr()), lo, p(a["dx"].data_ptr()),
                          p(a["sx"].data_ptr()), p(w.data_ptr()), n, k, inter)  # fmt: skip
        return
    lib.q6k_gemv_int8(p(out.data_ptr()), p(a["xq"].data_ptr()), p(a["dx"].data_ptr()),
                      p(a["bsum16"].data_ptr()), p(w.data_ptr()), n, k, inter)  # fmt: skip


def measure(lib: ctypes.CDLL, qtype: str, n: int, k: int, copies: int, rounds: int, threads: int):
    ws = [blocks_of(torch.randn(n, k) / k**0.5, qtype) for _ in range(copies)]
    rows = [w.data for w in ws]
    inter = [interleave(w.data, n, k // 256, BYTES[qtype]) for w in ws]
    x = torch.randn(1, k)
    a = int8_activations(x[0])
    out, out8 = torch.empty(1, n), torch.empty(n)
    exact = kernels.dequantize(ws[0]).double() @ x[0].double()
    x8 = (a["xq"].double().reshape(-1, 32) * a["dx"].double()[:, None]).reshape(-1)
    of_int8 = kernels.dequantize(ws[0]).double() @ x8
    errors = {}
    for layout, data in (("rows", rows[0]), ("interleaved", inter[0])):
        call(lib, qtype, out8, a, data, layout == "interleaved")
        assert (out8.double() - of_int8).abs().max() <= 1e-4 * of_int8.abs().max(), layout
    errors["int8"] = ((out8.double() - exact).norm() / exact.norm()).item()
    if qtype == "q4_k":
        s = split_activations(x[0])
        x15 = (s["q"].double().reshape(-1, 32) * s["dx"].double()[:, None]).reshape(-1)
        of_15 = kernels.dequantize(ws[0]).double() @ x15
        call(lib, qtype, out8, s, inter[0], 1)
        assert (out8.double() - of_15).abs().max() <= 1e-4 * of_15.abs().max()
        errors["15-bit as two int8"] = ((out8.double() - exact).norm() / exact.norm()).item()
    kernels.quantized_linear(x, ws[0], out)
    errors["int16"] = ((out[0].double() - exact).norm() / exact.norm()).item()
    clock = time.process_time if threads == 1 else time.perf_counter
    ways = {
        "int16, rows (the module)": lambda: [kernels.quantized_linear(x, w, out) for w in ws],
        "int8, rows": lambda: [call(lib, qtype, out8, a, d, 0) for d in rows],
        "int8, interleaved": lambda: [call(lib, qtype, out8, a, d, 1) for d in inter],
    }
    if qtype == "q4_k":
        ways["15-bit as two int8, interleaved"] = lambda: [
            call(lib, qtype, out8, s, d, 1) for d in inter
        ]
    total = sum(d.numel() for d in rows)
    best: dict[str, float] = {}
    for _ in range(rounds):  # the ways take turns
        for name, way in ways.items():
            way()
            start, reps = clock(), 0
            while clock() - start < 0.5 or reps < 3:
                way()
                reps += 1
            best[name] = max(best.get(name, 0.0), total * reps / (clock() - start) / 1e9)
    return {"qtype": qtype, "n": n, "k": k, "copies": copies, "weight_mb": total / 1e6,
            "gb_s": best, "relative_error_vs_float_x": errors}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        lib = build(Path(tmp))
        rows = [measure(lib, *case, args.rounds, args.threads) for case in CASES]
    for r in rows:
        cells = " | ".join(f"{name} {v:.1f}" for name, v in r["gb_s"].items())
        shape = f"{r['n']}x{r['k']} x{r['copies']} ({r['weight_mb']:.0f} MB)"
        print(f"{r['qtype']} {shape}: {cells} GB/s")
        print(f"  relative error against float x: {r['relative_error_vs_float_x']}")
    info = {"cpu": cpu_model(), "threads": args.threads,
            "clock": "process_time" if args.threads == 1 else "wall", "rows": rows}  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "int8_gemv.json").write_text(json.dumps(info, indent=2) + "\n")


if __name__ == "__main__":
    main()
