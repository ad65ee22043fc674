"""The Responses API on a reasoning model, and the openai-agents SDK on top of it: a tiny Qwen3
with Qwen3's chat template, taught (`memorize`) to think, then call get_weather; and, once the
call's output is back, to think again, then answer. Its thinking comes back as a reasoning item
(unary and streamed, its tokens counted); the reasoning item and the call sent back (by
previous_response_id, or whole as the agents SDK sends them) are the assistant turn the template
renders; and an agent with the one function tool, on the SDK's default Responses model, runs to
its final answer, unary and streamed."""

import asyncio
import json
from pathlib import Path

import openai
import pytest
import trio
from agents import (
    Agent,
    ModelSettings,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
    function_tool,
)

from nanoserve.server.chat_plan import chat_inputs
from nanoserve.server.protocol import parse
from nanoserve.server.protocol.responses_api import ResponsesRequest
from nanoserve.server.responses_api import chat_request
from nanoserve.testing.harness import MODEL_NAME, live_server
from nanoserve.testing.hf_families import memorize, write_qwen3_chat_checkpoint
from nanoserve.tokenizer import Tokenizer

QWEN3 = (Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text()
INSTRUCTIONS = "You answer questions about the weather."
QUESTION = "What is the weather in Paris?"
THOUGHT = "I should look it up."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ARGUMENTS = '{"city": "Paris"}'
SECOND_THOUGHT = "It is sunny there."
ANSWER = "It is sunny in Paris."


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return "sunny"


# The tool as the agents SDK sends it, so that the prompts taught are the prompts it asks for.
TOOL = {
    "type": "function",
    "name": get_weather.name,
    "description": get_weather.description,
    "parameters": get_weather.params_json_schema,
    "strict": get_weather.strict_json_schema,
}
FIRST = {
    "model": MODEL_NAME,
    "instructions": INSTRUCTIONS,
    "input": [{"role": "user", "content": QUESTION}],
    "tools": [TOOL],
    "temperature": 0,
    "max_output_tokens": 100,
}
CALLED = [
    {"type": "reasoning", "summary": [],
     "content": [{"type": "reasoning_text", "text": THOUGHT}]},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather",
     "arguments": ARGUMENTS},
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
]  # fmt: skip


def _prompt(tok: Tokenizer, body: dict) -> list[int]:
    """The prompt the server renders for a Responses API request."""
    req = parse(ResponsesRequest, json.dumps(body))
    inputs = chat_inputs(chat_request(req, req.items()), tok.chat_template)
    return tok.render_chat(inputs.messages, **inputs.kwargs)[1]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    path = write_qwen3_chat_checkpoint(tmp_path_factory.mktemp("qwen3"), QWEN3)
    tok = Tokenizer.from_dir(path)
    end = [tok.token_id("<|im_end|>")]
    second = {**FIRST, "input": FIRST["input"] + CALLED}
    examples = [
        (_prompt(tok, FIRST), f"<think>\n{THOUGHT}\n</think>\n\n{CALL}"),
        (_prompt(tok, second), f"<think>\n{SECOND_THOUGHT}\n</think>\n\n{ANSWER}"),
    ]
    memorize(path, [(p, tok.encode(a, add_special_tokens=False) + end) for p, a in examples])
    return path


@pytest.fixture
async def server(qwen3_dir):
    async with live_server(qwen3_dir, num_kv_blocks=64) as s:
        yield s


async def test_the_thinking_is_a_reasoning_item_and_goes_back_as_the_assistants(server, client):
    tok = server.engine.tokenizer
    first = await client.responses.create(**FIRST)
    reasoning, call = first.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert [c.text for c in reasoning.content] == [THOUGHT] and reasoning.summary == []
    assert (call.type, call.name, call.arguments) == ("function_call", "get_weather", ARGUMENTS)
    assert first.status == "completed" and first.output_text == ""
    thinking = len(tok.encode(f"<think>\n{THOUGHT}\n</think>", add_special_tokens=False))
    assert first.usage.output_tokens_details.reasoning_tokens == thinking
    events = [e async for e in await client.responses.create(**FIRST, stream=True)]
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    (done,) = [e for e in events if e.type == "response.reasoning_text.done"]
    assert deltas == done.text == THOUGHT
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "function_call"]
    assert final.usage.output_tokens_details.reasoning_tokens == thinking
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    second = await client.responses.create(
        **{**FIRST, "input": [output], "previous_response_id": first.id}
    )
    assert [item.type for item in second.output] == ["reasoning", "message"]
    assert second.output[0].content[0].text == SECOND_THOUGHT
    assert second.output_text == ANSWER and second.status == "completed"
    whole = await client.responses.create(**{**FIRST, "input": FIRST["input"] + CALLED})
    assert whole.output_text == ANSWER


async def test_reasoning_effort_switches_the_thinking(server, client):
    """reasoning.effort is chat's reasoning_effort: "none" renders the thinking closed (Qwen3's
    enable_thinking false); "xhigh" is "high", the thinking left on."""
    tok = server.engine.tokenizer
    closed = len(tok.encode("<think>\n\n</think>\n\n", add_special_tokens=False))

    async def input_tokens(**fields) -> int:
        body = {**FIRST, "max_output_tokens": 1, **fields}
        return (await client.responses.create(**body)).usage.input_tokens

    thinking = await input_tokens()
    assert await input_tokens(reasoning={"effort": "none"}) == thinking + closed
    assert await input_tokens(reasoning={"effort": "xhigh", "summary": "auto"}) == thinking


async def test_an_agent_with_a_function_tool_runs_to_its_final_answer(server):
    """The agents SDK's default Responses model on an AsyncOpenAI client of this server (tracing
    off): the model thinks and calls get_weather, the SDK runs it and sends back the thinking,
    the call and its output, and the model answers; unary, then streamed."""

    async def run(streamed: bool) -> str:
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0
        ) as client:
            model = OpenAIResponsesModel(model=MODEL_NAME, openai_client=client)
            agent = Agent(name="weather", instructions=INSTRUCTIONS, tools=[get_weather],
                          model=model, model_settings=ModelSettings(temperature=0))  # fmt: skip
            config = RunConfig(tracing_disabled=True)
            if not streamed:
                result = await Runner.run(agent, QUESTION, run_config=config)
                return str(result.final_output)
            stream = Runner.run_streamed(agent, QUESTION, run_config=config)
            async for _ in stream.stream_events():
                pass
            return str(stream.final_output)

    for streamed in (False, True):
        answer = await trio.to_thread.run_sync(asyncio.run, run(streamed))
        assert answer == ANSWER
