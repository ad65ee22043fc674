"""Anthropic's Messages API over a real socket, through the official anthropic SDK: an answer
equal to the chat completion of the same conversation (stop sequences too), a stream whose
deltas add up to it, a tool use round trip, count_tokens equal to the usage, errors in
Anthropic's shape (a missing max_tokens, an image, a wrong x-api-key, a full queue), and a
client that hangs up mid-stream (or mid-answer) aborting its request."""

import json
from typing import Literal

import anthropic
import jsonschema
import pydantic
import pytest

from nanoserve.engine import CompletionOutput, RequestMetrics, RequestOutput
from nanoserve.server.anthropic_format import MessageEvents
from nanoserve.server.protocol import ChatChunkChoice, ChatCompletionChunk
from nanoserve.testing.harness import MODEL_NAME, hang_up, live_server, open_request, read_until

BLOCKS = 256
M, X = "/v1/messages", "/v1/chat/completions"
SYSTEM = "You answer briefly."
CONVERSATION = [
    {"role": "user", "content": "She wrote the weather"},
    {"role": "assistant", "content": "in the log"},
    {"role": "user", "content": [{"type": "text", "text": "and then?"},
                                 {"type": "text", "text": "Go on."}]},
]  # fmt: skip
GREEDY = {"temperature": 0}  # the SDK has no temperature argument (any more): extra_body
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
# The tiny model may end at any token; a string of 4000 characters or more keeps it writing.
ENDLESS = {"format": {"type": "json_schema", "schema": {"type": "string", "minLength": 4000}}}
BUDGET = 1500  # tokens a departing request asks for
AFTER_HANG_UP = 16  # tokens the engine may still generate once the client is gone


@pytest.fixture
async def server(tiny_model_dir):
    async with live_server(tiny_model_dir, num_kv_blocks=BLOCKS) as s:
        yield s


