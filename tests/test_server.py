"""The OpenAI-compatible server, driven over a real socket: Hypercorn on an ephemeral port, the
official `openai` client for what a user does, httpx or raw bytes for what a user gets wrong.

Answers are checked against the offline engine (`nanoserve.LLM`) on the same tiny model; every
4xx path is checked for its status and its error body. Clients that hang up are in
test_disconnect.py.
"""

import contextlib
import json
import logging
import re
import signal
import socket

import httpx
import openai
import pytest
import trio

from nanoserve import LLM, SamplingParams
from nanoserve.testing.harness import (
    MODEL_NAME,
    WAIT_S,
    chat_token_ids,
    live_server,
    open_request,
    post_bytes,
    read_until,
    serve_command,
    sse_data,
)

BLOCKS = 256  # 4096 tokens of KV: max_model_len is the model's 2048
PROMPT = "She wrote the weather"  # the tiny model's greedy answer is ASCII: " m m m gull m..."
COMPLETION = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
LONG = {"max_tokens": 1500, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="session")
def offline(tiny_model_dir):
    """`run(prompt, **sampling) -> RequestOutput` on the offline engine."""
    llm = LLM(str(tiny_model_dir), num_kv_blocks=BLOCKS)

    def run(prompt, **sampling):
        return llm.generate(prompt, SamplingParams(**sampling), use_tqdm=False)[0]

    run.tokenizer = llm.engine.tokenizer
    return run


@pytest.fixture
async def server(tiny_model_dir):
    async with live_server(tiny_model_dir, num_kv_blocks=BLOCKS) as s:
        yield s


def _joined(chunks, n=1):
    texts = [""] * n
    for chunk in chunks:
        for choice in chunk.choices:
            piece = choice.text if hasattr(choice, "text") else choice.delta.content
            texts[choice.index] += piece or ""
    return texts


# -- answers ---------------------------------------------------------------------------------


async def test_completion_matches_the_offline_engine_with_usage(client, offline):
    expected = offline(PROMPT, temperature=0, max_tokens=12).outputs[0]
    r = await client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0
    )
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == MODEL_NAME
    assert r.choices[0].text == expected.text
    assert r.choices[0].finish_reason == expected.finish_reason
    prompt_tokens = len(offline.tokenizer.encode(PROMPT))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_tokens, 12)
    assert r.usage.total_tokens == prompt_tokens + 12


@pytest.mark.parametrize("prompt", [PROMPT, "chairs. She wrote the"], ids=["ascii", "utf8"])
async def test_streamed_completion_joins_to_the_same_text_with_usage_last(client, offline, prompt):
    """The second prompt's answer has multi-byte characters split across tokens: no chunk may
    carry half of one."""
    expected = offline(prompt, temperature=0, max_tokens=12).outputs[0]
    stream = await client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = [c async for c in stream]
    assert len(chunks) > 2 and len({c.id for c in chunks}) == 1
    assert _joined(chunks) == [expected.text]
    *body, last = chunks
    assert body[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in body)
    assert last.choices == [] and last.usage.completion_tokens == 12
    assert last.usage.prompt_tokens == len(offline.tokenizer.encode(prompt))


async def test_chat_unary_and_streamed_match_the_offline_engine(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    ids = chat_token_ids(offline.tokenizer, messages)
    expected = offline({"prompt_token_ids": ids}, temperature=0, max_tokens=10).outputs[0]
    r = await client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0
    )
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected.text
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 10)
    stream = await client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_completion_tokens=10, temperature=0,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert _joined(chunks) == [expected.text]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


async def test_n_choices_are_indexed_per_prompt_and_seeds_reproduce(client, offline):
    prompts = [PROMPT, "The lighthouse keeper"]
    sampling = dict(temperature=1.0, seed=7, max_tokens=6)
    expected = [[c.text for c in offline(p, n=2, **sampling).outputs] for p in prompts]
    r = await client.completions.create(model=MODEL_NAME, prompt=prompts, n=2, **sampling)
    got = {c.index: c.text for c in r.choices}
    assert got == {0: expected[0][0], 1: expected[0][1], 2: expected[1][0], 3: expected[1][1]}
    assert r.usage.completion_tokens == 4 * 6
    again = await client.completions.create(model=MODEL_NAME, prompt=prompts, n=2, **sampling)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    stream = await client.completions.create(
        model=MODEL_NAME, prompt=prompts, n=2, stream=True, **sampling
    )
    assert _joined([c async for c in stream], n=4) == [got[i] for i in range(4)]


