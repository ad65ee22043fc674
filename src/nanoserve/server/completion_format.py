"""Legacy completions' bodies from the engine's snapshots: a unary response, or a stream's
chunks, with the prompt echoed and its logprobs where asked (see `CompletionFormat`)."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel

from nanoserve.engine import CompletionOutput, Logprob, RequestOutput, SamplingParams
from nanoserve.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    UsageInfo,
)
from nanoserve.server.responses import ResponseFormat
from nanoserve.tokenizer import Tokenizer


class CompletionFormat(ResponseFormat):
    """Legacy completions. With `echo` the prompt's text comes first (in a stream: in the first
    chunk of each choice, which is sent once the prompt is computed, so that it can carry the
    prompt's logprobs); with echo and `logprobs` the prompt tokens lead the logprobs (the first
    one has none); with `prompt_logprobs` each choice carries vLLM's `prompt_logprobs` list; with
    `return_token_ids` its `prompt_token_ids` (in a stream, in the choice's first chunk) and
    `token_ids`."""

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
        self.ids_given: set[int] = set()  # choices whose prompt_token_ids went out

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
            prompt_token_ids=self._prompt_ids(index),
            token_ids=self._new_ids(c, start),
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
                        prompt_token_ids=head.prompt_token_ids,
                        token_ids=self._new_ids(c, 0),
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
        return CompletionChoice(index=index, text=text, logprobs=logprobs, prompt_logprobs=vllm,
                                prompt_token_ids=self._prompt_ids(index))  # fmt: skip

    def _prompt_ids(self, index: int) -> list[int] | None:
        """The choice's prompt's token ids, the first time it is sent (return_token_ids)."""
        if self.prompt_ids is None or index in self.ids_given:
            return None
        self.ids_given.add(index)
        return self.prompt_ids[index // self.n]

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
