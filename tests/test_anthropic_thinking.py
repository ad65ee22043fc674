"""Anthropic's thinking over a real socket, on a tiny Qwen3 model (Qwen3's chat template, so the
`think` parser is on) taught (`memorize`) to think before an answer, and before a tool call:
the thinking comes back as a thinking block before the text or the tool_use, unary and
streamed (thinking_delta, then an empty signature_delta); budget_tokens forces the end of the
thinking as thinking_token_budget does; display "omitted" empties it; "disabled" switches it off
in the template; an earlier turn's thinking block reaches the template."""

import json
from pathlib import Path

import anthropic
import pytest

from nanoserve.server.chat_plan import chat_inputs
from nanoserve.server.protocol import ChatCompletionRequest, parse
from nanoserve.server.protocol.anthropic import MessagesRequest, chat_body, parse_anthropic
from nanoserve.testing.harness import MODEL_NAME, live_server
from nanoserve.testing.hf_families import memorize, write_qwen3_chat_checkpoint
from nanoserve.tokenizer import Tokenizer

QWEN3 = (Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text()
M, X = "/v1/messages", "/v1/chat/completions"
BLOCKS = 64
WEATHER_TOOL = {
    "name": "get_weather",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"model": MODEL_NAME, "messages": QUESTION, "tools": [WEATHER_TOOL], "max_tokens": 200,
           "temperature": 0}  # fmt: skip
THOUGHT = "The weather: the tool knows it."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CITY = {
    "model": MODEL_NAME,
    "messages": [{"role": "user", "content": "Describe Paris."}],
    "max_tokens": 100,
    "temperature": 0,
    "thinking": {"type": "adaptive"},
}
CITY_THOUGHT = "A city: say where it is."
CITY_ANSWER = "Paris is the capital of France."


def _prompt(tok: Tokenizer, body: dict) -> list[int]:
    """The prompt the server renders for an Anthropic request."""
    req = parse_anthropic(MessagesRequest, json.dumps(body))
    chat = parse(ChatCompletionRequest, json.dumps(chat_body(req, switchable=True)))
    inputs = chat_inputs(chat, tok.chat_template)
    return tok.render_chat(inputs.messages, **inputs.kwargs)[1]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    path = write_qwen3_chat_checkpoint(tmp_path_factory.mktemp("qwen3"), QWEN3)
    tok = Tokenizer.from_dir(path)
    end = [tok.token_id("<|im_end|>")]
    examples = [
        (_prompt(tok, body), tok.encode(answer, add_special_tokens=False) + end)
        for body, answer in [
            (WEATHER, f"<think>\n{THOUGHT}\n</think>\n\n{CALL}"),
            (CITY, f"<think>\n{CITY_THOUGHT}\n</think>\n\n{CITY_ANSWER}"),
        ]
    ]
    memorize(path, examples)
    return path


@pytest.fixture
async def server(qwen3_dir):
    async with live_server(qwen3_dir, num_kv_blocks=BLOCKS) as s:
        yield s


@pytest.fixture
async def claude(server):
    async with anthropic.AsyncAnthropic(base_url=server.url, api_key="unused", max_retries=0) as c:
        yield c


async def _create(server, body: dict) -> dict:
    response = await server.http.post(M, json=body)
    assert response.status_code == 200, response.text
    return response.json()


async def _stream(server, body: dict) -> list[tuple[str, dict]]:
    """The stream's events, as (name, data) pairs (ping left out)."""
    response = await server.http.post(M, json={**body, "stream": True})
    assert response.status_code == 200, response.text
    events = []
    for block in response.text.split("\n\n")[:-1]:
        name, data = block.split("\n")
        if name != "event: ping":
            events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


def _blocks(events: list[tuple[str, dict]]) -> list[dict]:
    """The content blocks a stream's events build, as the SDK builds them."""
    blocks: list[dict] = []
    for name, data in events:
        if name == "content_block_start":
            assert data["index"] == len(blocks)
            blocks.append(dict(data["content_block"]))
        elif name == "content_block_delta":
            block, delta = blocks[data["index"]], data["delta"]
            key = {"thinking_delta": "thinking", "text_delta": "text",
                   "signature_delta": "signature", "input_json_delta": "partial_json"}  # fmt: skip
            field = key[delta["type"]]
            block[field] = block.get(field, "") + delta[field]
    for block in blocks:
        if "partial_json" in block:
            block["input"] = json.loads(block.pop("partial_json"))
    return blocks


async def test_the_thinking_is_a_block_before_the_text(server, claude):
    reply = await _create(server, CITY)
    assert reply["content"] == [
        {"type": "thinking", "thinking": CITY_THOUGHT, "signature": ""},
        {"type": "text", "text": CITY_ANSWER},
    ]
    assert reply["stop_reason"] == "end_turn"
    events = await _stream(server, CITY)
    assert _blocks(events) == reply["content"]
    kinds = [(n, d.get("delta", {}).get("type")) for n, d in events]
    thinking_end = kinds.index(("content_block_delta", "signature_delta"))
    assert kinds[thinking_end + 1] == ("content_block_stop", None)
    assert events[-2][1]["delta"]["stop_reason"] == "end_turn"
    ask = {k: v for k, v in CITY.items() if k != "temperature"}
    async with claude.messages.stream(**ask, extra_body={"temperature": 0}) as stream:
        final = await stream.get_final_message()
    assert [b.model_dump(exclude_none=True) for b in final.content] == reply["content"]
    again = await _create(server, {k: v for k, v in CITY.items() if k != "thinking"})
    assert again["content"] == reply["content"]  # the template's default: thinking on


async def test_the_thinking_comes_before_the_tool_use(server):
    """A call drafted in no text: the thinking, then the tool_use block; a forced call (tool
    choice "tool") waits for the end of the thinking."""
    for body in (WEATHER, {**WEATHER, "tool_choice": {"type": "tool", "name": "get_weather"}}):
        reply = await _create(server, body)
        (thinking, call) = reply["content"]
        assert thinking == {"type": "thinking", "thinking": THOUGHT, "signature": ""}
        assert call["type"] == "tool_use" and call["name"] == "get_weather"
        assert call["input"] == {"city": "Paris"} and reply["stop_reason"] == "tool_use"
        streamed = _blocks(await _stream(server, body))
        assert [b["type"] for b in streamed] == ["thinking", "tool_use"]
        assert streamed[0] == thinking and streamed[1]["input"] == call["input"]


async def test_budget_tokens_ends_the_thinking_as_thinking_token_budget(server):
    """thinking enabled with budget_tokens 3 is the chat route's thinking_token_budget 3; with
    display "omitted" the block is there, empty, and no thinking_delta is sent."""
    budgeted = {**CITY, "thinking": {"type": "enabled", "budget_tokens": 3}}
    reply = await _create(server, budgeted)
    chat = {"messages": CITY["messages"], "max_tokens": 100, "temperature": 0,
            "thinking_token_budget": 3}  # fmt: skip
    expected = (await server.http.post(X, json=chat)).json()["choices"][0]["message"]
    assert reply["content"][0] == {
        "type": "thinking", "thinking": expected["reasoning_content"], "signature": ""
    }  # fmt: skip
    assert len(server.engine.tokenizer.encode(reply["content"][0]["thinking"])) <= 3
    omitted = {**CITY, "thinking": {"type": "adaptive", "display": "omitted"}}
    reply = await _create(server, omitted)
    assert reply["content"][0] == {"type": "thinking", "thinking": "", "signature": ""}
    events = await _stream(server, omitted)
    types = [d["delta"]["type"] for n, d in events if n == "content_block_delta"]
    assert "thinking_delta" not in types and "signature_delta" in types
    assert _blocks(events)[1] == {"type": "text", "text": CITY_ANSWER}


async def test_disabled_switches_the_thinking_off_and_effort_leaves_it_on(server, claude):
    """Qwen3's template closes an empty thinking in the prompt when it is off."""
    tok = server.engine.tokenizer
    closed = len(tok.encode("<think>\n\n</think>\n\n", add_special_tokens=False))

    async def count(**fields) -> int:
        ask = {"model": MODEL_NAME, "messages": CITY["messages"], **fields}
        return (await claude.messages.count_tokens(**ask)).input_tokens

    on = await count(thinking={"type": "adaptive"})
    assert await count() == on
    assert await count(thinking={"type": "disabled"}) == on + closed
    for effort in ("low", "high", "max"):
        assert await count(output_config={"effort": effort}) == on
    assert await count(thinking={"type": "disabled"}, output_config={"effort": "high"}) == (
        on + closed
    )
    reply = await _create(server, {**CITY, "thinking": {"type": "disabled"}, "max_tokens": 4})
    assert reply["usage"]["input_tokens"] + reply["usage"]["cache_read_input_tokens"] == (
        on + closed
    )


async def test_an_earlier_turns_thinking_reaches_the_template(server, claude):
    """A thinking block of an earlier assistant turn is its reasoning_content, as the chat
    route takes it: the same prompt, with the thinking in it."""
    history = [
        *QUESTION,
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Ask.", "signature": "sig"},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
        ]},
    ]  # fmt: skip
    chat = [
        *QUESTION,
        {"role": "assistant", "content": None, "reasoning_content": "Ask.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
    ]  # fmt: skip
    response = await server.http.post("/tokenize", json={"messages": chat})
    assert response.status_code == 200, response.text
    text = server.engine.tokenizer.decode(response.json()["tokens"])
    assert "<think>\nAsk.\n</think>" in text
    tools = [
        {
            "type": "function",
            "function": {"name": "get_weather", "parameters": WEATHER_TOOL["input_schema"]},
        }
    ]
    body = {"messages": chat, "tools": tools, "max_tokens": 1}  # fmt: skip
    usage = (await server.http.post(X, json=body)).json()["usage"]
    counted = await claude.messages.count_tokens(
        model=MODEL_NAME, messages=history, tools=[WEATHER_TOOL]
    )
    assert counted.input_tokens == usage["prompt_tokens"]
    history[1]["content"] = history[1]["content"][1:]
    unthought = await claude.messages.count_tokens(
        model=MODEL_NAME, messages=history, tools=[WEATHER_TOOL]
    )
    assert unthought.input_tokens < counted.input_tokens