async def test_completion_logprobs_have_one_entry_per_token(client):
    r = await client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 3 <= len(top) <= 4 and top[token] == chosen == max(top.values())  # greedy
        assert chosen <= 0


async def test_chat_logprobs_list_the_top_alternatives_in_order(client):
    r = await client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": PROMPT}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 4
    for entry in content:
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
        assert entry.bytes == list(entry.token.encode()) or entry.token.startswith("bytes:")


async def test_stop_string_ends_the_text_before_it_unary_and_streamed(client, offline):
    full = offline(PROMPT, temperature=0, max_tokens=16).outputs[0].text
    assert "gull" in full[1:]
    expected = full[: full.index("gull")]
    r = await client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0, stop=["gull", "zz"]
    )
    assert r.choices[0].text == expected
    assert (r.choices[0].finish_reason, r.choices[0].model_extra["stop_reason"]) == ("stop", "gull")
    stream = await client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0, stop="gull", stream=True
    )
    assert _joined([c async for c in stream]) == [expected]  # "gu", "gul" never leak


async def test_stop_token_ids_and_echo(client, offline):
    expected = offline(PROMPT, temperature=0, max_tokens=8).outputs[0]
    third = expected.token_ids[2]
    r = await client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, echo=True,
        extra_body={"stop_token_ids": [third]},
    )  # fmt: skip
    cut = expected.token_ids.index(third) + 1
    assert r.usage.completion_tokens == cut and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == third
    assert r.choices[0].text.startswith(PROMPT)
    stream = await client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, echo=True, stream=True
    )
    assert _joined([c async for c in stream]) == [PROMPT + expected.text]


async def test_long_prompts_and_content_parts_give_the_offline_answer(client, offline):
    long_prompt = " ".join([PROMPT] * 300)  # past LONG_PROMPT_CHARS: tokenized in a thread
    expected = offline(long_prompt, temperature=0, max_tokens=4).outputs[0]
    r = await client.completions.create(
        model=MODEL_NAME, prompt=long_prompt, max_tokens=4, temperature=0
    )
    assert r.choices[0].text == expected.text
    assert r.usage.prompt_tokens == len(offline.tokenizer.encode(long_prompt))
    as_text = [{"role": "user", "content": PROMPT}]
    as_parts = [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]
    answers = [
        await client.chat.completions.create(
            model=MODEL_NAME, messages=m, max_tokens=6, temperature=0
        )
        for m in (as_text, as_parts)
    ]
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content


async def test_streams_outlive_quarts_response_timeout(server):
    server.app.config["RESPONSE_TIMEOUT"] = 0.05  # Quart's default, 60 s, would cut at 60 s
    body = {"prompt": PROMPT, "stream": True, **LONG, "max_tokens": 400}
    body["stream_options"] = {"include_usage": True}
    async with server.http.stream("POST", C, json=body) as response:
        events = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 400


async def test_models_health_and_metrics(server, client):
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert models.data[0].model_extra["max_model_len"] == 2048
    await client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0)
    health = (await server.http.get("/health")).json()
    assert health["status"] == "ok" and health["generation_tokens"] == 5
    assert health["free_blocks"] == health["total_blocks"] == BLOCKS
    response = await server.http.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    names = [
        "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
        "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
        "request_success_total", "requests_aborted_total",
        "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
        "e2e_request_latency_seconds_count", "request_queue_time_seconds_count",
    ]  # fmt: skip
    for name in names:
        assert f"\nnanoserve:{name}" in response.text, name
    assert await server.metric("nanoserve:generation_tokens_total") == 5
    assert 'nanoserve:request_success_total{finished_reason="length"} 1.0' in response.text


# -- failures --------------------------------------------------------------------------------


