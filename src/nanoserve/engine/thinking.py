"""Thinking: a reasoning model's `<think>…</think>` followed by the engine, token by token, for
the two things only the engine can do: a thinking budget (vLLM's `thinking_token_budget`: once
the thinking has taken that many tokens, the end tag is forced, then the model answers) and a
constraint deferred to the answer (the grammar's matcher starts after the end tag, so that a
thinking model thinks first, then writes what the constraint allows).

A request's `Thinking` is in one of three phases: before (nothing yet: the output may open with
the start tag), thinking, answering. Before, a deferred grammar's mask applies with the start
tag's first token allowed beside it: the model either thinks or answers within the grammar from
its first token. A tag of several tokens is forced to its end once its first token is out. A
forced token is the sampler's answer for its row, whatever the penalties, biases and masks.
The state depends on the output tokens alone, so, like a matcher, it survives a preemption.
Owned by its request.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


@dataclass(frozen=True)
class ThinkingParams:
    """What the engine needs to follow a request's thinking. `start_ids`, `end_ids`: the tokens
    of the start and end tags (`<think>`, `</think>`); `started`: the prompt ends inside an open
    thinking (DeepSeek-R1's templates end it with `<think>`), so the output starts in it;
    `budget`: the most tokens the thinking may take before the end tag is forced (None: no
    limit)."""

    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    started: bool = False
    budget: int | None = None

    def valid(self) -> bool:
        tags = (self.start_ids, self.end_ids)
        return (
            all(len(tag) > 0 and all(_token(t) for t in tag) for tag in tags)
            and isinstance(self.started, bool)
            and (self.budget is None or _token(self.budget))
        )


def _token(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


class Phase(Enum):
    BEFORE = "before"
    THINKING = "thinking"
    ANSWER = "answer"


class Thinking:
    """One request's place in its thinking, advanced with each output token."""

    def __init__(self, params: ThinkingParams):
        self.params = params
        self.phase = Phase.THINKING if params.started else Phase.BEFORE
        self.spent = 0  # tokens of thinking so far (a forced tag's are not counted)
        self.forced: list[int] = []  # the rest of a tag, forced one token a step
        self._closing = False  # the tag being forced is the end tag
        self._tail: list[int] = []  # the thinking's last tokens: the model may write the end tag
        self._check_budget()

    @property
    def forced_token(self) -> int | None:
        return self.forced[0] if self.forced else None

    def grammar(self, matcher: Any) -> tuple[Any, int | None]:
        """The matcher whose mask applies to the next token (None: no mask), and a token allowed
        beside its mask: the start tag's first, before anything is written."""
        if self.phase is Phase.ANSWER:
            return matcher, None
        if self.phase is Phase.BEFORE:
            return matcher, self.params.start_ids[0]
        return None, None

    def append(self, token: int) -> bool:
        """Follow one output token; True if it belongs to the answer (a deferred grammar's
        matcher consumes it)."""
        if self.phase is Phase.ANSWER:
            return True
        if self.forced:
            self.forced.pop(0)  # the sampler gave it
            if not self.forced and self._closing:
                self.phase = Phase.ANSWER
            self._check_budget()
            return False
        if self.phase is Phase.BEFORE:
            if token != self.params.start_ids[0]:
                self.phase = Phase.ANSWER  # no thinking: this token is the answer's first
                return True
            self.phase = Phase.THINKING
            self.forced = list(self.params.start_ids[1:])
            self._check_budget()
            return False
        end = list(self.params.end_ids)
        self.spent += 1
        self._tail = (self._tail + [token])[-len(end) :]
        if self._tail == end:
            self.phase = Phase.ANSWER  # the model ended its thinking itself
        else:
            self._check_budget()
        return False

    def _check_budget(self) -> None:
        """The budget spent while thinking: force the end tag (its rest, where the thinking
        already ends with its first tokens)."""
        budget = self.params.budget
        if self.phase is not Phase.THINKING or self.forced or budget is None:
            return
        if self.spent < budget:
            return
        end = list(self.params.end_ids)
        begun = next((k for k in range(len(end) - 1, 0, -1) if self._tail[-k:] == end[:k]), 0)
        self.forced, self._closing = end[begun:], True


def thinking_of(given: ThinkingParams | None, constrained: bool) -> Thinking | None:
    """A request's Thinking, where the engine has something to do with it: a budget to keep, or
    a constraint (`constrained`) deferred to the answer."""
    if given is None or (given.budget is None and not constrained):
        return None
    return Thinking(given)
