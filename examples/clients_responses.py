"""Clients of OpenAI's Responses API (/v1/responses): the openai SDK's responses.create (unary,
streamed, a function-call round trip by previous_response_id) and responses.parse (text.format
json_schema); the openai-agents SDK on its default Responses model; LangChain's ChatOpenAI with
use_responses_api."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

import openai
from client_shared import (
    CONSTRAINED_TOKENS,
    QUESTION,
    TOOL_RESULT,
    WEATHER,
    City,
    GetWeather,
    Target,
)
from pydantic import Field

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": GetWeather.__doc__,
    "parameters": GetWeather.model_json_schema(),
    "strict": False,
}
ENDS = ("completed", "incomplete")  # free text may be cut by max_output_tokens


def _client(target: Target) -> openai.OpenAI:
    return openai.OpenAI(base_url=target.base_url, api_key="unused", max_retries=0)


def create(target: Target) -> str:
    response = _client(target).responses.create(
        model=target.model, input=QUESTION, temperature=0, max_output_tokens=64,
        **target.reasoning(),
    )  # fmt: skip
    assert response.object == "response" and response.status in ENDS
    assert {item.type for item in response.output} <= {"message", "reasoning"}
    assert response.usage is not None and response.usage.output_tokens > 0
    return f"{response.status}: {response.output_text!r}"


def stream(target: Target) -> str:
    """Numbered events from response.created to response.completed; the text deltas add up to
    the response's text."""
    events = list(
        _client(target).responses.create(
            model=target.model,
            input=QUESTION,
            temperature=0,
            max_output_tokens=64,
            stream=True,
            **target.reasoning(),
        )  # fmt: skip
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds[:2]
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds[-1]
    numbers = [e.sequence_number for e in events]
    assert numbers == sorted(set(numbers))
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text
    return f"{len(events)} events, {final.status}: {text!r}"


def function_round_trip(target: Target) -> str:
    """A forced function_call (its arguments held to the schema); its output sent back by
    previous_response_id; an answer."""
    client = _client(target)
    first = client.responses.create(
        model=target.model, input=WEATHER, tools=[WEATHER_TOOL], temperature=0,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=CONSTRAINED_TOKENS,
        **target.reasoning(),
    )  # fmt: skip
    (call,) = [item for item in first.output if item.type == "function_call"]
    GetWeather.model_validate_json(call.arguments)
    output = {"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT}
    final = client.responses.create(
        model=target.model, input=[output], previous_response_id=first.id, tools=[WEATHER_TOOL],
        temperature=0, max_output_tokens=40, **target.reasoning(),
    )  # fmt: skip
    assert final.status in ENDS and final.previous_response_id == first.id
    return f"{call.name}({call.arguments}) -> {final.status}: {final.output_text!r}"


def parse(target: Target) -> str:
    """responses.parse sends text.format as a strict json_schema; the answer is held to it."""
    response = _client(target).responses.parse(
        model=target.model, input=QUESTION, text_format=City, temperature=0,
        max_output_tokens=CONSTRAINED_TOKENS, **target.reasoning(),
    )  # fmt: skip
    assert isinstance(response.output_parsed, City)
    return repr(response.output_parsed)


def agent(target: Target) -> str:
    """An agent with one function tool, on the SDK's default model (a Responses model) and the
    default client pointed at the server, tracing off: the first turn must call the tool (the
    SDK then sets tool_choice back to auto), and the run ends with a final answer (or, from a
    model that never ends its text, one cut at the limit: said so)."""
    from agents import (
        Agent,
        ModelBehaviorError,
        ModelSettings,
        Runner,
        function_tool,
        set_default_openai_client,
        set_tracing_disabled,
    )
    from openai.types.shared import Reasoning

    set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=target.base_url, api_key="unused", max_retries=0)
    set_default_openai_client(client, use_for_tracing=False)
    calls: list[str] = []

    @function_tool
    def get_weather(
        city: Annotated[str, Field(max_length=40)], unit: Literal["celsius", "fahrenheit"]
    ) -> str:
        """The current weather in a city."""
        calls.append(f"get_weather({city!r}, {unit!r})")
        return TOOL_RESULT

    effort = target.effort()
    settings = ModelSettings(
        temperature=0, max_tokens=CONSTRAINED_TOKENS, tool_choice="required",
        parallel_tool_calls=False,
        reasoning=None if effort is None else Reasoning(effort=effort),  # type: ignore[arg-type]
    )  # fmt: skip
    weather = Agent(name="weather", instructions="You answer questions about the weather.",
                    tools=[get_weather], model=target.model, model_settings=settings)  # fmt: skip
    try:
        result = asyncio.run(Runner.run(weather, WEATHER, max_turns=4))
    except ModelBehaviorError as e:
        # The SDK fails a run whose answer was cut at max_output_tokens. A model that never ends
        # its text (a random one never writes its EOS) gets there after its call: the protocol
        # ran, the text is the model's.
        if not calls or "max_output_tokens" not in str(e):
            raise
        return f"{', '.join(calls)} -> the answer cut at max_output_tokens (never ended)"
    assert calls and isinstance(result.final_output, str)
    return f"{', '.join(calls)} -> {result.final_output!r}"


def _chat_openai(target: Target, max_tokens: int) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=target.base_url, api_key="unused", model=target.model,
                      temperature=0, max_tokens=max_tokens, use_responses_api=True,
                      max_retries=0, reasoning=target.reasoning().get("reasoning"))  # fmt: skip


def langchain_invoke(target: Target) -> str:
    message = _chat_openai(target, 64).invoke(QUESTION)
    assert message.type == "ai" and message.response_metadata["status"] in ENDS
    return repr(message.text)


def langchain_tools(target: Target) -> str:
    llm = _chat_openai(target, CONSTRAINED_TOKENS)
    llm = llm.bind_tools([GetWeather], tool_choice="GetWeather")
    (call,) = llm.invoke(WEATHER).tool_calls
    GetWeather.model_validate(call["args"])
    return f"{call['name']}({call['args']})"


CHECKS = {
    "openai responses.create": create,
    "openai responses.create stream": stream,
    "openai responses function-call round trip": function_round_trip,
    "openai responses.parse (text.format json_schema)": parse,
    "openai-agents agent with a function tool": agent,
    "LangChain ChatOpenAI(use_responses_api) invoke": langchain_invoke,
    "LangChain ChatOpenAI(use_responses_api) bind_tools": langchain_tools,
}
