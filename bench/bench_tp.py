"""Tensor parallelism on this machine's CPU: one process with all the threads against two processes
with half of them each, side by side on the same model and requests (the 25M benchmark model,
float32, the uniform workload): offline throughput, the batch-1 decode step, and what the
collectives cost, timed inside the engine on rank 0 (all-reduces, the logits gather, the step
message) and alone between two processes. Prints tables; writes bench/results/tp_cpu.json.

    python -m bench.bench_tp [--requests 64] [--shape 25m] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from functools import partial
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.bench_engine import machine
from bench.workloads import SHAPES, workload
from nanoserve import LLM, SamplingParams
from nanoserve.demo import write_checkpoint
from nanoserve.engine import Engine
from nanoserve.model.parallel import Parallel

RESULTS = Path(__file__).parent / "results"
BATCHES = (1, 4, 16, 64, 256)  # rows of the [rows, hidden] tensors all-reduced alone
MESSAGE = 512  # int64s of a step message's first broadcast (engine/parallel/channel.py's FIRST)


@contextmanager
def timed_collectives(engine: Engine) -> Iterator[dict[str, list[float]]]:
    """Rank 0's time in each kind of collective (calls, seconds, bytes) while the block runs:
    the all-reduces (after o, down and the embedding), the logits gather, and the step message
    (the channel's `call`: the packing and the broadcast)."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0])

    def timer(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            start = time.perf_counter()
            result = fn(*args)
            entry = totals[name]
            entry[0] += 1
            entry[1] += time.perf_counter() - start
            entry[2] += sum(a.numel() * a.element_size() for a in args if torch.is_tensor(a))
            return result

        return run

    reduce, gather = Parallel.all_reduce, Parallel.gather_logits
    channel = getattr(engine.executor, "channel", None)  # tensor parallelism's only
    Parallel.all_reduce = timer("all_reduce", reduce)  # type: ignore[method-assign]
    Parallel.gather_logits = timer("gather_logits", gather)  # type: ignore[method-assign]
    if channel is not None:
        channel.call = timer("step message", channel.call)
    try:
        yield totals
    finally:
        Parallel.all_reduce, Parallel.gather_logits = reduce, gather  # type: ignore[method-assign]
        if channel is not None:
            del channel.call  # the class's method again


def run(model_dir: Path, requests: list, size: int, c_step: bool = True) -> dict[str, Any]:
    """Offline throughput and the batch-1 decode step of one setting, with their collectives."""
    with LLM(str(model_dir), tensor_parallel_size=size, max_num_seqs=64) as llm:
        engine = llm.engine
        threads = torch.get_num_threads()  # rank 0's, after the workers took their share
        if not c_step:
            engine.runner.cpu_step = None
        prompts = [{"prompt_token_ids": p} for p, _ in requests]
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
        llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
        before = engine.stats().computed_tokens
        steps, step = [0], engine.step

        def counted() -> Any:
            steps[0] += 1
            return step()

        engine.step = counted  # type: ignore[method-assign]
        with timed_collectives(engine) as offline:
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
        engine.step = step  # type: ignore[method-assign]
        batch1_ms, batch1 = batch_one(engine)
        return {
            "threads_per_rank": threads,
            "seconds": seconds,
            "output_tokens_per_s": sum(n for _, n in requests) / seconds,
            "steps": steps[0],
            "computed_tokens": engine.stats().computed_tokens - before,
            "collectives_per_step": _per_step(offline, steps[0]),
            "batch1_step_ms": batch1_ms,
            "batch1_collectives_per_step": batch1,
        }


def batch_one(engine: Engine, steps: int = 200) -> tuple[float, dict[str, dict[str, float]]]:
    """The median decode step of one sequence (128 tokens of context and on), in ms."""
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    engine.add_request("batch-1", list(range(1, 129)), params)
    for _ in range(3):  # the prefill, then two decodes
        engine.step()
    times = []
    with timed_collectives(engine) as totals:
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
    engine.abort("batch-1")
    return sorted(times)[steps // 2] * 1e3, _per_step(totals, steps)


def _per_step(totals: dict[str, list[float]], steps: int) -> dict[str, dict[str, float]]:
    return {
        name: {"calls": calls / steps, "ms": seconds * 1e3 / steps, "bytes": size / steps}
        for name, (calls, seconds, size) in totals.items()
    }


def _alone(rank: int, port: int, hidden: int, vocab: int, shm_name: str, out: Any) -> None:
    """One of two processes (one thread each) timing the collectives by themselves."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    results: dict[str, dict[str, float]] = {}
    for rows in BATCHES:
        x = torch.randn(rows, hidden)
        results[f"all_reduce [{rows}, {hidden}]"] = _time(partial(dist.all_reduce, x))
    for rows in (1, 64):
        part = torch.randn(rows, -(-vocab // 2))
        parts = [torch.empty_like(part) for _ in range(2)] if rank == 0 else None
        results[f"gather [{rows}, {part.shape[1]}] to rank 0"] = _time(
            partial(dist.gather, part, parts, group_dst=0)
        )
    message = torch.zeros(MESSAGE, dtype=torch.int64)
    results[f"broadcast of a {MESSAGE * 8}-byte message"] = _time(
        lambda: dist.broadcast(message, group_src=0)
    )
    memory = shared_memory.SharedMemory(name=shm_name)
    for rows in (1, 64):
        exchange = _SharedSum(memory, rank, rows, hidden)
        x = torch.randn(rows, hidden)
        results[f"for comparison: shared-memory sum [{rows}, {hidden}]"] = _time(
            partial(exchange, x)
        )
        del exchange
    memory.close()
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


class _SharedSum:
    """Not nanoserve's: the all-reduce that vLLM's and SGLang's CPU backends use instead of gloo,
    reduced to its core for a measurement. Each rank copies its tensor into its slot of a shared
    buffer (two, alternating), publishes a sequence number, spins until the peer's is there,
    and adds the slots in rank order. (x86 keeps stores in order; elsewhere this needs fences.)"""

    def __init__(self, memory: shared_memory.SharedMemory, rank: int, rows: int, hidden: int):
        self.rank, self.seq = rank, 0
        self.flags = torch.frombuffer(memory.buf, dtype=torch.int64, count=2)
        self.flags.zero_()
        dist.barrier()
        count = 2 * 2 * rows * hidden
        slots = torch.frombuffer(memory.buf, dtype=torch.float32, offset=64, count=count)
        self.slots = slots.view(2, 2, rows, hidden)  # [buffer, rank, rows, hidden]

    def __call__(self, x: torch.Tensor) -> None:
        self.seq += 1
        slots = self.slots[self.seq % 2]
        slots[self.rank].copy_(x)
        self.flags[self.rank] = self.seq
        while int(self.flags[1 - self.rank]) < self.seq:
            pass
        torch.add(slots[0], slots[1], out=x)


def _time(fn: Callable[[], Any], repeat: int = 400) -> dict[str, float]:
    """Milliseconds of one call: the median with both ranks starting each call together (after
    a barrier), and the mean of calls back to back (each rank as soon as its last one ended)."""
    for _ in range(20):
        fn()
    times = []
    for _ in range(repeat):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    loop = (time.perf_counter() - start) / repeat
    return {"together_ms": sorted(times)[repeat // 2] * 1e3, "back_to_back_ms": loop * 1e3}


def collectives_alone(hidden: int, vocab: int) -> dict[str, dict[str, float]]:
    queue = mp.get_context("spawn").SimpleQueue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    memory = shared_memory.SharedMemory(create=True, size=64 + 4 * 4 * max(BATCHES) * hidden)
    try:
        mp.spawn(_alone, args=(port, hidden, vocab, memory.name, queue), nprocs=2)
    finally:
        memory.close()
        memory.unlink()
    return queue.get()


def report(
    runs: dict[str, dict[str, Any]], alone: dict[str, dict[str, float]], layers: int
) -> None:
    print(f"\n{'(medians of the repeats)':38} {'threads':>7} {'seconds':>8} {'out tok/s':>10} "
          f"{'batch-1 step ms':>16}")  # fmt: skip
    for name, r in runs.items():
        print(
            f"{SETTINGS[name][0]:38} {r['threads_per_rank']:7d} {r['seconds']:8.2f} "
            f"{r['output_tokens_per_s']:10.1f} {r['batch1_step_ms']:16.2f}"
        )
    tp2 = runs["tp2"]
    print(f"\nTP=2 per step, on rank 0 ({2 * layers} + 1 all-reduces per forward):")
    both = (("workload", "collectives_per_step"), ("batch 1", "batch1_collectives_per_step"))
    for label, key in both:
        for name, c in tp2[key].items():
            print(
                f"  {label:8} {name:14} {c['calls']:6.1f} calls {c['bytes'] / 1e3:9.1f} kB "
                f"{c['ms']:8.2f} ms"
            )
        step_ms = (
            tp2["seconds"] * 1e3 / tp2["steps"] if label == "workload" else tp2["batch1_step_ms"]
        )
        print(f"  {label:8} {'whole step':14} {step_ms:35.2f} ms")
    print("\ncollectives alone, two processes of one thread (gloo):")
    print(f"  {'':52} {'together':>9} {'back to back':>13}")
    for name, t in alone.items():
        print(f"  {name:52} {t['together_ms'] * 1e3:6.0f} us {t['back_to_back_ms'] * 1e3:10.0f} us")


# name: (label, tensor_parallel_size, the one-call C decode step)
SETTINGS = {
    "tp1": ("TP=1, all threads", 1, True),
    "tp1_layer_by_layer": ("TP=1, all threads, no one-call C step", 1, False),
    "tp2": ("TP=2, half the threads each", 2, True),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="25m", choices=sorted(SHAPES))
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every setting, in turn")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    requests = workload(args.requests, vocab=shape["vocab_size"])
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_checkpoint(Path(tmp) / "m", **shape)
        # In turn, so that a slow spell of a shared machine does not land on one setting only.
        for _ in range(args.repeats):
            for name, (_, size, c_step) in SETTINGS.items():
                runs[name].append({"load_average": os.getloadavg()[0]})
                runs[name][-1].update(run(model_dir, requests, size, c_step))
    medians = {name: _median_run(r) for name, r in runs.items()}
    alone = collectives_alone(shape["hidden_size"], shape["vocab_size"])
    report(medians, alone, shape["num_layers"])
    result = {
        "machine": machine(),
        "shape": args.shape,
        "dtype": "float32",
        "requests": len(requests),
        "prompt_tokens": sum(len(p) for p, _ in requests),
        "output_tokens": sum(n for _, n in requests),
        "median": {
            name: {k: m[k] for k in ("seconds", "output_tokens_per_s", "batch1_step_ms")}
            for name, m in medians.items()
        },
        "runs": runs,
        "collectives_alone": alone,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tp_cpu.json").write_text(json.dumps(result, indent=2) + "\n")


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median throughput, with the median batch-1 step of all the runs."""
    ordered = sorted(runs, key=lambda r: r["seconds"])
    steps = sorted(r["batch1_step_ms"] for r in runs)
    return {**ordered[len(runs) // 2], "batch1_step_ms": steps[len(steps) // 2]}


if __name__ == "__main__":
    main()
