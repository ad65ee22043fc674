"""/v1/responses (OpenAI's Responses API): the request, the items of a conversation (messages,
function calls and their outputs, reasoning) as a request gives them, and the response body with
its output items. The request becomes a chat request at the edge (server/responses_api.py): the
fields here are those that map onto chat's, the bookkeeping that changes nothing, and those that
would change the answer and are not implemented, declared only to be refused by name at
anything but their defaults. An unknown field is refused by name too (the strict base).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nanoserve.engine import GrammarError, StructuredOutputsParams
from nanoserve.server.protocol.base import StrictModel, _invalid
from nanoserve.server.protocol.errors import InvalidRequest

EFFORTS = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
# OpenAI's efforts past "high" ask for more thinking than "high"; a model here thinks or does
# not (a Qwen3 cannot think a little, nor a lot), so they are "high".
CHAT_EFFORT = {"xhigh": "high", "max": "high"}


def validated(model: type[StrictModel], data: Any, at: str) -> Any:
    """`data` validated into `model`; an error names the field from `at` (`input.2`)."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        error = _invalid(e)
        param = f"{at}.{error.param}" if error.param else at
        message = error.message.replace(error.param, param, 1) if error.param else error.message
        raise InvalidRequest(message, param) from None


# -- the items of a conversation ------------------------------------------------------------------


