"""The acceptance test as a harness: a crowd of clients that disagree about everything (streamed
or unary, greedy or seeded, some hanging up), run alone and then together against one live server.

The claims are comparisons, not checklists: every answer that survives the crowd is byte-identical
to the same request run alone on the same server; every survivor completed; the pool came back
(ledger audit and counts); and the crowd was hard (peak running, preemptions, recomputed positions),
so that a crowd which never preempted fails instead of passing trivially.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field

import trio

from nanoserve.engine import Engine
from nanoserve.testing.harness import LiveServer, hang_up, open_request

WORDS = [
    "the",
    "a",
    "river",
    "city",
    "quiet",
    "stone",
    "bright",
    "learns",
    "under",
    "over",
    "market",
    "garden",
    "old",
    "song",
]


@dataclass(frozen=True)
class ClientPlan:
    name: str
    prompt: str
    max_tokens: int
    stream: bool
    seed: int | None = None  # None: greedy; else sampled with this seed
    hang_up_after_tokens: int | None = None  # streamed clients: leave after this many deltas
    hang_up_after_seconds: float | None = None  # any client: leave after this long

    @property
    def hangs_up(self) -> bool:
        return self.hang_up_after_tokens is not None or self.hang_up_after_seconds is not None

    def body(self, model: str) -> dict:
        sampling = (
            {"temperature": 0.0}
            if self.seed is None
            else {"temperature": 0.8, "top_p": 0.95, "seed": self.seed}
        )
        return {
            "model": model,
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "stream": self.stream,
            "ignore_eos": True,
            **sampling,
        }


@dataclass
class ClientResult:
    plan: ClientPlan
    text: str = ""
    completed: bool = False  # a finish_reason arrived (and [DONE], when streamed)
    hung_up: bool = False
    status: int | None = None
    deltas: int = 0


def mixed_crowd(n: int, seed: int = 0, max_tokens: tuple[int, int] = (16, 40)) -> list[ClientPlan]:
    """Half streamed, two thirds seeded sampling, a quarter hanging up halfway."""
    rng = random.Random(seed)
    plans = []
    for i in range(n):
        budget = rng.randint(*max_tokens)
        stream = i % 2 == 0
        leaves = i % 4 == 3
        plans.append(
            ClientPlan(
                name=f"client-{i}",
                prompt=" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30))),
                max_tokens=budget,
                stream=stream,
                seed=None if i % 3 == 0 else 1000 + i,
                hang_up_after_tokens=budget // 2 if leaves and stream else None,
                hang_up_after_seconds=0.05 if leaves and not stream else None,
            )
        )
    return plans


async def run_client(server: LiveServer, plan: ClientPlan, model: str) -> ClientResult:
    """One client on its own connection, over a raw socket so that hanging up is a real close."""
    result = ClientResult(plan)
    stream = await open_request(server, "/v1/completions", plan.body(model))
    try:
        with trio.move_on_after(plan.hang_up_after_seconds or float("inf")) as scope:
            await _read(stream, result)
        result.hung_up = scope.cancelled_caught or result.hung_up
    finally:
        await hang_up(stream)
    return result


async def _read(stream: trio.SocketStream, result: ClientResult) -> None:
    data = b""
    while True:
        chunk = await stream.receive_some()
        if not chunk:
            return
        data += chunk
        if result.plan.stream:
            if _consume_events(data, result):
                return
        elif _unary_complete(data, result):
            return


def _unary_complete(data: bytes, result: ClientResult) -> bool:
    """Parse a whole unary response once all of it has arrived (Content-Length framing)."""
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    length = re.search(rb"(?i)content-length: *(\d+)", head)
    if length is None or len(body) < int(length.group(1)):
        return False
    result.status = int(head.split(b" ", 2)[1])
    if result.status == 200:
        choice = json.loads(body)["choices"][0]
        result.text, result.completed = choice["text"], choice["finish_reason"] is not None
    return True


def _consume_events(data: bytes, result: ClientResult) -> bool:
    """Re-read the SSE events so far; True when the client is done (finished or leaving)."""
    result.text, result.deltas = "", 0
    finished = False
    for raw in data.split(b"data: ")[1:]:
        payload = raw.split(b"\n\n", 1)[0]
        if payload == b"[DONE]":
            result.completed = finished
            return True
        try:
            choices = json.loads(payload).get("choices") or []
        except ValueError:
            return False  # an event cut by the read: wait for the rest
        for choice in choices:
            result.text += choice.get("text", "")
            result.deltas += 1
            finished = finished or choice.get("finish_reason") is not None
    limit = result.plan.hang_up_after_tokens
    if limit is not None and result.deltas >= limit and not finished:
        result.hung_up = True
        return True
    return False


@dataclass
class CrowdReport:
    results: dict[str, ClientResult]
    peak_running: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0
    samples: list[int] = field(default_factory=list)


async def run_solo(server: LiveServer, plans: list[ClientPlan], model: str) -> dict[str, str]:
    """Each plan alone (in full, no hang-ups): the texts the crowd must reproduce."""
    texts = {}
    for plan in plans:
        full = ClientPlan(plan.name, plan.prompt, plan.max_tokens, plan.stream, plan.seed)
        result = await run_client(server, full, model)
        _check(result.completed, f"{plan.name} did not complete alone: {result}")
        texts[plan.name] = result.text
    return texts


async def run_crowd(server: LiveServer, plans: list[ClientPlan], model: str) -> CrowdReport:
    """All plans at once, with /health sampled meanwhile for the hardness instruments."""
    before = await server.health()
    report = CrowdReport({})

    async def client(plan: ClientPlan) -> None:
        report.results[plan.name] = await run_client(server, plan, model)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(_sample_running, server, report)
        async with trio.open_nursery() as clients:
            for plan in plans:
                clients.start_soon(client, plan)
        nursery.cancel_scope.cancel()
    after = await server.wait_idle()
    # The engine's own high-water mark (exact), not only what the 5 ms samples happened to see.
    report.peak_running = max(report.peak_running, after["peak_running"])
    report.preemptions = after["num_preemptions"] - before["num_preemptions"]
    report.recomputed_tokens = after["num_recomputed_tokens"] - before["num_recomputed_tokens"]
    return report


async def _sample_running(server: LiveServer, report: CrowdReport) -> None:
    while True:
        running = (await server.health())["running"]
        report.samples.append(running)
        report.peak_running = max(report.peak_running, running)
        await trio.sleep(0.005)


def check_answers(solo: dict[str, str], crowd: CrowdReport) -> int:
    """Every survivor's text equals its solo text; returns how many were compared."""
    survivors = [r for r in crowd.results.values() if not r.plan.hangs_up]
    for r in survivors:
        _check(r.text == solo[r.plan.name], f"{r.plan.name}: crowd {r.text!r} != solo")
    return len(survivors)


def check_survivors(crowd: CrowdReport) -> None:
    for r in crowd.results.values():
        if not r.plan.hangs_up:
            _check(r.completed and not r.hung_up, f"{r.plan.name} did not complete: {r}")


async def check_pool_returned(server: LiveServer) -> None:
    """Two questions: is the ledger consistent (audit), and is the pool empty (counts)."""
    health = await server.wait_idle()
    assert isinstance(server.engine, Engine), "a crowd of generation requests"
    server.engine.audit()  # safe: the engine task is idle, asleep on its inbox
    _check(health["free_blocks"] == health["total_blocks"], f"blocks still held: {health}")


class CrowdCheckFailed(AssertionError):
    """One of the acceptance test's claims does not hold."""


def _check(holds: bool, message: str) -> None:
    """A check that stays under `python -O` (an assert would vanish)."""
    if not holds:
        raise CrowdCheckFailed(message)
