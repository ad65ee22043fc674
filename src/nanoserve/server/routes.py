"""The OpenAI routes: /v1/completions and /v1/chat/completions (unary and SSE), /v1/models,
/health, /metrics, and the access check (API key, body limit) before each request.

Handlers validate, tokenize (in a "tokenize" thread when the prompt is long) and talk to the
engine only through `Serving.generate`. A client that leaves cancels its handler (or closes its
stream's body generator); leaving the `generate` block then queues the abort.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, aclosing
from dataclasses import dataclass
from functools import partial
from importlib import metadata
from typing import Any

import trio
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from quart import Response, g, request

from nanoserve.engine import WHOLE_VOCAB, RequestOutput, RequestRejected, SamplingParams
from nanoserve.server.access import AccessRecord, printable
from nanoserve.server.bridge import Serving
from nanoserve.server.chat_plan import chat_inputs, chat_plan
from nanoserve.server.completion_format import CompletionFormat
from nanoserve.server.errors import ModelNotFound, error_info, error_response, too_large
from nanoserve.server.loads import loads
from nanoserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    InvalidRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    Version,
    message_dicts,
    parse,
)
from nanoserve.server.reasoning import parser_for
from nanoserve.server.responses import ChatFormat, ResponseFormat

log = logging.getLogger(__name__)

LONG_PROMPT_CHARS = 4096  # longer prompts are tokenized off the event loop
LARGE_BODY = 2048  # tokens: a response with logprobs of more is built off the event loop


class OpenAIServer:
    """The routes. Reads the engine's fixed facts (tokenizer, context length), nothing else."""

    def __init__(
        self,
        serving: Serving,
        model_name: str,
        api_key: str | None,
        max_body_bytes: int,
        aliases: Sequence[str] = (),
    ):
        self.serving = serving
        self.tokenizer = serving.tokenizer
        # How a reasoning model's thinking is told apart from its answer (None: it is not)
        self.reasoning = parser_for(serving.reasoning_parser, self.tokenizer.chat_template)
        self.model_name = model_name
        self.model_names = {model_name, *aliases}  # what a request may call the model
        self.root = next(iter(aliases), model_name)  # the path it was loaded from, as given
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())

    async def check_access(self) -> Response | None:
        host, port = request.scope.get("client") or ("-", 0)
        raw = request.scope.get("raw_path") or request.path.encode()
        line = f"{request.method} {raw.decode('latin-1')}"
        g.access = AccessRecord(time.monotonic(), f"{host}:{port}", line)
        if self.api_key is not None and request.path != "/health":
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            given = [token] if scheme.lower() == "bearer" else []
            given += request.headers.getlist("x-api-key")  # Anthropic's SDK sends its key so
            key = self.api_key.encode()
            if not any(hmac.compare_digest(t.encode(), key) for t in given):
                return error_response(
                    401, "invalid or missing API key (Authorization: Bearer KEY, or x-api-key)",
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"},
                )  # fmt: skip
        length = request.content_length
        if length is not None and length > self.max_body_bytes:
            return too_large(self.max_body_bytes)
        return None

    async def log_access(self, response: Response) -> Response:
        """Unary responses are logged here; a stream logs itself when its body ends."""
        if response.mimetype != "text/event-stream" and "access" in g:
            g.access.write(response.status_code)
        return response

    # -- routes -------------------------------------------------------------------------------

    async def completions(self) -> Response:
        req: CompletionRequest = parse(CompletionRequest, await request.get_data(cache=False))
        self._check_model(req.model)
        self._check_generates("/v1/completions")
        prompts = req.prompts()
        req.check_sequences(len(prompts))
        if self.serving.max_queue is not None and len(prompts) > self.serving.max_queue:
            raise InvalidRequest(
                f"{len(prompts)} prompts are more than the server queues "
                f"(--max-queue {self.serving.max_queue}): send fewer at a time",
                "prompt",
            )
        token_ids = [
            await self._encode(p) if isinstance(p, str) else p for p in prompts
        ]  # fmt: skip
        echo = None
        if req.echo:
            echo = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in prompts]
        params = req.sampling_params(
            req.max_tokens, req.logprobs, req.num_prompt_logprobs, req.constraint()
        )
        fmt = CompletionFormat(
            self.tokenizer, f"cmpl-{uuid.uuid4().hex}", self.model_name, params, echo,
            prompt_logprobs=req.prompt_logprobs is not None,
        )  # fmt: skip
        if req.return_tokens_as_token_ids:
            fmt.name_tokens_by_id()
        if req.return_token_ids:
            fmt.return_token_ids(token_ids)
        return await self._respond(fmt, req.stream, _usage(req), token_ids, params)

    async def chat_completions(self) -> Response:
        req: ChatCompletionRequest = parse(
            ChatCompletionRequest, await request.get_data(cache=False)
        )
        self._check_model(req.model)
        self._check_generates("/v1/chat/completions")
        req.check_sequences(1)
        inputs = chat_inputs(req, self.tokenizer.chat_template)
        prompt, token_ids = await self._encode_chat(
            inputs.messages, req.add_generation_prompt, inputs.kwargs, req.continue_final_message
        )
        plan = chat_plan(
            req, self.tokenizer, self.reasoning, inputs, prompt, self.serving.thinking_token_budget
        )
        fmt = ChatFormat(
            self.tokenizer, f"chatcmpl-{uuid.uuid4().hex}", self.model_name, plan.params,
            plan.tools, plan.reasoning,
        )  # fmt: skip
        if req.return_tokens_as_token_ids:
            fmt.name_tokens_by_id()
        if req.return_token_ids:
            fmt.return_token_ids([token_ids])
        try:
            return await self._respond(fmt, req.stream, _usage(req), [token_ids], plan.params)
        except RequestRejected as e:  # the engine names its own field; chat calls it so
            if e.param == "logprobs":
                raise InvalidRequest(str(e).replace("logprobs", "top_logprobs", 1),
                                     "top_logprobs") from None  # fmt: skip
            raise

    async def models(self) -> Response:
        return _json(ModelList(data=[self._card()]))

    async def model(self, model_id: str) -> Response:
        """OpenAI's `models.retrieve`."""
        self._check_model(model_id)
        return _json(self._card())

    def _card(self) -> ModelCard:
        return ModelCard(
            id=self.model_name, created=self.created, max_model_len=self.serving.max_model_len,
            root=self.root,
        )  # fmt: skip

    async def version(self) -> Response:
        """vLLM's /version: this server's version."""
        return _json(Version(version=metadata.version("nanoserve")))

    async def tokenize(self) -> Response:
        """vLLM's /tokenize (lm-eval's remote tokenizer uses it)."""
        req: TokenizeRequest = parse(TokenizeRequest, await request.get_data(cache=False))
        self._check_model(req.model)
        if req.messages is not None:
            messages = message_dicts(req.messages)
            _, tokens = await self._encode_chat(
                messages, req.add_generation_prompt, {}, req.continue_final_message
            )
        else:
            tokens = await self._encode(req.prompt or "", req.add_special_tokens)
        body = {
            "tokens": tokens,
            "count": len(tokens),
            "max_model_len": self.serving.max_model_len,
            "token_strs": self.tokenizer.pieces(tokens) if req.return_token_strs else None,
        }
        return Response(json.dumps(body), mimetype="application/json")

    async def detokenize(self) -> Response:
        req: DetokenizeRequest = parse(DetokenizeRequest, await request.get_data(cache=False))
        self._check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < self.tokenizer.vocab_size]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary", "tokens")
        text = self.tokenizer.decode(req.tokens, skip_special_tokens=False)
        return Response(json.dumps({"prompt": text}), mimetype="application/json")

    async def tokenizer_info(self) -> Response:
        info = {
            "tokenizer_class": self.tokenizer.tokenizer_class,
            **self.tokenizer.special_tokens,
            "chat_template": self.tokenizer.chat_template,
            "model_max_length": self.serving.max_model_len,
            "vocab_size": self.tokenizer.vocab_size,
        }
        return Response(json.dumps(info), mimetype="application/json")

    async def health(self) -> Response:
        health = self.serving.health()
        return Response(
            json.dumps(health),
            200 if health["status"] == "ok" else 503,
            mimetype="application/json",
        )

    async def metrics(self) -> Response:
        return Response(self.serving.metrics.render(), content_type=CONTENT_TYPE_LATEST)

    async def loads(self) -> Response:
        """The load routers poll (server/loads.py); smg's `?include=` sections are all one."""
        return Response(json.dumps(loads(self.serving)), mimetype="application/json")

    # -- generation ---------------------------------------------------------------------------

    async def _respond(
        self,
        fmt: ResponseFormat,
        stream: bool,
        usage: Usage,
        prompts: list[list[int]],
        params: SamplingParams,
    ) -> Response:
        fmt.prompt_tokens = g.access.tokens_in = sum(len(p) for p in prompts)
        if not stream:
            try:
                async with AsyncExitStack() as stack:
                    streams = await self._submit(stack, prompts, params)
                    finals = [await _last(outputs) for outputs in streams]
            except trio.Cancelled:  # the client left: no response, so log it here
                g.access.write("499 (client left)")
                raise
            g.access.tokens_out = sum(len(c.token_ids) for out in finals for c in out.outputs)
            body = partial(_json_text, fmt.response, finals)
            tokens = fmt.prompt_tokens * params.n + g.access.tokens_out
            whole = params.logprobs == WHOLE_VOCAB  # a vocabulary's entries at each position
            small = params.logprobs is None and params.prompt_logprobs is None
            if not whole and (small or tokens < LARGE_BODY):
                return Response(body(), mimetype="application/json")
            # Logprobs of thousands of tokens take a second or more to build and serialize.
            text = await trio.to_thread.run_sync(body, thread_name="respond")
            return Response(text, mimetype="application/json")
        events = self._events(fmt, usage, prompts, params, g.access)
        await anext(events)  # submits: a refusal raises here and gets its own status
        response = Response(
            events, mimetype="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        response.timeout = None  # Quart's RESPONSE_TIMEOUT would cut a long stream
        return response

    async def _events(
        self,
        fmt: ResponseFormat,
        usage: Usage,
        prompts: list[list[int]],
        params: SamplingParams,
        access: AccessRecord,
    ) -> AsyncIterator[bytes]:
        """The SSE body. The streams' `generate` blocks close with this generator: on a
        disconnect it is cancelled, or closed (GeneratorExit) while suspended at a yield."""
        ending = None  # until submitted, a refusal is logged with its own status
        try:
            async with AsyncExitStack() as stack:
                streams = await self._submit(stack, prompts, params)
                ending = "200 (client left)"
                yield b""
                try:
                    for opening in fmt.opening(len(prompts)):
                        yield _sse(_with_usage(opening, fmt, usage))
                    async with aclosing(self._chunks(fmt, streams, usage)) as chunks:
                        async for chunk in chunks:
                            yield chunk
                    if usage.last:
                        yield _sse(fmt.usage_chunk())
                    ending = "200"
                except Exception as e:  # mid-stream: the status line is gone, report in it
                    status, info = error_info(e)
                    log.warning(
                        "stream %s failed (%d): %s", fmt.id, status, printable(info.message)
                    )
                    ending = f"200 (failed: {status})"
                    yield _sse(ErrorResponse(error=info))
                yield b"data: [DONE]\n\n"
        finally:
            if ending is not None:
                access.tokens_out = sum(fmt.sent_tokens.values())
                access.write(ending)

    async def _chunks(
        self, fmt: ResponseFormat, streams: list[AsyncIterator[RequestOutput]], usage: Usage
    ) -> AsyncGenerator[bytes, None]:
        """Round robin over the prompts' streams: outputs are coalesced snapshots, so a stream
        waited on later loses nothing; each step usually advances all of them at once."""
        pending = list(enumerate(streams))
        while pending:
            for entry in list(pending):
                index, outputs = entry
                out = await anext(outputs)
                for chunk in fmt.chunks(index, out):
                    yield _sse(_with_usage(chunk, fmt, usage))
                if out.finished:
                    pending.remove(entry)

    async def _submit(
        self, stack: AsyncExitStack, prompts: list[list[int]], params: SamplingParams
    ) -> list[AsyncIterator[RequestOutput]]:
        admitted = await self.serving.admit(prompts, params)  # every prompt checked first
        group = uuid.uuid4().hex  # this HTTP request's prompts take their turns together
        return [
            await stack.enter_async_context(self.serving.generate(one, group)) for one in admitted
        ]

    def _check_length(self, chars: int, param: str) -> None:
        """Refuse a text that cannot fit the context before tokenizing it: no token stands for
        more than `max_token_chars` characters."""
        at_least = -(-chars // self.tokenizer.max_token_chars)
        if at_least > self.serving.max_model_len:
            raise InvalidRequest(
                f"{param} has at least {at_least} tokens ({chars} characters); this model's "
                f"context is {self.serving.max_model_len} tokens (max_model_len)",
                param,
            )

    def _check_generates(self, route: str) -> None:
        """A pooling model (an embedding model, a cross-encoder) serves no generation route."""
        if self.serving.pooling is not None:
            raise InvalidRequest(
                f"{route}: the model {self.model_name!r} is an embedding model (--runner "
                "pooling); it serves /v1/embeddings, or /v1/rerank and /v1/score",
                "model",
            )

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise ModelNotFound(f"the model {model!r} does not exist (this server serves "
                                f"{self.model_name!r})")  # fmt: skip

    async def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self._check_length(len(text), "prompt")
        encode = partial(self.tokenizer.encode, text, add_special_tokens)
        if len(text) <= LONG_PROMPT_CHARS:
            return encode()
        return await trio.to_thread.run_sync(encode, thread_name="tokenize")

    async def _encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        kwargs: dict[str, Any],
        continue_final: bool = False,
    ) -> tuple[str, list[int]]:
        """The rendered chat's text and ids."""
        self._check_generates("chat")
        chars = sum(len(m["content"]) for m in messages)  # at least: the template adds more
        self._check_length(chars, "messages")
        render = partial(self._render_chat, messages, add_generation_prompt, kwargs, continue_final)
        if chars <= LONG_PROMPT_CHARS:
            return render()
        return await trio.to_thread.run_sync(render, thread_name="tokenize")

    def _render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        kwargs: dict[str, Any],
        continue_final: bool,
    ) -> tuple[str, list[int]]:
        try:
            return self.tokenizer.render_chat(
                messages, add_generation_prompt, continue_final_message=continue_final, **kwargs
            )
        except ValueError as e:
            raise InvalidRequest(str(e), "messages") from None


@dataclass(frozen=True)
class Usage:
    """Where a stream reports usage: in a last chunk of its own (include_usage), and so far in
    every chunk (vLLM's continuous_usage_stats)."""

    last: bool = False
    every_chunk: bool = False


def _usage(req: CompletionRequest | ChatCompletionRequest) -> Usage:
    return Usage(req.include_usage, req.continuous_usage)


def _with_usage(chunk: BaseModel, fmt: ResponseFormat, usage: Usage) -> BaseModel:
    if not usage.every_chunk:
        return chunk
    return chunk.model_copy(update={"usage": fmt.streamed_usage()})


async def _last(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = None
    async for last in outputs:  # noqa: B007
        pass
    assert last is not None and last.finished
    return last


def _json_text(build: Callable[[Sequence[RequestOutput]], BaseModel],
               finals: Sequence[RequestOutput]) -> str:  # fmt: skip
    return build(finals).model_dump_json()


def _json(body: BaseModel) -> Response:
    return Response(body.model_dump_json(), mimetype="application/json")


def _sse(body: BaseModel) -> bytes:
    return b"data: " + body.model_dump_json().encode() + b"\n\n"
