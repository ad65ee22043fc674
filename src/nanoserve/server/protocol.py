"""The OpenAI API's request and response bodies (pydantic), with vLLM's extra sampling fields.

Requests are strict: a wrong type, a missing field or an unknown field is an `InvalidRequest`
naming the field (a 400); a known parameter that would change the answer and is not implemented
is refused by name, never accepted and ignored. Responses mirror OpenAI's shapes. Owns nothing.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from nanoserve.engine import GrammarError, SamplingParams, StructuredOutputsParams

MAX_N = 16  # completions per prompt: each one is a sequence in the batch
MAX_LOGPROBS = 20
MAX_SEQUENCES = 256  # prompts x n in one request: each one is a sequence in the batch
MAX_STOP = 16  # stop strings in one request (OpenAI allows 4)
MAX_STOP_CHARS = 4096  # their total length
MAX_STOP_TOKEN_IDS = 1024  # stop token ids in one request
MAX_TOOLS = 128  # tools in one chat request, OpenAI's limit: each one is in the prompt and grammar
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1  # a signed 64-bit integer, as in OpenAI's and vLLM's
# Keys of chat_template_kwargs that the server itself sets: a client may not override them.
SERVER_TEMPLATE_KEYS = frozenset(
    ["messages", "add_generation_prompt", "continue_final_message", "tools", "documents",
     "bos_token", "eos_token", "pad_token", "unk_token", "raise_exception", "strftime_now"]
)  # fmt: skip


class InvalidRequest(Exception):
    """A request this server will not run; `param` names the field at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


