"""/v1/completions: the request (prompts as text or token ids, echo, prompt logprobs) and the
response, which is also the shape of each streamed chunk."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from nanoserve.engine import WHOLE_VOCAB
from nanoserve.server.protocol.base import PromptLogprob, UsageInfo
from nanoserve.server.protocol.errors import InvalidRequest
from nanoserve.server.protocol.generation import MAX_LOGPROBS, GenerationRequest

Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(GenerationRequest):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=0)  # 0, with echo: score the prompt, generate nothing
    logprobs: int | None = Field(None, ge=WHOLE_VOCAB, le=MAX_LOGPROBS)  # -1: vLLM's, all
    echo: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        super().check()
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequest("best_of is not supported (only best_of == n)", "best_of")
        if self.suffix:
            raise InvalidRequest("suffix is not supported by this server", "suffix")
        if self.logprobs == WHOLE_VOCAB:
            self.check_whole_vocab("logprobs", len(self.prompts()), self.echo)

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt position: asked for directly, or echoed with `logprobs`."""
        echoed = self.logprobs if self.echo else None
        if self.prompt_logprobs is None and echoed is None:
            return None
        return max(self.prompt_logprobs or 0, echoed or 0)

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts as a list of strings or a list of token id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequest("prompt is empty", "prompt")
        if isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return p  # type: ignore[return-value]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None for an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM: the stop string or token id that ended it
    # vLLM: with `prompt_logprobs`, per prompt token (None first) its logprob and alternatives
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None
    # vLLM's return_token_ids: the prompt's (in a stream, in the choice's first chunk) and the
    # choice's generated tokens (in a stream, those since the last chunk)
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    """A unary completion, and (with usage None) one chunk of a streamed one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