async def test_a_failing_step_ends_streams_with_an_error_event_and_unary_with_500(server):
    real_step, failing = server.engine.step, False

    def step():
        if failing:
            raise RuntimeError("injected step failure")
        return real_step()

    server.engine.step = step
    stream = await open_request(
        server, "/v1/completions", {"prompt": PROMPT, "stream": True, **LONG}
    )
    await read_until(stream, b"data: ")
    unary: dict = {}

    async def post_unary():
        unary["r"] = await server.http.post("/v1/completions", json={"prompt": PROMPT, **LONG})

    async with trio.open_nursery() as nursery:
        nursery.start_soon(post_unary)
        await server.wait_until(lambda h: h["running"] == 2)
        failing = True
    events = sse_data(await read_until(stream, b"data: [DONE]\n\n"))
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "injected step failure" in error["message"] and error["type"] == "server_error"
    assert unary["r"].status_code == 500
    assert "injected step failure" in unary["r"].json()["error"]["message"]
    health = await server.http.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "dead"
    refused = await server.http.post("/v1/completions", json=COMPLETION)
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "server_error"
    assert health.json()["free_blocks"] == BLOCKS  # the failed requests' blocks came back


# -- 4xx -------------------------------------------------------------------------------------


def _error(response, status):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    return body["error"]


def _with(base, **changes):
    body = {**base, **changes}
    return {k: v for k, v in body.items() if v is not ...}


C, X = "/v1/completions", "/v1/chat/completions"
BAD_REQUESTS = [
    # (path, body, param, words in the message)
    (C, b"{not json", None, "not valid JSON"),
    (C, b"[1, 2]", None, "JSON object"),
    (C, _with(COMPLETION, prompt=...), "prompt", "required"),
    (X, _with(CHAT, messages=...), "messages", "required"),
    (C, _with(COMPLETION, max_tokens="5"), "max_tokens", "integer"),
    (C, _with(COMPLETION, max_tokens=-1), "max_tokens", "greater than or equal to 0"),
    (C, _with(COMPLETION, temperature="hot"), "temperature", "number"),
    (C, _with(COMPLETION, prompt=5), "prompt", "must be a string"),
    (C, _with(COMPLETION, prompt=[1, "a"]), "prompt", "token ids"),
    (C, _with(COMPLETION, prompt=[]), "prompt", "empty"),
    (C, _with(COMPLETION, prompt=[10**6]), "prompt", "outside the vocabulary"),
    (C, _with(COMPLETION, stop=7), "stop", "string"),
    (C, _with(COMPLETION, stop=[""]), "stop", "non-empty"),
    (C, _with(COMPLETION, n=0), "n", "greater than or equal to 1"),
    (C, _with(COMPLETION, n=17), "n", "less than or equal to 16"),
    (C, _with(COMPLETION, top_p=0), "top_p", "greater than 0"),
    (C, _with(COMPLETION, logprobs=21), "logprobs", "less than or equal to 20"),
    (C, _with(COMPLETION, min_tokens=5), "min_tokens", "max_tokens"),
    (C, _with(COMPLETION, stop_token_ids=[10**6]), "stop_token_ids", "vocabulary"),
    (C, _with(COMPLETION, repeat_penalty=1.1), "repeat_penalty", "unrecognized"),
    (X, _with(CHAT, messages=[]), "messages", "at least 1"),
    (X, _with(CHAT, messages=[{"role": "robot", "content": "x"}]), "messages.0.role", "user"),
    (X, _with(CHAT, messages=[{"role": "user", "content": 3}]), "messages.0.content", "string"),
    (
        X,
        _with(CHAT, messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
        "messages.0.content",
        "image_url",
    ),
    # parameters that would change the answer and are not implemented: refused by name
    (C, _with(COMPLETION, logit_bias={"x5": 10}), "logit_bias", "token ids"),
    (C, _with(COMPLETION, logit_bias={"5": 101}), "logit_bias", "[-100, 100]"),
    (C, _with(COMPLETION, logit_bias={str(10**6): 1}), "logit_bias", "vocabulary"),
    (C, _with(COMPLETION, allowed_token_ids=[]), "allowed_token_ids", "at least 1"),
    (C, _with(COMPLETION, allowed_token_ids=[10**6]), "allowed_token_ids", "vocabulary"),
    (C, _with(COMPLETION, suffix="end"), "suffix", "not supported"),
    (C, _with(COMPLETION, best_of=2), "best_of", "not supported"),
    (C, _with(COMPLETION, prompt_logprobs=21), "prompt_logprobs", "less than or equal to 20"),
    (X, _with(CHAT, prompt_logprobs=1, stream=True), "prompt_logprobs", "not supported with"),
    (C, _with(COMPLETION, guided_json="{not json"), "guided_json", "guided_json"),
    (C, _with(COMPLETION, include_stop_str_in_output=True), "include_stop_str_in_output", "not"),
    (X, _with(CHAT, priority=1), "priority", "not supported"),
    (X, _with(CHAT, tools=[{"type": "function"}]), "tools.0.function", "required"),
    (X, _with(CHAT, tool_choice="required"), "tool_choice", "needs tools"),
    (X, _with(CHAT, functions=[{"name": "f"}]), "functions", "not supported"),
    (
        X,
        _with(CHAT, response_format={"type": "json_schema"}),
        "response_format.json_schema",
        "required",
    ),
    (X, _with(CHAT, echo=True), "echo", "not supported"),
    (X, _with(CHAT, top_logprobs=2), "top_logprobs", "logprobs"),
    (X, _with(CHAT, stream_options={"include_usage": True}), "stream", "stream"),
]


@pytest.mark.parametrize(("path", "body", "param", "words"), BAD_REQUESTS)
async def test_bad_requests_are_400_naming_the_field(server, path, body, param, words):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    error = _error(await server.http.post(path, content=content), 400)
    assert error["param"] == param
    assert words in error["message"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (C, _with(COMPLETION, user="u1", metadata={"k": "v"}, store=False, best_of=1)),
        (C, _with(COMPLETION, logit_bias={}, response_format={"type": "text"})),
        (X, _with(CHAT, tool_choice="none", parallel_tool_calls=False, service_tier="auto")),
    ],
)
async def test_harmless_fields_are_accepted(server, path, body):
    assert (await server.http.post(path, json=body)).status_code == 200