def _constraint(param: str, **fields: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields, param=param)
    except GrammarError as e:
        raise InvalidRequest(str(e), e.param) from None


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_means_the_default(cls, data: Any) -> Any:
        """OpenAI types its optional fields as nullable: `null` asks for the default."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, usage in every chunk

    def asks(self) -> bool:
        """Whether these options change a stream (unset, they change nothing)."""
        return self.include_usage or self.continuous_usage_stats


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | bool = Field(True, alias="schema")
    strict: bool | None = None  # the output is always held to the schema


class ResponseFormatSpec(_Strict):
    """OpenAI's `response_format`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsSpec(_Strict):
    """vLLM's `structured_outputs`."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False  # the default: objects take no other keys
    disable_fallback: bool = False  # one backend: nothing to fall back to
    structural_tag: Any = None  # refused


class _GenerationRequest(_Strict):
    """Fields shared by both endpoints: OpenAI's, then vLLM's extras, then harmless ones."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    # Harmless: bookkeeping that does not change the answer.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # Would change the answer and are not implemented: declared only to be refused by name (at
    # their defaults they change nothing, and are accepted).
    logit_bias: dict[str, float] | None = None
    include_stop_str_in_output: bool = False
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* fields; at most one of them.
    response_format: ResponseFormatSpec | None = None
    structured_outputs: StructuredOutputsSpec | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None

    def refused(self) -> str | None:
        """The first set parameter that would change the answer and is not implemented."""
        unsupported = {
            "logit_bias": any((self.logit_bias or {}).values()),  # biases of 0 change nothing
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "structured_outputs.structural_tag": self.structured_outputs is not None
            and self.structured_outputs.structural_tag is not None,
        }
        return next((name for name, used in unsupported.items() if used), None)

    def constraint(self) -> StructuredOutputsParams | None:
        """What the output must match, from whichever field gave it (a 400 naming it if two
        did, or if it is malformed)."""
        given = {
            "response_format": self._response_format(),
            "structured_outputs": self._structured_outputs(),
            "guided_json": self._guided("json", self.guided_json),
            "guided_regex": self._guided("regex", self.guided_regex),
            "guided_choice": self._guided("choice", self.guided_choice),
            "guided_grammar": self._guided("grammar", self.guided_grammar),
        }
        set_ = [(k, v) for k, v in given.items() if v is not None]
        if len(set_) > 1:
            names = " and ".join(k for k, _ in set_)
            raise InvalidRequest(f"{names} cannot be combined: give one", set_[1][0])
        return set_[0][1] if set_ else None

    def _response_format(self) -> StructuredOutputsParams | None:
        rf = self.response_format
        if rf is None or rf.type == "text":
            return None
        if rf.type == "json_object":
            return _constraint("response_format", json_object=True)
        if rf.json_schema is None:
            raise InvalidRequest(
                "response_format.json_schema is required for type json_schema",
                "response_format.json_schema",
            )
        return _constraint("response_format.json_schema.schema", json=rf.json_schema.json_schema)

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        so = self.structured_outputs
        if so is None:
            return None
        return _constraint(
            "structured_outputs",
            json=so.json_,
            regex=so.regex,
            choice=so.choice,
            grammar=so.grammar,
            json_object=bool(so.json_object),
            whitespace_pattern="" if so.disable_any_whitespace else so.whitespace_pattern,
        )

    def _guided(self, kind: str, value: Any) -> StructuredOutputsParams | None:
        if value is None:
            return None
        ws = self.guided_whitespace_pattern
        return _constraint(f"guided_{kind}", **{kind: value}, whitespace_pattern=ws)

    def check(self) -> None:
        if name := self.refused():
            raise InvalidRequest(f"{name} is not supported by this server", name)
        if self.stream_options is not None and self.stream_options.asks() and not self.stream:
            raise InvalidRequest("stream_options is only allowed when stream is true", "stream")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP or sum(len(s) for s in stops) > MAX_STOP_CHARS:
            raise InvalidRequest(
                f"stop: at most {MAX_STOP} strings of {MAX_STOP_CHARS} characters in all "
                f"(got {len(stops)} of {sum(len(s) for s in stops)})",
                "stop",
            )

    def check_sequences(self, num_prompts: int) -> None:
        """One request may fill at most MAX_SEQUENCES rows of the batch."""
        if num_prompts * self.n > MAX_SEQUENCES:
            raise InvalidRequest(
                f"{num_prompts} prompts x n={self.n} is {num_prompts * self.n} sequences; one "
                f"request may ask for at most {MAX_SEQUENCES}",
                "prompt" if num_prompts > 1 else "n",
            )

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        constraint: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        try:
            return SamplingParams(
                n=self.n,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0,
                min_p=self.min_p or 0.0,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=self.repetition_penalty or 1.0,
                seed=self.seed,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
                stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens,
                structured_outputs=constraint,
            )
        except ValueError as e:  # SamplingParams names the field first: "min_tokens must be ..."
            raise InvalidRequest(str(e), str(e).split(" ", 1)[0]) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """vLLM's continuous_usage_stats: usage so far in every chunk (with include_usage)."""
        options = self.stream_options
        return options is not None and options.include_usage and options.continuous_usage_stats


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_GenerationRequest):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=0)  # 0, with echo: score the prompt, generate nothing
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        super().check()
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequest("best_of is not supported (only best_of == n)", "best_of")
        if self.suffix:
            raise InvalidRequest("suffix is not supported by this server", "suffix")

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt position: asked for directly, or echoed with `logprobs`."""
        echoed = self.logprobs if self.echo else None
        if self.prompt_logprobs is None and echoed is None:
            return None
        return max(self.prompt_logprobs or 0, echoed or 0)

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts as a list of strings or a list of token id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequest("prompt is empty", "prompt")
        if isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return p  # type: ignore[return-value]


class ContentPart(BaseModel):
    # Other keys (cache_control, ...) are hints that do not change the answer; other part types
    # (images, audio) are refused below.
    model_config = ConfigDict(strict=True, extra="allow")

    type: str
    text: str | None = None


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's result answers this call

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
        if m.name:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


class FunctionSpec(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: any object
    strict: bool | None = None  # the arguments are always held to the schema


class ToolSpec(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class ToolChoiceFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
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
    reasoning_effort: str | None = None
    web_search_options: Any = None
    continue_final_message: bool = False
    echo: bool = False
    prompt_logprobs: int | None = None

    def refused(self) -> str | None:
        unsupported = {
            "functions": bool(self.functions),
            "function_call": self.function_call not in (None, "none"),
            "audio": self.audio is not None,
            "modalities": (self.modalities or ["text"]) != ["text"],
            "prediction": self.prediction is not None,
            "reasoning_effort": self.reasoning_effort is not None,
            "web_search_options": self.web_search_options is not None,
            "continue_final_message": self.continue_final_message,
            "echo": self.echo,
            "prompt_logprobs": self.prompt_logprobs is not None,
        }
        own = next((name for name, used in unsupported.items() if used), None)
        return super().refused() or own

    def check(self) -> None:
        super().check()
        if self.top_logprobs and not self.logprobs:  # 0 (vLLM's default) asks for nothing
            raise InvalidRequest("top_logprobs requires logprobs to be true", "top_logprobs")
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


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # refused: as in chat completions
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequest("give either prompt or messages", "prompt")
        if self.continue_final_message:
            raise InvalidRequest(
                "continue_final_message is not supported by this server", "continue_final_message"
            )


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]

    def check(self) -> None:
        pass


def parse(model: type[_Strict], body: str | bytes) -> Any:
    """Validate a JSON body into `model`, then refuse what this server does not do."""
    try:
        request = model.model_validate_json(body)
    except ValidationError as e:
        raise _invalid(e) from None
    request.check()  # type: ignore[attr-defined]
    return request


_UNION_TAG = re.compile(r"\W")  # pydantic names union members like "list[str]"
_SHAPES = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token id lists",
    "stop": "a string or a list of strings",
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


# -- responses ---------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens read from the prefix cache instead of computed


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None for an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    logprob: float
    rank: int
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM: the stop string or token id that ended it
    # vLLM: with `prompt_logprobs`, per prompt token (None first) its logprob and alternatives
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    """A unary completion, and (with usage None) one chunk of a streamed one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


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
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatChunkChoice(BaseModel):
    index: int
    # {"role": ...} first, then {"content": ...} or {"tool_calls": [...]}; {} at the end
    delta: dict[str, Any]
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "nanoserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
