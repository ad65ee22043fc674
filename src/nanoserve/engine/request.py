"""One sequence being generated: its tokens, its place in the cache, and how it ends.

A request with `n` > 1 is `n` of these sharing a `group_id`; each is scheduled on its own and the
later ones find the first one's prompt blocks in the prefix cache. Owned by the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from nanoserve.engine.sampling import Logprob, SamplingParams
from nanoserve.engine.thinking import Thinking
from nanoserve.tokenizer import IncrementalDetokenizer


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    group_id: str
    index: int  # which of the group's n completions
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    output_limit: int  # the most tokens it may generate: params.max_tokens, or its default
    detokenizer: IncrementalDetokenizer
    status: Status = Status.WAITING
    token_ids: list[int] = field(default_factory=list)  # prompt, then output
    num_computed_tokens: int = 0  # tokens whose keys and values are in the cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chain hashes of full blocks
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    num_preemptions: int = 0
    high_water: int = 0  # most tokens ever in the cache at once (preemption drops them)
    stop_token_ids: frozenset[int] = field(init=False, default=frozenset())  # from params
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    # Entry i: prompt token i's logprob and alternatives (None for the first token); filled chunk
    # by chunk as the prompt is computed. Only the first request of a group computes them.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: str | int | None = None  # the stop string or token that ended it
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Structured outputs: the llguidance matcher, advanced with each output token. It depends on
    # the output tokens alone, so a preemption (which recomputes only the cache) keeps it.
    matcher: Any = None
    # A reasoning model's thinking, where the engine keeps a budget or defers the grammar until
    # it ends (engine/thinking.py); like the matcher, it depends on the output tokens alone.
    thinking: Thinking | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.stop_token_ids = frozenset(self.params.stop_token_ids)  # checked at every token
        if self.params.prompt_logprobs is not None and self.index == 0:
            self.prompt_logprobs = [None]

    def prompt_logprob_positions(self, start: int, num_new: int) -> range:
        """Positions of a chunk [start, start + num_new) whose logits give prompt logprobs not
        yet recorded: position p predicts prompt token p + 1 (recomputed positions, after a
        preemption, are not recorded twice)."""
        if self.prompt_logprobs is None:
            return range(0)
        first = max(start, len(self.prompt_logprobs) - 1)
        return range(first, min(start + num_new, self.num_prompt_tokens - 1))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def scores_prompt(self) -> bool:
        """Prompt logprobs are asked for and not all recorded yet (a group's first request)."""
        return self.prompt_logprobs is not None and (
            len(self.prompt_logprobs) < self.num_prompt_tokens
        )

    @property
    def in_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def finish(self, reason: str, stop_reason: str | int | None = None) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.finished_time = time.monotonic()
        self.detokenizer.finish()  # release a held-back tail
