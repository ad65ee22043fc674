"""What the client checks (examples/clients.py) share: the answers they ask for, the questions,
and the target: the server, its model, and whether a reasoning model's thinking is on or off.

The checks hold the protocol to account, not the model: a 135M model (or a random one) writes
poor prose, so where an answer is free text a check asks that it came back in its API's shape;
where it is held to a schema or a forced call (constrained decoding), that it parses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field

QUESTION = "Describe the capital of France."
WEATHER = "What is the weather in Paris, in celsius?"
TOOL_RESULT = '{"temperature": 21}'
# Tokens a reasoning model may think for when its thinking is on, where the API takes a budget:
# after it the server forces </think>, so that the answer (a call, a schema) comes in time.
THINKING_BUDGET = 32
# The token limit of an answer held to a schema or a call's syntax. JSON may hold any whitespace
# between its tokens (llguidance's default, as vLLM's and OpenAI's grammars allow it): a real
# model writes little, a random one may write hundreds of tokens of it before the JSON closes.
CONSTRAINED_TOKENS = 1000


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population_millions: int = Field(ge=0, le=100)


class GetWeather(BaseModel):
    """The current weather in a city."""

    city: str = Field(max_length=40, description="the city's name")
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


@dataclass(frozen=True)
class Target:
    """`base_url`: the OpenAI base URL (http://host:port/v1); `thinking`: None sends nothing
    (the chat template decides: SmolLM2's has no switch, and refuses one), True or False switch
    a reasoning model's thinking on or off in each API's own words."""

    base_url: str
    model: str
    thinking: bool | None = None

    @property
    def root(self) -> str:
        """The server's root URL: Anthropic's SDK adds /v1 itself."""
        return self.base_url.removesuffix("/v1")

    def chat_extra(self) -> dict[str, Any]:
        """Chat completions' extra_body: vLLM's budget, or the template's switch turned off."""
        if self.thinking is None:
            return {}
        if self.thinking:
            return {"thinking_token_budget": THINKING_BUDGET}
        return {"chat_template_kwargs": {"enable_thinking": False}}

    def anthropic_thinking(self) -> dict[str, Any]:
        """The Messages API's `thinking`, as keyword arguments."""
        if self.thinking is None:
            return {}
        if self.thinking:
            return {"thinking": {"type": "enabled", "budget_tokens": THINKING_BUDGET}}
        return {"thinking": {"type": "disabled"}}

    def effort(self) -> str | None:
        """The Responses API's reasoning.effort (it takes no budget)."""
        return None if self.thinking is None else "medium" if self.thinking else "none"

    def reasoning(self) -> dict[str, Any]:
        """responses.create's `reasoning`, as keyword arguments."""
        effort = self.effort()
        return {} if effort is None else {"reasoning": {"effort": effort}}