@pytest.fixture
async def claude(server):
    async with anthropic.AsyncAnthropic(base_url=server.url, api_key="unused", max_retries=0) as c:
        yield c


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def _error(response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    return body["error"]["message"]


def _events(raw: bytes) -> list[tuple[str, dict]]:
    """An SSE body's events: each is `event: NAME` and `data: JSON` whose type is NAME."""
    events = []
    for block in raw.decode().split("\n\n")[:-1]:
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        events.append((name[7:], json.loads(data[6:])))
        assert events[-1][1]["type"] == events[-1][0]
    return events


async def test_an_answer_is_the_chat_completions_answer(server, claude):
    """The same conversation (a system prompt, text blocks) greedy: the same text and tokens,
    the usage in Anthropic's names; a stop sequence ends the answer as a stop string ends the
    chat's. Counted in the metrics as any request."""
    chat = [{"role": "system", "content": SYSTEM}, *CONVERSATION]
    expected = await server.http.post(X, json={"messages": chat, "max_tokens": 12, **GREEDY})
    choice, usage = expected.json()["choices"][0], expected.json()["usage"]
    reply = await claude.messages.create(
        model=MODEL_NAME, system=SYSTEM, messages=CONVERSATION, max_tokens=12,
        metadata={"user_id": "u1"}, extra_body=GREEDY,
    )  # fmt: skip
    assert reply.id.startswith("msg_") and reply.type == "message" and reply.role == "assistant"
    assert reply.model == MODEL_NAME and _text(reply) == choice["message"]["content"]
    assert reply.stop_reason == "max_tokens" and reply.stop_sequence is None
    prompt = reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    assert prompt == usage["prompt_tokens"] and reply.usage.output_tokens == 12
    text = _text(reply)
    stop = text[len(text) // 2 :][:2]
    stopped = await claude.messages.create(
        model=MODEL_NAME, system=SYSTEM, messages=CONVERSATION, max_tokens=12,
        stop_sequences=[stop], extra_body=GREEDY,
    )  # fmt: skip
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert _text(stopped) == text[: text.index(stop)]
    assert await server.metric("nanoserve:request_success_total") == 3


async def test_a_stream_adds_up_to_the_answer(server, claude):
    """The SDK's stream: its text deltas join into the unary answer, its final message has the
    same stop reason and usage. On the wire: message_start, a ping, the block, message_delta,
    message_stop, each event named as its data's type."""
    ask = {"model": MODEL_NAME, "system": SYSTEM, "messages": CONVERSATION, "max_tokens": 10}
    unary = await claude.messages.create(**ask, extra_body=GREEDY)
    async with claude.messages.stream(**ask, extra_body=GREEDY) as stream:
        text = "".join([delta async for delta in stream.text_stream])
        final = await stream.get_final_message()
    assert text == _text(final) == _text(unary)
    assert final.stop_reason == unary.stop_reason == "max_tokens"
    assert final.usage.output_tokens == unary.usage.output_tokens == 10
    total = final.usage.input_tokens + final.usage.cache_read_input_tokens
    assert total == unary.usage.input_tokens + unary.usage.cache_read_input_tokens
    response = await server.http.post(M, json={**ask, **GREEDY, "stream": True})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = _events(response.content)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["usage"]["input_tokens"] == total
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 10


async def test_a_tool_use_round_trip(server, claude):
    """tool_choice "tool" makes the random model call: a tool_use block (id toolu_..., input
    matching the schema), stop_reason "tool_use", streamed as the same call; its result goes
    back as a tool_result block and the next answer is text."""
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = {"model": MODEL_NAME, "tools": [WEATHER], "max_tokens": 200,
              "tool_choice": {"type": "tool", "name": "get_weather"}}  # fmt: skip
    reply = await claude.messages.create(**forced, messages=question, extra_body=GREEDY)
    assert reply.stop_reason == "tool_use", reply
    (call,) = reply.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    async with claude.messages.stream(**forced, messages=question, extra_body=GREEDY) as stream:
        final = await stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [
        ("tool_use", "get_weather", call.input)
    ]
    response = await server.http.post(M, json={**forced, **GREEDY, "messages": question,
                                               "stream": True})  # fmt: skip
    deltas = [e["delta"] for name, e in _events(response.content) if name == "content_block_delta"]
    assert [d["type"] for d in deltas] == ["input_json_delta"]
    assert json.loads(deltas[0]["partial_json"]) == call.input
    history = [
        *question,
        reply.to_param(),
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"},
        ]},
    ]  # fmt: skip
    after = await claude.messages.create(
        model=MODEL_NAME, tools=[WEATHER], tool_choice={"type": "none"}, messages=history,
        max_tokens=8, extra_body=GREEDY,
    )  # fmt: skip
    assert after.stop_reason in ("max_tokens", "end_turn") and _text(after)
    assert all(b.type == "text" for b in after.content)
    errors = [*history[:2], {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": call.id, "is_error": True,
         "content": [{"type": "text", "text": "no such city"}]},
    ]}]  # fmt: skip
    counted = await claude.messages.count_tokens(model=MODEL_NAME, messages=errors)
    error_text = "Error: no such city"
    plain = [*errors[:2], {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": call.id, "content": error_text}]}]  # fmt: skip
    assert (
        counted.input_tokens
        == (await claude.messages.count_tokens(model=MODEL_NAME, messages=plain)).input_tokens
    )


class City(pydantic.BaseModel):
    # The SDK moves a string's or a number's bounds into the description (Anthropic's structured
    # outputs do not hold them): a random model could write such a value for ever.
    name: Literal["Paris", "Rome"]
    capital: bool


async def test_the_sdk_parse_holds_the_answer_to_its_model(claude):
    """messages.parse(output_format=...) sends output_config.format: the answer is held to the
    model's schema (a structured output), and the SDK parses it."""
    for ask in ("What is the weather in Paris?", "She wrote the weather"):
        reply = await claude.messages.parse(
            model=MODEL_NAME, max_tokens=300, output_format=City, extra_body=GREEDY,
            messages=[{"role": "user", "content": ask}],
        )  # fmt: skip
        assert reply.stop_reason == "end_turn", reply
        assert isinstance(reply.parsed_output, City)


async def test_count_tokens_is_the_prompt_the_answer_counts(server, claude):
    """count_tokens (system and tools in the prompt) equals the answer's input_tokens; asked
    again, the prefix cache holds most of the prompt: cache_read_input_tokens, and input_tokens
    the rest."""
    ask = {"model": MODEL_NAME, "system": SYSTEM * 4, "tools": [WEATHER],
           "messages": [{"role": "user", "content": "She wrote the weather " * 8}]}  # fmt: skip
    counted = (await claude.messages.count_tokens(**ask)).input_tokens
    without_tools = await claude.messages.count_tokens(
        **{k: v for k, v in ask.items() if k != "tools"}
    )
    assert without_tools.input_tokens < counted
    first = await claude.messages.create(**ask, max_tokens=1)
    assert first.usage.input_tokens == counted and first.usage.cache_read_input_tokens == 0
    again = await claude.messages.create(**ask, max_tokens=1)
    cached = again.usage.cache_read_input_tokens
    assert cached >= 16 and again.usage.input_tokens + cached == counted


async def test_errors_in_anthropics_shape(server, claude):
    """A refusal names the field as this API calls it, under Anthropic's error type."""
    user = {"role": "user", "content": "hi"}
    refused = [
        ({"messages": [user]}, "max_tokens is required"),
        ({"max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}]}]},
         "messages.0.content.1: image blocks are not supported"),
        ({"max_tokens": 2, "messages": [user], "top_n": 2},
         "unrecognized request argument supplied: top_n"),
        ({"max_tokens": 2, "messages": [user], "thinking": {"type": "enabled",
                                                             "budget_tokens": 8}},
         "thinking.budget_tokens needs a reasoning parser"),
        ({"max_tokens": 2, "messages": [user], "tools": [WEATHER], "output_config": ENDLESS},
         "output_config.format"),
        ({"max_tokens": 2, "messages": [user], "stop_sequences": ["x"] * 17},
         "stop_sequences: at most 16"),
        ({"max_tokens": 2, "messages": [user], "tools": [WEATHER],
          "tool_choice": {"type": "tool", "name": "get_time"}}, "tool_choice.name"),
        ({"max_tokens": 10**6, "messages": [user]}, "max_tokens"),
    ]  # fmt: skip
    for body, message in refused:
        assert message in _error(await server.http.post(M, json=body), 400, "invalid_request_error")
    missing = {"model": "claude-sonnet-4-5", "max_tokens": 2, "messages": [user]}
    assert "claude-sonnet-4-5" in _error(await server.http.post(M, json=missing), 404,
                                         "not_found_error")  # fmt: skip
    image = {"role": "user", "content": [{"type": "image", "source": {}}]}
    counting = {"model": MODEL_NAME, "messages": [image]}
    response = await server.http.post(M + "/count_tokens", json=counting)
    assert "image" in _error(response, 400, "invalid_request_error")
    png = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}
    with pytest.raises(anthropic.BadRequestError) as raised:
        await claude.messages.create(
            model=MODEL_NAME, max_tokens=2,
            messages=[{"role": "user", "content": [{"type": "image", "source": png}]}],
        )  # fmt: skip
    assert raised.value.body["error"]["type"] == "invalid_request_error"
    assert "image" in raised.value.body["error"]["message"]


async def test_x_api_key_is_the_api_key(tiny_model_dir):
    """Under --api-key, x-api-key (the SDK's header, with anthropic-version and an
    anthropic-beta) is the key; a wrong one is 401 authentication_error."""
    async with live_server(tiny_model_dir, num_kv_blocks=BLOCKS, api_key="s3cret") as server:
        async with anthropic.AsyncAnthropic(
            base_url=server.url, api_key="s3cret", max_retries=0,
            default_headers={"anthropic-beta": "some-feature-2025-01-01"},
        ) as claude:  # fmt: skip
            reply = await claude.messages.create(
                model=MODEL_NAME, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
            )
            assert reply.usage.output_tokens == 2
        async with anthropic.AsyncAnthropic(
            base_url=server.url, api_key="wrong", max_retries=0
        ) as claude:
            with pytest.raises(anthropic.AuthenticationError) as raised:
                await claude.messages.count_tokens(
                    model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}]
                )
        assert raised.value.status_code == 401
        assert raised.value.body["error"]["type"] == "authentication_error"
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        keyed = await server.http.post(X, json=chat, headers={"Authorization": "",
                                                              "x-api-key": "s3cret"})  # fmt: skip
        assert keyed.status_code == 200


