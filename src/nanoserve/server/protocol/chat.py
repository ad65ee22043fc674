"""/v1/chat/completions: messages, tools and the choice among them, the request's checks, and
the unary response and its stream chunks."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from nanoserve.engine import WHOLE_VOCAB
from nanoserve.server.protocol.base import PromptLogprob, StrictModel, UsageInfo
from nanoserve.server.protocol.errors import InvalidRequest
from nanoserve.server.protocol.generation import MAX_LOGPROBS, GenerationRequest

MAX_TOOLS = 128  # tools in one chat request, OpenAI's limit: each one is in the prompt and grammar
# Keys of chat_template_kwargs that the server itself sets: a client may not override them.
SERVER_TEMPLATE_KEYS = frozenset(
    ["messages", "add_generation_prompt", "continue_final_message", "tools", "documents",
     "bos_token", "eos_token", "pad_token", "unk_token", "raise_exception", "strftime_now"]
)  # fmt: skip


class ContentPart(BaseModel):
    # Other keys (cache_control, ...) are hints that do not change the answer; other part types
    # (images, audio) are refused below.
    model_config = ConfigDict(strict=True, extra="allow")

    type: str
    text: str | None = None


class FunctionCall(StrictModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's result answers this call
    # An assistant's thinking, as a response gave it (vLLM's older name and its newer one)
    reasoning_content: str | None = None
    reasoning: str | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, content: str | list[ContentPart] | None) -> Any:
        for part in content if isinstance(content, list) else []:
            if part.type != "text" or part.text is None:
                raise ValueError(
                    f"content parts of type {part.type!r} are not supported: text only"
                )
        return content

    def text(self) -> str:
        """The content as one string, as chat templates expect it: text parts joined by
        newlines (as vLLM joins them); an assistant turn without content is empty."""
        if isinstance(self.content, list):
            return "\n".join(part.text or "" for part in self.content)
        return self.content or ""


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template receives them; a turn other than the assistant's needs
    content."""
    out = []
    for i, m in enumerate(messages):
        if m.content is None and m.role != "assistant":
            raise InvalidRequest(f"messages.{i}.content is required", f"messages.{i}.content")
        if m.tool_calls and m.role != "assistant":
            raise InvalidRequest("only assistant messages have tool_calls", f"messages.{i}")
        d: dict[str, Any] = {"role": m.role, "content": m.text()}
        if (thinking := _reasoning(m, i)) is not None:
            # Qwen3's template reads reasoning_content (and shows it for the turns after the
            # last question only); others may read reasoning.
            d["reasoning_content"] = d["reasoning"] = thinking
        if m.name:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def _reasoning(m: ChatMessage, i: int) -> str | None:
    """An assistant message's thinking, by either name (the same text if both are given)."""
    given = [t for t in (m.reasoning_content, m.reasoning) if t is not None]
    if given and m.role != "assistant":
        raise InvalidRequest("only assistant messages have reasoning_content", f"messages.{i}")
    if len(set(given)) > 1:
        raise InvalidRequest("reasoning_content and reasoning differ: give one",
                             f"messages.{i}.reasoning")  # fmt: skip
    return given[0] if given else None


class FunctionSpec(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: any object
    strict: bool | None = None  # the arguments are always held to the schema


class ToolSpec(StrictModel):
    type: Literal["function"]
    function: FunctionSpec


class ToolChoiceFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=WHOLE_VOCAB, le=MAX_LOGPROBS)  # -1: vLLM's, all
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    # OpenAI's: "none" and "minimal" turn a reasoning model's thinking off (server/reasoning.py)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    thinking_token_budget: int | None = Field(None, ge=0)  # vLLM's: then </think> is forced
    web_search_options: Any = None
    continue_final_message: bool = False
    echo: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's, unary only

    def refused(self) -> str | None:
        unsupported = {
            "functions": bool(self.functions),
            "function_call": self.function_call not in (None, "none"),
            "audio": self.audio is not None,
            "modalities": (self.modalities or ["text"]) != ["text"],
            "prediction": self.prediction is not None,
            "web_search_options": self.web_search_options is not None,
            "echo": self.echo,
        }
        own = next((name for name, used in unsupported.items() if used), None)
        return super().refused() or own

    def check(self) -> None:
        super().check()
        check_continuation(self.continue_final_message, self.add_generation_prompt)
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequest("prompt_logprobs is not supported with stream on chat: ask "
                                 "for it on a unary request", "prompt_logprobs")  # fmt: skip
        if self.top_logprobs and not self.logprobs:  # 0 (vLLM's default) asks for nothing
            raise InvalidRequest("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.num_logprobs == WHOLE_VOCAB:
            self.check_whole_vocab("top_logprobs")
        if len(self.tools or []) > MAX_TOOLS:
            raise InvalidRequest(
                f"tools: at most {MAX_TOOLS} tools (got {len(self.tools or [])})", "tools"
            )
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise InvalidRequest("tool_choice needs tools", "tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if self.tool_choice.function.name not in names:
                raise InvalidRequest(
                    f"tool_choice names {self.tool_choice.function.name!r}, which is not among "
                    f"the tools ({', '.join(names)})",
                    "tool_choice",
                )
        for key in self.chat_template_kwargs or {}:
            if key in SERVER_TEMPLATE_KEYS or not key.isidentifier():
                name = f"chat_template_kwargs.{key}"
                raise InvalidRequest(f"{name} cannot be set: the server sets it", name)

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def offered_tools(self) -> list[dict[str, Any]] | None:
        """The functions the model is shown (none with tool_choice "none")."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.function.model_dump(exclude_none=True) for t in self.tools]

    def required_tools(self) -> list[dict[str, Any]] | None:
        """The functions one of which must be called ("required" or a named choice)."""
        offered = self.offered_tools()
        if offered is None or self.tool_choice in (None, "auto"):
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return [f for f in offered if f["name"] == self.tool_choice.function.name]
        return offered

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    # A reasoning model's thinking, apart from the content: vLLM's older name and its newer one
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids: the choice's tokens


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    # vLLM: with `prompt_logprobs`, per prompt token (None first) its logprob and alternatives
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids: the rendered chat's


class ChatChunkChoice(BaseModel):
    index: int
    # {"role": ...} first, then {"reasoning_content": ..., "reasoning": ...} (the thinking),
    # {"content": ...} or {"tool_calls": [...]}; {} at the end
    delta: dict[str, Any]
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None  # return_token_ids: the tokens since the last chunk


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: in each choice's first chunk


def check_continuation(continue_final_message: bool, add_generation_prompt: bool) -> None:
    """vLLM's rule: a final message continued is not followed by a new turn's prompt."""
    if continue_final_message and add_generation_prompt:
        raise InvalidRequest(
            "continue_final_message and add_generation_prompt cannot both be true: send "
            "add_generation_prompt: false to continue the last message",
            "continue_final_message",
        )
