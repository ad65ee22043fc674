"""OpenAI's Responses API over a real socket, with the official openai client: a unary answer is
the chat completion's answer to the same conversation, a stream's deltas add up to it (numbered
events, the final response's usage), a forced function call and its output sent back with
previous_response_id, the store (previous_response_id, GET, DELETE, 404 in OpenAI's shape, the
oldest dropped first), text.format's JSON schema through the SDK's stream helper, what is not
implemented refused by name, and a stream whose client hangs up aborted."""

import json

import jsonschema
import openai
import pydantic
import pytest

from nanoserve.testing.harness import (
    MODEL_NAME,
    hang_up,
    live_server,
    open_request,
    read_until,
)

R, X = "/v1/responses", "/v1/chat/completions"
BLOCKS = 256
QUESTION = "What is the weather in Paris?"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}
FORCED = {"type": "function", "name": "get_weather"}


class Answer(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    answer: str = pydantic.Field(max_length=8)
    score: int = pydantic.Field(ge=0, le=9)


@pytest.fixture
async def server(tiny_model_dir):
    async with live_server(tiny_model_dir, num_kv_blocks=BLOCKS) as s:
        yield s


def _error(response, status):
    assert response.status_code == status, response.text
    return response.json()["error"]


async def _chat(client, messages, max_tokens):
    reply = await client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=max_tokens, temperature=0
    )
    return reply.choices[0], reply.usage


