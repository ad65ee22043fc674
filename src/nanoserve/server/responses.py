"""OpenAI response bodies from the engine's cumulative snapshots: a unary response, or the
per-choice delta chunks of a stream (with logprobs in each API's shape). One `ResponseFormat` per
request owns what that request's stream has sent so far; nothing else.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from nanoserve.engine import CompletionOutput, Logprob, RequestOutput, SamplingParams
from nanoserve.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    FunctionCall,
    PromptLogprob,
    PromptTokensDetails,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    UsageInfo,
)
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

    def name_tokens_by_id(self) -> None:
        """vLLM's return_tokens_as_token_ids: logprobs name each token "token_id:N", which a
        client can map back even where a token's text is not valid UTF-8 on its own."""
        self.token_name = _by_id

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


class CompletionFormat(ResponseFormat):
    """Legacy completions. With `echo` the prompt's text comes first (in a stream: in the first
    chunk of each choice, which is sent once the prompt is computed, so that it can carry the
    prompt's logprobs); with echo and `logprobs` the prompt tokens lead the logprobs (the first
    one has none); with `prompt_logprobs` each choice carries vLLM's `prompt_logprobs` list."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        request_id: str,
        model: str,
        params: SamplingParams,
        echo: list[str] | None,
        prompt_logprobs: bool = False,
    ):
        super().__init__(tokenizer, request_id, model, params)
        self.echo = echo
        self.prompt_logprobs = prompt_logprobs
        self.offsets: dict[int, int] = {}
        self.opened: set[int] = set()

    def chunks(self, prompt_index: int, out: RequestOutput) -> list[BaseModel]:
        openings = []
        if self.echo is not None or self.prompt_logprobs:
            for c in out.outputs:
                index = prompt_index * self.n + c.index
                if index not in self.opened:
                    self.opened.add(index)
                    openings.append(self._body([self._prompt_choice(index, prompt_index, out)]))
        return openings + super().chunks(prompt_index, out)

    def chunk(self, index: int, c: CompletionOutput, delta: str, start: int) -> BaseModel:
        choice = CompletionChoice(
            index=index,
            text=delta,
            logprobs=self._logprobs(index, c, start),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        return self._body([choice])

    def response(self, finals: Sequence[RequestOutput]) -> BaseModel:
        self.cached_tokens = {p: out.num_cached_tokens for p, out in enumerate(finals)}
        choices = []
        for p, out in enumerate(finals):
            for c in out.outputs:
                index = p * self.n + c.index
                head = self._prompt_choice(index, p, out)
                tail = self._logprobs(index, c, 0)
                choices.append(
                    CompletionChoice(
                        index=index,
                        text=head.text + c.text,
                        logprobs=_joined(head.logprobs, tail),
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        prompt_logprobs=head.prompt_logprobs,
                    )
                )
        completion = sum(len(c.token_ids) for out in finals for c in out.outputs)
        return self._body(choices, self.usage(completion))

    def usage_chunk(self) -> BaseModel:
        return self._body([], self.streamed_usage())

    def _body(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> BaseModel:
        return CompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def _prompt_choice(self, index: int, prompt_index: int, out: RequestOutput) -> CompletionChoice:
        """The prompt's part of a choice: its text and logprobs when echoed, vLLM's
        prompt_logprobs when asked for. Sets where the completion's text offsets start."""
        text = self.echo[prompt_index] if self.echo is not None else ""
        self.offsets[index] = len(text)
        logprobs = None
        if self.echo is not None and self.num_logprobs is not None:
            logprobs = self._prompt_logprobs(out)
        vllm = None
        if self.prompt_logprobs and out.prompt_logprobs is not None:
            vllm = [None if e is None else self._vllm_entries(e) for e in out.prompt_logprobs]
        return CompletionChoice(index=index, text=text, logprobs=logprobs, prompt_logprobs=vllm)

    def _prompt_logprobs(self, out: RequestOutput) -> CompletionLogprobs:
        ids = out.prompt_token_ids
        entries = out.prompt_logprobs or [None] * len(ids)
        pairs = list(zip(ids, entries, strict=True))
        top_n = self.num_logprobs or 0
        offsets, at = [], 0
        for t in ids:  # special tokens (BOS) are not in the echoed text
            offsets.append(at)
            at += 0 if t in self.tok.all_special_ids else len(self.tok.token_text(t))
        return CompletionLogprobs(
            tokens=[self.token_name(t) for t in ids],
            token_logprobs=[None if e is None else e[t].logprob for t, e in pairs],
            top_logprobs=[None if e is None else self._top(t, e, top_n) for t, e in pairs],
            text_offset=offsets,
        )

    def _top(self, token: int, entry: dict[int, Logprob], top_n: int) -> dict[str, float]:
        """The prompt token and the `top_n` most likely ones at its position."""
        chosen = {k: v for k, v in entry.items() if k == token or v.rank <= top_n}
        return {self.token_name(k): v.logprob for k, v in chosen.items()}

    def _logprobs(self, index: int, c: CompletionOutput, start: int) -> CompletionLogprobs | None:
        if c.logprobs is None:
            return None
        ids, entries = c.token_ids[start:], c.logprobs[start:]
        tokens = [self.token_name(t) for t in ids]
        offsets, at = [], self.offsets.get(index, 0)
        for t in ids:
            offsets.append(at)
            at += len(self.tok.token_text(t))
        self.offsets[index] = at
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[e[t].logprob for t, e in zip(ids, entries, strict=False)],
            top_logprobs=[{self.token_name(k): v.logprob for k, v in e.items()} for e in entries],
            text_offset=offsets,
        )


