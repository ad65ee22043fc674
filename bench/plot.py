"""Bar charts of the engine benchmark's results (bench/bench_engine.py writes JSON only).

For each bench/results/engine_*.json (or the files named), writes a PNG beside it: for each
workload, output tokens/s of each row (nanoserve batched, transformers, llama.cpp, nanoserve one
request at a time), each bar labelled with its speed-up over transformers.

    python -m bench.plot [RESULT.json ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def plot_engine(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads: dict[str, dict[str, Any]] = result["workloads"]
    heights = [0.55 * len(w["output_tokens_per_s"]) + 1.0 for w in workloads.values()]
    fig, axes = plt.subplots(
        len(workloads), 1, figsize=(7.5, sum(heights) + 0.8), height_ratios=heights, squeeze=False
    )
    for ax, (name, w) in zip(axes[:, 0], workloads.items(), strict=True):
        rates: dict[str, float] = w["output_tokens_per_s"]
        base = next((v for k, v in rates.items() if k.startswith("transformers")), None)
        names = list(rates)
        bars = ax.barh(names, [rates[n] for n in names], color=[f"C{i}" for i in range(len(names))])
        for bar, row in zip(bars, names, strict=True):
            note = f"{rates[row]:.0f} tok/s"
            if base:
                note += f"  ({rates[row] / base:.2f}x transformers)"
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, " " + note,
                    va="center", fontsize=8)  # fmt: skip
        ax.invert_yaxis()
        ax.set_xlim(0, max(rates.values()) * 1.8)
        ax.set_title(
            f"{name}: {w['requests']} requests, {w['prompt_tokens']} prompt / "
            f"{w['output_tokens']} output tokens",
            fontsize=9,
        )
    axes[-1, 0].set_xlabel("output tokens/s")
    m = result["machine"]
    fig.suptitle(
        f"offline throughput, {result['shape']} {result['dtype']}: {m.get('gpu') or m['cpu']}, "
        f"{m['cores']} threads, torch {m['torch']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(paths: list[str]) -> int:
    files = [Path(p) for p in paths] or sorted(RESULTS.glob("engine_*.json"))
    for file in files:
        out = file.with_suffix(".png")
        plot_engine(json.loads(file.read_text()), out)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
