"""Continuous batching: which requests run in the next step, and with how many new tokens.

Owns the waiting queue (first come, first served; preempted requests go back to its front) and the
running list (in admission order). Each step every running decode gets its token first; then the
prefills (running ones, then admissions while the token budget, the sequence budget and the free
blocks above a watermark allow) take turns of at most `prefill_turn` tokens each, and what budget
is left goes to them again, oldest first. So a long prompt shares each step with the decodes and
with a later arrival's first chunk instead of holding them back for its whole length; a request
that scores its prompt takes at most `scoring_turn` tokens a step while other groups' requests
are running or waiting, so that their steps stay short however long that prompt. The later
requests of a group (n > 1) wait while its first one computes their shared prompt, and while it
scores it: the group's outputs carry the prompt's logprobs, which must be whole. A request
that cannot get its next block preempts the most recently admitted one, whose blocks are freed
and whose tokens are recomputed when it is admitted again. With speculative decoding a decode
also takes the slots of its draft (engine/spec/ngram.py) when they fit without preempting
anyone; after the step the engine gives back the rejected ones (`after_verify`). Blocks are the
KV cache manager's (engine/kv_manager.py): the scheduler asks it for them and never sees the
block pool.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from nanoserve.engine.inputs import Chunk
from nanoserve.engine.kv_manager import ComputedBlocks, KVCacheManager
from nanoserve.engine.request import Request, Status


class Proposer(Protocol):
    """Drafts for decoding requests (engine/spec/ngram.py, engine/spec/draft_model.py). `room`: the
    most draft tokens the request may take; `propose(request, room)`: a draft of at most
    `room` tokens. A proposer that `writes_cache` (a draft model's keys and values) proposes
    after the scheduler reserved the request's slots for its token and `room` draft tokens,
    into which alone it writes, and returns exactly `room` tokens."""

    writes_cache: bool

    def room(self, request: Request) -> int: ...
    def propose(self, request: Request, room: int) -> list[int]: ...


@dataclass(frozen=True)
class ScheduledRequest:
    """A request's part of one step: `num_new_tokens` tokens from position `start` on. A
    decode with a `draft` computes its last token and the draft (num_new_tokens = 1 + len)."""

    request: Request
    num_new_tokens: int
    start: int
    draft: tuple[int, ...] = ()

    @property
    def token_ids(self) -> list[int]:
        return self.request.token_ids + list(self.draft) if self.draft else self.request.token_ids

    @property
    def verifies(self) -> bool:
        """Every position's logits are wanted: the request's next token and the draft's check."""
        return bool(self.draft)

    @property
    def samples(self) -> bool:
        """The chunk reaches the request's last token: its logits give the next one."""
        return self.start + self.num_new_tokens == self.request.num_tokens + len(self.draft)

    def chunk(self) -> Chunk:
        """What the packer reads of it."""
        return Chunk(
            self.token_ids, self.start, self.num_new_tokens, self.request.block_table,
            self.samples, self.request.prompt_logprob_positions(self.start, self.num_new_tokens),
            self.request.params.prompt_logprobs or 0, self.verifies,
        )  # fmt: skip


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0  # tokens computed again after a preemption
    num_prefix_hit_tokens: int = 0
    peak_running: int = 0


@dataclass
class _Plan:
    """The step being planned: new tokens per request, in the order they were given, and the
    token budget left."""

    budget: int
    shared: bool  # requests of more than one group are running or waiting
    chunks: dict[Request, int] = field(default_factory=dict)
    drafts: dict[Request, tuple[int, ...]] = field(default_factory=dict)
    draft_rows: int = 1 << 30  # rows the drafts may still take
    preempted: bool = False

    def add(self, request: Request, num_new: int) -> None:
        self.chunks[request] = self.chunks.get(request, 0) + num_new
        self.budget -= num_new

    def drop(self, request: Request) -> None:
        self.budget += self.chunks.pop(request, 0)
        self.draft_rows += len(self.drafts.pop(request, ()))

    def has_prefill(self) -> bool:
        return any(n > 1 for n in self.chunks.values())


@dataclass
class Scheduler:
    kv_cache_manager: KVCacheManager
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool = True
    # Most tokens one prefill takes in a step before every other prefill has had its turn
    # (default: half the budget); 0 or less means the default.
    prefill_turn: int = 0
    # Most prompt positions a request that scores its prompt computes in a step while requests
    # of other groups are running or waiting: each is a row of vocabulary-wide logits, and the
    # steps of those others should not grow with the length of the prompt being scored.
    scoring_turn: int = 256
    # Speculative decoding: a draft for a decoding request (engine/spec/ngram.py), or None.
    proposer: Proposer | None = None
    # The most decode rows (decodes and drafts) of a step with drafts: the rows whose results
    # do not depend on how many there are, within the one-call C step (model_runner's
    # `verify_rows`); None: any number.
    max_decode_rows: int | None = None
    waiting: deque[Request] = field(default_factory=deque)
    running: list[Request] = field(default_factory=list)
    stats: SchedulerStats = field(default_factory=SchedulerStats)

    def __post_init__(self) -> None:
        if self.prefill_turn <= 0:
            self.prefill_turn = max(1, self.max_num_batched_tokens // 2)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledRequest]:
        plan = _Plan(self.max_num_batched_tokens, self._shared())
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        if self.max_decode_rows is not None:
            plan.draft_rows = self.max_decode_rows - len(decodes)
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for request in decodes:
            if (
                request.status is Status.RUNNING
                and plan.budget > 0
                and not self._speculate(request, plan)
            ):
                self._take(request, 1, plan)
        for request in prefills:
            if request.status is Status.RUNNING and plan.budget > 0:
                wanted = request.num_tokens - request.num_computed_tokens
                num_new = self._chunk(request, wanted, plan)
                if num_new > 0:
                    self._take(request, num_new, plan)
        if not plan.preempted:
            self._admit(plan)
        self._top_up(plan)
        self.stats.peak_running = max(self.stats.peak_running, len(self.running))
        scheduled = []
        for request, num_new in plan.chunks.items():
            self._count_recomputed(request, num_new)
            draft = plan.drafts.get(request, ())
            scheduled.append(ScheduledRequest(request, num_new, request.num_computed_tokens, draft))
        # Decodes first, as packed (a verification is decode rows).
        scheduled.sort(key=lambda item: item.num_new_tokens > 1 and not item.verifies)
        return scheduled

    def _speculate(self, request: Request, plan: _Plan) -> bool:
        """Whether a decode was given its token and a draft: only where the draft's slots fit in
        the budget and the free blocks (a draft never preempts)."""
        proposer = self.proposer
        if proposer is None:
            return False
        room = min(plan.budget - 1, plan.draft_rows, proposer.room(request))
        if room <= 0:
            return False
        if proposer.writes_cache:  # the draft model writes the slots it is given, and only them
            if not self._allocate(request, 1 + room):
                return False
            draft = proposer.propose(request, room)
            assert len(draft) == room, "a proposer that writes the cache fills its room"
        else:
            draft = proposer.propose(request, room)
            if not draft or not self._allocate(request, 1 + len(draft)):
                return False
        plan.add(request, 1 + len(draft))
        plan.drafts[request] = tuple(draft)
        plan.draft_rows -= len(draft)
        return True

    def _take(self, request: Request, num_new: int, plan: _Plan) -> None:
        """Give a running request `num_new` tokens, preempting the most recently admitted
        requests (itself last) until its blocks fit."""
        while not self._allocate(request, num_new):
            plan.preempted = True
            victim = self.running.pop()
            plan.drop(victim)
            self._preempt(victim)
            if victim is request:
                return
        plan.add(request, num_new)

    def _admit(self, plan: _Plan) -> None:
        prefilling = {r.group_id for r in self.running if r.in_prefill}
        scoring = {r.group_id for r in self.running if r.scores_prompt}
        i = 0
        while i < len(self.waiting) and plan.budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[i]
            if request.group_id in scoring:
                i += 1  # the group's output carries the prompt's logprobs: none before they are
                continue
            computed, num_cached = self.kv_cache_manager.get_computed_blocks(request)
            if request.group_id in prefilling and num_cached < self._shareable_prompt_tokens(
                request
            ):
                i += 1  # a sibling is computing the shared prompt: wait, then reuse its blocks
                continue
            num_new = self._chunk(request, request.num_tokens - num_cached, plan)
            # Beside running requests an admission must leave the watermark's blocks free for
            # them to grow into; an admission to an empty batch may take the whole pool.
            if num_new == 0 or not self._allocate(request, num_new, computed, bool(self.running)):
                break
            del self.waiting[i]
            self._start(request, num_cached)
            plan.add(request, num_new)
            if request.in_prefill:
                prefilling.add(request.group_id)
            if request.scores_prompt:
                scoring.add(request.group_id)

    def _top_up(self, plan: _Plan) -> None:
        """Budget that every prefill's turn left over goes to the prefills of the step again,
        in the order they were given (decodes first, then oldest), as far as the free blocks
        above the watermark go (no preemption for more than a turn), and a scoring request's to
        its `scoring_turn` beside other groups."""
        for request, num_new in list(plan.chunks.items()):
            wanted = request.num_tokens - request.num_computed_tokens
            extra = min(wanted, self._most(request, plan)) - num_new
            extra = min(extra, plan.budget)
            if extra > 0 and self._allocate(request, num_new + extra, watermark=True):
                plan.add(request, extra)

    def _allocate(
        self,
        request: Request,
        num_new: int,
        computed: ComputedBlocks | None = None,
        watermark: bool = False,
    ) -> bool:
        """Whether the request got the blocks for its cached prefix and `num_new` more tokens
        (above the watermark, with `watermark`); when not, nothing was taken."""
        kv = self.kv_cache_manager
        return kv.allocate_slots(request, num_new, computed, watermark) is not None

    def _shareable_prompt_tokens(self, request: Request) -> int:
        bs = self.kv_cache_manager.block_size
        return (request.num_prompt_tokens - 1) // bs * bs

    def _chunk(self, request: Request, wanted: int, plan: _Plan) -> int:
        """How many of `wanted` tokens a prefill takes in its turn. Without chunked prefill one
        prompt per step may run whole past the budget (beside the decodes): long prompts never
        wait for an empty batch, and the decodes pay for them with a slow step."""
        if self.enable_chunked_prefill:
            return min(wanted, plan.budget, self.prefill_turn, self._most(request, plan))
        if wanted <= plan.budget or not plan.has_prefill():
            return wanted
        return 0

    def _most(self, request: Request, plan: _Plan) -> int:
        """The most new tokens the request may take in the step (with chunked prefill)."""
        if plan.shared and request.scores_prompt:
            return self.scoring_turn
        return self.max_num_batched_tokens

    def _shared(self) -> bool:
        groups = set()
        for request in itertools.chain(self.running, self.waiting):
            groups.add(request.group_id)
            if len(groups) > 1:
                return True
        return False

    def _start(self, request: Request, cached: int) -> None:
        request.num_computed_tokens = cached
        request.status = Status.RUNNING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
            request.num_cached_tokens = cached
        self.stats.num_prefix_hit_tokens += cached
        self.running.append(request)

    def _count_recomputed(self, request: Request, num_new: int) -> None:
        # Positions below the high-water mark were computed once already, before a preemption.
        redo = min(request.num_computed_tokens + num_new, request.high_water)
        self.stats.num_recomputed_tokens += max(0, redo - request.num_computed_tokens)

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.high_water = max(request.high_water, request.num_computed_tokens)
        request.num_computed_tokens = 0
        request.status = Status.WAITING
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)

    def after_step(self, batch: list[ScheduledRequest]) -> None:
        """Account the computed tokens and publish newly filled blocks to the prefix cache;
        verifications wait for `after_verify`, once the engine knows what it kept."""
        for item in batch:
            if not item.verifies:
                self._computed(item.request, item.num_new_tokens)

    def after_verify(self, item: ScheduledRequest, num_kept: int) -> None:
        """A verification kept the cache of its first `num_kept` positions (the last token and
        the accepted draft): the rejected positions' blocks go back to the pool."""
        self.kv_cache_manager.trim(item.request, item.start + num_kept)
        self._computed(item.request, num_kept)

    def _computed(self, request: Request, num_new: int) -> None:
        request.num_computed_tokens += num_new
        self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)

    def remove(self, request: Request) -> None:
        """Take a finished or aborted request out of the queues and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_cache_manager.free(request)
