"""What the engine reports about a request: snapshots (fresh lists every time, never changed
afterwards), safe to hand to another thread or task while the engine moves on. Shaped like vLLM's
`RequestOutput`, lists included.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoserve.engine.sampling import Logprob


@dataclass(frozen=True)
class CompletionOutput:
    index: int
    text: str  # finished: the whole text; running: what is safe to show (IncrementalDetokenizer)
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    stop_reason: str | int | None = None
    logprobs: list[dict[int, Logprob]] | None = None


@dataclass(frozen=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    # Entry i: prompt token i's logprob and the top alternatives; None for the first token. Whole
    # once the prompt is computed (before the first output token); None unless asked for.
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
