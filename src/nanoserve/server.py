"""The OpenAI-compatible HTTP app (Quart-Trio): routes, SSE, error mapping, auth and body limit.

Handlers validate, tokenize (in a "tokenize" thread when the prompt is long) and talk to the
engine only through `Serving.generate`. A client that leaves cancels its handler (or closes its
stream's body generator); leaving the `generate` block then queues the abort. The engine task runs
in the app's nursery from startup to shutdown. Owns nothing of the engine.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import AsyncExitStack, aclosing
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from quart import Response, g, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from nanoserve.config import ServerConfig
from nanoserve.engine import RequestRejected
from nanoserve.outputs import RequestOutput
from nanoserve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    InvalidRequest,
    ModelCard,
    ModelList,
    parse,
)
from nanoserve.responses import ChatFormat, CompletionFormat, ResponseFormat
from nanoserve.sampling import SamplingParams
from nanoserve.serving import EngineDead, Overloaded, RequestFailed, Serving
from nanoserve.tokenizer import Tokenizer

log = logging.getLogger("nanoserve.server")
access_log = logging.getLogger("nanoserve.access")

DEFAULT_MAX_BODY_BYTES = ServerConfig.max_body_bytes
LONG_PROMPT_CHARS = 4096  # longer prompts are tokenized off the event loop
HARD_STOP_FLUSH_S = 0.3  # after a second signal: time for open streams to write their ending


class ModelNotFound(Exception):
    """The request names a model this server does not serve (HTTP 404)."""


class App(QuartTrio):
    """QuartTrio, made safe for responses sent before the request body was read (413, 401, 404).

    Hypercorn recycles or closes an HTTP/1.1 connection inside the app's last `send`; Quart may
    cancel that send when its body reader sees the stream end, leaving the connection neither
    closed nor answering (the next request on it hangs). The last send is shielded, and a
    response that leaves body bytes unread says `Connection: close`, so the client reconnects."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await super().__call__(scope, receive, send)
        body_read = not _has_body(scope)

        async def tracked_receive() -> Any:
            nonlocal body_read
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                body_read = True
            return message

        async def guarded_send(message: Any) -> None:
            if message["type"] == "http.response.start" and not body_read:
                message = {**message, "headers": [*message["headers"], (b"connection", b"close")]}
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                with trio.CancelScope(shield=True):
                    await send(message)
            else:
                await send(message)

        await super().__call__(scope, tracked_receive, guarded_send)


def _has_body(scope: Any) -> bool:
    headers = dict(scope["headers"])
    return b"transfer-encoding" in headers or headers.get(b"content-length", b"0") != b"0"