async def test_prompts_that_do_not_fit_the_context_say_the_numbers(server):
    error = _error(await server.http.post(C, json=_with(COMPLETION, prompt=[5] * 2100)), 400)
    assert error["param"] == "prompt" and "2100" in error["message"] and "2048" in error["message"]
    body = _with(COMPLETION, prompt=[5] * 2000, max_tokens=100)
    error = _error(await server.http.post(C, json=body), 400)
    assert error["param"] == "max_tokens"
    assert all(n in error["message"] for n in ("2000", "100", "2100", "2048"))


async def test_unknown_model_route_and_method(server):
    error = _error(await server.http.post(X, json=_with(CHAT, model="gpt-4")), 404)
    assert (error["param"], error["code"]) == ("model", "model_not_found")
    assert "gpt-4" in error["message"]
    assert "Not Found" in _error(await server.http.get("/v1/nothing"), 404)["message"]
    assert "Method Not Allowed" in _error(await server.http.get(C), 405)["message"]


async def test_bodies_over_the_limit_are_413(tiny_model_dir):
    async with live_server(tiny_model_dir, num_kv_blocks=BLOCKS, max_body_bytes=1000) as server:
        big = _with(COMPLETION, prompt="x" * 2000)
        error = _error(await server.http.post(C, json=big), 413)
        assert "1000 bytes" in error["message"]

        async def chunked():  # no Content-Length: the limit is enforced while reading
            yield json.dumps(big).encode()

        error = _error(await server.http.post(C, content=chunked()), 413)
        assert "1000 bytes" in error["message"]
        assert (await server.http.post(C, json=COMPLETION)).status_code == 200


