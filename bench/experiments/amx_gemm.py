"""The quantized GEMM on AMX-INT8 tiles against the AVX-512 VNNI GEMM, side by side in one process:
calls alternate between the two paths (set_isa(amx=...)) round after round, so that both see the
same machine load, and each path's median is taken. The outputs are checked bitwise equal.

Llama-3.2-1B's matrix shapes (N x K) at M = 512 rows (a prefill chunk) and at 16 and 64, for the
formats of its Q4_K_M file that AMX takes (Q4_K; its Q6_K matrices stay on VNNI: quant_strips.h)
and Q4_1 and Q8_0. Weights are random valid blocks (tests/test_quant_kernels.py's makers). Prints
milliseconds per call and the VNNI/AMX ratio; writes bench/results/amx_gemm.json.

    python -m bench.experiments.amx_gemm [--rounds 7] [--rows 512,64,16] [--threads 2]
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.machine import cpu_model
from nanoserve import kernels
from nanoserve.kernels import quant

sys.path.insert(0, str(Path(__file__).parents[2] / "tests"))
from test_quant_kernels import _kquant_weight, _weight  # noqa: E402

SHAPES = [(2048, 2048), (512, 2048), (8192, 2048), (2048, 8192)]  # q/o, k/v, gate/up, down
FORMATS = ["q4_k", "q4_1", "q8_0"]
RESULTS = Path(__file__).parents[1] / "results"


def matrix(qtype: str, n: int, k: int) -> kernels.QuantizedWeight:
    if quant.BLOCK_VALUES[qtype] == 256:
        return _kquant_weight(qtype, n, k, seed=0)
    return kernels.quantize(_weight(n, k, seed=0), qtype)


def timed(amx: bool, x: torch.Tensor, w: kernels.QuantizedWeight) -> tuple[float, torch.Tensor]:
    quant.set_isa("avx512", True, amx)
    start = time.perf_counter()
    y = kernels.quantized_linear(x, w)
    return (time.perf_counter() - start) * 1e3, y


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--rows", default="512,64,16")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not quant.amx_supported():
        sys.exit("this CPU or OS does not run AMX-INT8")
    info = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "rounds": args.rounds}
    print(json.dumps(info), flush=True)
    rows = []
    for qtype in FORMATS:
        for n, k in SHAPES:
            w = matrix(qtype, n, k)
            for m in map(int, args.rows.split(",")):
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                times: dict[bool, list[float]] = {False: [], True: []}
                for _ in range(args.rounds + 1):  # the first round warms up
                    (t_vnni, y_vnni), (t_amx, y_amx) = timed(False, x, w), timed(True, x, w)
                    assert torch.equal(y_vnni, y_amx), (qtype, n, k, m)
                    times[False].append(t_vnni)
                    times[True].append(t_amx)
                vnni, amx = (statistics.median(times[p][1:]) for p in (False, True))
                rows.append(dict(qtype=qtype, n=n, k=k, m=m, vnni_ms=vnni, amx_ms=amx))
                print(f"{qtype} {n:5} x {k:5} M={m:4}  vnni {vnni:8.2f} ms  amx {amx:8.2f} ms"
                      f"  {vnni / amx:5.2f}x", flush=True)  # fmt: skip
    quant.set_isa("avx512", True, True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "amx_gemm.json").write_text(json.dumps(info | {"rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
