"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens): the request bodies, read
into the chat completion request that serves them (`chat_body`), and the response body.

The blocks a conversation may hold are text, an assistant's tool_use and thinking, a user's
tool_result; any other (image, document, server tools' blocks) is refused by its name. Fields
that change nothing here (cache_control, metadata, service_tier, citations of earlier answers)
are taken and ignored; an unknown field is a 400 naming it, as on the OpenAI routes.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from nanoserve.server.protocol.base import StrictModel
from nanoserve.server.protocol.errors import InvalidRequest

TOOL_NAME = r"^[A-Za-z0-9_.-]{1,64}$"  # what the chat path takes (its FunctionSpec)
# Anthropic's efforts above "high" ask for more thinking than OpenAI's reasoning_effort names.
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


def _text_blocks(value: Any) -> Any:
    """A string stands for one text block (Anthropic's shorthand)."""
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


class TextBlock(StrictModel):
    type: Literal["text"]
    text: str
    cache_control: Any = None  # a caching hint: the prefix cache needs none
    citations: Any = None  # an earlier answer's citations: the template shows none


class ThinkingBlock(StrictModel):
    type: Literal["thinking"]
    thinking: str
    signature: str = ""  # this server signs nothing; Anthropic's own are not checked


class ToolUseBlock(StrictModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: Any = None


class ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: list[TextBlock] = Field(default_factory=list)
    is_error: bool = False
    cache_control: Any = None

    @field_validator("content", mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        for block in value if isinstance(value, list) else []:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind != "text":
                raise ValueError(f"{kind} blocks are not supported in a tool result: text only")
        return _text_blocks(value)

    def text(self) -> str:
        """The result as the tool message's content; an error says so, the template has no
        other place for it."""
        text = "\n".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


Block = Annotated[TextBlock | ThinkingBlock | ToolUseBlock | ToolResultBlock,
                  Field(discriminator="type")]  # fmt: skip
BLOCK_TYPES = frozenset(["text", "thinking", "tool_use", "tool_result"])
# Which role may send which block.
ROLE_BLOCKS = {
    "user": {"text", "tool_result"},
    "assistant": {"text", "thinking", "tool_use"},
    "system": {"text"},
}


class MessageParam(StrictModel):
    role: Literal["user", "assistant", "system"]
    content: list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return _text_blocks(value)


class Tool(StrictModel):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: Any = None
    strict: bool | None = None  # the input is always held to the schema

    @model_validator(mode="before")
    @classmethod
    def _client_tools_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(f"server tools ({kind}) are not supported: tools the client runs only")
        return data


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(StrictModel):
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = Field(None, ge=0)  # the thinking's tokens, then </think> is forced
    display: Literal["summarized", "omitted"] | None = None  # omitted: empty thinking blocks


class OutputFormat(StrictModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(StrictModel):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class Metadata(StrictModel):
    user_id: str | None = None  # bookkeeping: changes no answer


class CountTokensRequest(StrictModel):
    """What is rendered into the prompt: /v1/messages/count_tokens's body, and the start of
    /v1/messages's."""

    model: str | None = None
    messages: list[MessageParam] = Field(min_length=1)
    system: list[TextBlock] = Field(default_factory=list)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    # Harmless: hints and routing that do not change the answer.
    cache_control: Any = None
    speed: Literal["standard", "fast"] | None = None

    @field_validator("system", mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return _text_blocks(value)

    def check(self) -> None:
        for i, m in enumerate(self.messages):
            for j, block in enumerate(m.content):
                if block.type not in ROLE_BLOCKS[m.role]:
                    raise InvalidRequest(
                        f"messages.{i}.content.{j}: a {m.role} message has no {block.type} "
                        "blocks", f"messages.{i}.content.{j}",
                    )  # fmt: skip
        choice, names = self.tool_choice, [t.name for t in self.tools or []]
        if choice is not None and choice.type in ("any", "tool") and not names:
            raise InvalidRequest(f"tool_choice {choice.type!r} needs tools", "tool_choice")
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise InvalidRequest(
                f"tool_choice.name: {choice.name!r} is not among the tools ({', '.join(names)})",
                "tool_choice.name",
            )
        thinking = self.thinking
        if thinking is not None and (thinking.type == "enabled") != (
            thinking.budget_tokens is not None
        ):
            raise InvalidRequest(
                'thinking.budget_tokens: given with type "enabled", and only then',
                "thinking.budget_tokens",
            )


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)  # required, as Anthropic requires it
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    # Harmless: bookkeeping and routing that do not change the answer.
    metadata: Metadata | None = None
    service_tier: str | None = None
    inference_geo: str | None = None


def parse_anthropic(model: type[CountTokensRequest], body: str | bytes) -> Any:
    """Validate a JSON body into `model`, then refuse what this server does not do; an error
    names the field as the client wrote it (a block's type is not part of its path)."""
    try:
        request = model.model_validate_json(body)
    except ValidationError as e:
        raise _invalid(e) from None
    request.check()
    return request


def _invalid(error: ValidationError) -> InvalidRequest:
    first = error.errors(include_url=False)[0]
    parts = list(first["loc"])
    path = ".".join(
        str(p) for k, p in enumerate(parts)
        if not (k and isinstance(parts[k - 1], int) and p in BLOCK_TYPES)
    )  # fmt: skip
    kind = first["type"]
    if kind == "json_invalid":
        return InvalidRequest(f"the body is not valid JSON: {first['msg']}")
    if not path:
        return InvalidRequest(f"the body must be a JSON object: {first['msg']}")
    if kind == "extra_forbidden":
        return InvalidRequest(f"unrecognized request argument supplied: {path}", path)
    if kind == "missing":
        return InvalidRequest(f"{path} is required", path)
    if kind == "union_tag_invalid":
        tag = first["ctx"]["tag"]
        return InvalidRequest(
            f"{path}: {tag} blocks are not supported by this server (it takes "
            f"{', '.join(sorted(BLOCK_TYPES))})", path,
        )  # fmt: skip
    if kind == "list_type" and parts[-1] in ("system", "content"):
        return InvalidRequest(f"{path} must be a string or a list of content blocks", path)
    message = re.sub(r"^Value error, ", "", first["msg"])
    return InvalidRequest(f"{path}: {message}", path)


def chat_body(req: CountTokensRequest, switchable: bool) -> dict[str, Any]:
    """The chat completion request (as JSON) that serves `req`. `switchable`: the chat template
    has enable_thinking, so the thinking can be switched off."""
    messages = [{"role": "system", "content": _joined(req.system)}] if req.system else []
    for m in req.messages:
        messages += _chat_messages(m)
    prefill = req.messages[-1].role == "assistant"  # the answer continues it
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "continue_final_message": prefill,
        "add_generation_prompt": not prefill,
        **_tools(req),
        **_thinking(req, switchable),
    }
    output = req.output_config
    if output is not None and output.format is not None:
        schema = {"name": "output", "schema": output.format.json_schema}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    if isinstance(req, MessagesRequest):
        body |= {"max_tokens": req.max_tokens, "stop": req.stop_sequences,
                 "stream": req.stream, "temperature": req.temperature, "top_p": req.top_p,
                 "top_k": req.top_k}  # fmt: skip
    return {k: v for k, v in body.items() if v is not None}


def _joined(blocks: list[TextBlock]) -> str:
    return "\n".join(b.text for b in blocks)  # as the chat path joins text parts


def _chat_messages(m: MessageParam) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: an assistant's thinking, text and calls in one;
    a user's tool results each a tool message, its text between them a user message."""
    if m.role == "assistant":
        return [_assistant(m)]
    result: list[dict[str, Any]] = []
    text: list[TextBlock] = []
    for b in m.content:
        if isinstance(b, ToolResultBlock):
            if text:
                result.append({"role": m.role, "content": _joined(text)})
                text = []
            result.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
        elif isinstance(b, TextBlock):
            text.append(b)
    if text or not result:
        result.append({"role": m.role, "content": _joined(text)})
    return result


def _assistant(m: MessageParam) -> dict[str, Any]:
    """Its thinking is reasoning_content, as the chat route takes an earlier turn's."""
    text = [b for b in m.content if isinstance(b, TextBlock)]
    thinking = [b.thinking for b in m.content if isinstance(b, ThinkingBlock)]
    calls = [b for b in m.content if isinstance(b, ToolUseBlock)]
    out: dict[str, Any] = {
        "role": "assistant",
        "content": _joined(text) if text or not calls else None,
    }
    if thinking:
        out["reasoning_content"] = "\n".join(thinking)
    if calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.input)}}
            for c in calls
        ]  # fmt: skip
    return out