async def test_a_full_queue_is_529_overloaded(tiny_model_dir):
    async with live_server(
        tiny_model_dir, num_kv_blocks=BLOCKS, max_num_seqs=1, max_queue=1
    ) as server:
        long = {"prompt": "hi", "max_tokens": BUDGET, "ignore_eos": True}
        holder = await open_request(server, "/v1/completions", {**long, "stream": True})
        await read_until(holder, b"data: ")
        queued = await open_request(server, "/v1/completions", long)
        await server.wait_until(lambda h: h["running"] == 1 and h["waiting"] == 1)
        body = {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        response = await server.http.post(M, json=body)
        assert "max queue 1" in _error(response, 529, "overloaded_error")
        assert response.headers["Retry-After"] == "1"
        await queued.aclose()
        await holder.aclose()
        await server.wait_idle()


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
async def test_a_client_that_hangs_up_is_aborted(server, stream):
    """A raw socket closed mid-stream (after the first text delta) or mid-answer: the engine
    stops within a few tokens and gives the blocks back."""
    body = {"max_tokens": BUDGET, "output_config": ENDLESS, "stream": stream,
            "messages": [{"role": "user", "content": "She wrote the weather"}]}  # fmt: skip
    client = await open_request(server, M, body)
    if stream:
        await read_until(client, b"text_delta")
    else:
        await server.wait_until(lambda h: h["generation_tokens"] >= 2)
    before = (await server.health())["generation_tokens"]
    await hang_up(client)
    idle = await server.wait_idle()
    server.engine.audit()
    assert idle["generation_tokens"] - before <= AFTER_HANG_UP
    assert await server.metric("nanoserve:requests_aborted_total") == 1
    assert await server.metric("nanoserve:generation_tokens_total") < BUDGET // 2


async def test_a_last_assistant_message_is_continued(server, claude):
    """Anthropic's prefill: the answer continues the last assistant message, as the chat
    route's continue_final_message; a system message in the list (the SDK's SystemMessageParam)
    is the system prompt's place too."""
    prefill = [*CONVERSATION, {"role": "assistant", "content": "She said"}]
    chat = {"messages": [{"role": "system", "content": SYSTEM}, *prefill], "max_tokens": 6,
            "continue_final_message": True, "add_generation_prompt": False, **GREEDY}  # fmt: skip
    expected = (await server.http.post(X, json=chat)).json()["choices"][0]["message"]["content"]
    reply = await claude.messages.create(
        model=MODEL_NAME, system=SYSTEM, messages=prefill, max_tokens=6, extra_body=GREEDY
    )
    assert _text(reply) == expected
    listed = [{"role": "system", "content": SYSTEM}, *CONVERSATION]
    counts = [
        (await claude.messages.count_tokens(model=MODEL_NAME, **ask)).input_tokens
        for ask in ({"system": SYSTEM, "messages": CONVERSATION}, {"messages": listed})
    ]
    assert counts[0] == counts[1]


async def test_a_stream_open_at_shutdown_ends_with_an_error_event(tiny_model_dir):
    async with live_server(tiny_model_dir, num_kv_blocks=BLOCKS) as server:
        body = {"max_tokens": BUDGET, "output_config": ENDLESS, "stream": True,
                "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
        client = await open_request(server, M, body)
        await read_until(client, b"text_delta")
        server.serving.close()
        raw = await read_until(client, b"\r\n0\r\n\r\n")  # the chunked body's end
        error = json.loads(raw.rsplit(b"event: error\ndata: ", 1)[1].split(b"\n\n")[0])
        assert error["type"] == "error" and error["error"]["type"] == "api_error"
        assert "shutting down" in error["error"]["message"]
        assert b"message_stop" not in raw
        await hang_up(client)
        await server.wait_idle()


def test_text_then_calls_are_blocks_in_turn():
    """Chat deltas of a text, then two calls: a text block, then a tool_use block per call
    (its input in one input_json_delta), each closed before the next opens."""

    def chunk(delta, finish=None):
        choice = ChatChunkChoice(index=0, delta=delta, finish_reason=finish)
        return ChatCompletionChunk(id="x", created=0, model="m", choices=[choice])

    def call(k, name, arguments):
        start = {"index": k, "id": f"call_{k}", "type": "function",
                 "function": {"name": name, "arguments": ""}}  # fmt: skip
        more = {"index": k, "function": {"arguments": arguments}}
        return [chunk({"tool_calls": [start]}), chunk({"tool_calls": [more]})]

    chunks = [chunk({"content": "Let me "}), chunk({"content": "look."}),
              *call(0, "f", '{"a": 1}'), *call(1, "g", "{}"), chunk({}, "tool_calls")]  # fmt: skip
    out = RequestOutput("0", [1, 2, 3], None, [CompletionOutput(0, "", [7] * 9, "stop")], True,
                        2, RequestMetrics(0.0, None, None, None, 0))  # fmt: skip
    events = MessageEvents("msg_1", "m").events(chunks, out)
    shape = [(n, d.get("index"), (d.get("delta") or d.get("content_block") or {}).get("type"))
             for n, d in events]  # fmt: skip
    assert shape == [
        ("content_block_start", 0, "text"),
        ("content_block_delta", 0, "text_delta"),
        ("content_block_delta", 0, "text_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, "tool_use"),
        ("content_block_delta", 1, "input_json_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("message_delta", None, None),
        ("message_stop", None, None),
    ]
    assert events[4][1]["content_block"]["name"] == "f"
    assert events[4][1]["content_block"]["id"].startswith("toolu_")
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    assert events[-2][1]["usage"] == {"input_tokens": 1, "output_tokens": 9,
                                      "cache_read_input_tokens": 2,
                                      "cache_creation_input_tokens": 0}  # fmt: skip
