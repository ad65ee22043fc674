"""Soak: random clients against a live server for a bounded time, then the bill.

A real `nanoserve serve` process (harness.serve_command) on the default model (SmolLM2, or
`--model demo` or a path), measured from outside: its resident memory from /proc/PID/status, its
KV blocks from /health. Clients arrive at a steady mean rate (Poisson), each with random
parameters: completions or chat, streamed or unary, greedy or sampled (temperature, seed, top_p,
top_k), stop strings, n, logprobs, echo, max_tokens, a JSON schema or tools under fresh names (so
that the grammar cache turns over); some hang up at a random point, a few send a deliberately
bad request. The pool is the server's default size (--kv-cache-memory 1), or --num-kv-blocks,
small enough that the engine preempts.

    python -m bench.soak [--seconds 240] [--rate 1] [--seed 0] [--model PATH|demo]
        [--kv-cache-memory GB | --num-kv-blocks N] [--warm-up 60]

Prints a table; writes bench/results/soak.json (and soak.png with matplotlib). Exits 1 if any
request got a 5xx (or a stream an error event), the server dropped a connection, a client hung,
a KV block leaked, or the server's RSS grew by more than 5% from the end of the warm-up to the
end of the run.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

from nanoserve.default_model import default_model_path
from nanoserve.demo import demo_model_dir
from nanoserve.testing.crowd import WORDS
from nanoserve.testing.harness import MODEL_NAME, LiveServer, serve_command, sse_data

RESULTS = Path(__file__).parent / "results"
C, X = "/v1/completions", "/v1/chat/completions"
# The clients' outcomes.
COUNTS = [
    "served",
    "hung_up",
    "4xx_expected",
    "4xx_unexpected",
    "refused_503",
    "5xx",
    "bad_accepted",
    "broken",
    "stuck",
    "server_error",
]
# What the server says at the end.
BILL = [
    "preemptions",
    "recomputed_tokens",
    "generation_tokens",
    "peak_running",
    "blocks_total",
    "blocks_leaked",
]
# The server's resident memory (MB): once ready, at the end of the warm-up, the most, at the end.
RSS = ["rss_mb_ready", "rss_mb_warm", "rss_mb_max", "rss_mb_end", "rss_growth_pct"]
RSS_GROWTH_PCT = 5.0  # more, from the end of the warm-up to the end, fails the run
# From /health, once a second.
SAMPLED = ["running", "waiting", "free_blocks", "generation_tokens"]
DRAIN_S = 60.0  # after the last arrival, how long clients still in flight may take
BAD = [  # (field, value): each must be a 400
    ("temperature", -1),
    ("n", 0),
    ("max_tokens", 10**9),
    ("top_p", 0),
    ("logprobs", 99),
    ("stop", [""]),
    ("repeat_penalty", 1.1),
    ("stop_token_ids", [10**6]),
]


@dataclass
class Plan:
    path: str
    body: dict[str, Any]
    hang_up_after_s: float | None = None  # leave after this long (any client)
    hang_up_after_events: int | None = None  # streamed: leave after this many events
    bad: bool = False  # expects a 400


def random_plan(rng: random.Random, hang_up_rate: float, bad_rate: float) -> Plan:
    chat, stream = rng.random() < 0.5, rng.random() < 0.5
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": rng.randint(1, 128)}
    body["stream"] = stream
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body.update(_sampling(rng, chat))
    constraint = _constraint(rng, chat)
    if constraint:
        body.update(constraint)
        body.pop("ignore_eos", None)  # a finished constraint ends the output
    elif not chat and rng.random() < 0.1:
        body["echo"] = True
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    plan = Plan(X if chat else C, body)
    if rng.random() < bad_rate:
        name, value = rng.choice(BAD)
        body[name], plan.bad = value, True
    elif rng.random() < hang_up_rate:
        if stream and rng.random() < 0.5:
            plan.hang_up_after_events = rng.randint(1, 10)
        else:
            plan.hang_up_after_s = rng.uniform(0.0, 1.0)
    return plan


def _constraint(rng: random.Random, chat: bool) -> dict[str, Any]:
    """A JSON schema (one in 8 requests) or, in chat, tools (one in 10), under a fresh name, so
    that each compiles anew and the grammar cache turns over."""
    name = f"f{rng.randrange(10**9)}"
    schema = {"type": "object", "properties": {name: {"type": "integer"}}, "required": [name]}
    draw = rng.random()
    if chat and draw < 0.1:
        function = {"name": name, "parameters": schema}
        return {"tools": [{"type": "function", "function": function}],
                "tool_choice": rng.choice(["auto", "required"])}  # fmt: skip
    if draw < 0.225:
        if chat:
            return {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "answer", "schema": schema},
                }
            }
        return {"structured_outputs": {"json": schema}}  # fmt: skip
    return {}


def _sampling(rng: random.Random, chat: bool) -> dict[str, Any]:
    params: dict[str, Any] = {"n": rng.choice([1, 1, 1, 2, 3])}
    if rng.random() < 0.3:
        params["temperature"] = 0
    else:
        params["temperature"] = round(rng.uniform(0.2, 1.5), 2)
        for name, value in (
            ("seed", rng.randint(0, 2**31)),
            ("top_p", round(rng.uniform(0.5, 1), 2)),
            ("top_k", rng.randint(1, 50)),
        ):
            if rng.random() < 0.5:
                params[name] = value
    if rng.random() < 0.3:
        params["stop"] = rng.sample(WORDS, rng.randint(1, 3))
    if rng.random() < 0.3:
        if chat:
            params.update(logprobs=True, top_logprobs=rng.randint(0, 5))
        else:
            params["logprobs"] = rng.randint(0, 5)
    if rng.random() < 0.3:
        params["ignore_eos"] = True
    return params


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)  # what each 5xx or broken answer was

    def fail(self, kind: str, detail: str) -> None:
        self.outcomes[kind] += 1
        if len(self.failures) < 20:
            self.failures.append(f"{kind}: {detail[:300]}")


async def run_client(http: httpx.AsyncClient, plan: Plan, tally: Tally) -> None:
    """One client; its outcome lands in `tally`."""
    try:
        await _request(http, plan, tally)
    except httpx.TransportError as e:  # the server closed or reset a connection it should not
        tally.fail("broken", f"{type(e).__name__}: {e} ({plan.body})")


async def _request(http: httpx.AsyncClient, plan: Plan, tally: Tally) -> None:
    with trio.move_on_after(plan.hang_up_after_s or float("inf")) as leave:
        async with http.stream("POST", plan.path, json=plan.body) as response:
            if response.status_code != 200 or not plan.body["stream"]:
                _judge(plan, response.status_code, await response.aread(), tally)
                return
            data = b""
            async for chunk in response.aiter_raw():
                data += chunk
                if _leaves_now(plan, data):
                    tally.outcomes["hung_up"] += 1
                    return  # leaving the block closes the connection mid-stream
            _judge(plan, 200, data, tally)
    if leave.cancelled_caught:
        tally.outcomes["hung_up"] += 1


def _leaves_now(plan: Plan, data: bytes) -> bool:
    limit = plan.hang_up_after_events
    return limit is not None and data.count(b"data: ") >= limit and b"data: [DONE]" not in data


def _judge(plan: Plan, status: int, raw: bytes, tally: Tally) -> None:
    if status == 503 and b'"overloaded"' in raw:
        tally.outcomes["refused_503"] += 1
    elif status >= 500:
        tally.fail("5xx", f"{status} {raw!r}")
    elif status >= 400:
        tally.outcomes["4xx_expected" if plan.bad and status == 400 else "4xx_unexpected"] += 1
        if not plan.bad:
            tally.failures.append(f"4xx: {plan.body} -> {raw[:200]!r}")
    elif plan.bad:
        tally.fail("bad_accepted", repr(plan.body))
    elif plan.body["stream"]:
        events = sse_data(raw)
        if not events or events[-1] != "[DONE]" or any('"error"' in e[:10] for e in events):
            tally.fail("5xx", f"stream ended badly: {events[-2:]}")
        else:
            tally.outcomes["served"] += 1
    elif all(c["finish_reason"] for c in json.loads(raw)["choices"]):
        tally.outcomes["served"] += 1
    else:
        tally.fail("5xx", f"unfinished answer: {raw[:200]!r}")


def rss_mb(pid: int) -> float:
    """Resident memory of the server process, from /proc/PID/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def sample_state(
    server: LiveServer, pid: int, samples: list[dict[str, float]], t0: float
) -> None:
    while True:
        health = await server.health()
        state = {key: health[key] for key in SAMPLED}
        samples.append({"t": time.monotonic() - t0, "rss_mb": rss_mb(pid), **state})
        await trio.sleep(1.0)


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    tally, samples = Tally(), []
    async with serve_command(args.model, *_serve_flags(args)) as (proc, server):
        rss_ready = rss_mb(proc.pid)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=16)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:
            await http.post(C, json={"prompt": "warm up", "max_tokens": 4})  # first-call costs
            before, t0 = await server.health(), time.monotonic()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_read_log, proc.stderr, tally)
                nursery.start_soon(sample_state, server, proc.pid, samples, t0)
                arrivals = await _arrive(http, args, rng, tally)
                wall = time.monotonic() - t0
                after = await _idle(server)
                rss_end = rss_mb(proc.pid)
                nursery.cancel_scope.cancel()
    warm = [s["rss_mb"] for s in samples if s["t"] <= args.warm_up] or [rss_ready]
    return {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "wall_s": round(wall, 1),
        "arrivals": arrivals,
        **{key: tally.outcomes[key] for key in COUNTS},
        "preemptions": after["num_preemptions"] - before["num_preemptions"],
        "recomputed_tokens": after["num_recomputed_tokens"] - before["num_recomputed_tokens"],
        "generation_tokens": after["generation_tokens"] - before["generation_tokens"],
        "peak_running": after["peak_running"],
        "blocks_total": after["total_blocks"],
        "blocks_leaked": after["total_blocks"] - after["free_blocks"],
        "rss_mb_ready": round(rss_ready, 1),
        "rss_mb_warm": round(warm[-1], 1),
        "rss_mb_max": round(max([s["rss_mb"] for s in samples] + [rss_end]), 1),
        "rss_mb_end": round(rss_end, 1),
        "rss_growth_pct": round(100 * (rss_end / warm[-1] - 1), 2),
        "failures": tally.failures,
        "samples": samples,
    }


