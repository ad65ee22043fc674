"""The engine task: the one owner of the Engine (or of a pooling model's PoolingEngine, driven
the same way) in a server, run in the app's nursery.

Each turn drains the inbox (arrivals and aborts), applies aborts, admits, delivers, then awaits
one `engine.step` in a named thread: the only line that leaves the event loop. Admission is fair
between HTTP requests: each one's prompts wait here, and the engine's queue is topped up to the
batch's free rows round robin across requests; one request holds at most `group_rows` rows (all
but a sixteenth of max_num_seqs), so that a request arriving beside one of many prompts finds a
free row at once instead of waiting for a whole wave of them. With no work it sleeps on the
inbox, waking every HEALTH_CHECK_S to ask the engine whether it can still step (a
tensor-parallel worker may die while nothing runs). Owns the Engine, the open requests'
deliveries, the rows each request holds and the snapshot it publishes (`stats`).
"""

from __future__ import annotations

import gc
import logging
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import trio

from nanoserve.engine import (
    Admitted,
    Engine,
    PoolingEngine,
    PoolingInput,
    PoolingOutput,
    RequestOutput,
)
from nanoserve.server.metrics import Metrics
from nanoserve.server.stats import ServingStats

log = logging.getLogger(__name__)

HEALTH_CHECK_S = 1.0  # an idle engine task asks the engine this often whether it still works
# Batch rows (max_num_seqs) per this many that no one HTTP request may hold: kept for others.
RESERVED_ROW_SHARE = 16


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

    latest: RequestOutput | PoolingOutput | None = None
    error: Exception | None = None
    wakeup: trio.Event = field(default_factory=trio.Event)

    def put(self, output: RequestOutput | PoolingOutput) -> None:
        self.latest = output
        self.wakeup.set()

    def fail(self, error: Exception) -> None:
        self.error = error
        self.wakeup.set()

    async def outputs(self) -> AsyncIterator[RequestOutput | PoolingOutput]:
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
class Arrival:
    request_id: str
    admitted: Admitted | PoolingInput  # checked by the handler: added as it is
    delivery: Delivery
    arrival_time: float  # when the handler submitted it: queueing includes the inbox
    group: str  # the HTTP request it is one prompt of: admission is fair between groups


@dataclass(frozen=True)
class Abort:
    request_id: str


