"""CUDA-graph decode against eager decode: the step time at batch 1 and 32, the speed-up of graphs.

A random Llama of the given shape (default the 1B shape, bfloat16) is served twice on one device,
with `cuda_graphs` on and off; each times decode steps (`engine.step()`, sampling and the token's
way back to the host included) at each batch size after a 128-token prompt per sequence, in rounds,
and keeps the best round. Both must give the same greedy tokens. Writes graphs_<device>.json.

    python -m bench.bench_graphs --device cuda --out DIR      # the run of bench/gpu_check.sh
    python -m bench.bench_graphs --device cpu --shape 25m --rounds 2   # a dry run of the code
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
from pathlib import Path

import torch

from bench.bench_engine import _decode_rounds, machine
from bench.workloads import SHAPES
from nanoserve import LLM, SamplingParams
from nanoserve.demo import write_checkpoint

RESULTS = Path(__file__).parent / "results"
BATCHES = (1, 32)


def step_times(model_dir: Path, args: argparse.Namespace, graphs: bool) -> dict:
    llm = LLM(str(model_dir), device=args.device, dtype=args.dtype, cuda_graphs=graphs,
              max_num_seqs=max(BATCHES), gpu_memory_utilization=0.3)  # fmt: skip
    captured = sorted(llm.engine.runner.graphs.graphs) if llm.engine.runner.graphs else []
    times = {b: min(_decode_rounds(llm.engine, b, steps=args.steps, rounds=args.rounds))
             for b in BATCHES}  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(7 + i, 40 + 3 * i))} for i in range(8)]
    tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the next engine sizes its pool from the free memory
    return {"step_ms": times, "captured_sizes": captured, "tokens": tokens}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_checkpoint(Path(tmp) / "m", dtype=args.dtype, **SHAPES[args.shape])
        on = step_times(model_dir, args, graphs=True)
        off = step_times(model_dir, args, graphs=False)
    same = on["tokens"] == off["tokens"]
    rows = {}
    print(f"{'batch':>5} {'graphs ms':>10} {'eager ms':>9} {'speed-up':>9} {'graphs tok/s':>13}")
    for b in BATCHES:
        g, e = on["step_ms"][b], off["step_ms"][b]
        rows[b] = {"graphs_ms": g, "eager_ms": e, "speedup": e / g, "graphs_tok_s": b * 1e3 / g}
        print(f"{b:5d} {g:10.3f} {e:9.3f} {e / g:8.2f}x {b * 1e3 / g:13.0f}")
    print(f"captured sizes {on['captured_sizes']}; greedy tokens equal with and without: {same}")
    result = {
        "benchmark": "decode step, CUDA graphs on and off",
        "machine": machine(),
        "device": args.device,
        "shape": args.shape,
        "dtype": args.dtype,
        "step_counts": "best round's mean of engine.step() wall time, a 128-token prompt per "
        "sequence, sampling and the token's copy to the host included",
        "batches": rows,
        "captured_sizes": on["captured_sizes"],
        "greedy_tokens_equal": same,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"graphs_{args.device}.json").write_text(json.dumps(result, indent=1) + "\n")
    if not same:
        raise SystemExit("greedy tokens differ with and without CUDA graphs")


if __name__ == "__main__":
    main()
