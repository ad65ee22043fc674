"""The Trio bridge between HTTP handlers and the synchronous Engine: the handlers' side.

Handlers never touch the Engine. `Serving.admit` checks a request's prompts against the engine's
fixed limits (engine/admission.py: the one check, its constraint compiled once, in a worker
thread); `Serving.generate` puts an admitted prompt in the inbox (a Trio memory channel) of the
engine task (engine_task.py, the Engine's one owner, started in the app's nursery through
`Serving.run`) and reads its deliveries;
leaving early, for any reason, queues an abort. A pooling engine's inputs (embeddings, a
cross-encoder's pairs) take the same inbox, queue limit and turns (`Serving.pool`). The
engine's fixed facts (`tokenizer`, `max_model_len`) are handed to the server here, at start-up.
Owns the handlers' count of the requests they have open.
"""

from __future__ import annotations

import itertools
import math
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict
from typing import cast

import trio

from nanoserve.engine import (
    Admitted,
    Engine,
    PoolingEngine,
    PoolingInput,
    PoolingOutput,
    RequestOutput,
    RequestRejected,
    SamplingParams,
)
from nanoserve.server.engine_task import (
    Abort,
    Arrival,
    Delivery,
    EngineDead,
    EngineTask,
    RequestFailed,
    ShuttingDown,
)
from nanoserve.server.metrics import Metrics

__all__ = ["EngineDead", "Overloaded", "RequestFailed", "Serving", "ShuttingDown"]


class Overloaded(Exception):
    """The waiting queue is full; try again later (HTTP 503 with Retry-After)."""

    retry_after = 1


class Serving:
    def __init__(
        self,
        engine: Engine | PoolingEngine,
        max_queue: int | None = None,
        metrics: Metrics | None = None,
    ):
        self.tokenizer = engine.tokenizer
        # What the model serves: generation, or pooling (its engine, for the pooling routes to
        # admit with: it reads fixed settings only, so any thread may call its admit).
        self.pooling = engine if isinstance(engine, PoolingEngine) else None
        self.max_model_len = engine.max_model_len
        self.reasoning_parser = engine.config.reasoning_parser  # None: from the chat template
        self.thinking_token_budget = engine.config.thinking_token_budget  # a request's wins
        self.max_queue = max_queue
        self.block_size = engine.config.block_size
        self.max_num_seqs = engine.config.max_num_seqs
        self.metrics = metrics or Metrics()
        self.metrics.on_start(
            engine.config.block_size,
            engine.num_blocks,
            engine.config.kv_cache_dtype,
            engine.kv_cache_bytes,
        )
        if isinstance(engine, Engine):
            self._admit = engine.admit  # reads fixed settings only: any thread may call it
            self._compile = engine.compile_constraint  # thread-safe; milliseconds to seconds
        self._send, inbox = trio.open_memory_channel[Arrival | Abort](math.inf)
        self.task = EngineTask(engine, inbox, self.metrics)
        self.run = self.task.run  # the engine task, for the app's nursery
        self.close = self.task.close  # at shutdown: fail what is still open
        self._ids = itertools.count()
        self._sent = 0  # arrivals put in the inbox (the task counts those it took)
        self._open = 0  # generate blocks entered and not yet left

    @property
    def dead(self) -> str | None:
        return self.task.dead

    @property
    def died(self) -> trio.Event:
        return self.task.died

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: in the inbox, waiting their turn, or in the engine's queue."""
        return self._sent - self.task.received + self.task.stats.waiting

    async def admit(self, prompts: list[list[int]], params: SamplingParams) -> list[Admitted]:
        """The prompts of one HTTP request checked (RequestRejected, naming the field, before any
        is queued); their constraint compiled once, in a worker thread (cached by constraint)."""
        if self.pooling is not None:
            raise RequestRejected(
                "this server runs an embedding model (--runner pooling): it serves "
                "/v1/embeddings (and /v1/rerank, /v1/score for a cross-encoder), not generation",
                "model",
            )
        grammar = None
        if params.structured_outputs is not None:
            grammar = await trio.to_thread.run_sync(self._compile, params, thread_name="grammar")
        return [self._admit(prompt, params, grammar) for prompt in prompts]

    @asynccontextmanager
    async def generate(
        self, admitted: Admitted, group: str | None = None
    ) -> AsyncIterator[AsyncIterator[RequestOutput]]:
        """Submit an admitted request and iterate over its outputs (cumulative snapshots, the
        last one finished). A full queue or a dead engine raises here, before anything is
        queued. Leaving the block before the request finished (a disconnect cancels the handler)
        aborts it at the next step. The prompts of one HTTP request share a `group`: they take
        turns with other requests."""
        request_id = str(next(self._ids))
        delivery = self._submit(request_id, admitted, group or request_id)
        self._open += 1
        try:
            yield cast(AsyncIterator[RequestOutput], delivery.outputs())
        finally:
            self._open -= 1
            if delivery.latest is None or not delivery.latest.finished:  # failed or left early
                # Synchronous: an await here would raise at once inside a cancelled scope.
                self._send.send_nowait(Abort(request_id))

    async def pool(self, inputs: list[PoolingInput]) -> list[PoolingOutput]:
        """Submit one HTTP request's inputs to the pooling engine (they share a group: they take
        turns with other requests) and wait for them all; leaving early (a disconnect cancels
        the handler) or a refusal of a later input aborts those already queued."""
        group = uuid.uuid4().hex
        submitted: list[tuple[str, Delivery]] = []
        self._open += 1
        try:
            for one in inputs:
                request_id = str(next(self._ids))
                submitted.append((request_id, self._submit(request_id, one, group)))
            results = []
            for _, delivery in submitted:
                async for output in delivery.outputs():
                    assert isinstance(output, PoolingOutput)
                    results.append(output)
            return results
        finally:
            self._open -= 1
            for request_id, delivery in submitted:
                if delivery.latest is None:  # failed or left early
                    self._send.send_nowait(Abort(request_id))

    def _submit(self, request_id: str, admitted: Admitted | PoolingInput, group: str) -> Delivery:
        if self.dead is not None:
            raise EngineDead(f"the engine has stopped: {self.dead}")
        if self.max_queue is not None and self.num_waiting >= self.max_queue:
            raise Overloaded(
                f"{self.num_waiting} requests are waiting (max queue {self.max_queue})"
            )
        delivery = Delivery()
        self._send.send_nowait(Arrival(request_id, admitted, delivery, time.monotonic(), group))
        self._sent += 1  # counted now: a burst sees its own queue before the next turn
        return delivery

    def health(self) -> dict[str, object]:
        return {
            "status": "ok" if self.dead is None else "dead",
            "reason": self.dead,
            "open_requests": self._open,
            **asdict(self.task.stats),
        }
