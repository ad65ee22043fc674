"""vLLM's token-level extras on a live server: `return_token_ids` (the prompt's token ids and
each choice's, unary and streamed, chat and completions) and whole-vocabulary logprobs
(`top_logprobs: -1` on chat, `logprobs: -1` on completions) with the bounds that keep them
affordable, each refusal naming the field."""

import json
import math

import pytest

from nanoserve.engine import admission
from nanoserve.testing.harness import MODEL_NAME, live_server

BLOCKS = 256
VOCAB = 1024  # the tiny model's
C, X = "/v1/completions", "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
CHAT = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 5, "temperature": 0}
COMPLETION = {"model": MODEL_NAME, "prompt": "She wrote", "max_tokens": 5, "temperature": 0}
TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


@pytest.fixture
async def server(tiny_model_dir):
    async with live_server(tiny_model_dir, num_kv_blocks=BLOCKS) as s:
        yield s


async def _post(server, path, body):
    response = await server.http.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


async def _stream(server, path, body):
    """The stream's chunks as JSON (the [DONE] line left out)."""
    chunks = []
    async with server.http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


async def _tokens(server, **body):
    return (await _post(server, "/tokenize", body))["tokens"]


async def _text(server, ids):
    return (await _post(server, "/detokenize", {"tokens": ids}))["prompt"]


async def test_return_token_ids_on_a_unary_chat(server):
    """Top-level prompt_token_ids (the rendered chat's, as /tokenize gives them) and each choice's
    token_ids, which decode to its text; without the field, both are null."""
    body = await _post(server, X, {**CHAT, "n": 2, "return_token_ids": True})
    assert body["prompt_token_ids"] == await _tokens(server, messages=MESSAGES)
    assert len(body["prompt_token_ids"]) == body["usage"]["prompt_tokens"]
    for choice in body["choices"]:
        ids = choice["token_ids"]
        assert len(ids) == 5 and await _text(server, ids) == choice["message"]["content"]
    assert sum(len(c["token_ids"]) for c in body["choices"]) == body["usage"]["completion_tokens"]
    plain = await _post(server, X, CHAT)
    assert plain["prompt_token_ids"] is None and plain["choices"][0]["token_ids"] is None


@pytest.mark.parametrize("tools", [None, [TOOL]], ids=["plain", "tools"])
async def test_return_token_ids_on_a_streamed_chat(server, tools):
    """The first chunk carries prompt_token_ids; each chunk's choice the tokens since the last
    one, which add up to the unary answer's (the path that reads calls from the text too)."""
    body = {**CHAT, "return_token_ids": True, **({"tools": tools} if tools else {})}
    unary = await _post(server, X, body)
    chunks = await _stream(server, X, body)
    assert chunks[0]["prompt_token_ids"] == unary["prompt_token_ids"]
    assert all(c["prompt_token_ids"] is None for c in chunks[1:])
    streamed = [t for c in chunks[1:] for t in c["choices"][0]["token_ids"] or []]
    assert streamed == unary["choices"][0]["token_ids"] and len(streamed) == 5


