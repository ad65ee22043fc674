"""The prefill's elementwise C kernels against torch on the same tensors: the gated MLP's f(gate) *
up (`kernels.gated_mul`, SwiGLU's silu) and the rotary embedding (`kernels.rope_`), over --rows rows
of Qwen3-0.6B's shapes (MLP 3072; 16 query and 8 KV heads of 128), float32 and bfloat16,
milliseconds per call (bench.machine.median_ms: the median of warm calls within --budget seconds).
torch's are F.silu(gate) * up and transformers' rotate-half formula. Results:
bench/results/elementwise_cpu.json, with the CPU's model and flags and the thread count.

    python -m bench.bench_elementwise [--rows 8192] [--budget 1.0]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.bench_context import machine
from bench.machine import median_ms
from nanoserve import kernels

RESULTS = Path(__file__).parent / "results"
INTER, HEADS, KV_HEADS, HEAD_DIM = 3072, 16, 8, 128


def torch_rope(qk: torch.Tensor, heads: int, positions: torch.Tensor, cos, sin) -> torch.Tensor:
    x = qk[:, : heads * HEAD_DIM].view(-1, heads, HEAD_DIM)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    half = HEAD_DIM // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * c + rotated * s


def bench_dtype(dtype: torch.dtype, rows: int, budget: float) -> dict:
    g = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(rows, 2 * INTER, generator=g) * 3).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    qk = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g).to(dtype)
    positions = torch.arange(rows, dtype=torch.int64) % 4096
    angles = torch.arange(4096).unsqueeze(1) / 10000 ** (torch.arange(HEAD_DIM) % 64 / 64)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    heads = HEADS + KV_HEADS  # q and k, rotated in one call as the model does
    return {
        "gated_mul C": median_ms(lambda: kernels.gated_mul(gate_up), budget),
        "F.silu(gate) * up": median_ms(lambda: F.silu(gate) * up, budget),
        "rope_ C": median_ms(lambda: kernels.rope_(qk, heads, positions, cos, sin), budget),
        "torch rotate-half": median_ms(lambda: torch_rope(qk, heads, positions, cos, sin), budget),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--budget", type=float, default=1.0, help="seconds per measurement")
    args = parser.parse_args()
    info = machine() | {"rows": args.rows}
    print(json.dumps(info), flush=True)
    rows = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        rows[name] = bench_dtype(dtype, args.rows, args.budget)
        for what, ms in rows[name].items():
            print(f"  {name:9s} {what:20s} {ms:8.2f} ms", flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "elementwise_cpu.json").write_text(json.dumps(info | {"ms": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
