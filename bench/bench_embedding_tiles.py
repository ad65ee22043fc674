"""The BERT encoder's matmuls (model/bert.py) on fixed row tiles, against one matmul over the
whole batch: what bitwise batch invariance costs. BERT-base's four matrices (q/k/v fused, the
attention's output, the MLP's up and down) over a batch of --tokens packed rows, side by side in
one run, float32 and bfloat16:

- `F.linear, one call`: torch's matmul over every row at once (not row invariant);
- `F.linear, 64-row tiles`: the same, a call per tile of 64 rows;
- `packed, 64-row tiles`: what bert.py runs: oneDNN with each weight prepacked once
  (model/linear.py), a call per tile.

The median of --repeats passes; the table and bench/results/embedding_tiles.json (and .png).

    python -m bench.bench_embedding_tiles [--tokens 8192] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.machine import cpu_model
from nanoserve.model.bert import TILE_ROWS, _linear
from nanoserve.model.linear import Linear

RESULTS = Path(__file__).parent / "results"
SHAPES = [(2304, 768), (768, 768), (3072, 768), (768, 3072)]  # BERT-base: out, in


def _tiles(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    n, pad = x.shape[0], -x.shape[0] % TILE_ROWS
    x = torch.cat([x, x.new_zeros(pad, x.shape[1])]) if pad else x
    return torch.cat([F.linear(t, weight) for t in x.split(TILE_ROWS)])[:n]


def run(dtype: torch.dtype, tokens: int, repeats: int) -> dict[str, float]:
    torch.manual_seed(0)
    weights = [torch.randn(o, i, dtype=dtype) / i**0.5 for o, i in SHAPES]
    packed = [Linear(w) for w in weights]
    biases = [torch.zeros(o, dtype=dtype) for o, _ in SHAPES]
    inputs = [torch.randn(tokens, i, dtype=dtype) for _, i in SHAPES]
    pairs = list(zip(inputs, weights, strict=True))
    ways = {
        "F.linear, one call": lambda: [F.linear(x, w) for x, w in pairs],
        f"F.linear, {TILE_ROWS}-row tiles": lambda: [_tiles(x, w) for x, w in pairs],
        f"packed, {TILE_ROWS}-row tiles": lambda: [
            _linear(x, p, b) for x, p, b in zip(inputs, packed, biases, strict=True)
        ],
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):  # the ways take turns, so that they share the machine's noise
        for name, way in ways.items():
            start = time.perf_counter()
            way()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        seconds = run(dtype, args.tokens, args.repeats)
        base = seconds["F.linear, one call"]
        results[str(dtype).removeprefix("torch.")] = seconds
        print(f"{dtype}, {args.tokens} rows through BERT-base's four matrices:")
        for name, s in seconds.items():
            print(f"  {name:24s} {s * 1e3:8.1f} ms   x{s / base:.2f} of one call")
    out = {
        "machine": {"cpu": cpu_model(), "threads": torch.get_num_threads(),
                    "cores": os.cpu_count(), "torch": torch.__version__},
        "tokens": args.tokens, "repeats": args.repeats, "seconds": results,
    }  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "embedding_tiles.json").write_text(json.dumps(out, indent=2) + "\n")
    _plot(out, RESULTS / "embedding_tiles.png")


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(result["seconds"]), figsize=(10, 2.8))
    for ax, (dtype, seconds) in zip(axes, result["seconds"].items(), strict=True):
        names = list(seconds)
        ax.barh(names, [seconds[n] * 1e3 for n in names], color=["C0", "C1", "C2"])
        ax.invert_yaxis()
        ax.set_title(f"{dtype}: {result['tokens']} rows", fontsize=9)
        ax.set_xlabel("ms (median)")
    fig.suptitle(f"BERT-base matmuls, {result['machine']['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
