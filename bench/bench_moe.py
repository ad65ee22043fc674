"""Benchmark of a mixture-of-experts block on the CPU (model/moe.py): the step's tokens grouped by
expert (each chosen expert multiplies all its tokens in one matmul, its weights read once a step)
against the same block token by token (each token's experts multiplied for it alone: every chosen
expert's weights read once per token that chose it), side by side in one run, on GGUF blocks;
and the grouped block's experts in one C call per projection (kernels.expert_linear, what
sparse_moe does) against one call per chosen expert (sparse_moe's one_call=False).
One layer at Qwen3-30B-A3B's expert shapes (hidden 2048, experts of 768, top 8) with 32 experts
instead of 128 (to quantize in seconds), Q8_0 and Q4_0 (quantized here; K-quants come only
from llama.cpp's quantizer). Prints a table and writes
bench/results/moe_cpu.json and .png.

    python -m bench.bench_moe [--quick]
"""

import argparse
import json
import os
import platform
import statistics
from functools import partial
from pathlib import Path

import torch

from bench.machine import cpu_model, median_ms
from nanoserve.kernels import quantize, route_experts
from nanoserve.model.linear import Linear
from nanoserve.model.moe import Experts, sparse_moe

HIDDEN, EXPERT, EXPERTS, TOP_K = 2048, 768, 32, 8
RESULTS = Path(__file__).parent / "results"


def experts(rows: int, columns: int, qtype: str, gen: torch.Generator) -> Experts:
    w = torch.randn(EXPERTS * rows, columns, generator=gen) / columns**0.5
    return Experts(quantize(w, qtype), EXPERTS)


def token_by_token(x, router, gate, up, down) -> torch.Tensor:
    """The block computed for each token alone: the reference it is measured against."""
    weights, chosen = route_experts(router(x), TOP_K, True)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        xt = x[t : t + 1]
        for k in range(TOP_K):
            e = int(chosen[t, k])
            h = torch.nn.functional.silu(gate(e, xt)) * up(e, xt)
            out[t] += down(e, h)[0] * weights[t, k]
    return out


def side_by_side(a, b, rounds: int = 5) -> tuple[float, float]:
    """Medians over `rounds` alternating rounds of each one's median time (ms): on a machine that
    other work shares, a burst of it lands in one round of one side, not in the figure."""
    times = [(median_ms(a), median_ms(b)) for _ in range(rounds)]
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer token counts")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--qtypes", default="q8_0,q4_0", help="comma-separated formats")
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    router = Linear(torch.randn(EXPERTS, HIDDEN, generator=gen) / HIDDEN**0.5)
    counts = [1, 8, 32] if args.quick else [1, 4, 8, 32, 128]
    rows = []
    for qtype in args.qtypes.split(","):
        gate, up = (experts(EXPERT, HIDDEN, qtype, gen) for _ in range(2))
        down = experts(HIDDEN, EXPERT, qtype, gen)
        for n in counts:
            x = torch.randn(n, HIDDEN, generator=gen)
            grouped = sparse_moe(x, router, gate, up, down, TOP_K, True, True)
            torch.testing.assert_close(grouped, token_by_token(x, router, gate, up, down))
            block = partial(sparse_moe, x, router, gate, up, down, TOP_K, True, True)
            ours, alone = side_by_side(block, partial(token_by_token, x, router, gate, up, down))
            one, each = side_by_side(block, partial(block, one_call=False))
            rows.append({"qtype": qtype, "tokens": n, "grouped_ms": ours,
                         "token_by_token_ms": alone, "speedup": alone / ours,
                         "one_call_ms": one, "per_expert_ms": each})  # fmt: skip
            print(f"{qtype:5} {n:4} tokens: grouped {ours:8.2f} ms, token by token "
                  f"{alone:8.2f} ms, x{alone / ours:.2f}; one call {one:8.2f} ms, a call per "
                  f"expert {each:8.2f} ms, x{each / one:.2f}", flush=True)  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"cpu": cpu_model(), "machine": platform.machine(), "threads": torch.get_num_threads(),
              "load_average": os.getloadavg(),
              "shape": {"hidden": HIDDEN, "expert": EXPERT, "experts": EXPERTS, "top_k": TOP_K},
              "rows": rows}  # fmt: skip
    (args.out / "moe_cpu.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(rows, args.out / "moe_cpu.png")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for qtype in sorted({r["qtype"] for r in rows}):
        mine = [r for r in rows if r["qtype"] == qtype]
        ax.plot([r["tokens"] for r in mine], [r["speedup"] for r in mine], "o-", label=qtype)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens in the step")
    ax.set_ylabel("grouped by expert / token by token (x)")
    ax.set_title(f"MoE block, {EXPERTS} experts of {EXPERT}, top {TOP_K}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
