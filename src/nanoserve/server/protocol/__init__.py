"""The OpenAI API's request and response bodies (pydantic), with vLLM's extra sampling fields: a
module per API (completions, chat, tokenization, models), the fields both generation endpoints
share (generation), the strict base and `parse` (base), and the refusal and error body (errors).

Requests are strict: a wrong type, a missing field or an unknown field is an `InvalidRequest`
naming the field (a 400); a known parameter that would change the answer and is not implemented
is refused by name, never accepted and ignored. Responses mirror OpenAI's shapes. Owns nothing.
"""

from nanoserve.server.protocol.base import (
    PromptLogprob,
    PromptTokensDetails,
    StrictModel,
    UsageInfo,
    parse,
)
from nanoserve.server.protocol.chat import (
    MAX_TOOLS,
    SERVER_TEMPLATE_KEYS,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatMessageOut,
    ContentPart,
    FunctionCall,
    FunctionSpec,
    NamedToolChoice,
    TokenLogprob,
    ToolCall,
    ToolChoiceFunction,
    ToolSpec,
    TopLogprob,
    message_dicts,
)
from nanoserve.server.protocol.completions import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Prompt,
)
from nanoserve.server.protocol.errors import ErrorInfo, ErrorResponse, InvalidRequest
from nanoserve.server.protocol.generation import (
    MAX_LOGPROBS,
    MAX_N,
    MAX_SEED,
    MAX_SEQUENCES,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    MIN_SEED,
    GenerationRequest,
    JsonSchemaFormat,
    ResponseFormatSpec,
    StreamOptions,
    StructuredOutputsSpec,
)
from nanoserve.server.protocol.models import ModelCard, ModelList, Version
from nanoserve.server.protocol.tokenization import DetokenizeRequest, TokenizeRequest

__all__ = [
    "MAX_LOGPROBS",
    "MAX_N",
    "MAX_SEED",
    "MAX_SEQUENCES",
    "MAX_STOP",
    "MAX_STOP_CHARS",
    "MAX_STOP_TOKEN_IDS",
    "MAX_TOOLS",
    "MIN_SEED",
    "SERVER_TEMPLATE_KEYS",
    "ChatChoice",
    "ChatChunkChoice",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatLogprobs",
    "ChatMessage",
    "ChatMessageOut",
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionRequest",
    "CompletionResponse",
    "ContentPart",
    "DetokenizeRequest",
    "ErrorInfo",
    "ErrorResponse",
    "FunctionCall",
    "FunctionSpec",
    "GenerationRequest",
    "InvalidRequest",
    "JsonSchemaFormat",
    "ModelCard",
    "ModelList",
    "NamedToolChoice",
    "Prompt",
    "PromptLogprob",
    "PromptTokensDetails",
    "ResponseFormatSpec",
    "StreamOptions",
    "StrictModel",
    "StructuredOutputsSpec",
    "TokenLogprob",
    "TokenizeRequest",
    "ToolCall",
    "ToolChoiceFunction",
    "ToolSpec",
    "TopLogprob",
    "UsageInfo",
    "Version",
    "message_dicts",
    "parse",
]
