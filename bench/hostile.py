"""What one heavy client costs the others: a live server on the default model, a probe that asks
/health every 10 ms and a short 4-token completion, while one client sends a heavy request.

    python -m bench.hostile [--case NAME ...] [--model PATH]

Cases: `huge_prompt` (a 3 MB prompt, six at once), `echo_logprobs` (echo + logprobs 20 of an
8,000-token prompt, n=4), `many_prompts` (one request of 256 prompts), `stops` (16 stop
strings, n=4), `stops_200k` (200,000 of them); constraints: `grammar_chain` (a Lark grammar of
3,000 chained rules), `schema_cycle` (`{"$ref": "#"}`), `choices_100k` (100,000 choices),
`slow_regex` (a regex whose compile passes the time limit), `slow_regex_x4` (four at once),
`alternation_20k` (a Lark alternation of 20,000 strings). For each: the longest /health answer
and the short completion's latency while the heavy request runs, against the same probes on the
idle server. Prints a table and writes bench/results/hostile.json, with the machine's CPU count and
load average before and after (a shared machine makes every figure slower).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from nanoserve.default_model import default_model_path
from nanoserve.testing.harness import live_server

RESULTS = Path(__file__).parent / "results"
C = "/v1/completions"
SHORT = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
TEXT = "The quick brown fox jumps over the lazy dog near the river bank. "


def cases() -> dict[str, list[dict[str, Any]]]:
    """The heavy requests of each case (sent at once)."""
    return {
        "huge_prompt": [{"prompt": "word " * 600_000, "max_tokens": 1}] * 6,
        "echo_logprobs": [
            {"prompt": TEXT * 570, "max_tokens": 0, "echo": True, "logprobs": 20, "n": 4}
        ],
        "many_prompts": [{"prompt": [TEXT * 4] * 256, "max_tokens": 8, "ignore_eos": True}],
        "stops": [
            {"prompt": TEXT, "max_tokens": 64, "n": 4, "ignore_eos": True,
             "stop": [f"never-{i:04d}" for i in range(16)]}
        ],
        "grammar_chain": [_constrained(grammar=_chain(3000))],
        "schema_cycle": [_constrained(json={"$ref": "#"})],
        "choices_100k": [_constrained(choice=[f"option {i}" for i in range(100_000)])],
        "slow_regex": [_constrained(regex="(a{1000}){1000}")],
        "slow_regex_x4": [_constrained(regex=f"(a{{1000}}){{{1000 + i}}}") for i in range(4)],
        "alternation_20k": [_constrained(grammar="start: " + " | ".join(
            f'"w{i}"' for i in range(20_000)))],
        "stops_200k": [
            {"prompt": TEXT, "max_tokens": 64, "n": 4, "ignore_eos": True,
             "stop": [f"never-{i:06d}" for i in range(200_000)]}
        ],
    }  # fmt: skip


def _constrained(**constraint: Any) -> dict[str, Any]:
    return {"prompt": TEXT, "max_tokens": 8, "structured_outputs": constraint}


def _chain(rules: int) -> str:
    lines = [f'r{i}: "t{i}" r{i + 1} | "e"' for i in range(rules)]
    return "\n".join(["start: r0", *lines, f'r{rules}: "z"'])


async def probe(http: httpx.AsyncClient, done: trio.Event) -> tuple[float, float]:
    """Until `done`: the longest /health round trip, and the short completion's latency."""
    worst = 0.0
    short = -1.0

    async def completion() -> None:
        nonlocal short
        start = time.perf_counter()
        (await http.post(C, json=SHORT)).raise_for_status()
        short = time.perf_counter() - start

    async with trio.open_nursery() as nursery:
        nursery.start_soon(completion)
        while not done.is_set() or short < 0:
            start = time.perf_counter()
            await http.get("/health")
            worst = max(worst, time.perf_counter() - start)
            await trio.sleep(0.01)
    return worst, short


async def run_case(http: httpx.AsyncClient, heavy: list[dict[str, Any]]) -> dict[str, Any]:
    done = trio.Event()
    statuses: list[int] = []
    result: dict[str, Any] = {}

    async def send(body: dict[str, Any]) -> None:
        statuses.append((await http.post(C, json=body)).status_code)

    async def heavies() -> None:
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for body in heavy:
                nursery.start_soon(send, body)
        result["heavy_s"] = time.perf_counter() - start
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(heavies)
        await trio.sleep(0.05)  # the heavy requests arrive first
        result["health_max_s"], result["short_s"] = await probe(http, done)
    result["statuses"] = sorted(set(statuses))
    return result


async def main(names: list[str], model: Path) -> None:
    chosen = {name: body for name, body in cases().items() if name in names}
    results: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "load_before": os.getloadavg()}}
    async with (
        live_server(model, kv_cache_memory_gb=2.0) as server,
        httpx.AsyncClient(base_url=server.url, timeout=600) as http,
    ):
        await http.post(C, json=SHORT)  # warm up, the grammar checker's process too
        await http.post(C, json=_constrained(choice=["yes", "no"]))
        done = trio.Event()
        done.set()
        idle = await probe(http, done)
        results["idle"] = {"health_max_s": idle[0], "short_s": idle[1]}
        for name, heavy in chosen.items():
            results[name] = await run_case(http, heavy)
            await server.wait_idle()
    results["machine"]["load_after"] = os.getloadavg()
    print(f"{'case':<14} {'/health max s':>14} {'4-token s':>10} {'heavy s':>8}  statuses")
    for name, r in results.items():
        if name == "machine":
            continue
        print(f"{name:<14} {r['health_max_s']:>14.3f} {r['short_s']:>10.3f} "
              f"{r.get('heavy_s', 0):>8.2f}  {r.get('statuses', '')}")  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "hostile.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", action="append", choices=list(cases()), help="default: all")
    parser.add_argument("--model", type=Path, default=None)
    args = parser.parse_args()
    trio.run(main, args.case or list(cases()), args.model or default_model_path())
