"""Benchmark of prefill attention on the CPU: the C kernel (kernels.paged_attention_prefill) against
the model's SDPA path (nanoserve.model.attention._prefill), one chunk of one sequence.

Shapes of SmolLM2-135M (9 query / 3 KV heads) and Llama-3.2-1B (32 / 8), head_dim 64, block 16,
float32; chunks of 512 and 2048 new tokens with nothing cached, and 512 after 3584 cached
(context 4096). The two are called alternately in one process, so both see the same machine load.
Prints a table and writes bench/results/prefill_cpu.json and .png.
"""

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import nanoserve.kernels as kernels
from bench.machine import cpu_model
from nanoserve.model.attention import PrefillChunk, _prefill

SHAPES = {"SmolLM2-135M": (9, 3), "Llama-3.2-1B": (32, 8)}  # (query heads, KV heads)
HEAD_DIM, BLOCK = 64, 16
CHUNKS = [(512, 0), (2048, 0), (512, 3584)]  # (new tokens, cached tokens)
RESULTS = Path(__file__).parent / "results"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7, help="timed calls of each, alternating")
    p.add_argument("--quick", action="store_true", help="the smallest case only, 3 rounds")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON and PNG")
    return p.parse_args()


def make_chunk(heads: int, kv_heads: int, tokens: int, cached: int, gen: torch.Generator):
    """A cache whose blocks are shuffled, holding the chunk's context; the chunk's q, k and v."""
    context = cached + tokens
    num_blocks = -(-context // BLOCK)
    shape = (num_blocks + 4, kv_heads, BLOCK, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    table = torch.randperm(shape[0], generator=gen)[:num_blocks].to(torch.int32)
    positions = torch.arange(cached, context)
    slots = table[positions // BLOCK].long() * BLOCK + positions % BLOCK
    q = torch.randn((tokens, heads, HEAD_DIM), generator=gen)
    k = k_cache[slots // BLOCK, :, slots % BLOCK]  # the chunk's rows, as store_kv left them
    v = v_cache[slots // BLOCK, :, slots % BLOCK]
    chunk = PrefillChunk(start=0, length=tokens, context_len=context, block_table=table)
    return q, k, v, k_cache, v_cache, chunk


def time_pair(case, rounds: int) -> dict[str, float]:
    """Median and best ms of the SDPA path and of the C kernel, called alternately (the best is the
    figure least disturbed by other jobs on a shared machine); their largest difference."""
    q, k, v, k_cache, v_cache, chunk = case
    scale = HEAD_DIM**-0.5
    out = torch.empty_like(q)

    def sdpa() -> torch.Tensor:
        return _prefill(q, k, v, k_cache, v_cache, chunk, scale, 0)

    def kernel() -> torch.Tensor:
        return kernels.paged_attention_prefill(
            q, k_cache, v_cache, chunk.block_table, chunk.context_len, scale, out=out, backend="c"
        )

    error = (sdpa() - kernel()).abs().max().item()  # also the warm-up call of each
    times: dict[str, list[float]] = {"sdpa": [], "c": []}
    for _ in range(rounds):
        for name, fn in (("sdpa", sdpa), ("c", kernel)):
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    result = {f"{name}_ms": statistics.median(t) for name, t in times.items()}
    result.update({f"{name}_best_ms": min(t) for name, t in times.items()})
    return {**result, "speedup": result["sdpa_ms"] / result["c_ms"], "max_abs_diff": error}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"{r['shape']}\nT={r['tokens']} cached={r['cached']}" for r in rows]
    fig, ax = plt.subplots(figsize=(8, 0.7 * len(rows) + 1.2))
    y = range(len(rows))
    ax.barh(
        [i - 0.2 for i in y],
        [r["sdpa_ms"] for r in rows],
        0.4,
        label="SDPA path (model/attention.py)",
    )
    ax.barh([i + 0.2 for i in y], [r["c_ms"] for r in rows], 0.4, label="C kernel")
    for i, r in enumerate(rows):
        ax.text(r["c_ms"], i + 0.2, f" {r['speedup']:.1f}x", va="center", fontsize=8)
    ax.set_yticks(list(y), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("ms per chunk (one layer's attention)")
    ax.legend(fontsize=8)
    m = result["machine"]
    ax.set_title(f"prefill attention, float32: {m['cpu']}, {m['threads']} threads", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    cases = [(s, *c) for s in SHAPES for c in CHUNKS]
    rounds = 3 if args.quick else args.rounds
    if args.quick:
        cases = cases[:1]
    print(f"{'shape':14} {'tokens':>6} {'cached':>6} {'SDPA ms':>9} {'C ms':>9} {'speed-up':>8}"
          f" {'SDPA best':>9} {'C best':>9} {'max diff':>9}")  # fmt: skip
    rows = []
    for shape, tokens, cached in cases:
        row = time_pair(make_chunk(*SHAPES[shape], tokens, cached, gen), rounds)
        rows.append(dict(shape=shape, tokens=tokens, cached=cached, **row))
        times = f"{row['sdpa_ms']:9.2f} {row['c_ms']:9.2f} {row['speedup']:7.2f}x"
        best = f"{row['sdpa_best_ms']:9.2f} {row['c_best_ms']:9.2f}"
        print(f"{shape:14} {tokens:6} {cached:6} {times} {best} {row['max_abs_diff']:9.1e}")
    machine = dict(cpu=cpu_model(), threads=args.threads, torch=torch.__version__,
                   python=platform.python_version())  # fmt: skip
    result = dict(machine=machine, head_dim=HEAD_DIM, block_size=BLOCK, dtype="float32", rows=rows)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "prefill_cpu" + ("_quick" if args.quick else "")
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out / stem}.json")
    try:
        plot(result, args.out / f"{stem}.png")
        print(f"wrote {args.out / stem}.png")
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
