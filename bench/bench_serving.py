"""Serving benchmark: a load generator against the real app, with latency split where it is spent.

The server (Hypercorn + Quart-Trio + the engine task) runs in this process, on a random Llama, and
the clients (httpx, streaming /v1/completions with `stream_options.include_usage`, greedy,
`ignore_eos`, prompts as token ids) run in the same Trio run. Each load point is a Poisson arrival
rate (`--rate`) or a fixed number of clients that each send their next request when the last one
ends (`--concurrency`). Per request the client times TTFT, the gaps between streamed chunks (ITL)
and end to end; a spy on the server's metrics hook records the engine's own timestamps, which split
each request into queueing (arrival -> first scheduled), prefill (-> first token) and decode
(-> finished), and time the wait from the client's send to the engine's arrival (HTTP, and the
inbox behind a running step, which the engine's queue time cannot see). A ticker task in the same
run measures how late the event loop wakes it (the loop's stalls).
Prints a table; writes bench/results/serving_<device>.json and .png.

    python -m bench.bench_serving [--rate 2 4 8 16 32] [--concurrency 1 16] [--requests 48]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
import trio

from bench.machine import cpu_model
from nanoserve.demo import write_checkpoint
from nanoserve.engine import RequestMetrics, RequestOutput
from nanoserve.server.metrics import Metrics
from nanoserve.testing.harness import MODEL_NAME, LiveServer, live_server

RESULTS = Path(__file__).parent / "results"
SHAPES = {
    # small enough that a sweep of several load points runs in a few minutes on 2 cores
    "small": dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2,
                  intermediate_size=768),
    # the engine benchmark's model (bench_engine.py)
    "25m": dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2,
                intermediate_size=1536, vocab_size=4096, max_position_embeddings=1024),
}  # fmt: skip
PROMPT_VOCAB = 1000  # prompt ids stay below the demo tokenizer's special tokens
QUANTILES = (50, 90, 99)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--rate",
        type=float,
        nargs="*",
        default=[2.0, 4.0, 8.0, 16.0, 32.0],
        help="Poisson arrival rates, requests/s, one load point each ('inf': a burst)",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        nargs="*",
        default=[1, 16],
        help="fixed numbers of clients, one load point each",
    )
    p.add_argument("--requests", type=int, default=48, help="requests per load point")
    p.add_argument("--prompt-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"))
    p.add_argument("--shape", default="small", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument(
        "--tick-ms",
        type=float,
        default=1.0,
        help="the loop ticker's sleep; 0 spins (and competes with the engine thread)",
    )
    p.add_argument(
        "--no-chunked-prefill",
        action="store_true",
        help="run each prompt's prefill whole instead of in chunks of the token budget",
    )
    p.add_argument("--name", default="", help="suffix of the result files (serving_cpu_NAME)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args()  # fmt: skip


# ---------------------------------------------------------------- the workload and the client


@dataclass(frozen=True)
class Spec:
    prompt: list[int]
    max_tokens: int


@dataclass
class Result:
    """What one client saw; times are time.monotonic(), the engine's clock."""

    sent: float
    max_tokens: int
    chunks: list[float] = field(default_factory=list)  # chunks that carried text
    done: float = math.nan
    request_id: str | None = None
    tokens: int = 0  # completion_tokens of the usage chunk
    error: str | None = None


def workload(args: argparse.Namespace, rng: random.Random) -> list[Spec]:
    return [
        Spec(
            [rng.randrange(PROMPT_VOCAB) for _ in range(rng.randint(*args.prompt_len))],
            rng.randint(*args.output_len),
        )
        for _ in range(args.requests)
    ]