class EngineTask:
    def __init__(
        self,
        engine: Engine | PoolingEngine,
        inbox: trio.MemoryReceiveChannel[Arrival | Abort],
        metrics: Metrics,
    ):
        self.engine = engine
        self.metrics = metrics
        self._inbox = inbox
        self.received = 0  # arrivals taken from the inbox
        self._open: dict[str, Delivery] = {}  # requests taken in and not yet finished
        self._queued: OrderedDict[str, deque[Arrival]] = OrderedDict()  # by group, in turn
        self._num_queued = 0
        max_num_seqs = engine.config.max_num_seqs
        self.group_rows = max_num_seqs - max_num_seqs // RESERVED_ROW_SHARE
        self._rows: dict[str, int] = {}  # batch rows each group's admitted requests hold
        self._admitted: dict[str, tuple[str, int]] = {}  # request id -> (group, rows)
        # Produced by the last step, not yet delivered
        self._pending: list[RequestOutput | PoolingOutput] = []
        self.dead: str | None = None  # why the engine stopped serving, once it has
        self.died = trio.Event()  # set with `dead`: `nanoserve serve` exits then
        self.steps = 0
        self._prompt_tokens = 0  # admitted to the engine, n times each: the prefix hit rate's base
        self._publish()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Runs until cancelled; a step in flight always completes first."""
        # Everything alive now (weights, tokenizer, framework) lives as long as the server: keep it
        # out of the garbage collector's scans, which otherwise pause every thread for ~100 ms.
        gc.collect()
        gc.freeze()
        task_status.started()
        while True:
            if not self.engine.has_unfinished() and not self._pending and not self._queued:
                await self._idle()
            for request_id in self._drain():
                self._abort(request_id)
            self._admit()
            self._deliver()
            if self.engine.has_unfinished() and self.dead is None:
                await self._step()

    def close(self, reason: str = "the server is shutting down") -> None:
        """Fail every request still open or still in the inbox (their handlers end cleanly);
        call at shutdown, after the handlers had their grace period."""
        self._drain()
        for delivery in self._open.values():
            delivery.fail(ShuttingDown(reason))

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
        """Take every message in the inbox; returns the aborts."""
        aborts: list[str] = []
        while True:
            try:
                message = self._inbox.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                return aborts
            if isinstance(message, Abort):
                aborts.append(message.request_id)
            else:
                self._handle(message)

    def _handle(self, message: Arrival | Abort) -> None:
        if isinstance(message, Abort):
            self._abort(message.request_id)
            return
        self.received += 1
        if self.dead is not None:
            message.delivery.fail(EngineDead(f"the engine has stopped: {self.dead}"))
            return
        self._open[message.request_id] = message.delivery
        self._queued.setdefault(message.group, deque()).append(message)
        self._num_queued += 1

    def _admit(self) -> None:
        """Top up the engine's queue to the batch's free rows (a request's n completions take n),
        one arrival per group in turn, each group below its `group_rows`."""
        stats = self.engine.stats()
        room = self.engine.config.max_num_seqs - stats.running - stats.waiting
        while room > 0:
            group = next((g for g in self._queued if self._rows.get(g, 0) < self.group_rows), None)
            if group is None:
                break
            arrivals = self._queued.pop(group)
            arrival = arrivals.popleft()
            if arrivals:
                self._queued[group] = arrivals  # to the back of the line
            self._num_queued -= 1
            try:
                self._add(arrival)
            except Exception as e:  # a rejected arrival fails only its own caller
                del self._open[arrival.request_id]
                arrival.delivery.fail(e)
                continue
            n = arrival.admitted.params.n if isinstance(arrival.admitted, Admitted) else 1
            self.metrics.on_arrival(len(arrival.admitted.token_ids))
            self._prompt_tokens += n * len(arrival.admitted.token_ids)
            room -= n
            self._rows[group] = self._rows.get(group, 0) + n
            self._admitted[arrival.request_id] = (group, n)
        self._publish()

    def _add(self, arrival: Arrival) -> None:
        """Hand an arrival to the engine: a generation's to the Engine, an input to pool to the
        pooling engine (the server's routes send each engine only its own kind)."""
        engine, admitted, when = self.engine, arrival.admitted, arrival.arrival_time
        if isinstance(engine, PoolingEngine):
            assert isinstance(admitted, PoolingInput)
            engine.add_request(arrival.request_id, admitted, arrival_time=when)
        else:
            assert isinstance(admitted, Admitted)
            engine.add_request(arrival.request_id, admitted, arrival_time=when)

    def _release(self, request_id: str) -> None:
        """A request left the engine (finished or aborted): its group's rows are free."""
        group, rows = self._admitted.pop(request_id, (None, 0))
        if group is not None:
            self._rows[group] -= rows
            if not self._rows[group]:
                del self._rows[group]

    def _abort(self, request_id: str) -> None:
        # Whatever the last step produced for it is moot: its caller has gone.
        self._pending = [o for o in self._pending if o.request_id != request_id]
        self._open.pop(request_id, None)
        queued = self._unqueue(request_id)
        self._release(request_id)
        if self.engine.abort(request_id) is not None or queued:
            self.metrics.on_abort(request_id)
        self._publish()

    def _unqueue(self, request_id: str) -> bool:
        """Take an arrival out of the queue of those not yet admitted; whether it was there."""
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
                if output.finished:
                    del self._open[output.request_id]

    async def _step(self) -> None:
        try:
            outputs: list[RequestOutput] | list[PoolingOutput] = await trio.to_thread.run_sync(
                self.engine.step, thread_name="engine-step"
            )
        except Exception as e:
            log.exception("engine step failed")
            self._fail_all(f"{type(e).__name__}: {e}")
            return
        self.steps += 1
        for output in outputs:
            if output.finished:
                self._release(output.request_id)
        self._pending.extend(outputs)
        self._publish()
        self.metrics.on_step(self.stats)

    def _fail_all(self, reason: str) -> None:
        """A failed step, or a schedule that cannot progress: every open request fails, the
        engine's requests are aborted so their blocks come back, and new ones are refused."""
        self.dead = reason
        self.died.set()
        self.engine.abort_all()
        self._queued.clear()
        self._num_queued = 0
        self._rows.clear()
        self._admitted.clear()
        for delivery in self._open.values():
            delivery.fail(RequestFailed(reason))
        self._open.clear()
        self._pending.clear()
        self._publish()

    def _publish(self) -> None:
        """The snapshot /health, the queue limit and the metrics read, written only here."""
        s = self.engine.stats()
        self.stats = ServingStats(
            running=s.running,
            waiting=s.waiting + self._num_queued,
            free_blocks=s.free_blocks,
            total_blocks=s.total_blocks,
            steps=self.steps,
            num_preemptions=s.num_preemptions,
            num_recomputed_tokens=s.num_recomputed_tokens,
            peak_running=s.peak_running,
            generation_tokens=s.generation_tokens,
            prompt_tokens=self._prompt_tokens,
            prefix_hit_tokens=s.num_prefix_hit_tokens,
            spec_decode_num_drafts=s.spec_decode.num_drafts,
            spec_decode_num_draft_tokens=s.spec_decode.num_draft_tokens,
            spec_decode_num_accepted_tokens=s.spec_decode.num_accepted_tokens,
        )
        self.metrics.on_state(self.stats)
