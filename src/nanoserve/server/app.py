"""The OpenAI-compatible HTTP app (Quart-Trio): the app object, its lifecycle (the engine task
runs in the app's nursery from startup to shutdown), its routes, error handlers and access log.
The routes live in routes.py; nothing here owns anything of the engine.
"""

from __future__ import annotations

from typing import Any

import trio
from quart_trio import QuartTrio

from nanoserve.config import ServerConfig
from nanoserve.server.bridge import Serving
from nanoserve.server.errors import error_handlers
from nanoserve.server.routes import OpenAIServer


def create_app(
    serving: Serving,
    model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = ServerConfig.max_body_bytes,
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
    app.add_url_rule("/tokenize", view_func=api.tokenize, methods=["POST"])
    app.add_url_rule("/detokenize", view_func=api.detokenize, methods=["POST"])
    app.add_url_rule("/tokenizer_info", view_func=api.tokenizer_info, methods=["GET"])
    app.add_url_rule("/health", view_func=api.health, methods=["GET"])
    app.add_url_rule("/metrics", view_func=api.metrics, methods=["GET"])
    for exception, handler in error_handlers(max_body_bytes).items():
        app.register_error_handler(exception, handler)
    return app


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