def _joined(
    head: CompletionLogprobs | None, tail: CompletionLogprobs | None
) -> CompletionLogprobs | None:
    if head is None or tail is None:
        return head or tail
    return CompletionLogprobs(
        tokens=head.tokens + tail.tokens,
        token_logprobs=head.token_logprobs + tail.token_logprobs,
        top_logprobs=head.top_logprobs + tail.top_logprobs,
        text_offset=head.text_offset + tail.text_offset,
    )


@dataclass(frozen=True)
class ToolPlan:
    """The tools a chat request offered: how their calls look, and their names. `required`: a
    call was forced (tool_choice "required" or a named function), so the whole output is calls:
    none of it is content, even cut short by max_tokens before a call is complete."""

    syntax: ToolSyntax
    names: frozenset[str]
    required: bool = False


@dataclass
class _Calls:
    """What a streamed choice has sent of its tool calls."""

    content_sent: int = 0  # characters of the text sent as content
    ids: list[str] = field(default_factory=list)


class ChatFormat(ResponseFormat):
    """Chat completions. With tools, each choice's text is read for calls: before the first one
    it is content; each complete call becomes a `tool_calls` entry (streamed: its id and name,
    then its arguments), and the choice ends with finish_reason "tool_calls". When a call was
    required, the text is never content: a call cut short is no call, and no markup."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        request_id: str,
        model: str,
        params: SamplingParams,
        tools: ToolPlan | None = None,
    ):
        super().__init__(tokenizer, request_id, model, params)
        self.tools = tools
        self.calls: dict[int, _Calls] = {}
        self.prompt_logprobs = params.prompt_logprobs is not None  # vLLM's, unary only

    def opening(self, num_prompts: int) -> list[BaseModel]:
        return [
            self._chunk([ChatChunkChoice(index=i, delta={"role": "assistant", "content": ""})])
            for i in range(num_prompts * self.n)
        ]

    def chunks(self, prompt_index: int, out: RequestOutput) -> list[BaseModel]:
        if self.tools is None:
            return super().chunks(prompt_index, out)
        self.cached_tokens[prompt_index] = out.num_cached_tokens
        result = []
        for c in out.outputs:
            index = prompt_index * self.n + c.index
            if index not in self.finished:
                result += self._tool_chunks(index, c, self.tools)
        return result

    def _tool_chunks(self, index: int, c: CompletionOutput, tools: ToolPlan) -> list[BaseModel]:
        state = self.calls.setdefault(index, _Calls())
        done = c.finish_reason is not None
        first, calls = tools.syntax.split(c.text, set(tools.names))
        if first is not None:
            end = first
        else:
            end = len(c.text) if done else tools.syntax.may_start(c.text)
        deltas: list[dict[str, Any]] = []
        if end > state.content_sent and not state.ids and not tools.required:
            deltas.append({"content": c.text[state.content_sent : end]})
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
            )
            result.append(self._chunk([choice]))
        if result:
            self.sent_tokens[index] = len(c.token_ids)
        return result

    def chunk(self, index: int, c: CompletionOutput, delta: str, start: int) -> BaseModel:
        choice = ChatChunkChoice(
            index=index,
            delta={"content": delta} if delta else {},
            logprobs=self._logprobs(c, start),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        return self._chunk([choice])

    def response(self, finals: Sequence[RequestOutput]) -> BaseModel:
        (out,) = finals
        self.cached_tokens = {0: out.num_cached_tokens}
        choices = []
        for c in out.outputs:
            message = ChatMessageOut(content=c.text)
            if self.tools is not None:
                content, calls = self.tools.syntax.parse(c.text, set(self.tools.names))
                message = ChatMessageOut(
                    content=None if self.tools.required else content,
                    tool_calls=[
                        ToolCall(id=self.tools.syntax.call_id(), function=FunctionCall(**call))
                        for call in calls
                    ],
                )
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=message,
                    logprobs=self._logprobs(c, 0),
                    finish_reason=_finish(c, bool(message.tool_calls)),
                    stop_reason=c.stop_reason,
                )
            )
        usage = self.usage(sum(len(c.token_ids) for c in out.outputs))
        scored = None
        if self.prompt_logprobs and out.prompt_logprobs is not None:
            scored = [None if e is None else self._vllm_entries(e) for e in out.prompt_logprobs]
        return ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage,
            prompt_logprobs=scored,
        )  # fmt: skip

    def usage_chunk(self) -> BaseModel:
        return self._chunk([], self.streamed_usage())

    def _chunk(self, choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> BaseModel:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def _logprobs(self, c: CompletionOutput, start: int) -> ChatLogprobs | None:
        if c.logprobs is None:
            return None
        top_n = self.num_logprobs or 0
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
