"""The OpenAI-compatible HTTP app (Quart-Trio): the app object, its lifecycle (the engine task
runs in the app's nursery from startup to shutdown), its routes, error handlers and access log.
The routes live in routes.py; nothing here owns anything of the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import trio
from quart_trio import QuartTrio
from werkzeug.routing import PathConverter

from nanoserve.config import ServerConfig
from nanoserve.server.anthropic import AnthropicServer
from nanoserve.server.bridge import Serving
from nanoserve.server.errors import error_handlers
from nanoserve.server.pooling_routes import PoolingAPI
from nanoserve.server.responses_api import ResponsesAPI
from nanoserve.server.routes import OpenAIServer


def create_app(
    serving: Serving,
    model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = ServerConfig.max_body_bytes,
    aliases: Sequence[str] = (),
    responses_store_size: int = ServerConfig.responses_store_size,
) -> QuartTrio:
    """The app over `serving`, serving the model as `model_name` (requests may also call it by
    one of `aliases`); its engine task starts and stops with the app."""
    app = App("nanoserve")
    app.config["MAX_CONTENT_LENGTH"] = max_body_bytes
    app.config["BACKGROUND_TASK_SHUTDOWN_TIMEOUT"] = None  # the engine task is stopped below
    app.url_map.converters["model_id"] = ModelId
    api = OpenAIServer(serving, model_name, api_key, max_body_bytes, aliases)
    anthropic = AnthropicServer(api)
    responses = ResponsesAPI(api, responses_store_size)
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
    app.after_request(anthropic.reshape_errors)  # runs first: the log sees the final status
    app.add_url_rule("/v1/completions", view_func=api.completions, methods=["POST"])
    app.add_url_rule("/v1/chat/completions", view_func=api.chat_completions, methods=["POST"])
    app.add_url_rule("/v1/messages", view_func=anthropic.messages, methods=["POST"])
    app.add_url_rule(
        "/v1/messages/count_tokens", view_func=anthropic.count_tokens, methods=["POST"]
    )
    app.add_url_rule("/v1/models", view_func=api.models, methods=["GET"])
    PoolingAPI(api).add_routes(app)  # /v1/embeddings, /v1/rerank, /v1/score
    # OpenAI's Responses API (responses_api.py): an adapter onto chat's path
    app.add_url_rule("/v1/responses", "responses_create", responses.create, methods=["POST"])
    one = "/v1/responses/<response_id>"
    app.add_url_rule(one, "responses_retrieve", responses.retrieve, methods=["GET"])
    app.add_url_rule(one, "responses_delete", responses.delete, methods=["DELETE"])
    app.add_url_rule("/v1/models/<model_id:model_id>", view_func=api.model, methods=["GET"])
    app.add_url_rule("/version", view_func=api.version, methods=["GET"])
    app.add_url_rule("/tokenize", view_func=api.tokenize, methods=["POST"])
    app.add_url_rule("/detokenize", view_func=api.detokenize, methods=["POST"])
    app.add_url_rule("/tokenizer_info", view_func=api.tokenizer_info, methods=["GET"])
    app.add_url_rule("/health", view_func=api.health, methods=["GET"])
    app.add_url_rule("/metrics", view_func=api.metrics, methods=["GET"])
    app.add_url_rule("/v1/loads", view_func=api.loads, methods=["GET"])
    for exception, handler in error_handlers(max_body_bytes).items():
        app.register_error_handler(exception, handler)
    return app


class ModelId(PathConverter):
    """The rest of the path, slashes and all, a leading one too: the openai client asks for a
    model called /home/me/x.gguf at /v1/models//home/me/x.gguf, which must not be merged into
    /v1/models/home/me/x.gguf (a redirect to a model of another name)."""

    regex = ".+"
    part_isolating = False  # werkzeug infers True for a regex without a slash in it


class App(QuartTrio):
    """QuartTrio, made safe for responses sent before the request body was read (413, 401, 404).

    Hypercorn recycles or closes an HTTP/1.1 connection inside the app's last `send`; Quart may
    cancel that send when its body reader sees the stream end, leaving the connection neither
    closed nor answering: the last send is shielded. A response decided before the body arrived
    waits (briefly) for the rest of the body, so that the connection stays in step and a
    pipelined request behind it is answered in turn; a body that does not come (or a request
    whose headers disagree about its length) gets `Connection: close`, so the client reconnects.
    """

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await super().__call__(scope, receive, send)
        headers = dict(scope["headers"])
        chunked, length = b"transfer-encoding" in headers, headers.get(b"content-length", b"0")
        body_read = trio.Event()
        if not chunked and length == b"0":
            body_read.set()
        # Past the limit the body is not read: no use waiting for it.
        wait_s = BODY_WAIT_S if chunked or _int(length) <= self.config["MAX_CONTENT_LENGTH"] else 0
        # RFC 9112 6.1: both length headers is a request smuggling attempt; answer, then close.
        ambiguous = chunked and b"content-length" in headers

        async def tracked_receive() -> Any:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_read.set()
            return message

        async def guarded_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                with trio.move_on_after(wait_s):
                    await body_read.wait()
                if ambiguous or not body_read.is_set():
                    message = {**message, "headers": [*message["headers"], CLOSE]}
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                with trio.CancelScope(shield=True):
                    await send(message)
            else:
                await send(message)

        await super().__call__(scope, tracked_receive, guarded_send)


CLOSE = (b"connection", b"close")
BODY_WAIT_S = 1.0  # how long a refusal waits for the rest of a request's body


def _int(text: bytes) -> int:
    return int(text) if text.isdigit() else 0
