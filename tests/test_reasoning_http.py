"""Reasoning over a real socket, on a tiny Qwen3 model with Qwen3's chat template (so the
`think` parser is on by default), taught (`memorize`) to think first, drafting a call inside
its thinking, then to call a tool; and to think before a JSON answer. The thinking comes back
as reasoning_content and reasoning, unary and streamed, and a call drafted in it is never a
call; a required call and a JSON schema wait for the end of the thinking; the thinking budget
forces </think>; reasoning_effort switches the thinking off; --reasoning-parser none leaves it
all in the content; a model that does not think refuses the fields that need it, by name."""

import json
from pathlib import Path

import jsonschema
import pytest

from nanoserve.server.chat_plan import chat_inputs
from nanoserve.server.protocol import ChatCompletionRequest, parse
from nanoserve.testing.harness import MODEL_NAME, live_server, sse_data
from nanoserve.testing.hf_families import memorize, write_qwen3_chat_checkpoint
from nanoserve.tokenizer import Tokenizer

QWEN3 = (Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text()
X = "/v1/chat/completions"
BLOCKS = 64
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
WEATHER = {
    "model": MODEL_NAME,
    "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
    "tools": [WEATHER_TOOL],
    "temperature": 0,
    "max_tokens": 200,
}
DRAFT = 'I could write <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
THOUGHT = DRAFT + "</tool_call> here, but not yet."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CITY = {
    "model": MODEL_NAME,
    "messages": [{"role": "user", "content": "Describe Paris as JSON."}],
    "temperature": 0,
    "max_tokens": 100,
}
CITY_THOUGHT = "A city object: its name and its country."
CITY_JSON = '{"name": "Paris", "country": "France"}'
CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "country": {"type": "string", "maxLength": 12},
    },
    "required": ["name", "country"],
}


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """The answers are taught after the prompts the server renders for these requests."""
    path = write_qwen3_chat_checkpoint(tmp_path_factory.mktemp("qwen3"), QWEN3)
    tok = Tokenizer.from_dir(path)
    end = [tok.token_id("<|im_end|>")]
    examples = []
    for body, answer in [
        (WEATHER, f"<think>\n{THOUGHT}\n</think>\n\n{CALL}"),
        (CITY, f"<think>\n{CITY_THOUGHT}\n</think>\n\n{CITY_JSON}"),
    ]:
        inputs = chat_inputs(parse(ChatCompletionRequest, json.dumps(body)), tok.chat_template)
        _, prompt = tok.render_chat(inputs.messages, **inputs.kwargs)
        examples.append((prompt, tok.encode(answer, add_special_tokens=False) + end))
    memorize(path, examples)
    return path


@pytest.fixture
async def server(qwen3_dir):
    async with live_server(qwen3_dir, num_kv_blocks=BLOCKS) as s:
        yield s