async def send(client: httpx.AsyncClient, spec: Spec, results: list[Result]) -> None:
    body = {
        "model": MODEL_NAME,
        "prompt": spec.prompt,
        "max_tokens": spec.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = Result(sent=time.monotonic(), max_tokens=spec.max_tokens)
    results.append(result)
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    read(result, time.monotonic(), json.loads(line.removeprefix("data: ")))
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
    result.done = time.monotonic()


def read(result: Result, now: float, event: dict[str, Any]) -> None:
    result.request_id = event.get("id", result.request_id)
    if "error" in event:
        result.error = event["error"]["message"]
    elif event["choices"] and event["choices"][0]["text"]:
        result.chunks.append(now)
    elif event.get("usage"):
        result.tokens = event["usage"]["completion_tokens"]


async def poisson(client: httpx.AsyncClient, specs: list[Spec], rate: float, rng: random.Random):
    results: list[Result] = []
    async with trio.open_nursery() as nursery:
        for spec in specs:
            nursery.start_soon(send, client, spec, results)
            if math.isfinite(rate):
                await trio.sleep(rng.expovariate(rate))
    return results


async def closed_loop(client: httpx.AsyncClient, specs: list[Spec], clients: int):
    results: list[Result] = []
    queue = iter(specs)

    async def worker() -> None:
        for spec in queue:
            await send(client, spec, results)

    async with trio.open_nursery() as nursery:
        for _ in range(clients):
            nursery.start_soon(worker)
    return results


# ---------------------------------------------------------------- the server side


class EngineSpy:
    """Wraps the server's `Metrics.on_output` (called by the engine task for every delivered
    output) to keep each request's engine timestamps and the times its tokens were delivered."""

    def __init__(self, metrics: Metrics) -> None:
        self._inner = metrics.on_output
        metrics.on_output = self.on_output  # type: ignore[method-assign]
        self.reset()

    def reset(self) -> None:
        self.finished: dict[str, RequestMetrics] = {}
        self.deliveries: dict[str, list[tuple[float, int]]] = defaultdict(list)

    def on_output(self, output: RequestOutput) -> None:
        self._inner(output)
        count = sum(len(c.token_ids) for c in output.outputs)
        self.deliveries[output.request_id].append((time.monotonic(), count))
        if output.finished:
            self.finished[output.request_id] = output.metrics


@dataclass
class LoopWatch:
    """How late the loop wakes a sleeper (the longest lag is the longest stall), with the loop
    thread's CPU time during each lag (near the lag: the loop was busy; near 0: it waited, for
    the GIL or for a core) and the garbage collector's pauses."""

    lags: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    gc_pauses: list[float] = field(default_factory=list)
    _gc_start: float = 0.0

    async def run(self, stop: trio.Event, tick_s: float) -> None:
        gc.callbacks.append(self._on_gc)
        try:
            while not stop.is_set():
                start, cpu = time.perf_counter(), time.thread_time()
                await trio.sleep(tick_s)
                self.cpu.append(time.thread_time() - cpu)
                self.lags.append(time.perf_counter() - start - tick_s)
        finally:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.gc_pauses.append(time.perf_counter() - self._gc_start)

    def summary(self) -> dict[str, Any]:
        out = percentiles(self.lags) | {"ticks": len(self.lags)}
        if self.lags:
            worst = int(np.argmax(self.lags))
            out["worst_loop_cpu_ms"] = round(self.cpu[worst] * 1e3, 2)
        out["stalls_over_10ms"] = sum(lag > 0.01 for lag in self.lags)
        out["gc_pause_max_ms"] = round(max(self.gc_pauses, default=0.0) * 1e3, 2)
        return out


async def load_point(
    server: LiveServer, client: httpx.AsyncClient, spy: EngineSpy, mode: str, load: float,
    specs: list[Spec], args: argparse.Namespace,
) -> dict[str, Any]:  # fmt: skip
    await server.wait_idle()
    spy.reset()
    watch = LoopWatch()
    stop = trio.Event()
    rng = random.Random(args.seed)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.run, stop, args.tick_ms / 1e3)
        if mode == "rate":
            results = await poisson(client, specs, load, rng)
        else:
            results = await closed_loop(client, specs, int(load))
        stop.set()
    return summarize(mode, load, results, spy, watch)


# ---------------------------------------------------------------- statistics


