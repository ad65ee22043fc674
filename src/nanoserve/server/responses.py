"""OpenAI response bodies from the engine's cumulative snapshots: a unary response, or the
per-choice delta chunks of a stream (with logprobs in each API's shape). One `ResponseFormat` per
request owns what that request's stream has sent so far; nothing else.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

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
    TokenLogprob,
    TopLogprob,
    UsageInfo,
)
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
        self.sent_text: dict[int, str] = {}
        self.sent_tokens: dict[int, int] = {}
        self.finished: set[int] = set()

    def opening(self, num_prompts: int) -> list[BaseModel]:
        return []

    def chunks(self, prompt_index: int, out: RequestOutput) -> list[BaseModel]:
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
        )

    def streamed_usage(self) -> UsageInfo:
        return self.usage(sum(self.sent_tokens.values()))


class CompletionFormat(ResponseFormat):
    def __init__(
        self,
        tokenizer: Tokenizer,
        request_id: str,
        model: str,
        params: SamplingParams,
        echo: list[str] | None,
    ):
        super().__init__(tokenizer, request_id, model, params)
        self.echo = echo
        self.offsets: dict[int, int] = {}

    def opening(self, num_prompts: int) -> list[BaseModel]:
        if self.echo is None:
            return []
        return [
            self._body([CompletionChoice(index=p * self.n + i, text=self.echo[p])])
            for p in range(num_prompts)
            for i in range(self.n)
        ]

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
        choices = []
        for p, out in enumerate(finals):
            for c in out.outputs:
                index = p * self.n + c.index
                prefix = self.echo[p] if self.echo is not None else ""
                choices.append(
                    CompletionChoice(
                        index=index,
                        text=prefix + c.text,
                        logprobs=self._logprobs(index, c, 0),
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
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

    def _logprobs(self, index: int, c: CompletionOutput, start: int) -> CompletionLogprobs | None:
        if c.logprobs is None:
            return None
        ids, entries = c.token_ids[start:], c.logprobs[start:]
        tokens = [self.tok.token_text(t) for t in ids]
        offsets, at = [], self.offsets.get(index, 0)
        for token in tokens:
            offsets.append(at)
            at += len(token)
        self.offsets[index] = at
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[e[t].logprob for t, e in zip(ids, entries, strict=False)],
            top_logprobs=[
                {self.tok.token_text(k): v.logprob for k, v in e.items()} for e in entries
            ],
            text_offset=offsets,
        )


class ChatFormat(ResponseFormat):
    def opening(self, num_prompts: int) -> list[BaseModel]:
        return [
            self._chunk([ChatChunkChoice(index=i, delta={"role": "assistant", "content": ""})])
            for i in range(num_prompts * self.n)
        ]

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
        choices = [
            ChatChoice(
                index=c.index,
                message=ChatMessageOut(content=c.text),
                logprobs=self._logprobs(c, 0),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in out.outputs
        ]
        usage = self.usage(sum(len(c.token_ids) for c in out.outputs))
        return ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )

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
            token=self.tok.token_text(token_id),
            logprob=lp.logprob,
            bytes=list(self.tok.token_bytes(token_id)),
        )
