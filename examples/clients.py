"""The clients agent builders use, against a running `nanoserve serve`: the openai SDK's parse(),
LangChain's with_structured_output and bind_tools, instructor's TOOLS and JSON_SCHEMA modes.
Each prints what it got and the script exits 1 if any of them failed.

    nanoserve serve &            # the default model, SmolLM2-135M-Instruct
    python examples/clients.py [--base-url http://127.0.0.1:8000/v1]
    python examples/clients.py --serve    # starts `nanoserve serve` itself, stops it after

`nox -s clients` installs the clients (langchain-openai, instructor) and runs it with --serve.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator

import openai
from pydantic import BaseModel, Field


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population_millions: int = Field(ge=0, le=100)


class GetWeather(BaseModel):
    """The current weather in a city."""

    city: str = Field(max_length=40, description="the city's name")
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


QUESTION = "Describe the capital of France."
WEATHER = "What is the weather in Paris, in celsius?"


def openai_parse(base_url: str, model: str) -> str:
    client = openai.OpenAI(base_url=base_url, api_key="unused")
    reply = client.beta.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": QUESTION}], response_format=City,
        temperature=0, max_tokens=200,
    )  # fmt: skip
    city = reply.choices[0].message.parsed
    assert isinstance(city, City)
    return repr(city)


def openai_tool_round_trip(base_url: str, model: str) -> str:
    client = openai.OpenAI(base_url=base_url, api_key="unused")
    tools = [openai.pydantic_function_tool(GetWeather)]
    messages: list = [{"role": "user", "content": WEATHER}]
    first = client.chat.completions.create(
        model=model, messages=messages, tools=tools, tool_choice="required", temperature=0,
        max_tokens=100,
    )  # fmt: skip
    call = first.choices[0].message.tool_calls[0]
    GetWeather.model_validate_json(call.function.arguments)
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'})
    final = client.chat.completions.create(
        model=model, messages=messages, tools=tools, temperature=0, max_tokens=40
    )
    answer = final.choices[0].message.content
    return f"{call.function.name}({call.function.arguments}) -> {answer!r}"


def langchain_structured(base_url: str, model: str) -> str:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=base_url, api_key="unused", model=model, temperature=0,
                     max_tokens=200)  # fmt: skip
    city = llm.with_structured_output(City).invoke(QUESTION)
    assert isinstance(city, City)
    return repr(city)


def langchain_tools(base_url: str, model: str) -> str:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=base_url, api_key="unused", model=model, temperature=0,
                     max_tokens=100)  # fmt: skip
    message = llm.bind_tools([GetWeather], tool_choice="GetWeather").invoke(WEATHER)
    (call,) = message.tool_calls
    GetWeather.model_validate(call["args"])
    return json.dumps(call)


def instructor_mode(mode_name: str) -> Callable[[str, str], str]:
    def run(base_url: str, model: str) -> str:
        import instructor

        client = instructor.from_openai(
            openai.OpenAI(base_url=base_url, api_key="unused"),
            mode=getattr(instructor.Mode, mode_name),
        )
        city = client.chat.completions.create(
            model=model, response_model=City, max_retries=0, temperature=0, max_tokens=200,
            messages=[{"role": "user", "content": QUESTION}],
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


@contextlib.contextmanager
def serve() -> Iterator[str]:
    """`nanoserve serve` on a free port; yields its OpenAI base URL."""
    command = [sys.executable, "-m", "nanoserve.cli", "serve", "--port", "0"]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:  # type: ignore[union-attr]
            ready = re.search(r"OpenAI API at (\S+)\)", line)
            if ready:
                yield ready[1]
                return
        raise RuntimeError("nanoserve serve exited before it was ready")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def run_all(base_url: str, model: str) -> int:
    failed = 0
    for name, check in CHECKS.items():
        try:
            print(f"{name}: ok: {check(base_url, model)}", flush=True)
        except Exception:
            failed += 1
            print(f"{name}: FAILED\n{traceback.format_exc()}", flush=True)
    return failed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--serve", action="store_true", help="start nanoserve serve for the run")
    args = ap.parse_args()
    if args.serve:
        with serve() as base_url:
            failed = run_all(base_url, args.model)
    else:
        failed = run_all(args.base_url, args.model)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
