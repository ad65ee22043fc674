"""What the engine reports about a request: snapshots (fresh lists every time, never changed
afterwards), safe to hand to another thread or task while the engine moves on. Shaped like vLLM's
`RequestOutput`, lists included; `output_of` takes one of a request's group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from nanoserve.engine.sampling import Logprob

if TYPE_CHECKING:
    from nanoserve.engine.request import Request


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


def output_of(group: list[Request]) -> RequestOutput:
    """A snapshot of a request: its `n` sequences (the group), as they stand."""
    first = group[0]
    return RequestOutput(
        request_id=first.group_id,
        prompt_token_ids=list(first.prompt_token_ids),
        prompt_logprobs=None if first.prompt_logprobs is None else list(first.prompt_logprobs),
        outputs=[_completion(r) for r in group],
        finished=all(r.is_finished for r in group),
        num_cached_tokens=first.num_cached_tokens,
        metrics=RequestMetrics(
            arrival_time=first.arrival_time,
            first_scheduled_time=first.first_scheduled_time,
            first_token_time=min(
                (r.first_token_time for r in group if r.first_token_time), default=None
            ),
            finished_time=max(r.finished_time for r in group if r.finished_time)
            if all(r.is_finished for r in group)
            else None,
            num_preemptions=sum(r.num_preemptions for r in group),
        ),
    )


def _completion(request: Request) -> CompletionOutput:
    return CompletionOutput(
        index=request.index,
        text=request.detokenizer.visible_text(),
        token_ids=list(request.output_token_ids),
        finish_reason=request.finish_reason,
        stop_reason=request.stop_reason,
        logprobs=list(request.logprobs) if request.params.logprobs is not None else None,
    )