async def test_return_token_ids_on_completions(server):
    """Each choice carries its own prompt's prompt_token_ids and its token_ids; streamed, a
    choice's first chunk carries the prompt's (with echo, the chunk that echoes it), and the
    choice's chunks add up to the unary token_ids."""
    prompts = ["She wrote", "The weather"]
    body = {**COMPLETION, "prompt": prompts, "n": 2, "return_token_ids": True}
    unary = await _post(server, C, body)
    expected = [await _tokens(server, prompt=p) for p in prompts]
    assert len(unary["choices"]) == 4
    for choice in unary["choices"]:
        assert choice["prompt_token_ids"] == expected[choice["index"] // 2]
        assert await _text(server, choice["token_ids"]) == choice["text"]
    for extra in ({}, {"echo": True}):
        chunks = await _stream(server, C, {**body, **extra})
        for index in range(4):
            mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
            assert mine[0]["prompt_token_ids"] == expected[index // 2]
            assert all(c["prompt_token_ids"] is None for c in mine[1:])
            streamed = [t for c in mine for t in c["token_ids"] or []]
            assert streamed == unary["choices"][index]["token_ids"]


async def test_return_token_ids_through_the_openai_sdk(server, client):
    """The SDK keeps vLLM's extra fields on the objects it returns."""
    reply = await client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=3, temperature=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert reply.prompt_token_ids == await _tokens(server, messages=MESSAGES)
    assert len(reply.choices[0].token_ids) == reply.usage.completion_tokens == 3


async def test_top_logprobs_minus_one_is_the_whole_vocabulary(server):
    """Every token of the vocabulary at every position (named by id, so that none collide), a
    distribution (its probabilities sum to 1), the chosen token among them, its first 20 the
    tokens and values top_logprobs 20 gives."""
    body = {**CHAT, "max_tokens": 3, "logprobs": True, "return_tokens_as_token_ids": True}
    whole = (await _post(server, X, {**body, "top_logprobs": -1}))["choices"][0]
    top = (await _post(server, X, {**body, "top_logprobs": 20}))["choices"][0]
    assert whole["message"] == top["message"]
    for entry, short in zip(whole["logprobs"]["content"], top["logprobs"]["content"], strict=True):
        listed = {t["token"]: t["logprob"] for t in entry["top_logprobs"]}
        assert len(entry["top_logprobs"]) == len(listed) == VOCAB
        assert math.fsum(math.exp(v) for v in listed.values()) == pytest.approx(1, abs=1e-4)
        assert listed[entry["token"]] == entry["logprob"]
        # The second request reads the prompt from the prefix cache: the last digits may differ.
        assert entry["logprob"] == pytest.approx(short["logprob"], abs=1e-4)
        first = entry["top_logprobs"][:20]
        assert [t["token"] for t in first] == [t["token"] for t in short["top_logprobs"]]
        assert [t["logprob"] for t in first] == pytest.approx(
            [t["logprob"] for t in short["top_logprobs"]], abs=1e-4
        )


async def test_logprobs_minus_one_on_completions(server):
    body = {**COMPLETION, "max_tokens": 2, "logprobs": -1, "return_tokens_as_token_ids": True}
    logprobs = (await _post(server, C, body))["choices"][0]["logprobs"]
    for token, value, alternatives in zip(
        logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
    ):
        assert len(alternatives) == VOCAB and alternatives[token] == value
        assert math.fsum(math.exp(v) for v in alternatives.values()) == pytest.approx(1, abs=1e-4)


WHOLE_CHAT = {**CHAT, "logprobs": True, "top_logprobs": -1}
WHOLE_COMPLETION = {**COMPLETION, "logprobs": -1}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (X, {**WHOLE_CHAT, "stream": True}, "top_logprobs"),
        (X, {**WHOLE_CHAT, "max_tokens": None}, "top_logprobs"),  # 2,048 tokens by default
        (X, {**WHOLE_CHAT, "n": 2, "max_tokens": 600}, "top_logprobs"),
        (X, {**WHOLE_CHAT, "logprobs": False}, "top_logprobs"),
        (X, {**WHOLE_CHAT, "top_logprobs": -2}, "top_logprobs"),
        (C, {**WHOLE_COMPLETION, "stream": True}, "logprobs"),
        (C, {**WHOLE_COMPLETION, "echo": True}, "logprobs"),
        (C, {**WHOLE_COMPLETION, "prompt": ["a", "b"]}, "logprobs"),
        (C, {**WHOLE_COMPLETION, "max_tokens": 1025}, "logprobs"),
    ],
    ids=[
        "stream",
        "default-length",
        "n",
        "no-logprobs",
        "minus-two",
        "completion-stream",
        "echo",
        "prompts",
        "length",
    ],
)
async def test_whole_vocabulary_logprobs_are_bounded(server, path, body, param):
    """Unary, one prompt, no echo, and at most 2**20 entries a request (n x max_tokens x the
    vocabulary): otherwise a 400 that names the field as the endpoint calls it."""
    response = await server.http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"]


async def test_whole_vocabulary_logprobs_refused_for_a_larger_vocabulary(server, monkeypatch):
    """Past the vocabulary bound (262,144 tokens; lowered here below the tiny model's), -1 is a
    400 whatever the length."""
    monkeypatch.setattr(admission, "MAX_WHOLE_VOCAB", VOCAB - 1)
    for path, body, param in ((X, WHOLE_CHAT, "top_logprobs"), (C, WHOLE_COMPLETION, "logprobs")):
        response = await server.http.post(path, json={**body, "max_tokens": 1})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and "at most 1023 tokens" in error["message"]
