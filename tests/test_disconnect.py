"""Clients that hang up, over a real socket: the engine must stop generating for them within a
few steps and give their KV blocks back, whether the client was waiting for a unary answer,
reading a stream, or still queued behind a busy slot.

Each request asks for far more tokens than the bound checked here, so a server that did not abort
would spend them (and keep the pool busy): removing the abort in `Serving.generate` fails the
first four tests. Counts come from the server itself (/health and /metrics).
"""

import pytest

from nanoserve.testing.harness import hang_up, live_server, open_request, read_until

BUDGET = 1500  # tokens each departing request asks for
AFTER_HANG_UP = 16  # tokens the engine may still generate once the client is gone
LONG = {"prompt": "She wrote the weather", "max_tokens": BUDGET, "ignore_eos": True}


@pytest.fixture
async def server(tiny_model_dir):
    async with live_server(tiny_model_dir, num_kv_blocks=256) as s:
        yield s


@pytest.fixture
async def one_slot(tiny_model_dir):
    async with live_server(tiny_model_dir, num_kv_blocks=256, max_num_seqs=1) as s:
        yield s


async def _tokens_spent_after(server, stream, reset=False):
    """Hang up `stream`; return the tokens generated from just before the hang-up until idle."""
    before = (await server.health())["generation_tokens"]
    await hang_up(stream, reset)
    idle = await server.wait_idle()
    engine = server.engine
    engine.audit()
    assert engine.stats().free_blocks == engine.num_blocks and not engine.has_unfinished()
    return idle["generation_tokens"] - before


@pytest.mark.parametrize("reset", [False, True], ids=["fin", "rst"])
async def test_unary_client_that_leaves_is_aborted(server, reset):
    stream = await open_request(server, "/v1/completions", LONG)
    await server.wait_until(lambda h: h["generation_tokens"] >= 2)
    assert await _tokens_spent_after(server, stream, reset) <= AFTER_HANG_UP
    assert await server.metric("nanoserve:requests_aborted_total") == 1
    assert await server.metric("nanoserve:generation_tokens_total") < BUDGET // 2


async def test_streaming_client_that_leaves_is_aborted(server):
    stream = await open_request(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": LONG["prompt"]}], "stream": True,
        "max_tokens": BUDGET, "ignore_eos": True,
    })  # fmt: skip
    await read_until(stream, b'"content":"')  # the role chunk, then the first text
    assert await _tokens_spent_after(server, stream) <= AFTER_HANG_UP
    assert await server.metric("nanoserve:requests_aborted_total") == 1
    assert await server.metric("nanoserve:generation_tokens_total") < BUDGET // 2


async def test_queued_client_that_leaves_never_runs(one_slot):
    server = one_slot
    holder = await open_request(server, "/v1/completions", {**LONG, "stream": True})
    await read_until(holder, b"data: ")
    queued = await open_request(server, "/v1/completions", LONG)
    await server.wait_until(lambda h: h["waiting"] == 1)
    await hang_up(queued)
    health = await server.wait_until(lambda h: h["waiting"] == 0 and h["open_requests"] == 1)
    assert (health["running"], health["waiting"]) == (1, 0)  # left the queue, not finished
    # Only the holder was ever scheduled (the queue time is observed at a first token).
    assert await server.metric("nanoserve:request_queue_time_seconds_count") == 1
    assert await _tokens_spent_after(server, holder) <= AFTER_HANG_UP
    assert await server.metric("nanoserve:requests_aborted_total") == 2
    assert await server.metric("nanoserve:e2e_request_latency_seconds_count") == 0  # none ended


async def _hang_up_a_stream(server):
    stream = await open_request(server, "/v1/completions", {**LONG, "stream": True})
    await read_until(stream, b"data: ")
    await hang_up(stream)
    await server.wait_idle()


async def test_gauges_read_idle_after_a_hang_up(server):
    await _hang_up_a_stream(server)
    assert await server.metric("nanoserve:num_requests_running") == 0
    assert await server.metric("nanoserve:kv_cache_usage_perc") == 0


async def test_a_request_that_left_has_one_first_token(server):
    await _hang_up_a_stream(server)
    assert await server.metric("nanoserve:time_to_first_token_seconds_count") == 1
    assert await server.metric("nanoserve:request_queue_time_seconds_count") == 1
