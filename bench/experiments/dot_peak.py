"""The ceiling that int16 activations put on prompt processing: each core's peak rate of
vpdpwssd (int16 pairs: 32 products a 512-bit instruction, what the quantized GEMM runs on),
vpdpbusd (int8 x uint8: 64 products, what llama.cpp's int8 activations run on) and a float32
FMA (16), measured on this CPU (dot_peak.c, compiled here with gcc; needs AVX-512 VNNI), and what
they allow a prompt's tokens per second for a model of `--macs` multiply-adds a token in its
matrices (default: the 1B-shaped benchmark file's 4 layers, 243.3 M; its output projection is
computed for the last token only). Writes bench/results/dot_peak.json.

    python -m bench.experiments.dot_peak [--threads 2] [--macs 243.3e6]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.machine import cpu_model

HERE = Path(__file__).parent
RESULTS = HERE.parent / "results"
# instruction: products per instruction
KINDS = {"vpdpwssd": 32, "vpdpbusd": 64, "vfmadd": 16}
LOOPS = 50_000_000  # of 12 instructions


def build(out: Path) -> ctypes.CDLL:
    lib = out / "dot_peak.so"
    cmd = ["gcc", "-O2", "-shared", "-fPIC", str(HERE / "dot_peak.c"), "-o", str(lib)]
    subprocess.run(cmd, check=True)
    return ctypes.CDLL(str(lib))


def rate(lib: ctypes.CDLL, kind: str, threads: int) -> float:
    """Instructions a second on all `threads` cores together (ctypes drops the GIL)."""
    fn = getattr(lib, f"peak_{kind}")
    fn.argtypes, fn.restype = [ctypes.c_longlong], ctypes.c_longlong
    fn(LOOPS // 10)
    with ThreadPoolExecutor(threads) as pool:
        start = time.perf_counter()
        list(pool.map(fn, [LOOPS] * threads))
        return LOOPS * 12 * threads / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--macs", type=float, default=243.3e6, help="per prompt token")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        lib = build(Path(tmp))
        rows = {}
        for kind, products in KINDS.items():
            best = max(rate(lib, kind, args.threads) for _ in range(3))
            rows[kind] = {"instructions_per_s": best, "products_per_s": best * products,
                          "prompt_tokens_per_s_ceiling": best * products / args.macs}  # fmt: skip
            print(
                f"{kind:9} {best / 1e9:6.2f} G/s on {args.threads} cores = "
                f"{best * products / 1e9:6.0f} G products/s: at most "
                f"{best * products / args.macs:6.0f} prompt tokens/s",
                flush=True,
            )
    out = {"cpu": cpu_model(), "threads": args.threads, "macs_per_token": args.macs, "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "dot_peak.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