def _serve_flags(args: argparse.Namespace) -> list[str]:
    """The server's flags: the clients' model name, the pool, the batch and queue limits."""
    flags = ["--served-model-name", MODEL_NAME]
    flags += ["--max-num-seqs", str(args.max_num_seqs)]
    if args.num_kv_blocks is not None:
        flags += ["--num-kv-blocks", str(args.num_kv_blocks)]
    else:
        flags += ["--kv-cache-memory", str(args.kv_cache_memory)]
    if args.max_queue is not None:
        flags += ["--max-queue", str(args.max_queue)]
    return flags


async def _arrive(
    http: httpx.AsyncClient, args: argparse.Namespace, rng: random.Random, tally: Tally
) -> int:
    """Start clients at Poisson arrivals for args.seconds; wait (bounded) for them to end."""
    arrivals, deadline = 0, trio.current_time() + args.seconds
    async with trio.open_nursery() as clients:
        while trio.current_time() < deadline:
            plan = random_plan(rng, args.hang_up_rate, args.bad_rate)
            clients.start_soon(run_client, http, plan, tally)
            arrivals += 1
            await trio.sleep(rng.expovariate(args.rate))
        with trio.move_on_after(DRAIN_S):
            while len(clients.child_tasks):
                await trio.sleep(0.05)
        tally.outcomes["stuck"] += len(clients.child_tasks)
        clients.cancel_scope.cancel()
    return arrivals


