"""HTTP errors in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`): the status
and body for every exception a handler or a stream may meet, and the app's error handlers.
"""

from __future__ import annotations

import logging
from typing import Any

from quart import Response
from werkzeug.exceptions import HTTPException

from nanoserve.engine import RequestRejected
from nanoserve.server.bridge import EngineDead, Overloaded, RequestFailed, ShuttingDown
from nanoserve.server.protocol import ErrorInfo, ErrorResponse, InvalidRequest

log = logging.getLogger(__name__)


class ModelNotFound(Exception):
    """The request names a model this server does not serve (HTTP 404)."""


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


def error_info(e: Exception) -> tuple[int, ErrorInfo]:
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
    if isinstance(e, ShuttingDown):
        return 503, ErrorInfo(message=f"not finished: {e}", type="server_error")
    if isinstance(e, RequestFailed):
        return 500, ErrorInfo(message=f"generation failed: {e}", type="server_error")
    return 500, ErrorInfo(message=f"internal error: {type(e).__name__}", type="server_error")


def error_handlers(max_body_bytes: int) -> dict[type[Exception], Any]:
    async def known(e: Exception) -> Response:
        status, info = error_info(e)
        headers = {"Retry-After": str(e.retry_after)} if isinstance(e, Overloaded) else None
        return error_response(status, info.message, info.type, info.param, info.code, headers)

    async def http(e: HTTPException) -> Response:
        if e.code == 413:
            return too_large(max_body_bytes)
        return error_response(e.code or 500, f"{e.name}: {e.description}")

    async def unexpected(e: Exception) -> Response:
        log.exception("unhandled error in a request", exc_info=e)
        return error_response(500, f"internal error: {type(e).__name__}", "server_error")

    handled = (InvalidRequest, RequestRejected, ModelNotFound, Overloaded, EngineDead)
    return {
        **{cls: known for cls in (*handled, RequestFailed, ShuttingDown)},
        HTTPException: http,
        Exception: unexpected,
    }


def too_large(limit: int) -> Response:
    return error_response(413, f"the request body is larger than the limit of {limit} bytes")
