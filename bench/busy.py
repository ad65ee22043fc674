"""A busy machine: how long an 8-token greedy answer from the default model takes (LLM.generate,
median of 5) quiet and beside two CPU hogs (`python -c 'while True: pass'`), for each OpenMP
setting, each in a fresh child process (libgomp reads its settings once, when torch loads it).

    python -m bench.busy [--model PATH] [--runs 5]

Settings: libgomp's default (neither OMP_WAIT_POLICY nor GOMP_SPINCOUNT; the child imports torch
before nanoserve, which would otherwise set GOMP_SPINCOUNT), OMP_WAIT_POLICY=ACTIVE,
OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT=100000 (what importing nanoserve sets). Each child
reports the settings the runtime started with (OMP_DISPLAY_ENV). Prints a table and writes
bench/results/busy.json, with the CPU and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.machine import cpu_model

RESULTS = Path(__file__).parent / "results"
PROMPT = "The capital of France is"
HOG = "while True: pass"
SETTINGS: dict[str, dict[str, str]] = {
    "libgomp default": {},
    "OMP_WAIT_POLICY=ACTIVE": {"OMP_WAIT_POLICY": "ACTIVE"},
    "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
    "GOMP_SPINCOUNT=100000": {"GOMP_SPINCOUNT": "100000"},
}


def child(model: str, runs: int) -> None:
    """In the child: torch first (libgomp starts with the environment as given), then the
    timed answers; prints one JSON line of seconds."""
    import torch  # noqa: F401  (before nanoserve: it sets GOMP_SPINCOUNT when none is set)

    from nanoserve import LLM, SamplingParams

    llm = LLM(model)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm.generate(PROMPT, params, use_tqdm=False)  # warm-up
    seconds = []
    for _ in range(runs):
        start = time.perf_counter()
        llm.generate(PROMPT, params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
    print(json.dumps(seconds))


def measure(model: str, runs: int, setting: dict[str, str], hogs: int) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(setting, OMP_DISPLAY_ENV="verbose")
    hogging = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(hogs)]
    try:
        result = subprocess.run(
            [sys.executable, "-m", "bench.busy", "--child", "--model", model, "--runs", str(runs)],
            env=env, cwd=Path(__file__).parent.parent, capture_output=True, text=True,
            check=True,
        )  # fmt: skip
    finally:
        for hog in hogging:
            hog.kill()
            hog.wait()
    seconds = json.loads(result.stdout.strip().splitlines()[-1])
    shown = dict(re.findall(r"(OMP_WAIT_POLICY|GOMP_SPINCOUNT) = '([^']*)'", result.stderr))
    return {"median_s": statistics.median(seconds), "seconds": seconds, "openmp": shown}


def main(model: str, runs: int) -> None:
    results: dict[str, Any] = {
        "machine": {"cpu": cpu_model(), "cpus": os.cpu_count(), "load_before": os.getloadavg()},
        "runs": runs,
        "settings": {},
    }
    for name, setting in SETTINGS.items():
        quiet = measure(model, runs, setting, hogs=0)
        busy = measure(model, runs, setting, hogs=2)
        results["settings"][name] = {
            "quiet": quiet,
            "two_hogs": busy,
            "ratio": busy["median_s"] / quiet["median_s"],
        }
    results["machine"]["load_after"] = os.getloadavg()
    print(f"{'setting':<26} {'quiet s':>8} {'2 hogs s':>9} {'ratio':>6}  runtime")
    for name, r in results["settings"].items():
        print(f"{name:<26} {r['quiet']['median_s']:>8.3f} {r['two_hogs']['median_s']:>9.3f} "
              f"{r['ratio']:>5.1f}x  {r['quiet']['openmp']}")  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "busy.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model is None:
        from nanoserve.default_model import default_model_path

        args.model = str(default_model_path())
    if args.child:
        child(args.model, args.runs)
    else:
        main(args.model, args.runs)
