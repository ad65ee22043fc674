"""CUDA-graph decode against eager decode: the step time at batch 1 and 32, the speed-up of graphs.

A random Llama of the given shape (default the 1B shape, bfloat16) is served twice on one device,
with `cuda_graphs` on and off; each times decode steps (`engine.step()`, sampling and the token's
way back to the host included) at each batch size after a 128-token prompt per sequence, in rounds,
and keeps the best round. Both must give the same greedy tokens. Then, with graphs, where a step's
time goes: the forward pass alone (CUDA events), the packing of its inputs, and the engine's step
with the model replaced by ready-made logits (its other host work). Writes graphs_<device>.json.

    python -m bench.bench_graphs --device cuda --out DIR      # the run of bench/gpu_check.sh
    python -m bench.bench_graphs --device cpu --shape 25m --rounds 2   # a dry run of the code
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
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
    parts = breakdown(llm.engine, args) if graphs else {}
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the next engine sizes its pool from the free memory
    return {"step_ms": times, "captured_sizes": captured, "tokens": tokens, "parts": parts}


def breakdown(engine, args: argparse.Namespace) -> dict:
    """Where a step's time goes, per batch size: the forward pass alone (runner.execute, timed with
    CUDA events on a GPU: a graph replay), and the engine's own step with the model replaced by
    ready-made logits (scheduling, packing, sampling, detokenizing: host work)."""
    runner, cuda = engine.runner, args.device.startswith("cuda")
    execute, prepare = runner.execute, runner.prepare
    forward: list[float] = []
    packing: list[float] = []

    def packed(batch):
        start = time.perf_counter()
        inputs = prepare(batch)
        packing.append((time.perf_counter() - start) * 1e3)
        return inputs

    def timed(inputs):
        if not cuda:
            start = time.perf_counter()
            out = execute(inputs)
            forward.append((time.perf_counter() - start) * 1e3)
            return out
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        out = execute(inputs)
        end.record()
        end.synchronize()
        forward.append(begin.elapsed_time(end))
        return out

    parts = {}
    for b in BATCHES:
        forward.clear()
        packing.clear()
        runner.execute, runner.prepare = timed, packed
        _decode_rounds(engine, b, steps=args.steps, rounds=2)
        runner.execute, runner.prepare = execute, prepare
        logits = torch.zeros(b, engine.model_config.vocab_size, device=runner.device)
        runner.prepare = lambda batch: batch  # no packing, no forward pass
        runner.execute = lambda batch, logits=logits: (logits[: len(batch)], {})
        host = min(_decode_rounds(engine, b, steps=args.steps, rounds=args.rounds))
        runner.prepare, runner.execute = prepare, execute
        parts[b] = {
            "forward_ms": statistics.median(forward),
            "prepare_ms": statistics.median(packing),
            "engine_host_ms": host,
        }
    return parts


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
        rows[b].update(on["parts"][b])
        print(f"{b:5d} {g:10.3f} {e:9.3f} {e / g:8.2f}x {b * 1e3 / g:13.0f}")
    for b in BATCHES:
        part = on["parts"][b]
        print(f"batch {b}: a graphs step {on['step_ms'][b]:.3f} ms, of which the forward pass "
              f"(graph replay) {part['forward_ms']:.3f} ms, packing its inputs "
              f"{part['prepare_ms']:.3f} ms; the engine's step with ready-made logits "
              f"{part['engine_host_ms']:.3f} ms")  # fmt: skip
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