async def _response(stream: trio.SocketStream) -> tuple[int, dict[str, str], bytes]:
    """One response with a Content-Length body, read off a raw connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some()
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    while len(body) < int(headers["content-length"]):
        body += await stream.receive_some()
    return int(status_line.split()[1]), headers, body


def _raw(method: str, path: str, body: bytes = b"", headers: dict | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: test", *(f"{k}: {v}" for k, v in
             {"Content-Type": "application/json", **(headers or {})}.items())]  # fmt: skip
    if body and "Transfer-Encoding" not in (headers or {}):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def test_a_refused_request_never_hangs_its_connection(tiny_model_dir):
    """After a response sent before the body was read (413, 401, 404) or after a 400 for an
    unparsable body, the same connection answers the next request, or the refusal said
    `Connection: close` and the server closed it. (A 413 used to leave the connection silent.)"""
    big = json.dumps({"prompt": "x" * 2000}).encode()
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(big), big)
    auth = {"Authorization": "Bearer k"}
    cases = [
        (413, _raw("POST", C, big, auth)),
        (413, _raw("POST", C, chunked, {**auth, "Transfer-Encoding": "chunked"})),
        (413, _raw("POST", C, b" " * (16 * 2**20), auth)),
        (401, _raw("POST", C, big)),
        (404, _raw("POST", "/v1/nothing", b'{"prompt": "x"}', auth)),
        (400, _raw("POST", C, b"{", auth)),
    ]
    async with live_server(
        tiny_model_dir, num_kv_blocks=BLOCKS, max_body_bytes=1000, api_key="k"
    ) as server:
        for expected, request in cases:
            stream = await trio.open_tcp_stream(server.host, server.port)
            server.raw.append(stream)

            async def send(request=request, stream=stream):  # a refusal may come mid-body
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await stream.send_all(request)

            with trio.fail_after(WAIT_S):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(send)
                    status, headers, _ = await _response(stream)
                assert status == expected
                if headers.get("connection") == "close":
                    while await stream.receive_some():
                        pass  # the server closes: the client knows to reconnect
                else:  # the next request, sent once the answer came, as HTTP clients do
                    await stream.send_all(_raw("GET", "/v1/models", headers=auth))
                    status, _, models = await _response(stream)
                    assert status == 200 and MODEL_NAME.encode() in models


async def test_one_access_line_per_request(server, caplog):
    """At the default level every request logs one line: client, request line, status, prompt
    and completion tokens, seconds; a stream logs when it ends, a refusal with its status."""
    caplog.set_level(logging.INFO, logger="nanoserve.access")
    await server.http.post(C, json=_with(COMPLETION, max_tokens=3, temperature=0))
    async with server.http.stream("POST", X, json={**CHAT, "max_tokens": 4, "stream": True}) as r:
        _ = [line async for line in r.aiter_lines()]
    await server.http.post(C, json=_with(COMPLETION, top_p=5))
    stream = await open_request(server, C, {"prompt": PROMPT, "stream": True, **LONG})
    await read_until(stream, b"data: ")
    await stream.aclose()
    await server.wait_idle()
    lines = [r.getMessage() for r in caplog.records if r.name == "nanoserve.access"]
    lines = [line for line in lines if "GET /health" not in line]  # wait_idle's polls
    request = r'127\.0\.0\.1:\d+ "POST /v1/(chat/)?completions"'
    pattern = request + r" (.+) in=(\d+|-) out=(\d+|-) \d+\.\d{3}s"
    matches = [re.fullmatch(pattern, line) for line in lines]
    assert all(matches) and len(matches) == 4, lines
    assert [m.group(2) for m in matches] == ["200", "200", "400", "200 (client left)"]
    assert [m.group(4) for m in matches[:3]] == ["3", "4", "-"]
    assert int(matches[3].group(4)) < LONG["max_tokens"]


async def test_api_key_guards_every_route_but_health(tiny_model_dir):
    async with live_server(tiny_model_dir, num_kv_blocks=BLOCKS, api_key="s3cret") as server:
        assert (await server.http.post(C, json=COMPLETION)).status_code == 200
        async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as anonymous:
            for path in ("/v1/models", "/metrics"):
                error = _error(await anonymous.get(path), 401)
                assert error["code"] == "invalid_api_key"
            wrong = {"Authorization": "Bearer s3cre"}
            _error(await anonymous.post(C, json=COMPLETION, headers=wrong), 401)
            assert (await anonymous.get("/health")).status_code == 200
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="wrong", max_retries=0
        ) as client:
            with pytest.raises(openai.AuthenticationError):
                await client.models.list()


async def test_a_full_queue_is_503_with_retry_after(tiny_model_dir):
    async with live_server(
        tiny_model_dir, num_kv_blocks=BLOCKS, max_num_seqs=1, max_queue=1
    ) as server:
        holder = await open_request(server, C, {"prompt": PROMPT, "stream": True, **LONG})
        await read_until(holder, b"data: ")
        queued = await open_request(server, C, {"prompt": PROMPT, **LONG})
        await server.wait_until(lambda h: h["running"] == 1 and h["waiting"] == 1)
        response = await server.http.post(C, json=COMPLETION)
        assert response.status_code == 503 and response.headers["Retry-After"] == "1"
        error = response.json()["error"]
        assert error["type"] == "server_error" and "max queue 1" in error["message"]
        await queued.aclose()
        await holder.aclose()
        await server.wait_idle()


# -- the command line ------------------------------------------------------------------------


async def test_serve_command_answers_then_exits_on_sigterm_despite_open_connections(
    tiny_model_factory,
):
    """`nanoserve serve` on port 0: a ready line with the URL, the served model named by the
    MODEL_DIR's name (and retrieved by it or by the path). SIGTERM with an idle keep-alive
    connection and a stream that would run for a long while: the stream ends cleanly (an error
    event, then [DONE]) and the process exits within the grace period."""
    model_dir = tiny_model_factory(max_position_embeddings=16384)
    async with serve_command(model_dir) as (proc, server):
        models = (await server.http.get("/v1/models")).json()
        assert models["data"][0]["id"] == model_dir.name
        for model in (model_dir.name, str(model_dir)):
            retrieved = (await server.http.get(f"/v1/models/{model}")).json()
            assert retrieved["id"] == model_dir.name
        body = {"prompt": PROMPT, "stream": True, **LONG, "max_tokens": 16000}
        stream = await open_request(server, C, body)
        await read_until(stream, b"data: ")
        proc.send_signal(signal.SIGTERM)
        with trio.fail_after(10):  # grace: 3 s
            events = sse_data(await read_until(stream, b"data: [DONE]\n\n"))
            assert await proc.wait() == 0
    error = json.loads(events[-2])["error"]
    assert "shutting down" in error["message"] and error["type"] == "server_error"


async def test_serve_without_a_model_serves_smollm2_under_its_name():
    async with serve_command(None) as (proc, server):
        models = (await server.http.get("/v1/models")).json()
        assert models["data"][0]["id"] == "SmolLM2-135M-Instruct"
        question = [{"role": "user", "content": "What is the capital of France?"}]
        body = {"messages": question, "max_tokens": 20, "temperature": 0}
        reply = (await server.http.post(X, json=body)).json()
        assert "Paris" in reply["choices"][0]["message"]["content"]
        proc.send_signal(signal.SIGTERM)
        assert await proc.wait() == 0


@pytest.mark.parametrize("signum,status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
async def test_a_second_signal_stops_at_once_and_still_ends_the_streams(
    tiny_model_factory, signum, status
):
    """The first signal starts the graceful drain; a second one, during it, fails the open
    stream at once (an error event, then [DONE]) and exits with 128 + the signal's number,
    saying so in one line and with no traceback."""
    model_dir = tiny_model_factory(max_position_embeddings=16384)
    async with serve_command(model_dir) as (proc, server):
        body = {"prompt": PROMPT, "stream": True, **LONG, "max_tokens": 16000}
        stream = await open_request(server, C, body)
        await read_until(stream, b"data: ")
        proc.send_signal(signum)
        log = b""
        with trio.fail_after(WAIT_S):
            while b"shutting down" not in log:
                log += await proc.stderr.receive_some()
        proc.send_signal(signum)
        with trio.fail_after(WAIT_S):
            events = sse_data(await read_until(stream, b"data: [DONE]\n\n"))
            assert await proc.wait() == status
            while chunk := await proc.stderr.receive_some():
                log += chunk
    error = json.loads(events[-2])["error"]
    assert "stopped" in error["message"] and error["type"] == "server_error"
    lines = log.decode().strip().splitlines()
    assert lines[-1] == f"nanoserve: second {signal.Signals(signum).name}, stopped without waiting"
    assert "Traceback" not in log.decode()


async def test_serve_command_exits_on_sigterm_despite_a_client_that_stopped_reading(
    tiny_model_factory,
):
    """A client that stops reading a long stream blocks Hypercorn's (shielded) socket write, and
    with it a graceful shutdown: the watchdog exits anyway, a few seconds past the grace."""
    model_dir = tiny_model_factory(max_position_embeddings=16384)
    async with serve_command(model_dir, "--num-kv-blocks", "8500") as (proc, server):
        sock = trio.socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a tiny window
        await sock.connect((server.host, server.port))
        server.raw.append(trio.SocketStream(sock))
        # 8 choices with 20 alternatives each: about 12 kB of events per step.
        body = {"prompt": PROMPT, "stream": True, **LONG, "max_tokens": 8000, "n": 8}
        await sock.send(post_bytes(C, {**body, "logprobs": 20}))
        await server.wait_until(lambda h: h["generation_tokens"] > 1600)
        proc.send_signal(signal.SIGTERM)
        with trio.fail_after(15):  # grace 3 s, the watchdog 2 s later
            assert await proc.wait() == 1
            log = b""
            while chunk := await proc.stderr.receive_some():
                log += chunk
        assert b"shutdown is stuck" in log
