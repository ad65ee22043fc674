"""What every request and response body shares: the strict base model (a wrong type, a missing
or unknown field is an `InvalidRequest` naming the field), `parse`, which validates a body and
then refuses what this server does not do, and the token counts a response reports."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from nanoserve.server.protocol.errors import InvalidRequest


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_means_the_default(cls, data: Any) -> Any:
        """OpenAI types its optional fields as nullable: `null` asks for the default."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    def check(self) -> None:
        """Refuse what validation lets through and this server does not do (a request body
        overrides this; nothing is refused by default)."""


def parse(model: type[StrictModel], body: str | bytes) -> Any:
    """Validate a JSON body into `model`, then refuse what this server does not do."""
    try:
        request = model.model_validate_json(body)
    except ValidationError as e:
        raise _invalid(e) from None
    request.check()
    return request


def validate(model: type[StrictModel], data: dict[str, Any]) -> Any:
    """As parse, for a body an adapter built (another API's request made this one): a field
    outside its limits is a 400 naming it, never a 500."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _invalid(e) from None


_UNION_TAG = re.compile(r"\W")  # pydantic names union members like "list[str]"
_SHAPES = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token id lists",
    "stop": "a string or a list of strings",
    "input": "a string, a list of strings, a list of token ids or a list of token id lists",
    "content": "a string or a list of text content parts",
}


def _invalid(error: ValidationError) -> InvalidRequest:
    first = error.errors(include_url=False)[0]
    if first["type"] == "extra_forbidden":  # the last part is the client's own name, any name
        name = ".".join(str(part) for part in first["loc"])
        return InvalidRequest(f"unrecognized request argument supplied: {name}", name)
    path: list[str] = []
    for part in first["loc"]:
        if path and isinstance(part, str) and (_UNION_TAG.search(part) or part in ("str", "int")):
            shape = _SHAPES.get(path[-1])
            message = f"{path[-1]} must be {shape}" if shape else f"{path[-1]} has the wrong type"
            return InvalidRequest(message, ".".join(path))
        path.append(str(part))
    param = ".".join(path) or None
    if first["type"] == "json_invalid":
        return InvalidRequest(f"the body is not valid JSON: {first['msg']}")
    if first["type"] == "missing":
        return InvalidRequest(f"{param} is required", param)
    if param is None:
        return InvalidRequest(f"the body must be a JSON object: {first['msg']}")
    return InvalidRequest(f"{param}: {first['msg']}", param)


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens read from the prefix cache instead of computed


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class PromptLogprob(BaseModel):
    """vLLM's prompt_logprobs entry: a token's logprob, its rank and its text."""

    logprob: float
    rank: int
    decoded_token: str