def percentiles(values: list[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {f"p{q}": None for q in QUANTILES}
    out["mean"] = out["max"] = None
    if values:
        ms = np.asarray(values) * 1e3
        out.update({f"p{q}": round(float(np.percentile(ms, q)), 2) for q in QUANTILES})
        out["mean"], out["max"] = round(float(ms.mean()), 2), round(float(ms.max()), 2)
    return out


def engine_itl(deliveries: list[tuple[float, int]]) -> list[float]:
    """Per-token gaps between the engine task's deliveries (a delivery of k tokens counts k
    gaps of 1/k of its interval, as the server's own ITL histogram does)."""
    gaps = []
    for (t0, n0), (t1, n1) in zip(deliveries, deliveries[1:], strict=False):
        if n0 and n1 > n0:
            gaps += [(t1 - t0) / (n1 - n0)] * (n1 - n0)
    return gaps


def summarize(
    mode: str, load: float, results: list[Result], spy: EngineSpy, watch: LoopWatch
) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    start, end = min(r.sent for r in results), max(r.done for r in results)
    duration = end - start
    wrong = sum(r.tokens != r.max_tokens for r in ok)
    per = {name: [] for name in ("ttft", "itl", "tpot", "e2e", "queue", "prefill", "decode",
                                 "to_engine", "itl_engine")}  # fmt: skip
    chunks = 0
    for r in ok:
        first = r.chunks[0] if r.chunks else r.done
        per["ttft"].append(first - r.sent)
        per["e2e"].append(r.done - r.sent)
        per["itl"] += list(np.diff(r.chunks))
        chunks += len(r.chunks)
        if r.tokens > 1 and r.chunks:
            per["tpot"].append((r.chunks[-1] - first) / (r.tokens - 1))
        m = spy.finished.get(r.request_id or "")
        if m is None or m.first_scheduled_time is None or m.first_token_time is None:
            continue
        per["to_engine"].append(m.arrival_time - r.sent)
        per["queue"].append(m.first_scheduled_time - m.arrival_time)
        per["prefill"].append(m.first_token_time - m.first_scheduled_time)
        per["decode"].append((m.finished_time or m.first_token_time) - m.first_token_time)
        per["itl_engine"] += engine_itl(spy.deliveries[r.request_id or ""])
    tokens = sum(r.tokens for r in ok)
    return {
        "mode": mode,
        "load": load if math.isfinite(load) else "inf",
        "requests": len(results),
        "errors": [r.error for r in results if r.error is not None],
        "wrong_lengths": wrong,
        "matched_engine_ids": sum(r.request_id in spy.finished for r in ok),
        "duration_s": round(duration, 3),
        "throughput_req_s": round(len(ok) / duration, 3),
        "output_tok_s": round(tokens / duration, 1),
        "output_tokens": tokens,
        "chunks_per_token": round(chunks / tokens, 3) if tokens else None,
        "latency_ms": {name: percentiles(values) for name, values in per.items()},
        "loop_lag_ms": watch.summary(),
    }


# ---------------------------------------------------------------- reporting


def label(point: dict[str, Any]) -> str:
    if point["mode"] == "rate":
        return "burst" if point["load"] == "inf" else f"{point['load']:g} req/s"
    return f"{point['load']:g} clients"


def print_table(points: list[dict[str, Any]]) -> None:
    cols = [("ttft", "TTFT"), ("itl", "ITL"), ("e2e", "e2e"), ("to_engine", "to engine"),
            ("queue", "queue"), ("prefill", "prefill"), ("decode", "decode")]  # fmt: skip
    head = f"{'offered load':>13} {'req/s':>6} {'tok/s':>7} "
    head += " ".join(f"{name + ' p50/p99':>17}" for _, name in cols)
    print(f"{head} {'loop stall p99/max':>19} {'err':>3}")
    for pt in points:
        lat = pt["latency_ms"]
        cells = " ".join(f"{lat[k]['p50'] or 0:>8.0f}/{lat[k]['p99'] or 0:<8.0f}" for k, _ in cols)
        lag = pt["loop_lag_ms"]
        print(
            f"{label(pt):>13} {pt['throughput_req_s']:>6.2f} {pt['output_tok_s']:>7.1f} {cells} "
            f"{lag['p99']:>9.1f}/{lag['max']:<9.1f} {len(pt['errors']):>3}"
        )
    print("latencies in ms. Client: TTFT, ITL (between chunks), e2e. Engine timestamps: queue,")
    print("prefill, decode; 'to engine' is client send -> engine arrival (HTTP + inbox)")


def machine(device: str) -> dict[str, Any]:
    info = {
        "cpu": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": device,
    }
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in ("rate", "concurrency") if any(p["mode"] == m for p in result["points"])]
    fig, axes = plt.subplots(len(modes), 3, figsize=(15, 4.4 * len(modes)), squeeze=False)
    for row, mode in zip(axes, modes, strict=True):
        points = [p for p in result["points"] if p["mode"] == mode and p["load"] != "inf"]
        xs = [float(p["load"]) for p in points]
        plot_throughput(row[0], points, xs, mode)
        plot_latency(row[1], points, xs)
        plot_split(row[2], points, xs)
        for ax in row:
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [f"{x:g}" for x in xs])
            ax.set_xlabel("offered load, requests/s" if mode == "rate" else "concurrent clients")
    m, w = result["machine"], result["workload"]
    fig.suptitle(
        f"nanoserve serving, {w['shape']} {w['dtype']} model, prompts {w['prompt_len']}, "
        f"outputs {w['output_len']} tokens, {w['requests']} requests per point; "
        f"{m['cpu']}, {m['cpu_cores']} cores, torch {m['torch']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_throughput(ax, points: list[dict[str, Any]], xs: list[float], mode: str) -> None:
    ax.plot(xs, [p["output_tok_s"] for p in points], "o-")
    for x, p in zip(xs, points, strict=True):
        ax.annotate(f"{p['throughput_req_s']:.1f} req/s", (x, p["output_tok_s"]), fontsize=7,
                    textcoords="offset points", xytext=(4, -10))  # fmt: skip
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput (requests/s achieved beside each point)", fontsize=10)


def plot_latency(ax, points: list[dict[str, Any]], xs: list[float]) -> None:
    top = 0.0
    for i, (key, name) in enumerate([("ttft", "TTFT"), ("itl", "ITL"), ("e2e", "e2e")]):
        for q, style in (("p50", "-"), ("p99", ":")):
            ys = [p["latency_ms"][key][q] for p in points]
            ax.plot(xs, ys, style, marker="o", color=f"C{i}", label=f"{name} {q}")
            top = max(top, *ys)
    ax.plot(xs, [p["loop_lag_ms"]["max"] for p in points], "x--", color="gray",
            label="event-loop stall, max")  # fmt: skip
    ax.set_yscale("log")
    ax.set_ylim(top=top * 40)  # room for the legend
    ax.set_ylabel("ms")
    ax.set_title("latency as the client sees it", fontsize=10)
    ax.legend(fontsize=7, ncol=4, loc="upper center")


def plot_split(ax, points: list[dict[str, Any]], xs: list[float]) -> None:
    """Mean time per request in each stage, as stacked bars (log-x: widths scale with x)."""
    bottom = np.zeros(len(points))
    widths = [x * 0.5 for x in xs]
    for i, key in enumerate(("to_engine", "queue", "prefill", "decode")):
        ys = np.array([p["latency_ms"][key]["mean"] or 0.0 for p in points])
        ax.bar(xs, ys, widths, bottom=bottom, color=f"C{i + 3}", label=key.replace("_", " "))
        bottom += ys
    ax.set_ylabel("ms, mean per request")
    ax.set_title("where a request's time goes (engine timestamps)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")


# ---------------------------------------------------------------- the run


async def sweep(model_dir: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    engine_args = dict(
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=not args.no_chunked_prefill,
    )
    loads = [("rate", r) for r in args.rate] + [("concurrency", c) for c in args.concurrency]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    points = []
    async with (
        live_server(model_dir, **engine_args) as server,
        httpx.AsyncClient(base_url=server.url, timeout=None, limits=limits) as client,
    ):
        spy = EngineSpy(server.serving.metrics)
        rng = random.Random(args.seed)
        await closed_loop(client, workload(args, rng)[:8], 4)  # warm-up: connections, shapes
        for i, (mode, load) in enumerate(loads):
            specs = workload(args, random.Random(args.seed + 1 + i))
            point = await load_point(server, client, spy, mode, load, specs, args)
            points.append(point)
            print(f"{label(point)}: {point['output_tok_s']} tok/s", flush=True)
    return points


def main() -> None:
    args = parse_args()
    shape = SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_checkpoint(Path(tmp) / "m", dtype=args.dtype, **shape)
        start = time.perf_counter()
        points = trio.run(sweep, model_dir, args)
        wall = time.perf_counter() - start
    print_table(points)
    result = {
        "benchmark": "serving",
        "machine": machine(args.device),
        "workload": {
            "shape": args.shape,
            "model": shape,
            "dtype": args.dtype,
            "requests": args.requests,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "sampling": "greedy, ignore_eos, streamed, prompts as token ids",
            "engine": {
                "max_num_seqs": args.max_num_seqs,
                "max_num_batched_tokens": args.max_num_batched_tokens,
                "chunked_prefill": not args.no_chunked_prefill,
            },
            "tick_ms": args.tick_ms,
            "seed": args.seed,
        },  # fmt: skip
        "notes": "clients, HTTP server and engine task share one process and one Trio loop; "
        "to_engine is client send -> the engine task's add_request (HTTP, parsing, and the wait "
        "in the inbox behind a running step, which the engine's queue time does not see); "
        "ITL is the gap between streamed chunks that carried text (chunks_per_token < 1 when "
        "the byte-level tokenizer holds back partial characters), itl_engine the per-token gap "
        "between the engine task's deliveries; loop_lag is how late a ticker sleeping tick_ms "
        "woke up, worst_loop_cpu_ms the loop thread's CPU time during the longest stall (near 0: "
        "it waited for the GIL, e.g. on a garbage collection in the engine thread); p99 of a few "
        "dozen requests is close to the max",
        "wall_s": round(wall, 1),
        "points": points,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / "_".join(filter(None, ["serving", args.device.split(":")[0], args.name]))
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, stem.with_suffix(".png"))
    print(f"wrote {stem}.json and .png ({wall:.0f} s)")


if __name__ == "__main__":
    main()
