"""Clients of /v1/chat/completions: the openai SDK's parse() and a tool round trip, LangChain's
ChatOpenAI (with_structured_output, bind_tools), instructor's TOOLS and JSON_SCHEMA modes."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

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


def openai_parse(target: Target) -> str:
    client = openai.OpenAI(base_url=target.base_url, api_key="unused")
    reply = client.beta.chat.completions.parse(
        model=target.model, messages=[{"role": "user", "content": QUESTION}],
        response_format=City, temperature=0, max_tokens=CONSTRAINED_TOKENS,
        extra_body=target.chat_extra(),
    )  # fmt: skip
    city = reply.choices[0].message.parsed
    assert isinstance(city, City)
    return repr(city)


def openai_tool_round_trip(target: Target) -> str:
    client = openai.OpenAI(base_url=target.base_url, api_key="unused")
    tools = [openai.pydantic_function_tool(GetWeather)]
    messages: list = [{"role": "user", "content": WEATHER}]
    first = client.chat.completions.create(
        model=target.model, messages=messages, tools=tools, tool_choice="required",
        temperature=0, max_tokens=CONSTRAINED_TOKENS, extra_body=target.chat_extra(),
    )  # fmt: skip
    call = first.choices[0].message.tool_calls[0]
    GetWeather.model_validate_json(call.function.arguments)
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": TOOL_RESULT})
    final = client.chat.completions.create(
        model=target.model, messages=messages, tools=tools, temperature=0, max_tokens=40,
        extra_body=target.chat_extra(),
    )  # fmt: skip
    choice = final.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    return f"{call.function.name}({call.function.arguments}) -> {choice.message.content!r}"


def _chat_openai(target: Target, max_tokens: int) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=target.base_url, api_key="unused", model=target.model,
                      temperature=0, max_tokens=max_tokens,
                      extra_body=target.chat_extra() or None)  # fmt: skip


def langchain_structured(target: Target) -> str:
    llm = _chat_openai(target, CONSTRAINED_TOKENS).with_structured_output(City)
    city = llm.invoke(QUESTION)
    assert isinstance(city, City)
    return repr(city)


def langchain_tools(target: Target) -> str:
    llm = _chat_openai(target, CONSTRAINED_TOKENS)
    llm = llm.bind_tools([GetWeather], tool_choice="GetWeather")
    (call,) = llm.invoke(WEATHER).tool_calls
    GetWeather.model_validate(call["args"])
    return json.dumps(call)


def instructor_mode(mode_name: str) -> Callable[[Target], str]:
    def run(target: Target) -> str:
        import instructor

        client = instructor.from_openai(
            openai.OpenAI(base_url=target.base_url, api_key="unused"),
            mode=getattr(instructor.Mode, mode_name),
        )
        city = client.chat.completions.create(
            model=target.model, response_model=City, max_retries=0, temperature=0,
            max_tokens=CONSTRAINED_TOKENS, messages=[{"role": "user", "content": QUESTION}],
            extra_body=target.chat_extra(),
        )  # fmt: skip
        assert isinstance(city, City)
        return repr(city)

    return run


CHECKS = {
    "openai parse()": openai_parse,
    "openai tool round trip": openai_tool_round_trip,
    "LangChain with_structured_output": langchain_structured,
    "LangChain bind_tools": langchain_tools,
    "instructor TOOLS": instructor_mode("TOOLS"),
    "instructor JSON_SCHEMA": instructor_mode("JSON_SCHEMA"),
}
