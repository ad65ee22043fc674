"""Data-parallel replicas behind smg against one server on the same cores, on a shared-prefix
workload (system prompts x questions, as many chat users of a few assistants send): output
tokens/s with a crowd of concurrent clients, and the prefix hit rate summed over the servers'
/metrics. Configurations: one server with all the CPUs, then `--data-parallel-size N` (each
replica CPUs/N) under smg's round_robin and cache_aware; each started as a user starts it
(`nanoserve serve`), in turn, for --rounds rounds. Answers (greedy) are checked equal to the
one server's.

    python -m bench.bench_dp [--model PATH] [--replicas 2] [--systems 8] [--questions 6]
        [--clients 8] [--max-tokens 32] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import trio

from bench.machine import cpu_model

RESULTS = Path(__file__).parent / "results"
WORDS = [
    "the", "keeper", "lamp", "harbour", "ship", "night", "storm", "rock", "light", "tide", "wind",
    "sea", "coast", "watch", "signal", "beacon", "lens", "oil", "bell", "fog", "island", "pier",
    "rope", "boat", "gull", "wave", "cliff", "shore",
]  # fmt: skip


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the default model (SmolLM2 Q4_1)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--systems", type=int, default=8, help="system prompts (shared prefixes)")
    p.add_argument("--questions", type=int, default=6, help="questions per system prompt")
    p.add_argument("--clients", type=int, default=8, help="requests in flight at once")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS / "dp_cpu.json")
    return p.parse_args()


def prompts(systems: int, questions: int) -> list[list[dict[str, str]]]:
    """systems x questions chats, shuffled: each system prompt about 200 tokens."""
    rng = random.Random(0)
    chats = []
    for s in range(systems):
        system = f"You are assistant {s}. " + " ".join(rng.choice(WORDS) for _ in range(180))
        for q in range(questions):
            question = f"Question {q}: what does the " + " ".join(rng.sample(WORDS, 6)) + " mean?"
            chats.append(
                [{"role": "system", "content": system}, {"role": "user", "content": question}]
            )
    rng.shuffle(chats)
    return chats


def start(model: str | None, port: int, dp: int, policy: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "nanoserve.cli", "serve", *([model] if model else []),
            "--port", str(port), "--served-model-name", "m", "--kv-cache-memory", "0.5",
            "--log-level", "warning"]  # fmt: skip
    if dp > 1:
        argv += ["-dp", str(dp), "--router-policy", policy]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_ready(url: str, process: subprocess.Popen, dp: int) -> list[str]:
    """The servers behind `url`: itself, or the replicas smg lists."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        assert process.poll() is None, "the server exited"
        try:
            if dp == 1 and httpx.get(f"{url}/health").status_code == 200:
                return [url]
            workers = httpx.get(f"{url}/workers").json()["workers"] if dp > 1 else []
            if dp > 1 and sum(w["is_healthy"] for w in workers) == dp:
                return [w["url"] for w in workers]
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise TimeoutError(url)


def metric(urls: list[str], name: str) -> float:
    total = 0.0
    for url in urls:
        for line in httpx.get(f"{url}/metrics").text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


async def crowd(url: str, chats: list, clients: int, max_tokens: int) -> tuple[float, list[str]]:
    """All chats through `clients` at a time: seconds, and the answers in the chats' order."""
    answers = [""] * len(chats)
    todo = iter(range(len(chats)))
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:

        async def client() -> None:
            for i in todo:
                body = {"model": "m", "messages": chats[i], "max_tokens": max_tokens,
                        "temperature": 0, "ignore_eos": True}  # fmt: skip
                r = await http.post("/v1/chat/completions", json=body)
                r.raise_for_status()
                answers[i] = r.json()["choices"][0]["message"]["content"]

        start_t = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(clients):
                nursery.start_soon(client)
        return time.perf_counter() - start_t, answers


def run_one(args: argparse.Namespace, dp: int, policy: str, chats: list) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    process = start(args.model, port, dp, policy)
    try:
        servers = wait_ready(url, process, dp)
        warm = [[{"role": "user", "content": "Hello."}]]
        trio.run(crowd, url, warm, 1, 4)
        hits0 = metric(servers, "nanoserve:prefix_cache_hits_total")
        queries0 = metric(servers, "nanoserve:prefix_cache_queries_total")
        seconds, answers = trio.run(crowd, url, chats, args.clients, args.max_tokens)
        hits = metric(servers, "nanoserve:prefix_cache_hits_total") - hits0
        queries = metric(servers, "nanoserve:prefix_cache_queries_total") - queries0
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    tokens = len(chats) * args.max_tokens
    return {"replicas": dp, "policy": policy if dp > 1 else None, "seconds": round(seconds, 3),
            "output_tok_s": round(tokens / seconds, 1), "prefix_hit_rate": round(hits / queries, 4),
            "answers": answers}  # fmt: skip


def main() -> None:
    args = parse_args()
    chats = prompts(args.systems, args.questions)
    configs = [(1, ""), (args.replicas, "round_robin"), (args.replicas, "cache_aware")]
    rows = []
    for r in range(args.rounds):
        for dp, policy in configs:
            row = run_one(args, dp, policy, chats)
            row["round"] = r
            rows.append(row)
            name = "one server" if dp == 1 else f"{dp} replicas, {policy}"
            print(f"round {r} {name:26} {row['output_tok_s']:7.1f} tok/s   prefix hit rate "
                  f"{row['prefix_hit_rate']:.3f}", flush=True)  # fmt: skip
    alone = rows[0]["answers"]
    for row in rows:
        pairs = zip(row.pop("answers"), alone, strict=True)
        row["answers_equal_one_servers"] = sum(a == b for a, b in pairs)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    result = {"cpu": cpu_model(), "cpus": len(os.sched_getaffinity(0)), "requests": len(chats),
              "settings": settings, "rows": rows}  # fmt: skip
    result["settings"]["model"] = args.model or "default (SmolLM2-135M-Instruct Q4_1)"
    args.out.write_text(json.dumps(result, indent=1))
    print(f"answers equal to one server's: {[r['answers_equal_one_servers'] for r in rows]} of "
          f"{len(chats)}; {args.out}")  # fmt: skip


if __name__ == "__main__":
    main()
