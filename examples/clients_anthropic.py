"""Clients of the Anthropic Messages API (/v1/messages): the anthropic SDK's messages.create,
messages.stream, a tool-use round trip and count_tokens; LangChain's ChatAnthropic."""

from __future__ import annotations

from typing import Any

from client_shared import CONSTRAINED_TOKENS, QUESTION, TOOL_RESULT, WEATHER, GetWeather, Target

SYSTEM = "You answer in one sentence."
MESSAGES = [{"role": "user", "content": QUESTION}]
WEATHER_TOOL = {
    "name": "get_weather",
    "description": GetWeather.__doc__,
    "input_schema": GetWeather.model_json_schema(),
}
ENDS = ("end_turn", "max_tokens", "tool_use")  # what free text may end with
GREEDY = {"extra_body": {"temperature": 0}}  # the SDK's create() has no temperature argument


def _client(target: Target) -> Any:
    import anthropic

    return anthropic.Anthropic(base_url=target.root, api_key="unused", max_retries=0)


def _text(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def messages_create(target: Target) -> str:
    message = _client(target).messages.create(
        model=target.model, max_tokens=64, system=SYSTEM, messages=MESSAGES, **GREEDY,
        **target.anthropic_thinking(),
    )  # fmt: skip
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.stop_reason in ENDS
    assert {b.type for b in message.content} <= {"text", "thinking"}
    assert message.usage.output_tokens > 0
    return f"{message.stop_reason}: {_text(message)!r}"


def messages_stream(target: Target) -> str:
    """The stream's text deltas add up to the text of the message it ends with."""
    with _client(target).messages.stream(
        model=target.model, max_tokens=64, system=SYSTEM, messages=MESSAGES, **GREEDY,
        **target.anthropic_thinking(),
    ) as stream:  # fmt: skip
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == _text(final) and final.stop_reason in ENDS
    return f"{len(texts)} text deltas, {final.stop_reason}: {_text(final)!r}"


def tool_round_trip(target: Target) -> str:
    """A forced tool_use (its input held to the schema), its result sent back, an answer."""
    client = _client(target)
    messages: list[dict[str, Any]] = [{"role": "user", "content": WEATHER}]
    first = client.messages.create(
        model=target.model, max_tokens=CONSTRAINED_TOKENS, messages=messages,
        tools=[WEATHER_TOOL], tool_choice={"type": "tool", "name": "get_weather"}, **GREEDY,
        **target.anthropic_thinking(),
    )  # fmt: skip
    assert first.stop_reason == "tool_use"
    (call,) = [b for b in first.content if b.type == "tool_use"]
    GetWeather.model_validate(call.input)
    messages.append({"role": "assistant", "content": first.content})
    result = {"type": "tool_result", "tool_use_id": call.id, "content": TOOL_RESULT}
    messages.append({"role": "user", "content": [result]})
    final = client.messages.create(
        model=target.model, max_tokens=40, messages=messages, tools=[WEATHER_TOOL], **GREEDY,
        **target.anthropic_thinking(),
    )  # fmt: skip
    assert final.stop_reason in ENDS
    return f"{call.name}({call.input}) -> {final.stop_reason}: {_text(final)!r}"


def count_tokens(target: Target) -> str:
    """count_tokens's input_tokens: what a message's usage counts, cached or not."""
    client = _client(target)
    counted = client.messages.count_tokens(model=target.model, system=SYSTEM, messages=MESSAGES)
    message = client.messages.create(
        model=target.model, max_tokens=1, system=SYSTEM, messages=MESSAGES, **GREEDY
    )
    usage = message.usage
    assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)
    return f"{counted.input_tokens} input tokens"


def _chat_anthropic(target: Target, max_tokens: int) -> Any:
    from langchain_anthropic import ChatAnthropic

    thinking = target.anthropic_thinking().get("thinking")
    # Anthropic's API refuses a temperature beside thinking; this server does not, the client
    # may: leave it out then.
    return ChatAnthropic(model=target.model, base_url=target.root, api_key="unused",
                         max_tokens=max_tokens, max_retries=0, thinking=thinking,
                         temperature=None if thinking else 0)  # fmt: skip


def langchain_invoke(target: Target) -> str:
    message = _chat_anthropic(target, 64).invoke(QUESTION)
    assert message.type == "ai" and message.response_metadata["stop_reason"] in ENDS
    return repr(message.text)


def langchain_tools(target: Target) -> str:
    llm = _chat_anthropic(target, CONSTRAINED_TOKENS)
    llm = llm.bind_tools([GetWeather], tool_choice="GetWeather")
    (call,) = llm.invoke(WEATHER).tool_calls
    GetWeather.model_validate(call["args"])
    return f"{call['name']}({call['args']})"


CHECKS = {
    "anthropic messages.create": messages_create,
    "anthropic messages.stream": messages_stream,
    "anthropic tool-use round trip": tool_round_trip,
    "anthropic count_tokens": count_tokens,
    "LangChain ChatAnthropic invoke": langchain_invoke,
    "LangChain ChatAnthropic bind_tools": langchain_tools,
}
