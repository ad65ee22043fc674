"""Bar charts of the engine benchmark's results (bench/bench_engine.py writes JSON only).

For each bench/results/engine_*.json (or the files named), writes a PNG beside it: output
tokens/s of each row (nanoserve batched, transformers, nanoserve one request at a time), each bar
labelled with its speed-up over transformers.

    python bench/plot.py [RESULT.json ...]
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

    rates: dict[str, float] = result["output_tokens_per_s"]
    base = next((v for k, v in rates.items() if k.startswith("transformers")), None)
    names = list(rates)
    fig, ax = plt.subplots(figsize=(7.5, 0.7 * len(names) + 1.8))
    bars = ax.barh(names, [rates[n] for n in names], color=[f"C{i}" for i in range(len(names))])
    for bar, name in zip(bars, names, strict=True):
        note = f"{rates[name]:.0f} tok/s"
        if base:
            note += f"  ({rates[name] / base:.2f}x transformers)"
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, " " + note,
                va="center", fontsize=8)  # fmt: skip
    ax.invert_yaxis()
    ax.set_xlim(0, max(rates.values()) * 1.8)
    ax.set_xlabel("output tokens/s")
    m = result["machine"]
    ax.set_title(
        f"offline throughput: {result['requests']} requests, {result['output_tokens']} output "
        f"tokens, {result['shape']} {result['dtype']}\n{m.get('gpu') or m['cpu']}, "
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
