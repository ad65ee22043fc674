"""The Trio bridge between HTTP handlers and the synchronous Engine.

One engine task (`Serving.run`, started in the server's nursery) owns the Engine. Handlers never
touch it: `Serving.generate` puts an arrival in the inbox (a Trio memory channel) and reads the
request's deliveries; leaving early, for any reason, queues an abort. Each turn of the engine task
drains the inbox, applies aborts, admits, delivers, then awaits one `engine.step` in a named
thread: the only line that leaves the event loop. Admission is fair between HTTP requests: each
one's prompts wait in the bridge, and the engine's queue is topped up to the batch's free rows
round robin across requests, so that one request of many prompts cannot make another wait for
all of them. With no work it sleeps on the inbox, waking every HEALTH_CHECK_S to ask the engine
whether it can still step (a tensor-parallel worker may die while nothing runs). The engine's
fixed facts (`tokenizer`, `max_model_len`) are handed to the server here, at start-up.
"""

from __future__ import annotations

import gc
import itertools
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio

from nanoserve.engine import Engine, RequestOutput, SamplingParams
from nanoserve.server.metrics import Metrics

log = logging.getLogger(__name__)

HEALTH_CHECK_S = 1.0  # an idle engine task asks the engine this often whether it still works


class Overloaded(Exception):
    """The waiting queue is full; try again later (HTTP 503 with Retry-After)."""

    retry_after = 1


class EngineDead(Exception):
    """The engine failed and serves no more requests (HTTP 503)."""


class RequestFailed(Exception):
    """The engine failed while this request was open."""


class ShuttingDown(Exception):
    """The server stopped while this request was open (HTTP 503)."""


@dataclass(eq=False)
class Delivery:
    """One request's mailbox. The engine task replaces `latest` (outputs are cumulative, so a slow
    reader skips intermediate snapshots instead of queueing them) and wakes the reader."""

    latest: RequestOutput | None = None
    error: Exception | None = None
    wakeup: trio.Event = field(default_factory=trio.Event)

    def put(self, output: RequestOutput) -> None:
        self.latest = output
        self.wakeup.set()

    def fail(self, error: Exception) -> None:
        self.error = error
        self.wakeup.set()

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        seen = None
        while True:
            await self.wakeup.wait()
            self.wakeup = trio.Event()
            if self.error is not None:
                raise self.error
            if self.latest is not None and self.latest is not seen:
                seen = self.latest
                yield seen
                if seen.finished:
                    return


@dataclass(frozen=True)
class _Arrival:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    delivery: Delivery
    arrival_time: float  # when the handler submitted it: queueing includes the inbox
    group: str  # the HTTP request it is one prompt of: admission is fair between groups


@dataclass(frozen=True)
class _Abort:
    request_id: str