def create_app(
    serving: Serving,
    model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> QuartTrio:
    """The app over `serving`; its engine task starts and stops with the app."""
    app = App("nanoserve")
    app.config["MAX_CONTENT_LENGTH"] = max_body_bytes
    app.config["BACKGROUND_TASK_SHUTDOWN_TIMEOUT"] = None  # the engine task is stopped below
    api = OpenAIServer(serving, model_name, api_key, max_body_bytes)
    engine_scope = trio.CancelScope()

    async def run_engine(task_status: trio.TaskStatus[None]) -> None:
        with engine_scope:
            await serving.run(task_status=task_status)

    @app.before_serving
    async def start_engine() -> None:
        await app.nursery.start(run_engine)

    @app.after_serving
    async def stop_engine() -> None:
        serving.close()  # handlers still open end with an error, not a cut connection
        engine_scope.cancel()  # a step in flight completes first

    app.before_request(api.check_access)
    app.after_request(api.log_access)
    app.add_url_rule("/v1/completions", view_func=api.completions, methods=["POST"])
    app.add_url_rule("/v1/chat/completions", view_func=api.chat_completions, methods=["POST"])
    app.add_url_rule("/v1/models", view_func=api.models, methods=["GET"])
    app.add_url_rule("/health", view_func=api.health, methods=["GET"])
    app.add_url_rule("/metrics", view_func=api.metrics, methods=["GET"])
    for exception, handler in _error_handlers(max_body_bytes).items():
        app.register_error_handler(exception, handler)
    return app


async def serve(
    app: QuartTrio,
    serving: Serving,
    sock: socket.socket,
    graceful_timeout: float = ServerConfig.graceful_timeout,
) -> int:
    """Run `app` under Hypercorn's Trio worker on the bound `sock` until SIGINT or SIGTERM;
    returns the exit status (0).

    On a signal Hypercorn stops accepting; open requests get most of `graceful_timeout` to
    finish, then fail cleanly (streams end with an error event and [DONE]); Hypercorn cancels
    what is left at the deadline, and the engine task stops after its current step. A client
    that stopped reading can hold a shielded socket write past all that: a watchdog exits then.
    A second signal fails every open request at once and exits with 128 + its number.
    """
    config = HypercornConfig()
    config.bind = [f"fd://{sock.detach()}"]  # Hypercorn's socket object owns the descriptor now
    config.graceful_timeout = graceful_timeout
    config.errorlog = logging.getLogger("hypercorn.error")
    stop = trio.Event()
    async with trio.open_nursery() as nursery:

        async def run_hypercorn(task_status: trio.TaskStatus[list[str]]) -> None:
            await hypercorn_serve(app, config, shutdown_trigger=stop.wait, task_status=task_status)  # type: ignore[arg-type]
            nursery.cancel_scope.cancel()  # the signal watcher

        await nursery.start(_watch_signals, stop, serving, graceful_timeout)
        binds = await nursery.start(run_hypercorn)
        log.info("ready: %s (OpenAI API at %s/v1)", binds[0], binds[0])
    log.info("stopped")
    return 0


async def _watch_signals(
    stop: trio.Event,
    serving: Serving,
    grace: float,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        signum = await anext(signals)
        log.info("%s: shutting down (grace %.1f s)", signal.Signals(signum).name, grace)
        stop.set()
        with trio.move_on_after(0.8 * grace):
            await _stop_at_once(await anext(signals), serving)
        serving.close()
        with trio.move_on_after(0.2 * grace + 2.0):
            await _stop_at_once(await anext(signals), serving)
    log.error("shutdown is stuck (a client that stopped reading?): exiting now")
    os._exit(1)


async def _stop_at_once(signum: int, serving: Serving) -> None:
    """A second signal: every open request fails now; streams get a moment to write it."""
    serving.close("the server was stopped")
    with trio.CancelScope(shield=True):  # the server may finish first: exit as promised anyway
        await trio.sleep(HARD_STOP_FLUSH_S)
    name = signal.Signals(signum).name
    print(f"nanoserve: second {name}, stopped without waiting", file=sys.stderr, flush=True)
    os._exit(128 + signum)


@dataclass
class AccessRecord:
    """One request's line in the access log, filled in as the request goes."""

    started: float
    client: str
    request_line: str
    tokens_in: int | None = None
    tokens_out: int | None = None

    def write(self, status: int | str) -> None:
        tokens = f"in={_count(self.tokens_in)} out={_count(self.tokens_out)}"
        seconds = time.monotonic() - self.started
        access_log.info('%s "%s" %s %s %.3fs', self.client, self.request_line, status, tokens,
                        seconds)  # fmt: skip


def _count(n: int | None) -> str:
    return "-" if n is None else str(n)


class OpenAIServer:
    """The routes. Reads the engine's fixed facts (tokenizer, context length), nothing else."""

    def __init__(self, serving: Serving, model_name: str, api_key: str | None, max_body_bytes: int):
        self.serving = serving
        self.tokenizer: Tokenizer = serving.engine.tokenizer
        self.model_name = model_name
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())

    async def check_access(self) -> Response | None:
        host, port = request.scope.get("client") or ("-", 0)
        line = f"{request.method} {request.path}"
        g.access = AccessRecord(time.monotonic(), f"{host}:{port}", line)
        if self.api_key is not None and request.path != "/health":
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.encode(), self.api_key.encode()
            ):
                return error_response(
                    401, "invalid or missing API key (Authorization: Bearer KEY)",
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"},
                )  # fmt: skip
        length = request.content_length
        if length is not None and length > self.max_body_bytes:
            return _too_large(self.max_body_bytes)
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
        prompts = req.prompts()
        token_ids = [
            await self._encode(p) if isinstance(p, str) else p for p in prompts
        ]  # fmt: skip
        echo = None
        if req.echo:
            echo = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in prompts]
        params = req.sampling_params(req.max_tokens, req.logprobs)
        fmt = CompletionFormat(
            self.tokenizer, f"cmpl-{uuid.uuid4().hex}", self.model_name, params, echo
        )
        return await self._respond(fmt, req.stream, req.include_usage, token_ids, params)

    async def chat_completions(self) -> Response:
        req: ChatCompletionRequest = parse(
            ChatCompletionRequest, await request.get_data(cache=False)
        )
        self._check_model(req.model)
        render = partial(self._render_chat, req)
        if sum(len(m.model_dump_json()) for m in req.messages) > LONG_PROMPT_CHARS:
            token_ids = await trio.to_thread.run_sync(render, thread_name="tokenize")
        else:
            token_ids = render()
        params = req.sampling_params(req.completion_limit, req.num_logprobs)
        fmt = ChatFormat(self.tokenizer, f"chatcmpl-{uuid.uuid4().hex}", self.model_name, params)
        return await self._respond(fmt, req.stream, req.include_usage, [token_ids], params)

    async def models(self) -> Response:
        card = ModelCard(
            id=self.model_name,
            created=self.created,
            max_model_len=self.serving.engine.max_model_len,
        )
        return _json(ModelList(data=[card]))

    async def health(self) -> Response:
        health = self.serving.health()
        return Response(
            json.dumps(health),
            200 if health["status"] == "ok" else 503,
            mimetype="application/json",
        )

    async def metrics(self) -> Response:
        return Response(self.serving.metrics.render(), content_type=CONTENT_TYPE_LATEST)

    # -- generation ---------------------------------------------------------------------------

    async def _respond(
        self,
        fmt: ResponseFormat,
        stream: bool,
        include_usage: bool,
        prompts: list[list[int]],
        params: SamplingParams,
    ) -> Response:
        fmt.prompt_tokens = g.access.tokens_in = sum(len(p) for p in prompts)
        if not stream:
            async with AsyncExitStack() as stack:
                streams = await self._submit(stack, fmt.id, prompts, params)
                finals = [await _last(outputs) for outputs in streams]
            body = fmt.response(finals)
            g.access.tokens_out = sum(len(c.token_ids) for out in finals for c in out.outputs)
            return _json(body)
        events = self._events(fmt, include_usage, prompts, params, g.access)
        await anext(events)  # submits: a refusal raises here and gets its own status
        response = Response(
            events, mimetype="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        response.timeout = None  # Quart's RESPONSE_TIMEOUT would cut a long stream
        return response

    async def _events(
        self,
        fmt: ResponseFormat,
        include_usage: bool,
        prompts: list[list[int]],
        params: SamplingParams,
        access: AccessRecord,
    ) -> AsyncIterator[bytes]:
        """The SSE body. The streams' `generate` blocks close with this generator: on a
        disconnect it is cancelled, or closed (GeneratorExit) while suspended at a yield."""
        ending = None  # until submitted, a refusal is logged with its own status
        try:
            async with AsyncExitStack() as stack:
                streams = await self._submit(stack, fmt.id, prompts, params)
                ending = "200 (client left)"
                yield b""
                try:
                    for opening in fmt.opening(len(prompts)):
                        yield _sse(opening)
                    async with aclosing(self._chunks(fmt, streams)) as chunks:
                        async for chunk in chunks:
                            yield chunk
                    if include_usage:
                        yield _sse(fmt.usage_chunk())
                    ending = "200"
                except Exception as e:  # mid-stream: the status line is gone, report in it
                    status, info = _error_info(e)
                    log.warning("stream %s failed (%d): %s", fmt.id, status, info.message)
                    ending = f"200 (failed: {status})"
                    yield _sse(ErrorResponse(error=info))
                yield b"data: [DONE]\n\n"
        finally:
            if ending is not None:
                access.tokens_out = sum(fmt.sent_tokens.values())
                access.write(ending)

    async def _chunks(
        self, fmt: ResponseFormat, streams: list[AsyncIterator[RequestOutput]]
    ) -> AsyncGenerator[bytes, None]:
        """Round robin over the prompts' streams: outputs are coalesced snapshots, so a stream
        waited on later loses nothing; each step usually advances all of them at once."""
        pending = list(enumerate(streams))
        while pending:
            for entry in list(pending):
                index, outputs = entry
                out = await anext(outputs)
                for chunk in fmt.chunks(index, out):
                    yield _sse(chunk)
                if out.finished:
                    pending.remove(entry)

    async def _submit(
        self,
        stack: AsyncExitStack,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
    ) -> list[AsyncIterator[RequestOutput]]:
        streams = []
        for i, token_ids in enumerate(prompts):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            streams.append(
                await stack.enter_async_context(self.serving.generate(rid, token_ids, params))
            )
        return streams

    # -- helpers ------------------------------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ModelNotFound(f"the model {model!r} does not exist (this server serves "
                                f"{self.model_name!r})")  # fmt: skip

    async def _encode(self, text: str) -> list[int]:
        if len(text) <= LONG_PROMPT_CHARS:
            return self.tokenizer.encode(text)
        return await trio.to_thread.run_sync(self.tokenizer.encode, text, thread_name="tokenize")

    def _render_chat(self, req: ChatCompletionRequest) -> list[int]:
        kwargs = {
            k: v
            for k, v in (req.chat_template_kwargs or {}).items()
            if k not in ("messages", "add_generation_prompt")
        }
        try:
            text = self.tokenizer.apply_chat_template(
                req.message_dicts(), add_generation_prompt=req.add_generation_prompt, **kwargs
            )
        except ValueError as e:
            raise InvalidRequest(str(e), "messages") from None
        return self.tokenizer.encode(text, add_special_tokens=False)  # the template has BOS