async def test_a_response_is_the_chat_completions_answer(server, client):
    """Greedy: the output text, the token counts and the cut at max_output_tokens are chat's for
    the same conversation (instructions the system message; parts of input_text joined)."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    choice, usage = await _chat(client, messages, 12)
    parts = [{"type": "input_text", "text": "What is the weather"},
             {"type": "input_text", "text": "in Paris?"}]  # fmt: skip
    for given in (QUESTION, [{"role": "user", "content": QUESTION}]):
        response = await client.responses.create(
            model=MODEL_NAME, instructions="Be brief.", input=given, max_output_tokens=12,
            temperature=0,
        )  # fmt: skip
        assert response.id.startswith("resp_") and response.object == "response"
        assert response.output_text == choice.message.content
        (message,) = response.output
        assert message.type == "message" and message.id.startswith("msg_")
        assert message.content[0].annotations == []
        assert response.usage.input_tokens == usage.prompt_tokens
        assert response.usage.output_tokens == usage.completion_tokens == 12
        assert response.usage.total_tokens == usage.total_tokens
        assert response.usage.output_tokens_details.reasoning_tokens == 0
        assert choice.finish_reason == "length" and response.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"
        assert message.status == "incomplete"
    joined = await client.responses.create(
        model=MODEL_NAME, input=[{"role": "user", "content": parts}], max_output_tokens=4,
        temperature=0,
    )  # fmt: skip
    choice, _ = await _chat(client, [{"role": "user", "content": "What is the weather\nin Paris?"}],
                            4)  # fmt: skip
    assert joined.output_text == choice.message.content
    assert joined.tools == [] and joined.tool_choice == "auto" and joined.temperature == 0


async def test_a_stream_adds_up_to_the_unary_answer(client):
    body = {"model": MODEL_NAME, "input": QUESTION, "max_output_tokens": 16, "temperature": 0}
    unary = await client.responses.create(**body)
    events = [e async for e in await client.responses.create(**body, stream=True)]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]  # fmt: skip
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    text = "".join(e.delta for e in deltas)
    assert text == unary.output_text
    item = events[-2].item
    assert {e.item_id for e in deltas} == {item.id} and item.content[0].text == text
    final = events[-1].response
    assert final.output_text == text and final.status == "incomplete"
    assert final.usage.output_tokens == 16
    assert final.usage.input_tokens == unary.usage.input_tokens


async def test_a_forced_call_and_its_output_sent_back(server, client):
    """tool_choice naming the function: the random model must call it, its arguments held to the
    schema; the output goes back with previous_response_id, and the answer after it is text.
    Streamed (raw events, and the SDK's stream helper), the call comes as an item and its
    arguments, equal to the unary call."""
    first = await client.responses.create(
        model=MODEL_NAME, input=QUESTION, tools=[WEATHER], tool_choice=FORCED,
        max_output_tokens=200, temperature=0,
    )  # fmt: skip
    assert first.status == "completed", first
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    second = await client.responses.create(
        model=MODEL_NAME, previous_response_id=first.id, tools=[WEATHER], max_output_tokens=4,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        temperature=0,
    )  # fmt: skip
    assert second.output_text and second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 16  # the first prompt's blocks
    events = [e async for e in await client.responses.create(
        model=MODEL_NAME, input=QUESTION, tools=[WEATHER], tool_choice=FORCED,
        max_output_tokens=200, temperature=0, stream=True,
    )]  # fmt: skip
    arguments = "".join(e.delta for e in events if e.type.endswith("arguments.delta"))
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert arguments == done.arguments == call.arguments
    assert events[-1].type == "response.completed"
    (streamed,) = events[-1].response.output
    assert (streamed.name, streamed.arguments) == (call.name, call.arguments)
    async with client.responses.stream(
        model=MODEL_NAME, input=QUESTION, tools=[WEATHER], tool_choice=FORCED,
        max_output_tokens=200, temperature=0,
    ) as stream:  # fmt: skip
        (helped,) = (await stream.get_final_response()).output
    assert (helped.name, helped.arguments) == (call.name, call.arguments)


async def test_previous_response_id_get_and_delete(server, client):
    """A response continued is the chat of its whole conversation; a stored response comes back
    from GET until DELETE; an unknown id is a 404 in OpenAI's shape; store false keeps none."""
    first = await client.responses.create(
        model=MODEL_NAME, input="hi", max_output_tokens=4, temperature=0
    )
    second = await client.responses.create(
        model=MODEL_NAME, input="and then?", previous_response_id=first.id, max_output_tokens=4,
        temperature=0,
    )  # fmt: skip
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "and then?"}]  # fmt: skip
    choice, usage = await _chat(client, history, 4)
    assert second.output_text == choice.message.content
    assert second.usage.input_tokens == usage.prompt_tokens
    fetched = await client.responses.retrieve(second.id)
    assert fetched.model_dump() == second.model_dump()
    await client.responses.delete(second.id)
    for call in (client.responses.retrieve(second.id), client.responses.delete(second.id)):
        with pytest.raises(openai.NotFoundError):
            await call
    unknown = await server.http.post(R, json={"input": "hi", "previous_response_id": "resp_x"})
    error = _error(unknown, 404)
    assert error["param"] == "previous_response_id"
    assert error["code"] == "previous_response_not_found" and "resp_x" in error["message"]
    assert _error(await server.http.get(f"{R}/resp_x"), 404)["type"] == "invalid_request_error"
    unstored = await client.responses.create(
        model=MODEL_NAME, input="hi", max_output_tokens=1, store=False
    )
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(unstored.id)


async def test_the_store_drops_the_oldest_response(tiny_model_dir):
    async with live_server(tiny_model_dir, num_kv_blocks=BLOCKS, responses_store_size=2) as s:
        ids = []
        for _ in range(3):
            reply = await s.http.post(R, json={"input": "hi", "max_output_tokens": 1})
            ids.append(reply.json()["id"])
        assert _error(await s.http.get(f"{R}/{ids[0]}"), 404)
        body = {"input": "more", "previous_response_id": ids[0]}
        assert _error(await s.http.post(R, json=body), 404)["param"] == "previous_response_id"
        for kept in ids[1:]:
            assert (await s.http.get(f"{R}/{kept}")).json()["id"] == kept