class TextPart(StrictModel):
    """A message's text: the user's (input_text) or, given back, the model's (output_text)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # an output_text's, as a response gave it
    logprobs: list[Any] | None = None
    prompt_cache_breakpoint: Any = None  # a caching hint


class Message(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None
    phase: Literal["commentary", "final_answer"] | None = None  # a label: changes no prompt

    def text(self, at: str) -> str:
        """The content as one string: text parts joined by newlines (as chat joins them); any
        other part (an image, a file, audio) refused by name."""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for j, part in enumerate(self.content):
            kind = part.get("type")
            if kind not in ("input_text", "output_text"):
                raise InvalidRequest(
                    f"content parts of type {kind!r} are not supported: input_text and "
                    "output_text only", f"{at}.content.{j}.type",
                )  # fmt: skip
            texts.append(validated(TextPart, part, f"{at}.content.{j}").text)
        return "\n".join(texts)


class FunctionCall(StrictModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text, as the model wrote it
    id: str | None = None
    status: str | None = None


class FunctionCallOutput(StrictModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None


class SummaryText(StrictModel):
    type: Literal["summary_text"]
    text: str


class ReasoningText(StrictModel):
    type: Literal["reasoning_text"]
    text: str


class Reasoning(StrictModel):
    type: Literal["reasoning"]
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        """The thinking: its text, or where a response gave only a summary, the summary."""
        parts = self.content or self.summary
        return "\n".join(p.text for p in parts)


Item = Message | FunctionCall | FunctionCallOutput | Reasoning
ITEMS: dict[str, type[StrictModel]] = {
    "message": Message,
    "function_call": FunctionCall,
    "function_call_output": FunctionCallOutput,
    "reasoning": Reasoning,
}


def input_items(given: str | list[dict[str, Any]], at: str = "input") -> list[Item]:
    """The items of `input` (a string is one user message), each checked, named by place."""
    if isinstance(given, str):
        return [Message(role="user", content=given)]
    items = []
    for i, raw in enumerate(given):
        kind = raw.get("type", "message")
        model = ITEMS.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise InvalidRequest(
                f"input items of type {kind!r} are not supported: message, function_call, "
                "function_call_output and reasoning are", f"{at}.{i}.type",
            )  # fmt: skip
        item = validated(model, raw, f"{at}.{i}")
        if isinstance(item, Message):
            item.text(f"{at}.{i}")  # its parts checked now, while the place is known
        if isinstance(item, FunctionCallOutput) and not isinstance(item.output, str):
            item.output = Message(role="user", content=item.output).text(f"{at}.{i}.output")
        items.append(item)
    return items


# -- the request -----------------------------------------------------------------------------------


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: any object
    strict: bool | None = None  # a required call's arguments are always held to the schema


class NamedFunction(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None  # the output is always held to the schema


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(StrictModel):
    effort: EFFORTS | None = None
    # Asked-for summaries: none is written (the thinking comes whole, as reasoning_text).
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesStreamOptions(StrictModel):
    include_obfuscation: bool = True  # padding on stream events against side channels: none here


class ResponsesRequest(StrictModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    reasoning: ReasoningConfig | None = None
    store: bool = True
    previous_response_id: str | None = None
    # vLLM's sampling extras, which routers in front of vLLM (smg) send: checked by chat's model.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    stop: str | list[str] | None = None
    priority: int = 0  # vLLM's priority scheduling; this server runs first come, first served
    request_id: str | None = None
    # Harmless: bookkeeping that does not change the answer.
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    # Would change the answer and are not implemented: refused unless at their defaults.
    include: list[str] | None = None
    background: bool = False
    truncation: Literal["auto", "disabled"] = "disabled"
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_tool_calls: int | None = None

    def check(self) -> None:
        unsupported = {
            "include": bool(self.include),
            "background": self.background,
            "truncation": self.truncation != "disabled",
            "top_logprobs": bool(self.top_logprobs),
            "priority": self.priority != 0,
            "max_tool_calls": self.max_tool_calls is not None,
            "text.verbosity": self.text is not None and self.text.verbosity not in (None, "medium"),
        }
        if name := next((name for name, used in unsupported.items() if used), None):
            raise InvalidRequest(f"{name} is not supported by this server", name)
        self.items()
        tools = self.function_tools()
        self.named_function(tools)
        if self.constraint() is not None and tools and self.tool_choice != "none":
            raise InvalidRequest(
                'text.format cannot be combined with tools unless tool_choice is "none": the '
                "format would rule out the calls", "text.format",
            )  # fmt: skip

    def items(self) -> list[Item]:
        return input_items(self.input)

    def function_tools(self) -> list[FunctionTool]:
        """The function tools; any other kind (web_search, file_search, mcp, ...) refused."""
        tools = []
        for i, tool in enumerate(self.tools or []):
            if tool.get("type") != "function":
                raise InvalidRequest(
                    f"tools of type {tool.get('type')!r} are not supported: function tools "
                    "only", f"tools.{i}.type",
                )  # fmt: skip
            tools.append(validated(FunctionTool, tool, f"tools.{i}"))
        return tools

    def named_function(self, tools: list[FunctionTool]) -> str | None:
        """The function tool_choice names (None where it names none)."""
        choice = self.tool_choice
        if not isinstance(choice, dict):
            if choice not in (None, "none", "auto") and not tools:
                raise InvalidRequest("tool_choice needs tools", "tool_choice")
            return None
        if choice.get("type") != "function":
            raise InvalidRequest(
                f"tool_choice of type {choice.get('type')!r} is not supported: none, auto, "
                "required or a function", "tool_choice",
            )  # fmt: skip
        name = validated(NamedFunction, choice, "tool_choice").name
        names = [t.name for t in tools]
        if name not in names:
            raise InvalidRequest(f"tool_choice names {name!r}, which is not among the tools "
                                 f"({', '.join(names)})", "tool_choice")  # fmt: skip
        return str(name)

    def constraint(self) -> StructuredOutputsParams | None:
        """What text.format holds the output to (json_schema, json_object; text: nothing)."""
        fmt = self.text.format if self.text is not None else None
        try:
            if fmt is None or fmt.type == "text":
                return None
            if fmt.type == "json_object":
                return StructuredOutputsParams(json_object=True, param="text.format")
            if fmt.json_schema is None:
                raise InvalidRequest("text.format.schema is required for type json_schema",
                                     "text.format.schema")  # fmt: skip
            return StructuredOutputsParams(json=fmt.json_schema, param="text.format.schema")
        except GrammarError as e:
            raise InvalidRequest(str(e), e.param) from None

    @property
    def effort(self) -> str | None:
        effort = self.reasoning.effort if self.reasoning is not None else None
        return CHAT_EFFORT.get(effort, effort) if effort is not None else None


# -- the response ----------------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed"]


class OutputReasoning(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]


OutputItem = OutputMessage | OutputFunctionCall | OutputReasoning


class InputTokensDetails(BaseModel):
    cached_tokens: int  # read from the prefix cache instead of computed
    cache_write_tokens: int = 0  # OpenAI's explicit caching: none here


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseBody(BaseModel):
    """A response, with the request's settings echoed as OpenAI echoes them."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict[str, Any]
    store: bool
    temperature: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float
    truncation: Literal["disabled"] = "disabled"
    background: bool = False
    usage: ResponseUsage | None = None
    user: str | None
