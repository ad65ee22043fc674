"""Limits a client meets through the server: a chat without max_tokens stops at the server's
default cap (--default-max-tokens) with finish_reason "length"; min_tokens above what such a
request may generate is a 400 naming min_tokens; stop_token_ids has a bound (a 400 naming it)."""

import json

from nanoserve.server.protocol import MAX_STOP_TOKEN_IDS
from nanoserve.testing.harness import live_server, sse_data

C, X = "/v1/completions", "/v1/chat/completions"
CAP = 5  # the server's default_max_tokens here
CHAT = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "ignore_eos": True}


async def test_a_chat_without_max_tokens_stops_at_the_default_cap(tiny_model_dir):
    async with live_server(tiny_model_dir, num_kv_blocks=64, default_max_tokens=CAP) as server:
        for body in (CHAT, {**CHAT, "max_tokens": None}):
            reply = (await server.http.post(X, json=body)).json()
            assert reply["choices"][0]["finish_reason"] == "length", reply
            assert reply["usage"]["completion_tokens"] == CAP
        streamed = await server.http.post(X, json={**CHAT, "stream": True})
        events = [json.loads(e) for e in sse_data(streamed.content) if e != "[DONE]"]
        finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
        assert finishes == ["length"]
        assert sum(1 for e in events for c in e["choices"] if c["delta"].get("content")) <= CAP


async def test_min_tokens_beyond_the_default_cap_is_refused_naming_it(tiny_model_dir):
    async with live_server(tiny_model_dir, num_kv_blocks=64, default_max_tokens=CAP) as server:
        bodies = [
            (X, {**CHAT, "min_tokens": 1_000_000_000, "max_tokens": None}),
            (C, {"prompt": "hi", "min_tokens": 1_000_000_000, "max_tokens": None}),
            (X, {**CHAT, "min_tokens": CAP + 1}),
        ]
        for path, body in bodies:
            response = await server.http.post(path, json=body)
            assert response.status_code == 400, (path, body, response.text)
            error = response.json()["error"]
            assert error["param"] == "min_tokens" and "min_tokens" in error["message"]
        ok = await server.http.post(X, json={**CHAT, "min_tokens": CAP})
        assert ok.json()["usage"]["completion_tokens"] == CAP
        await server.wait_idle()


async def test_stop_token_ids_are_bounded(tiny_model_dir):
    """Past MAX_STOP_TOKEN_IDS ids a 400 names the field; at the bound every id stops (here the
    whole vocabulary of 1024 tokens: the first token generated is a stop)."""
    async with live_server(tiny_model_dir, num_kv_blocks=64) as server:
        many = [i % 1000 for i in range(MAX_STOP_TOKEN_IDS + 1)]
        response = await server.http.post(C, json={"prompt": "hi", "stop_token_ids": many})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "stop_token_ids" and str(MAX_STOP_TOKEN_IDS) in error["message"]
        every = list(range(MAX_STOP_TOKEN_IDS))
        body = {"prompt": "hi", "stop_token_ids": every, "max_tokens": 8, "ignore_eos": True}
        choice = (await server.http.post(C, json=body)).json()["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] in every
        await server.wait_idle()