class Serving:
    def __init__(
        self, engine: Engine, max_queue: int | None = None, metrics: Metrics | None = None
    ):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.max_queue = max_queue
        self.metrics = metrics or Metrics()
        self._send, self._inbox = trio.open_memory_channel[_Arrival | _Abort](math.inf)
        self._open: dict[str, Delivery] = {}  # every request a handler is waiting on
        self._queued: OrderedDict[str, deque[_Arrival]] = OrderedDict()  # by group, in turn
        self._num_queued = 0
        self._ids = itertools.count()
        self._pending: list[RequestOutput] = []  # produced by the last step, not yet delivered
        self.dead: str | None = None  # why the engine stopped serving, once it has
        self.died = trio.Event()  # set with `dead`: `nanoserve serve` exits then
        self.steps = 0
        self.num_waiting = 0  # in the inbox or the scheduler's queue
        self._arrivals_in_inbox = 0
        self.state: dict[str, int] = {}
        self._snapshot()

    # -- the handler side ---------------------------------------------------------------------

    @asynccontextmanager
    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, group: str | None = None
    ) -> AsyncIterator[AsyncIterator[RequestOutput]]:
        """Submit a request and iterate over its outputs (cumulative snapshots, the last one
        finished). Refusals raise here, before anything is queued. Leaving the block before the
        request finished (a disconnect cancels the handler) aborts it at the next step. The
        prompts of one HTTP request share a `group`."""
        request_id = str(next(self._ids))
        delivery = self._submit(request_id, prompt_token_ids, params, group or request_id)
        try:
            yield delivery.outputs()
        finally:
            self._open.pop(request_id, None)
            if delivery.latest is None or not delivery.latest.finished:  # failed or left early
                # Synchronous: an await here would raise at once inside a cancelled scope.
                self._send.send_nowait(_Abort(request_id))

    def _submit(
        self, request_id: str, prompt: list[int], params: SamplingParams, group: str
    ) -> Delivery:
        if self.dead is not None:
            raise EngineDead(f"the engine has stopped: {self.dead}")
        self.engine.check_request(prompt, params)
        if self.max_queue is not None and self.num_waiting >= self.max_queue:
            raise Overloaded(
                f"{self.num_waiting} requests are waiting (max queue {self.max_queue})"
            )
        delivery = Delivery()
        self._open[request_id] = delivery
        arrival = _Arrival(request_id, prompt, params, delivery, time.monotonic(), group)
        self._send.send_nowait(arrival)
        self._arrivals_in_inbox += 1
        self.num_waiting += 1  # counted now: a burst sees its own queue before the next turn
        return delivery

    # -- the engine task ----------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The engine task. Runs until cancelled; a step in flight always completes first."""
        # Everything alive now (weights, tokenizer, framework) lives as long as the server: keep it
        # out of the garbage collector's scans, which otherwise pause every thread for ~100 ms.
        gc.collect()
        gc.freeze()
        task_status.started()
        while True:
            if not self.engine.has_unfinished() and not self._pending and not self._queued:
                await self._idle()
            aborts = self._drain()
            for request_id in aborts:
                self._abort(request_id)
            self._admit()
            self._deliver()
            if self.engine.has_unfinished() and self.dead is None:
                await self._step()

    async def _idle(self) -> None:
        """Sleep on the inbox until a message comes; check the engine's health meanwhile."""
        while True:
            with trio.move_on_after(HEALTH_CHECK_S):
                self._handle(await self._inbox.receive())
                return
            if self.dead is None:
                try:
                    self.engine.check_health()
                except Exception as e:
                    log.error("engine health check failed: %s", e)
                    self._fail_all(f"{type(e).__name__}: {e}")

    def _drain(self) -> list[str]:
        aborts: list[str] = []
        while True:
            try:
                message = self._inbox.receive_nowait()
            except trio.WouldBlock:
                return aborts
            if isinstance(message, _Abort):
                aborts.append(message.request_id)
            else:
                self._handle(message)

    def _handle(self, message: _Arrival | _Abort) -> None:
        if isinstance(message, _Abort):
            self._abort(message.request_id)
            return
        self._arrivals_in_inbox -= 1
        if self.dead is not None:
            message.delivery.fail(EngineDead(f"the engine has stopped: {self.dead}"))
            return
        self._queued.setdefault(message.group, deque()).append(message)
        self._num_queued += 1

    def _admit(self) -> None:
        """Top up the engine's queue to the batch's free rows, one arrival per group in turn."""
        stats = self.engine.stats()
        room = self.engine.config.max_num_seqs - stats.running - stats.waiting
        while self._queued and room > 0:
            group, arrivals = self._queued.popitem(last=False)
            arrival = arrivals.popleft()
            if arrivals:
                self._queued[group] = arrivals  # to the back of the line
            self._num_queued -= 1
            room -= 1
            try:
                self.engine.add_request(
                    arrival.request_id, arrival.prompt_token_ids, arrival.params,
                    arrival.arrival_time,
                )  # fmt: skip
                self.metrics.on_arrival(len(arrival.prompt_token_ids))
            except Exception as e:  # a rejected arrival fails only its own caller
                arrival.delivery.fail(e)
        self._snapshot()

    def _abort(self, request_id: str) -> None:
        # Whatever the last step produced for it is moot: its caller has gone.
        self._pending = [o for o in self._pending if o.request_id != request_id]
        queued = self._unqueue(request_id)
        if self.engine.abort(request_id) is not None or queued:
            self.metrics.on_abort(request_id)
        self._snapshot()

    def _unqueue(self, request_id: str) -> bool:
        """Take an arrival out of the bridge's queue; whether it was there."""
        for group, arrivals in self._queued.items():
            for arrival in arrivals:
                if arrival.request_id == request_id:
                    arrivals.remove(arrival)
                    self._num_queued -= 1
                    if not arrivals:
                        del self._queued[group]
                    return True
        return False

    def _deliver(self) -> None:
        pending, self._pending = self._pending, []
        for output in pending:
            self.metrics.on_output(output)
            delivery = self._open.get(output.request_id)
            if delivery is not None:
                delivery.put(output)

    async def _step(self) -> None:
        try:
            outputs = await trio.to_thread.run_sync(self.engine.step, thread_name="engine-step")
        except Exception as e:
            log.exception("engine step failed")
            self._fail_all(f"{type(e).__name__}: {e}")
            return
        self.steps += 1
        self._pending.extend(outputs)
        self._snapshot()
        self.metrics.on_step(self.state)

    def _fail_all(self, reason: str) -> None:
        """A failed step, or a schedule that cannot progress: every open request fails, the
        engine's requests are aborted so their blocks come back, and new ones are refused."""
        self.dead = reason
        self.died.set()
        self.engine.abort_all()
        self._queued.clear()
        self._num_queued = 0
        for delivery in self._open.values():
            delivery.fail(RequestFailed(reason))
        self._pending.clear()
        self._snapshot()

    def _snapshot(self) -> None:
        """What /health and the queue limit read, written only by the engine task between steps."""
        stats = self.engine.stats()
        self.num_waiting = stats.waiting + self._num_queued + self._arrivals_in_inbox
        self.state = {
            "running": stats.running,
            "waiting": stats.waiting + self._num_queued,
            "free_blocks": stats.free_blocks,
            "total_blocks": stats.total_blocks,
            "steps": self.steps,
            "num_preemptions": stats.num_preemptions,
            "num_recomputed_tokens": stats.num_recomputed_tokens,
            "peak_running": stats.peak_running,
            "generation_tokens": stats.generation_tokens,
        }
        self.metrics.on_state(self.state)

    def close(self, reason: str = "the server is shutting down") -> None:
        """Fail every request still open (their handlers end cleanly); call at shutdown, after
        the handlers had their grace period."""
        for delivery in self._open.values():
            delivery.fail(ShuttingDown(reason))

    def health(self) -> dict[str, object]:
        return {
            "status": "ok" if self.dead is None else "dead",
            "reason": self.dead,
            "open_requests": len(self._open),
            **self.state,
        }