def _tools(req: CountTokensRequest) -> dict[str, Any]:
    if not req.tools:
        return {}
    tools = [
        {"type": "function", "function": {"name": t.name, "description": t.description,
                                          "parameters": t.input_schema}}
        for t in req.tools
    ]  # fmt: skip
    choice = req.tool_choice
    if choice is None:
        return {"tools": tools}
    named = {"type": "function", "function": {"name": choice.name}}
    modes = {"auto": "auto", "any": "required", "none": "none", "tool": named}
    return {"tools": tools, "tool_choice": modes[choice.type],
            "parallel_tool_calls": not choice.disable_parallel_tool_use}  # fmt: skip


def _thinking(req: CountTokensRequest, switchable: bool) -> dict[str, Any]:
    """thinking and output_config.effort as the chat path's fields: enabled (with a budget) or
    adaptive turns the thinking on, disabled off where the template has the switch; the effort
    is reasoning_effort, unless the thinking is off (then it asks for nothing more)."""
    thinking = req.thinking
    out: dict[str, Any] = {}
    if thinking is not None and switchable:
        out["chat_template_kwargs"] = {"enable_thinking": thinking.type != "disabled"}
    if thinking is not None and thinking.budget_tokens is not None:
        out["thinking_token_budget"] = thinking.budget_tokens
    effort = req.output_config.effort if req.output_config is not None else None
    if effort is not None and (thinking is None or thinking.type != "disabled"):
        out["reasoning_effort"] = EFFORTS[effort]
    return out


class Usage(BaseModel):
    """Anthropic's: the prompt is input_tokens + cache_read_input_tokens (read from the prefix
    cache); nothing is written to a cache of its own (cache_creation_input_tokens)."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class Message(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    # {"type": "thinking", "thinking", "signature"}, {"type": "text", "text"},
    # {"type": "tool_use", "id", "name", "input"}: thinking first, calls last
    content: list[dict[str, Any]]
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: Usage