async def _unary(server, body):
    response = await server.http.post(X, json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


async def _streamed(server, body):
    """The stream's thinking, content, calls (name and arguments) and finish reason."""
    response = await server.http.post(X, json={**body, "stream": True})
    assert response.status_code == 200, response.text
    events = sse_data(response.content)
    assert events[-1] == "[DONE]"
    choices = [c for e in events[:-1] for c in json.loads(e)["choices"]]
    deltas = [c["delta"] for c in choices]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    assert reasoning == "".join(d.get("reasoning", "") for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    calls: dict[int, dict] = {}
    for part in (p for d in deltas for p in d.get("tool_calls", [])):
        call = calls.setdefault(part["index"], {"name": "", "arguments": ""})
        for key in ("name", "arguments"):
            call[key] += part.get("function", {}).get(key, "")
    finish = [c["finish_reason"] for c in choices if c.get("finish_reason")]
    return reasoning, content, [calls[k] for k in sorted(calls)], finish


async def test_the_thinking_comes_apart_and_a_call_drafted_in_it_is_no_call(server):
    """tool_choice auto: the thinking (with its drafted call) is reasoning_content and
    reasoning, the answer's call the one call, and the content null; the stream says the same."""
    choice = await _unary(server, WEATHER)
    message = choice["message"]
    assert message["reasoning_content"] == message["reasoning"] == THOUGHT
    calls = [c["function"] for c in message["tool_calls"]]
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert message["content"] is None and choice["finish_reason"] == "tool_calls"
    assert await _streamed(server, WEATHER) == (THOUGHT, "", calls, ["tool_calls"])


async def test_a_required_call_waits_for_the_end_of_the_thinking(server):
    """The call's grammar starts after </think>: the model thinks as it would, then calls."""
    for body in ({**WEATHER, "tool_choice": "required"},
                 {**WEATHER, "tool_choice": {"type": "function",
                                             "function": {"name": "get_weather"}}}):  # fmt: skip
        choice = await _unary(server, body)
        message = choice["message"]
        assert message["reasoning_content"] == THOUGHT and message["content"] is None
        (call,) = message["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert isinstance(json.loads(call["function"]["arguments"])["city"], str)
        reasoning, content, calls, _ = await _streamed(server, body)
        assert (reasoning, content) == (THOUGHT, "") and len(calls) == 1


async def test_a_json_schema_waits_for_the_end_of_the_thinking(server):
    choice = await _unary(server, CITY)
    assert choice["message"]["reasoning_content"] == CITY_THOUGHT
    assert choice["message"]["content"] == CITY_JSON
    schema = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}}
    for body in ({**CITY, "response_format": schema},
                 {**CITY, "response_format": schema, "thinking_token_budget": 2}):  # fmt: skip
        choice = await _unary(server, {**body, "max_tokens": 200})
        message = choice["message"]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(message["content"]), CITY_SCHEMA)
        if "thinking_token_budget" not in body:
            assert message["reasoning_content"] == CITY_THOUGHT


async def test_the_thinking_budget_forces_the_end_of_the_thinking(server):
    """With thinking_token_budget 3: <think>, the three tokens the model would have written,
    then </think>, forced; the reasoning is those three tokens' text."""
    tok = server.engine.tokenizer
    ask = {**WEATHER, "logprobs": True, "return_tokens_as_token_ids": True}
    free = await _unary(server, ask)
    budgeted = await _unary(server, {**ask, "thinking_token_budget": 3})
    ids = [[int(t["token"].split(":")[1]) for t in c["logprobs"]["content"]]
           for c in (free, budgeted)]  # fmt: skip
    think, end = tok.token_id("<think>"), tok.token_id("</think>")
    assert ids[0][0] == ids[1][0] == think and ids[1][1:4] == ids[0][1:4]
    assert ids[1][4] == end and end not in ids[0][:5]
    assert budgeted["message"]["reasoning_content"] == tok.decode(ids[1][1:4]).strip()
    reasoning, *_ = await _streamed(server, {**WEATHER, "thinking_token_budget": 3})
    assert reasoning == budgeted["message"]["reasoning_content"]


async def test_the_servers_thinking_budget_holds_where_a_request_gives_none(server, qwen3_dir):
    """`serve --thinking-token-budget 3`: a chat request without a budget thinks as one with
    thinking_token_budget 3; a request's own budget wins; the Responses API (which has no such
    field) is held to it too."""
    budgeted = await _unary(server, {**WEATHER, "thinking_token_budget": 3})
    own = await _unary(server, {**WEATHER, "thinking_token_budget": 5})
    async with live_server(qwen3_dir, num_kv_blocks=BLOCKS, thinking_token_budget=3) as held:
        assert _said(await _unary(held, WEATHER)) == _said(budgeted)
        assert _said(await _unary(held, {**WEATHER, "thinking_token_budget": 5})) == _said(own)
        body = {"model": MODEL_NAME, "input": WEATHER["messages"][0]["content"],
                "tools": [{"type": "function", **WEATHER_TOOL["function"]}],
                "temperature": 0, "max_output_tokens": 200}  # fmt: skip
        response = (await held.http.post("/v1/responses", json=body)).json()
    (thought,) = [item for item in response["output"] if item["type"] == "reasoning"]
    assert thought["content"][0]["text"] == budgeted["message"]["reasoning_content"]


def _said(choice: dict) -> tuple:
    """A chat answer without its call ids (new each time)."""
    m = choice["message"]
    calls = [c["function"] for c in m.get("tool_calls") or []]
    return m["reasoning_content"], m["content"], calls