async def _last(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = None
    async for last in outputs:  # noqa: B007
        pass
    assert last is not None and last.finished
    return last


# -- errors ----------------------------------------------------------------------------------


def error_response(
    status: int,
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
    return Response(body.model_dump_json(), status, headers=headers, mimetype="application/json")


def _error_info(e: Exception) -> tuple[int, ErrorInfo]:
    """Status and body for an exception a handler (or a stream) may meet."""
    if isinstance(e, InvalidRequest):
        return 400, ErrorInfo(message=e.message, type="invalid_request_error", param=e.param)
    if isinstance(e, RequestRejected):
        return 400, ErrorInfo(message=str(e), type="invalid_request_error", param=e.param)
    if isinstance(e, ModelNotFound):
        info = ErrorInfo(
            message=str(e), type="invalid_request_error", param="model", code="model_not_found"
        )
        return 404, info
    if isinstance(e, Overloaded):
        return 503, ErrorInfo(message=str(e), type="server_error", code="overloaded")
    if isinstance(e, EngineDead):
        return 503, ErrorInfo(message=str(e), type="server_error")
    if isinstance(e, RequestFailed):
        return 500, ErrorInfo(message=f"generation failed: {e}", type="server_error")
    return 500, ErrorInfo(message=f"internal error: {type(e).__name__}", type="server_error")


def _error_handlers(max_body_bytes: int) -> dict[type[Exception], Any]:
    async def known(e: Exception) -> Response:
        status, info = _error_info(e)
        headers = {"Retry-After": str(e.retry_after)} if isinstance(e, Overloaded) else None
        return error_response(status, info.message, info.type, info.param, info.code, headers)

    async def http(e: HTTPException) -> Response:
        if e.code == 413:
            return _too_large(max_body_bytes)
        return error_response(e.code or 500, f"{e.name}: {e.description}")

    async def unexpected(e: Exception) -> Response:
        log.exception("unhandled error in a request", exc_info=e)
        return error_response(500, f"internal error: {type(e).__name__}", "server_error")

    handled = (InvalidRequest, RequestRejected, ModelNotFound, Overloaded, EngineDead)
    return {
        **{cls: known for cls in (*handled, RequestFailed)},
        HTTPException: http,
        Exception: unexpected,
    }


def _too_large(limit: int) -> Response:
    return error_response(413, f"the request body is larger than the limit of {limit} bytes")


def _json(body: BaseModel) -> Response:
    return Response(body.model_dump_json(), mimetype="application/json")


def _sse(body: BaseModel) -> bytes:
    return b"data: " + body.model_dump_json().encode() + b"\n\n"
