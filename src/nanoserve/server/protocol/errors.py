"""A refusal and the body that carries it: `InvalidRequest` names the field at fault, and
`ErrorResponse` is OpenAI's error shape (`{"error": {"message", "type", "param", "code"}}`)."""

from __future__ import annotations

from pydantic import BaseModel


class InvalidRequest(Exception):
    """A request this server will not run; `param` names the field at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