async def test_text_format_json_schema_through_the_sdks_stream_helper(client):
    """The SDK's responses.stream with a pydantic model: the output parses, and matches."""
    async with client.responses.stream(
        model=MODEL_NAME, input="Answer as JSON.", text_format=Answer, max_output_tokens=200,
        temperature=0,
    ) as stream:  # fmt: skip
        final = await stream.get_final_response()
    assert final.status == "completed"
    assert isinstance(final.output_parsed, Answer)
    unary = await client.responses.create(
        model=MODEL_NAME, input="Answer as JSON.", max_output_tokens=200, temperature=0,
        text={"format": {"type": "json_schema", "name": "answer", "strict": True,
                         "schema": Answer.model_json_schema()}},
    )  # fmt: skip
    jsonschema.validate(json.loads(unary.output_text), Answer.model_json_schema())
    assert unary.output_text == final.output_text
    assert unary.text.format.type == "json_schema"
    anything = await client.responses.create(
        model=MODEL_NAME, input="JSON", max_output_tokens=200, temperature=0,
        text={"format": {"type": "json_object"}},
    )  # fmt: skip
    assert anything.output_text.startswith("{")  # an object (greedy, it runs past 200 tokens)
    assert anything.text.format.type == "json_object"


REFUSED = [
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [{**WEATHER, "defer_loading": True}]}, "tools.0.defer_loading"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input.0.content.0.type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "x"}]},
     "input.0.encrypted_content"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"background": True}, "background"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"priority": 1}, "priority"),
    ({"top_k": -2}, "top_k"),
    ({"text": {"verbosity": "high"}}, "text.verbosity"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
     "text.format.schema"),
    ({"text": {"format": {"type": "json_object"}}, "tools": [WEATHER]}, "text.format"),
    ({"tool_choice": {"type": "web_search_preview"}, "tools": [WEATHER]}, "tool_choice"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 5000}, "max_output_tokens"),
    ({"reasoning": {"effort": "none"}}, "reasoning.effort"),
    ({"input": []}, "input"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "param"), REFUSED, ids=[p for _, p in REFUSED])
async def test_what_is_not_implemented_is_refused_by_name(server, fields, param):
    response = await server.http.post(R, json={"input": "hi", **fields})
    error = _error(response, 400)
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert param.split(".")[-1] in error["message"] or "input" in param, error


async def test_a_client_that_hangs_up_mid_stream_is_aborted(server):
    body = {"input": "She wrote the weather", "stream": True, "max_output_tokens": 1500,
            "temperature": 0}  # fmt: skip
    stream = await open_request(server, R, body)
    await read_until(stream, b"response.output_text.delta")
    before = (await server.health())["generation_tokens"]
    await hang_up(stream)
    idle = await server.wait_idle()
    assert idle["generation_tokens"] - before <= 16
    server.engine.audit()
    assert await server.metric("nanoserve:requests_aborted_total") == 1
    assert await server.metric("nanoserve:generation_tokens_total") < 750


async def test_requests_open_at_shutdown_end_cleanly(tiny_model_dir):
    """A server that stops: a unary request gets chat's 503, a stream an error event."""
    async with live_server(tiny_model_dir, num_kv_blocks=BLOCKS) as server:
        body = {"input": "She wrote the weather", "max_output_tokens": 1500, "temperature": 0}
        unary = await open_request(server, R, body)
        stream = await open_request(server, R, {**body, "stream": True})
        await read_until(stream, b"response.output_text.delta")
        await server.wait_until(lambda h: h["running"] == 2)
        server.serving.close()
        raw = await read_until(unary, b"}}")
        assert raw.startswith(b"HTTP/1.1 503") and b"shutting down" in raw
        raw = await read_until(stream, b"event: error")
        while chunk := await stream.receive_some():  # to the end of the response
            raw += chunk
        error = json.loads(raw.rsplit(b"event: error\ndata: ", 1)[1].split(b"\n")[0])
        assert error["type"] == "error" and error["code"] == "server_error"
        assert "shutting down" in error["message"]
        await server.wait_idle()
