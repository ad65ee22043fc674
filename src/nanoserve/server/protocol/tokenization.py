"""vLLM's /tokenize and /detokenize: a prompt or chat messages to token ids, and back."""

from __future__ import annotations

from nanoserve.server.protocol.base import StrictModel
from nanoserve.server.protocol.chat import ChatMessage, check_continuation
from nanoserve.server.protocol.errors import InvalidRequest


class TokenizeRequest(StrictModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequest("give either prompt or messages", "prompt")
        check_continuation(self.continue_final_message, self.add_generation_prompt)


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]
