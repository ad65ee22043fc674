"""Structured outputs and tool calls through a real server and the official openai client:
response_format (json_object, json_schema and the SDK's parse() with a pydantic model), vLLM's
structured_outputs and guided_* fields, tools with tool_choice required, named and auto, a tool
round trip with the call and its result in the history, streamed equal to unary, tool schemas
that refer to their own definitions ($defs, definitions, #), a forced call cut by max_tokens, and
bad constraints refused with a 400 naming the field before anything is queued."""

import json
import re
from pathlib import Path
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

from nanoserve.testing.harness import MODEL_NAME, live_server, sse_data

C, X = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8},
                           "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}  # fmt: skip
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 8},
                   "score": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["answer", "score"],
    "additionalProperties": False,
}  # fmt: skip


class Answer(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    answer: str = pydantic.Field(max_length=8)
    score: int = pydantic.Field(ge=0, le=9)


class WeatherOptions(pydantic.BaseModel):
    unit: Literal["C", "F"]
    days: int = pydantic.Field(ge=1, le=7)


class WeatherQuery(pydantic.BaseModel):
    """Its schema, as pydantic writes a nested model: the nested one in `$defs`, a `$ref` to
    `#/$defs/WeatherOptions` where it is used."""

    city: str = pydantic.Field(max_length=8)
    options: WeatherOptions


NESTED = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": WeatherQuery.model_json_schema()},
}
# Older pydantic (and other writers) put the definitions under `definitions`; a string that
# looks like a reference (in `const`) is a value, not a reference.
DEFINITIONS = {
    "definitions": {
        "Zone": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
        }
    },
    "type": "object",
    "properties": {"where": {"$ref": "#/definitions/Zone"}, "kind": {"const": "#/definitions"}},
    "required": ["where", "kind"],
}
# A tree: `#` is the tool's own schema.
RECURSIVE = {
    "type": "object",
    "properties": {"value": {"type": "integer", "minimum": 0, "maximum": 9},
                   "children": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
    "required": ["value", "children"],
}  # fmt: skip


@pytest.fixture
async def server(tiny_model_dir):
    async with live_server(tiny_model_dir, num_kv_blocks=256) as s:
        yield s


def _error(response, status=400):
    assert response.status_code == status, response.text
    return response.json()["error"]


async def _stream_text(server, path, body):
    response = await server.http.post(path, json={**body, "stream": True})
    assert response.status_code == 200, response.text
    events = [json.loads(d) for d in sse_data(response.content) if d != "[DONE]"]
    key = "text" if path == C else "content"
    texts = [c["text"] if path == C else c["delta"].get(key, "") for e in events
             for c in e["choices"]]  # fmt: skip
    return "".join(texts), events


async def test_json_schema_and_json_object_unary_and_streamed(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        body = {"messages": USER, "max_tokens": 300, "temperature": 1.0, "seed": seed,
                "response_format": fmt}  # fmt: skip
        reply = (await server.http.post(X, json=body)).json()
        text = reply["choices"][0]["message"]["content"]
        jsonschema.validate(json.loads(text), SCHEMA)
        assert reply["choices"][0]["finish_reason"] == "stop"
        streamed, _ = await _stream_text(server, X, body)
        assert streamed == text
    body = {"messages": USER, "max_tokens": 300, "seed": 0,
            "response_format": {"type": "json_object"}}  # fmt: skip
    text = (await server.http.post(X, json=body)).json()["choices"][0]["message"]["content"]
    assert isinstance(json.loads(text), dict)


async def test_the_sdk_parse_with_a_pydantic_model(client):
    completion = await client.beta.chat.completions.parse(
        model=MODEL_NAME, messages=USER, response_format=Answer, max_tokens=300, seed=1
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Answer)


async def test_vllm_fields_on_both_endpoints(server):
    cases = [
        ({"structured_outputs": {"regex": "[0-9]{3}"}}, lambda t: re.fullmatch("[0-9]{3}", t)),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
        ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) or True),
        ({"guided_regex": "a+b"}, lambda t: re.fullmatch("a+b", t)),
        ({"guided_choice": ["x"]}, lambda t: t == "x"),
        ({"structured_outputs": {"grammar": 'start: "k=" /[0-9]/'}},
         lambda t: re.fullmatch("k=[0-9]", t)),
        ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
         lambda t: t == json.dumps(json.loads(t), separators=(",", ":"), ensure_ascii=False)),
    ]  # fmt: skip
    for fields, ok in cases:
        for path, base in ((C, {"prompt": "Answer:"}), (X, {"messages": USER})):
            body = {**base, **fields, "max_tokens": 300, "temperature": 1.0, "seed": 3}
            reply = (await server.http.post(path, json=body)).json()
            choice = reply["choices"][0]
            text = choice["text"] if path == C else choice["message"]["content"]
            assert ok(text), (fields, text)
            streamed, _ = await _stream_text(server, path, body)
            assert streamed == text


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a",
          "schema": {"type": "nope"}}}}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "surprise": 1}}, "structured_outputs.surprise"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function",
          "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
         "tools.0.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
          "type": "object", "properties": {"a": {"$ref": "http://example.com/a.json"}}}}}],
          "tool_choice": "required"}, "tools"),
    ],
)  # fmt: skip
async def test_a_bad_constraint_is_a_400_naming_the_field(server, fields, param):
    body = {"messages": USER, "max_tokens": 4, **fields}
    error = _error(await server.http.post(X, json=body))
    assert error["param"] == param, error
    health = (await server.http.get("/health")).json()
    assert health["running"] == health["waiting"] == 0