async def _read_log(stderr: trio.abc.ReceiveStream, tally: Tally) -> None:
    """The server's log past its ready line (one line per request), read so that the pipe never
    fills and blocks the server; its errors are failures."""
    async for chunk in stderr:
        for line in chunk.decode(errors="replace").splitlines():
            if " ERROR " in line or "Traceback" in line:
                tally.fail("server_error", line)


async def _idle(server: LiveServer) -> dict[str, Any]:
    """/health once the server is idle (bounded wait): blocks still held then have leaked."""
    try:
        return await server.wait_idle()
    except trio.TooSlowError:
        return await server.health()


def report(result: dict[str, Any], out: Path) -> None:
    keys = ["wall_s", "arrivals", *COUNTS, *BILL, *RSS]
    print(f"\nsoak: {result['config']['seconds']} s at {result['config']['rate']}/s")
    for key in keys:
        print(f"  {key:<20} {result[key]}")
    for failure in result["failures"]:
        print(f"  ! {failure}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(result, indent=1) + "\n")
    _plot(result, out / "soak.png")
    print(f"wrote {out / 'soak.json'}")


def _plot(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    t = [s["t"] for s in result["samples"]]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 5))
    top.plot(t, [s["rss_mb"] for s in result["samples"]])
    top.set_ylabel("RSS (MB)")
    for key in ("running", "waiting"):
        bottom.plot(t, [s[key] for s in result["samples"]], label=key)
    bottom.set(xlabel="seconds", ylabel="requests")
    bottom.legend()
    top.set_title(
        f"soak: {result['arrivals']} arrivals, {result['served']} served, "
        f"{result['hung_up']} hung up, {result['5xx']} 5xx"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=240.0, help="arrival window")
    parser.add_argument("--rate", type=float, default=1.0, help="mean arrivals per second")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="a path, or demo; default: SmolLM2")
    parser.add_argument("--kv-cache-memory", type=float, default=1.0, help="GiB")
    parser.add_argument("--num-kv-blocks", type=int, help="instead (32: forces preemption)")
    parser.add_argument("--warm-up", type=float, default=60.0, help="seconds before RSS counts")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-queue", type=int, default=None, help="503 past this many waiting")
    parser.add_argument("--hang-up-rate", type=float, default=0.2)
    parser.add_argument("--bad-rate", type=float, default=0.05)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.model = (
        demo_model_dir() if args.model == "demo" else Path(args.model or default_model_path())
    )
    result = trio.run(soak, args)
    report(result, args.out)
    bad = ("5xx", "bad_accepted", "broken", "stuck", "server_error", "blocks_leaked")
    grew = result["rss_growth_pct"] > RSS_GROWTH_PCT
    if grew:
        print(f"! RSS grew by {result['rss_growth_pct']}% after the warm-up", file=sys.stderr)
    return 0 if not any(result[key] for key in bad) and not grew else 1


if __name__ == "__main__":
    sys.exit(main())
