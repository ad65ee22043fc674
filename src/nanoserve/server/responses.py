"""OpenAI response bodies from the engine's cumulative snapshots: a unary response, or the
per-choice delta chunks of a stream (with logprobs in each API's shape): the base, and chat's
(legacy completions' are in completion_format.py). One `ResponseFormat` per request owns what
that request's stream has sent so far; nothing else.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from nanoserve.engine import WHOLE_VOCAB, CompletionOutput, Logprob, RequestOutput, SamplingParams
from nanoserve.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    FunctionCall,
    PromptLogprob,
    PromptTokensDetails,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    UsageInfo,
)
from nanoserve.server.reasoning import Reasoning
from nanoserve.server.tools import ToolSyntax
from nanoserve.tokenizer import Tokenizer


class ResponseFormat:
    """Turns one request's cumulative snapshots into OpenAI bodies: a unary response, or stream
    chunks carrying per-choice deltas. Choice `index` is prompt_index * n + completion index."""

    def __init__(self, tokenizer: Tokenizer, request_id: str, model: str, params: SamplingParams):
        self.tok = tokenizer
        self.id = request_id
        self.model = model
        self.n = params.n
        self.num_logprobs = params.logprobs
        self.created = int(time.time())
        self.prompt_tokens = 0
        self.cached_tokens: dict[int, int] = {}  # per prompt: tokens from the prefix cache
        self.sent_text: dict[int, str] = {}
        self.sent_tokens: dict[int, int] = {}
        self.finished: set[int] = set()
        self.token_name = tokenizer.token_text  # how logprobs name a token
        self.prompt_ids: list[list[int]] | None = None  # each prompt's, when they are returned

    def name_tokens_by_id(self) -> None:
        """vLLM's return_tokens_as_token_ids: logprobs name each token "token_id:N", which a
        client can map back even where a token's text is not valid UTF-8 on its own."""
        self.token_name = _by_id

    def return_token_ids(self, prompts: list[list[int]]) -> None:
        """vLLM's return_token_ids: the prompts' token ids and each choice's (in a stream, the
        tokens since the choice's last chunk), which a client can use without tokenizing."""
        self.prompt_ids = prompts

    def _new_ids(self, c: CompletionOutput, start: int) -> list[int] | None:
        return None if self.prompt_ids is None else c.token_ids[start:]

    def _vllm_entries(self, entry: dict[int, Logprob]) -> dict[int, PromptLogprob]:
        return {
            k: PromptLogprob(logprob=v.logprob, rank=v.rank, decoded_token=self.token_name(k))
            for k, v in entry.items()
        }

    def opening(self, num_prompts: int) -> list[BaseModel]:
        return []

    def chunks(self, prompt_index: int, out: RequestOutput) -> list[BaseModel]:
        self.cached_tokens[prompt_index] = out.num_cached_tokens
        result = []
        for c in out.outputs:
            index = prompt_index * self.n + c.index
            if index in self.finished:
                continue
            text, start = self.sent_text.get(index, ""), self.sent_tokens.get(index, 0)
            delta = c.text[len(text) :]
            new_tokens = len(c.token_ids) - start
            if delta or c.finish_reason is not None or (new_tokens and c.logprobs is not None):
                result.append(self.chunk(index, c, delta, start))
                self.sent_text[index], self.sent_tokens[index] = c.text, len(c.token_ids)
            if c.finish_reason is not None:
                self.finished.add(index)
        return result

    def chunk(self, index: int, c: CompletionOutput, delta: str, start: int) -> BaseModel:
        raise NotImplementedError

    def response(self, finals: Sequence[RequestOutput]) -> BaseModel:
        raise NotImplementedError

    def usage_chunk(self) -> BaseModel:
        raise NotImplementedError

    @property
    def _top_n(self) -> float:
        """The rank up to which an entry is an alternative (-1 asked for them all)."""
        return math.inf if self.num_logprobs == WHOLE_VOCAB else self.num_logprobs or 0

    def usage(self, completion_tokens: int) -> UsageInfo:
        total = self.prompt_tokens + completion_tokens
        return UsageInfo(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=total,
            prompt_tokens_details=PromptTokensDetails(
                cached_tokens=sum(self.cached_tokens.values())
            ),
        )

    def streamed_usage(self) -> UsageInfo:
        return self.usage(sum(self.sent_tokens.values()))


