"""The real-model benchmark: SmolLM2-135M-Instruct, the default model's Q4_1 GGUF file.

Offline throughput of one workload (32 requests, prompts of 32-256 and outputs of 32-128 tokens,
greedy, EOS ignored), all requests at once ("batched") and a few one at a time ("one stream"),
for nanoserve (weights kept in their GGUF blocks, or de-quantized to float32 or bfloat16),
transformers (float32, the file de-quantized by transformers) and llama.cpp (llama-cpp-python on
the file itself, its default settings, 2 threads), in one run; then nanoserve's start-up, from
`nanoserve serve` to the first answer, with the server's resident memory.

    python -m bench.bench_gguf [--requests 32] [--serial 4] [--skip-llamacpp] [--skip-hf]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

from bench.bench_engine import run_transformers
from bench.machine import cpu_model
from bench.workloads import workload
from nanoserve import LLM, SamplingParams
from nanoserve.default_model import default_model_path

RESULTS = Path(__file__).parent / "results"


def run_nanoserve(path: Path, requests, **engine_args) -> float:
    llm = LLM(str(path), **engine_args)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def run_serial(run, requests) -> float:
    """Seconds for the requests one at a time (each its own batch)."""
    return sum(run([r]) for r in requests)


def startup(path: Path) -> dict:
    """Seconds from `nanoserve serve` to its first answer, and the server's resident memory."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "nanoserve.cli", "serve", str(path), "--port", "0"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        log = ""
        while "ready: " not in log:
            log += proc.stderr.readline()  # type: ignore[union-attr]
        url = re.search(r"ready: (\S+)", log).group(1)  # type: ignore[union-attr]
        body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        seconds = time.perf_counter() - start
        status = Path(f"/proc/{proc.pid}/status").read_text()
        rss = int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024  # type: ignore[union-attr]
    finally:
        proc.terminate()
        proc.wait()
    return {
        "seconds": round(seconds, 2),
        "rss_mib": round(rss),
        "answer": answer["choices"][0]["text"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--serial", type=int, default=4)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--skip-llamacpp", action="store_true")
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    path = default_model_path()
    requests = workload(args.requests, vocab=49152, prompts=(32, 256), outputs=(32, 128))
    serial = requests[: args.serial]
    runs = {
        "nanoserve Q4_1 blocks": lambda rs: run_nanoserve(path, rs),
        "nanoserve float32": lambda rs: run_nanoserve(path, rs, quantization="none"),
        "nanoserve bfloat16": lambda rs: run_nanoserve(path, rs, dtype="bfloat16"),
    }
    if not args.skip_hf:
        runs["transformers float32"] = lambda rs: run_transformers(
            path.parent, rs, "float32", "cpu", 8, gguf_file=path.name
        )
    if not args.skip_llamacpp:
        from bench.llamacpp import generate

        runs["llama.cpp (the GGUF)"] = lambda rs: generate(path, rs, args.threads, exact=False)[0]
    rows = []
    for name, run in runs.items():
        batched, one = run(requests), run_serial(run, serial)
        rows.append({"engine": name,
                     "batched_tok_s": sum(n for _, n in requests) / batched,
                     "one_stream_tok_s": sum(n for _, n in serial) / one})  # fmt: skip
        print(f"{name:28} batched {rows[-1]['batched_tok_s']:7.1f} tok/s   one stream "
              f"{rows[-1]['one_stream_tok_s']:6.1f} tok/s", flush=True)  # fmt: skip
    starts = [startup(path) for _ in range(2)]  # the first builds the GGUF index, if not cached
    print(f"start-up to first answer: {starts}")
    RESULTS.mkdir(exist_ok=True)
    out = {
        "model": path.name, "cpu": cpu_model(), "threads": args.threads,
        "requests": len(requests), "serial": len(serial), "rows": rows, "startup": starts,
    }  # fmt: skip
    (RESULTS / "engine_smollm2.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