async def test_a_prompt_that_opens_the_thinking_starts_the_output_in_it(qwen3_dir):
    """DeepSeek-R1's templates end the prompt with <think>: the output is thinking from its
    first token (no <think> of its own: banned here), and the budget counts from there."""
    opened = QWEN3.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'")
    assert opened != QWEN3
    async with live_server(qwen3_dir, num_kv_blocks=BLOCKS, chat_template=opened) as s:
        tok = s.engine.tokenizer
        body = {**CITY, "max_tokens": 8, "thinking_token_budget": 2, "logprobs": True,
                "return_tokens_as_token_ids": True,
                "logit_bias": {str(tok.token_id("<think>")): -100}}  # fmt: skip
        choice = await _unary(s, body)
    ids = [int(t["token"].split(":")[1]) for t in choice["logprobs"]["content"]]
    assert ids[2] == tok.token_id("</think>")
    assert choice["message"]["reasoning_content"] == (tok.decode(ids[:2]).strip() or None)
    assert choice["message"]["content"] == (tok.decode(ids[3:]).lstrip() or None)


async def test_reasoning_effort_renders_the_thinking_off(server):
    """ "none" and "minimal" render with enable_thinking false (Qwen3's template closes an empty
    thinking in the prompt); "low" to "high" leave it on."""
    tok = server.engine.tokenizer
    closed = len(tok.encode("<think>\n\n</think>\n\n", add_special_tokens=False))
    short = {**CITY, "max_tokens": 1}

    async def prompt_tokens(**fields) -> int:
        response = await server.http.post(X, json={**short, **fields})
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens"]

    thinking = await prompt_tokens()
    for effort in ("none", "minimal"):
        assert await prompt_tokens(reasoning_effort=effort) == thinking + closed
    for effort in ("low", "medium", "high"):
        assert await prompt_tokens(reasoning_effort=effort) == thinking
    off = {"enable_thinking": False}
    assert await prompt_tokens(chat_template_kwargs=off) == thinking + closed
    response = await server.http.post(
        X, json={**short, "reasoning_effort": "high", "chat_template_kwargs": off}
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "reasoning_effort"


async def test_an_earlier_turns_thinking_is_taken(server):
    """reasoning_content (or reasoning) on an assistant message reaches Qwen3's template."""
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    history = [
        *WEATHER["messages"],
        {"role": "assistant", "content": None, "reasoning": "Ask.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    response = await server.http.post("/tokenize", json={"messages": history})
    assert response.status_code == 200, response.text
    text = server.engine.tokenizer.decode(response.json()["tokens"])
    assert "<think>\nAsk.\n</think>" in text
    choice = await _unary(server, {**WEATHER, "messages": history, "max_tokens": 4})
    assert choice["finish_reason"] in ("length", "stop")


async def test_reasoning_parser_none_leaves_the_thinking_in_the_content(qwen3_dir):
    """Without the parser the thinking is text like any other: its drafted call is read as a
    call too (what the parser is there to prevent)."""
    async with live_server(qwen3_dir, num_kv_blocks=BLOCKS, reasoning_parser="none") as s:
        message = (await _unary(s, WEATHER))["message"]
    assert message["reasoning_content"] is None and message["content"].startswith("<think>")
    cities = [json.loads(c["function"]["arguments"])["city"] for c in message["tool_calls"]]
    assert cities == ["Rome", "Paris"]


async def test_a_model_that_does_not_think_refuses_what_needs_thinking(tiny_model_dir):
    """The default tiny model's template has no <think>: no parser, so a budget is refused, and
    so is reasoning_effort "none" (no enable_thinking switch); "high" is taken."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with live_server(tiny_model_dir, num_kv_blocks=BLOCKS) as s:
        refused = [({"thinking_token_budget": 8}, "thinking_token_budget"),
                   ({"reasoning_effort": "none"}, "reasoning_effort"),
                   ({"reasoning_effort": "max"}, "reasoning_effort"),
                   ({"thinking_token_budget": -1}, "thinking_token_budget")]  # fmt: skip
        for fields, param in refused:
            response = await s.http.post(X, json={**chat, **fields})
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == param
        response = await s.http.post(X, json={**chat, "reasoning_effort": "high"})
        assert response.status_code == 200
        assert response.json()["choices"][0]["message"]["reasoning_content"] is None