async def _required_call_and_history(client, id_pattern: str) -> list:
    """tool_choice "required": a call of one of the tools with arguments that match its schema
    and an id matching `id_pattern`; returns the history with the call and its result."""
    messages: list = list(USER)
    reply = await client.chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=[WEATHER, TIME], tool_choice="required",
        max_tokens=300, seed=2, temperature=1.0,
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and all(re.fullmatch(id_pattern, c.id) for c in calls)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    messages.append(choice.message.model_dump(exclude_none=True))
    for call in calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'})
    return messages


async def test_a_required_tool_call_and_the_round_trip(client):
    """The call and its result go back in the history, and the final answer (tool_choice
    "none") is text."""
    messages = await _required_call_and_history(client, "call_[0-9a-f]{24}")
    final = await client.chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=[WEATHER, TIME], tool_choice="none",
        max_tokens=8, temperature=0,
    )  # fmt: skip
    assert final.choices[0].message.tool_calls in (None, [])
    assert final.choices[0].message.content


async def test_a_named_tool_choice_calls_that_tool_once(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(3):
        reply = await client.chat.completions.create(
            model=MODEL_NAME, messages=USER, tools=[WEATHER, TIME], tool_choice=named,
            max_tokens=200, seed=seed, temperature=1.0,
        )  # fmt: skip
        assert reply.choices[0].finish_reason == "tool_calls", reply.choices[0]
        (call,) = reply.choices[0].message.tool_calls
        assert call.function.name == "get_time"
        assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
        assert reply.choices[0].message.content is None


async def test_streamed_tool_calls_in_openai_shape(server, client):
    """Streamed: the call's id, type and name first, then its arguments; the fragments put
    together equal the unary answer's call."""
    body = {"messages": USER, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 200,
            "seed": 4, "temperature": 1.0, "parallel_tool_calls": False}  # fmt: skip
    unary = (await server.http.post(X, json=body)).json()["choices"][0]
    (expected,) = unary["message"]["tool_calls"]
    _, events = await _stream_text(server, X, body)
    deltas = [c["delta"] for e in events for c in e["choices"]]
    parts = [d["tool_calls"][0] for d in deltas if d.get("tool_calls")]
    assert parts[0]["id"].startswith("call_") and parts[0]["type"] == "function"
    assert parts[0]["function"]["name"] == "get_weather"
    assert (
        "".join(p["function"].get("arguments", "") for p in parts)
        == (expected["function"]["arguments"])
    )
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["tool_calls"]
    stream = await client.chat.completions.create(
        model=MODEL_NAME, **{k: v for k, v in body.items() if k != "messages"}, messages=USER,
        stream=True,
    )  # fmt: skip
    names = [tc.function.name async for chunk in stream for tc in chunk.choices[0].delta.tool_calls
             or [] if tc.function and tc.function.name]  # fmt: skip
    assert names == ["get_weather"]


def _function(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


async def _streamed_calls(client, **body) -> tuple[list, str, str | None]:
    """A streamed chat completion's calls (name and arguments put together), its content and its
    finish reason."""
    stream = await client.chat.completions.create(model=MODEL_NAME, stream=True, **body)
    calls: dict[int, list] = {}
    content, finish = "", None
    async for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        finish = choice.finish_reason or finish
        for part in choice.delta.tool_calls or []:
            call = calls.setdefault(part.index, ["", ""])
            call[0] += part.function.name or ""
            call[1] += part.function.arguments or ""
    return [calls[k] for k in sorted(calls)], content, finish


@pytest.mark.parametrize("choice", ["required", "named"])
async def test_forced_calls_of_a_pydantic_model_with_defs(client, choice):
    """A tool whose schema refers to its own `$defs` (a pydantic model nesting another): a
    forced call, unary and streamed, has arguments the model validates, as the same schema
    does as a response_format."""
    tool_choice = choice if choice == "required" else {
        "type": "function", "function": {"name": "get_weather"}}  # fmt: skip
    for seed in range(2):
        body = {"messages": USER, "tools": [NESTED, TIME], "tool_choice": tool_choice,
                "max_tokens": 300, "seed": seed, "temperature": 1.0,
                "parallel_tool_calls": False}  # fmt: skip
        reply = await client.chat.completions.create(model=MODEL_NAME, **body)
        assert reply.choices[0].finish_reason == "tool_calls", reply.choices[0]
        (call,) = reply.choices[0].message.tool_calls
        if call.function.name == "get_weather":
            WeatherQuery.model_validate_json(call.function.arguments)
        calls, content, finish = await _streamed_calls(client, **body)
        assert calls == [[call.function.name, call.function.arguments]]
        assert (content, finish) == ("", "tool_calls")
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = await client.chat.completions.create(
        model=MODEL_NAME, messages=USER, tools=[NESTED], tool_choice=named, max_tokens=300,
        seed=5, temperature=1.0,
    )  # fmt: skip
    WeatherQuery.model_validate_json(reply.choices[0].message.tool_calls[0].function.arguments)


async def _forced_arguments(client, schema: dict) -> list:
    """The arguments of forced calls (tool_choice "required" and named, a few seeds, 4 choices
    each) of a tool "f" with `schema`, offered among others."""
    tools = [TIME, _function("f", schema)]
    named = {"type": "function", "function": {"name": "f"}}
    arguments = []
    for seed in range(3):
        for tool_choice in ("required", named):
            reply = await client.chat.completions.create(
                model=MODEL_NAME, messages=USER, tools=tools, tool_choice=tool_choice,
                max_tokens=300, seed=seed, temperature=1.0, parallel_tool_calls=False, n=4,
            )  # fmt: skip
            for choice in reply.choices:
                assert choice.finish_reason == "tool_calls", choice
                calls = [c.function for c in choice.message.tool_calls if c.function.name == "f"]
                arguments += [json.loads(f.arguments) for f in calls]
    return arguments


@pytest.mark.parametrize(
    "schema",
    [DEFINITIONS, {"$id": "https://example.com/z.json", **DEFINITIONS}],
    ids=["plain", "$id"],
)
async def test_forced_calls_with_definitions(client, schema):
    """`#/definitions/...` refers to the tool's own definitions (with an `$id`, to that
    document's, which is the tool's)."""
    arguments = await _forced_arguments(client, schema)
    assert arguments
    for a in arguments:
        jsonschema.validate(a, schema)


async def test_forced_calls_with_a_recursive_schema(client):
    """`#` refers to the tool's own schema: a child is a tree, not a call."""
    arguments = await _forced_arguments(client, RECURSIVE)
    for a in arguments:
        jsonschema.validate(a, RECURSIVE)
    assert any(a["children"] for a in arguments)  # the samples did take the reference


@pytest.mark.parametrize("max_tokens", [1, 8, 24])
@pytest.mark.parametrize("choice", ["required", "named"])
async def test_a_forced_call_cut_by_max_tokens_is_no_call_and_no_content(
    client, choice, max_tokens
):
    """Cut before the call is complete: finish_reason "length", no calls, and none of the call's
    markup as content (null), unary and streamed."""
    tool_choice = choice if choice == "required" else {
        "type": "function", "function": {"name": "get_weather"}}  # fmt: skip
    body = {"messages": USER, "tools": [NESTED, TIME], "tool_choice": tool_choice,
            "max_tokens": max_tokens, "seed": 0, "temperature": 1.0}  # fmt: skip
    reply = await client.chat.completions.create(model=MODEL_NAME, **body)
    choice_ = reply.choices[0]
    assert choice_.finish_reason == "length"
    assert choice_.message.content is None and not choice_.message.tool_calls
    assert reply.usage.completion_tokens == max_tokens
    calls, content, finish = await _streamed_calls(client, **body)
    assert (calls, content, finish) == ([], "", "length")


async def test_at_most_128_tools(server):
    """OpenAI's limit: each tool is in the prompt, and in the grammar of a required call."""
    tools = [_function(f"f{i}", {"type": "object"}) for i in range(129)]
    error = _error(await server.http.post(X, json={"messages": USER, "tools": tools}))
    assert error["param"] == "tools" and "at most 128 tools (got 129)" in error["message"]
    # 128 pass (and make a prompt longer than the tiny model's context)
    body = {"messages": USER, "tools": tools[:128], "max_tokens": 1}
    assert _error(await server.http.post(X, json=body))["param"] == "prompt"


MISTRAL_TOKENS = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                  "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]  # fmt: skip


@pytest.fixture(scope="module")
def mistral_dir(tiny_model_factory, tmp_path_factory):
    """The tiny model with Mistral v0.3's control tokens (ids past the trained vocabulary, within
    the model's) and its chat template, which calls tools with [TOOL_CALLS]."""
    import shutil

    import tokenizers

    source = tiny_model_factory(vocab_size=1040)
    path = tmp_path_factory.mktemp("mistral")
    shutil.copytree(source, path, dirs_exist_ok=True)
    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens(MISTRAL_TOKENS)
    tok.save(str(path / "tokenizer.json"))
    template = Path(__file__).parent / "data" / "mistral_v3_tools.jinja"
    shutil.copy(template, path / "chat_template.jinja")
    return path


async def test_mistral_calls_with_its_control_token_and_9_character_ids(mistral_dir):
    """A template with [TOOL_CALLS]: a required call is the control token and a JSON list, read
    back as OpenAI's calls with ids of 9 letters and digits, which the template takes back in the
    history (it raises on any other); a tool with `$defs`, and a required call cut short, in that
    list."""
    async with (
        live_server(mistral_dir, num_kv_blocks=256) as server,
        openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client,
    ):
        messages = await _required_call_and_history(client, "[A-Za-z0-9]{9}")
        messages.append({"role": "user", "content": "And in Rome?"})
        final = await client.chat.completions.create(
            model=MODEL_NAME, messages=messages, tools=[WEATHER, TIME], max_tokens=8,
            temperature=0,
        )  # fmt: skip
        assert final.choices[0].finish_reason in ("length", "stop", "tool_calls")
        required = {"messages": USER, "tools": [NESTED], "tool_choice": "required",
                    "temperature": 1.0, "seed": 1}  # fmt: skip
        reply = await client.chat.completions.create(model=MODEL_NAME, max_tokens=300, **required)
        assert reply.choices[0].finish_reason == "tool_calls", reply.choices[0]
        for call in reply.choices[0].message.tool_calls:
            WeatherQuery.model_validate_json(call.function.arguments)
        cut = await client.chat.completions.create(model=MODEL_NAME, max_tokens=3, **required)
        assert cut.choices[0].finish_reason == "length"
        assert cut.choices[0].message.content is None and not cut.choices[0].message.tool_calls
        calls, content, finish = await _streamed_calls(client, max_tokens=3, **required)
        assert (calls, content, finish) == ([], "", "length")


async def test_a_tool_token_missing_from_the_vocabulary_is_refused(mistral_dir, tmp_path):
    """A template that calls tools with [TOOL_CALLS] on a vocabulary without that token: a 400
    naming tools, not calls the model cannot write."""
    import shutil

    plain = tmp_path / "plain"
    shutil.copytree(mistral_dir, plain)
    tokenizer_json = json.loads((plain / "tokenizer.json").read_text())
    tokenizer_json["added_tokens"] = [
        t for t in tokenizer_json["added_tokens"] if t["content"] not in MISTRAL_TOKENS
    ]
    (plain / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    async with live_server(plain, num_kv_blocks=64) as server:
        body = {"messages": USER, "tools": [WEATHER], "max_tokens": 4}
        error = _error(await server.http.post(X, json=body))
        assert error["param"] == "tools" and "[TOOL_CALLS]" in error["message"], error