@dataclass(frozen=True)
class ToolPlan:
    """The tools a chat request offered: how their calls look, and their names. `required`: a
    call was forced (tool_choice "required" or a named function), so the whole output is calls:
    none of it is content, even cut short by max_tokens before a call is complete."""

    syntax: ToolSyntax
    names: frozenset[str]
    required: bool = False


@dataclass
class _Sent:
    """What a streamed choice has sent of its thinking, its content and its tool calls."""

    reasoning_sent: int = 0  # characters of the thinking sent
    content_sent: int = 0  # characters of the answer sent as content
    ids: list[str] = field(default_factory=list)


class ChatFormat(ResponseFormat):
    """Chat completions. With a reasoning parser, each choice's thinking is `reasoning_content`
    (and `reasoning`, vLLM's newer name), apart from the answer, which alone is content and is
    read for tool calls. With tools, the answer is read for calls: before the first one it is
    content; each complete call becomes a `tool_calls` entry (streamed: its id and name, then its
    arguments), and the choice ends with finish_reason "tool_calls". When a call was required,
    the answer is never content: a call cut short is no call, and no markup."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        request_id: str,
        model: str,
        params: SamplingParams,
        tools: ToolPlan | None = None,
        reasoning: Reasoning | None = None,
    ):
        super().__init__(tokenizer, request_id, model, params)
        self.tools = tools
        self.reasoning = reasoning
        self.sent: dict[int, _Sent] = {}
        self.prompt_logprobs = params.prompt_logprobs is not None  # vLLM's, unary only

    def opening(self, num_prompts: int) -> list[BaseModel]:
        ids = None if self.prompt_ids is None else self.prompt_ids[0]  # in each choice's, as vLLM
        return [
            self._chunk(
                [ChatChunkChoice(index=i, delta={"role": "assistant", "content": ""})],
                prompt_token_ids=ids,
            )
            for i in range(num_prompts * self.n)
        ]

    def chunks(self, prompt_index: int, out: RequestOutput) -> list[BaseModel]:
        if self.tools is None and self.reasoning is None:
            return super().chunks(prompt_index, out)
        self.cached_tokens[prompt_index] = out.num_cached_tokens
        result = []
        for c in out.outputs:
            index = prompt_index * self.n + c.index
            if index not in self.finished:
                result += self._read_chunks(index, c)
        return result

    def _read_chunks(self, index: int, c: CompletionOutput) -> list[BaseModel]:
        """A choice's new chunks, its text read for thinking and calls: each part is sent as
        far as it can no longer change."""
        state = self.sent.setdefault(index, _Sent())
        done = c.finish_reason is not None
        answer = c.text
        deltas: list[dict[str, Any]] = []
        if self.reasoning is not None:
            split = self.reasoning.split(c.text, final=done, cut=c.finish_reason == "length")
            if len(split.reasoning) > state.reasoning_sent:
                new = split.reasoning[state.reasoning_sent :]
                deltas.append({"reasoning_content": new, "reasoning": new})
                state.reasoning_sent = len(split.reasoning)
            answer = split.content
        if self.tools is not None:
            deltas += self._call_deltas(state, answer, done, self.tools)
        elif len(answer) > state.content_sent:
            deltas.append({"content": answer[state.content_sent :]})
            state.content_sent = len(answer)
        start = self.sent_tokens.get(index, 0)
        if done:
            self.finished.add(index)
            deltas.append({})
        result = []
        for j, delta in enumerate(deltas):
            last = done and j == len(deltas) - 1
            choice = ChatChunkChoice(
                index=index,
                delta=delta,
                logprobs=self._logprobs(c, start) if j == 0 else None,
                finish_reason=_finish(c, bool(state.ids)) if last else None,
                stop_reason=c.stop_reason if last else None,
                token_ids=self._new_ids(c, start) if j == 0 else None,
            )
            result.append(self._chunk([choice]))
        if result:
            self.sent_tokens[index] = len(c.token_ids)
        return result

    def _call_deltas(
        self, state: _Sent, text: str, done: bool, tools: ToolPlan
    ) -> list[dict[str, Any]]:
        """The answer's new content (up to where a call may begin) and its new complete calls.
        Whitespace before a call is no content (the unary answer strips it): it waits for what
        follows it."""
        first, calls = tools.syntax.split(text, set(tools.names))
        if first is None and done:
            end = len(text)
        else:
            end = len(text[: tools.syntax.may_start(text) if first is None else first].rstrip())
        deltas: list[dict[str, Any]] = []
        if end > state.content_sent and not state.ids and not tools.required:
            deltas.append({"content": text[state.content_sent : end]})
            state.content_sent = end
        for k, call in enumerate(calls[len(state.ids) :], start=len(state.ids)):
            state.ids.append(tools.syntax.call_id())
            deltas.append(
                {
                    "tool_calls": [
                        {
                            "index": k,
                            "id": state.ids[k],
                            "type": "function",
                            "function": {"name": call["name"], "arguments": ""},
                        }
                    ]
                }
            )
            deltas.append(
                {"tool_calls": [{"index": k, "function": {"arguments": call["arguments"]}}]}
            )
        return deltas

    def chunk(self, index: int, c: CompletionOutput, delta: str, start: int) -> BaseModel:
        choice = ChatChunkChoice(
            index=index,
            delta={"content": delta} if delta else {},
            logprobs=self._logprobs(c, start),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            token_ids=self._new_ids(c, start),
        )
        return self._chunk([choice])

    def response(self, finals: Sequence[RequestOutput]) -> BaseModel:
        (out,) = finals
        self.cached_tokens = {0: out.num_cached_tokens}
        choices = []
        for c in out.outputs:
            message = self._message(c.text, c.finish_reason == "length")
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=message,
                    logprobs=self._logprobs(c, 0),
                    finish_reason=_finish(c, bool(message.tool_calls)),
                    stop_reason=c.stop_reason,
                    token_ids=self._new_ids(c, 0),
                )
            )
        usage = self.usage(sum(len(c.token_ids) for c in out.outputs))
        scored = None
        if self.prompt_logprobs and out.prompt_logprobs is not None:
            scored = [None if e is None else self._vllm_entries(e) for e in out.prompt_logprobs]
        prompt_ids = None if self.prompt_ids is None else out.prompt_token_ids
        return ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage,
            prompt_logprobs=scored, prompt_token_ids=prompt_ids,
        )  # fmt: skip

    def _message(self, text: str, cut: bool = False) -> ChatMessageOut:
        """A finished choice's message: its thinking, its content and its calls (`cut`: it
        finished for its length)."""
        reasoning: str | None = None
        content: str | None = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.answer(text, cut)
        calls = []
        tools = self.tools
        if tools is not None and content is not None:
            content, found = tools.syntax.parse(content, set(tools.names))
            calls = [ToolCall(id=tools.syntax.call_id(), function=FunctionCall(**call))
                     for call in found]  # fmt: skip
        if tools is not None and tools.required:
            content = None
        return ChatMessageOut(
            content=content, reasoning_content=reasoning, reasoning=reasoning, tool_calls=calls
        )

    def usage_chunk(self) -> BaseModel:
        return self._chunk([], self.streamed_usage())

    def _chunk(
        self,
        choices: list[ChatChunkChoice],
        usage: UsageInfo | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> BaseModel:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage,
            prompt_token_ids=prompt_token_ids,
        )  # fmt: skip

    def _logprobs(self, c: CompletionOutput, start: int) -> ChatLogprobs | None:
        if c.logprobs is None:
            return None
        top_n = self._top_n
        content = []
        for t, entry in zip(c.token_ids[start:], c.logprobs[start:], strict=False):
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)
            content.append(
                TokenLogprob(
                    **self._top(t, entry[t]).model_dump(),
                    top_logprobs=[self._top(k, v) for k, v in ranked if v.rank <= top_n],
                )
            )
        return ChatLogprobs(content=content)

    def _top(self, token_id: int, lp: Logprob) -> TopLogprob:
        return TopLogprob(
            token=self.token_name(token_id),
            logprob=lp.logprob,
            bytes=list(self.tok.token_bytes(token_id)),
        )


def _by_id(token_id: int) -> str:
    return f"token_id:{token_id}"


def _finish(c: CompletionOutput, called: bool) -> str | None:
    """OpenAI's finish reason: "tool_calls" when the model ended after calling tools."""
    return "tool_calls" if called and c.finish_reason == "stop" else c.finish_reason
