"""What real clients do to a live server: flood it past its queue, keep one connection for many
requests, read a stream very slowly, and stop it with SIGTERM while all of that is going on.

Every wait is bounded (the harness' WAIT_S, or `fail_after`); nothing here asserts a duration.
Answers are compared with the offline engine (`nanoserve.LLM`) on the same tiny model. A client
that leaves while queued is in test_disconnect.py.
"""

import json
import signal
import socket

import pytest
import trio

from nanoserve import LLM, SamplingParams
from nanoserve.testing.crowd import check_pool_returned
from nanoserve.testing.harness import (
    MODEL_NAME,
    WAIT_S,
    LiveServer,
    chat_token_ids,
    live_server,
    open_request,
    post_bytes,
    read_until,
    serve_command,
    sse_data,
)

BLOCKS = 256
C, X = "/v1/completions", "/v1/chat/completions"
PROMPT = "She wrote the weather"


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    """`run(prompt or token ids, **sampling) -> text` on the offline engine."""
    llm = LLM(str(tiny_model_dir), num_kv_blocks=BLOCKS)

    def run(prompt, **sampling):
        if isinstance(prompt, list):
            prompt = {"prompt_token_ids": prompt}
        return llm.generate(prompt, SamplingParams(**sampling), use_tqdm=False)[0].outputs[0].text

    run.tokenizer = llm.engine.tokenizer
    return run


def _expected(offline, path, body):
    """The offline answer to one greedy-or-seeded completion or chat body."""
    sampling = {k: body[k] for k in ("temperature", "top_p", "seed") if k in body}
    limit = body.get("max_tokens") or body["max_completion_tokens"]
    prompt = body["prompt"] if path == C else chat_token_ids(offline.tokenizer, body["messages"])
    return offline(prompt, max_tokens=limit, **sampling)


def _stream_text(events: list[str]) -> tuple[str, str | None]:
    """Joined text of a one-choice SSE stream, and its finish_reason; asserts [DONE] closes it
    and nothing in it is an error."""
    assert events and events[-1] == "[DONE]", events[-3:]
    text, finish = "", None
    for event in events[:-1]:
        chunk = json.loads(event)
        assert "error" not in chunk, chunk
        for choice in chunk["choices"]:
            text += choice.get("text") or choice.get("delta", {}).get("content") or ""
            finish = choice.get("finish_reason") or finish
    return text, finish


def _unary_text(body: dict) -> str:
    choice = body["choices"][0]
    assert choice["finish_reason"] is not None
    return choice["text"] if "text" in choice else choice["message"]["content"]


# -- overload --------------------------------------------------------------------------------

BURST = 30
BURST_BODY = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}


async def test_a_burst_past_the_queue_is_answered_or_refused_never_lost(tiny_model_dir, offline):
    """30 requests at once, 1 slot, a queue of 2: each one gets a full answer or a 503 with
    Retry-After, and the server's own count of successes equals the answers the clients got (no
    refused request ran, none was lost). Removing the queue limit fails `refused`."""
    expected = offline(PROMPT, temperature=0, max_tokens=24)
    async with live_server(tiny_model_dir, num_kv_blocks=BLOCKS, max_num_seqs=1, max_queue=2) as s:
        outcomes: list[tuple] = []

        async def client(i: int) -> None:
            body = {**BURST_BODY, "stream": i % 2 == 0}
            async with s.http.stream("POST", C, json=body) as response:
                raw = await response.aread()
            outcomes.append((response.status_code, response.headers, raw, body["stream"]))

        with trio.fail_after(WAIT_S):  # none hangs
            async with trio.open_nursery() as nursery:
                for i in range(BURST):
                    nursery.start_soon(client, i)
        completed = refused = 0
        for status, headers, raw, stream in outcomes:
            if status == 200:
                text = _stream_text(sse_data(raw))[0] if stream else _unary_text(json.loads(raw))
                assert text == expected
                completed += 1
            else:
                assert status == 503 and headers["Retry-After"] == "1", (status, raw)
                error = json.loads(raw)["error"]
                assert (error["type"], error["code"]) == ("server_error", "overloaded")
                refused += 1
        print(f"\n[burst] sent {BURST}: {completed} completed, {refused} refused (503)")
        assert completed + refused == BURST and completed >= 1 and refused >= 1
        await check_pool_returned(s)
        assert await s.metric("nanoserve:request_success_total") == completed
        assert await s.metric("nanoserve:requests_aborted_total") == 0
        assert (await s.health())["status"] == "ok"
        after = await s.http.post(C, json=BURST_BODY)
        assert after.status_code == 200 and _unary_text(after.json()) == expected


# -- keep-alive ------------------------------------------------------------------------------


class KeptAlive:
    """One HTTP/1.1 connection that sends its requests one after another (no Connection: close)
    and reads each response exactly, by Content-Length or by chunked framing."""

    def __init__(self, stream: trio.SocketStream):
        self.stream = stream
        self.buffer = b""

    async def request(self, path: str, body: dict) -> tuple[int, dict[str, str], bytes]:
        data = json.dumps(body).encode()
        head = f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        await self.stream.send_all(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
        status_line, *lines = (await self._until(b"\r\n\r\n")).decode().split("\r\n")
        headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
        if headers.get("transfer-encoding") == "chunked":
            payload = b""
            while size := int(await self._until(b"\r\n"), 16):
                payload += (await self._exactly(size + 2))[:-2]
            await self._exactly(2)  # the blank line after the last (empty) chunk
        else:
            payload = await self._exactly(int(headers["content-length"]))
        return int(status_line.split()[1]), headers, payload

    async def _fill(self) -> None:
        chunk = await self.stream.receive_some()
        assert chunk, "the server closed a kept-alive connection"
        self.buffer += chunk

    async def _until(self, marker: bytes) -> bytes:
        while marker not in self.buffer:
            await self._fill()
        part, _, self.buffer = self.buffer.partition(marker)
        return part

    async def _exactly(self, n: int) -> bytes:
        while len(self.buffer) < n:
            await self._fill()
        part, self.buffer = self.buffer[:n], self.buffer[n:]
        return part


def _keep_alive_plan(client: int) -> list[tuple[str, dict]]:
    """Four requests: unary and streamed, completion and chat, one of them seeded."""
    prompt = f"{PROMPT} {['river', 'garden', 'stone', 'market'][client]}"
    messages = [{"role": "user", "content": prompt}]
    greedy = {"temperature": 0, "max_tokens": 6 + client}
    seeded = {"temperature": 0.8, "seed": client, "max_tokens": 7}
    return [
        (C, {"prompt": prompt, **greedy}),
        (X, {"messages": messages, "stream": True, **greedy}),
        (C, {"prompt": prompt, "stream": True, **seeded}),
        (X, {"messages": messages, **greedy}),
    ]


async def test_keep_alive_clients_get_every_answer_on_one_connection(tiny_model_dir, offline):
    """Four clients at once, each sending four requests in turn on its single connection: every
    answer equals the offline engine's, no response asks to close the connection, and the
    connection still serves a fifth request."""
    async with live_server(tiny_model_dir, num_kv_blocks=BLOCKS, max_num_seqs=2) as s:
        answered: dict[int, int] = {}

        async def client(index: int) -> None:
            stream = await trio.open_tcp_stream(s.host, s.port)
            s.raw.append(stream)
            conn = KeptAlive(stream)
            plan = _keep_alive_plan(index)
            for path, body in plan:
                status, headers, payload = await conn.request(path, body)
                assert status == 200 and headers.get("connection", "") != "close", headers
                if body.get("stream"):
                    text, finish = _stream_text(sse_data(payload))
                    assert finish is not None
                else:
                    text = _unary_text(json.loads(payload))
                assert text == _expected(offline, path, body), (index, path, body)
                answered[index] = answered.get(index, 0) + 1
            status, _, payload = await conn.request(C, plan[0][1])  # still the same connection
            assert status == 200 and _unary_text(json.loads(payload))

        with trio.fail_after(WAIT_S):
            async with trio.open_nursery() as nursery:
                for index in range(4):
                    nursery.start_soon(client, index)
        assert answered == {0: 4, 1: 4, 2: 4, 3: 4}
        await check_pool_returned(s)
        assert await s.metric("nanoserve:request_success_total") == 4 * 5


# -- a slow reader ---------------------------------------------------------------------------

SLOW_BUDGET = 600


def _small_requests() -> list[tuple[str, dict]]:
    """Two completions and two chats, one of each streamed, 12 greedy tokens each."""
    requests = []
    for i, stream in enumerate((False, True, False, True)):
        sampling = {"temperature": 0, "max_tokens": 12, "stream": stream}
        if i < 2:
            requests.append((C, {"prompt": f"{PROMPT} {i}", **sampling}))
        else:
            requests.append((X, {"messages": [{"role": "user", "content": str(i)}], **sampling}))
    return requests


async def _stalled_stream(server: LiveServer, body: dict) -> tuple[trio.SocketStream, bytes]:
    """A stream on a socket with a tiny receive window, read up to its first event only."""
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a tiny window
    await sock.connect((server.host, server.port))
    stream = trio.SocketStream(sock)
    server.raw.append(stream)
    await stream.send_all(post_bytes(C, body))
    return stream, await read_until(stream, b"data: ")


async def test_a_slow_reader_holds_up_no_one_and_the_server_keeps_one_snapshot(
    tiny_model_dir, offline
):
    """A streaming client stops reading after its first event (some 350 kB of logprobs events
    follow). Meanwhile four other clients complete with the offline answers; the engine finishes
    the slow request and returns its blocks while its stream is still unread; what the server
    holds for it is one finished snapshot (outputs are cumulative, so a slow reader skips
    snapshots instead of queueing them). Read at last, the stream carries the whole text in far
    fewer events than tokens: the coalescing that keeps the server's memory bounded."""
    body = {
        "prompt": PROMPT,
        "stream": True,
        "max_tokens": SLOW_BUDGET,
        "ignore_eos": True,
        "temperature": 0,
        "logprobs": 20,
    }
    async with live_server(tiny_model_dir, num_kv_blocks=BLOCKS) as s:
        slow, data = await _stalled_stream(s, body)
        finished: list[str] = []

        async def other(path: str, request: dict) -> None:
            response = await s.http.post(path, json=request)
            assert response.status_code == 200
            if request["stream"]:
                text = _stream_text(sse_data(response.content))[0]
            else:
                text = _unary_text(response.json())
            assert text == _expected(offline, path, request)
            finished.append(text)

        async with trio.open_nursery() as nursery:  # bounded by the httpx timeout (WAIT_S)
            for path, request in _small_requests():
                nursery.start_soon(other, path, request)
        assert len(finished) == 4
        assert (await s.health())["open_requests"] == 1  # the slow stream is still open

        await s.wait_until(
            lambda h: h["running"] == h["waiting"] == 0 and h["free_blocks"] == h["total_blocks"]
        )
        assert (await s.health())["open_requests"] == 1  # done, and its reader still open

        with trio.fail_after(WAIT_S):
            while b"data: [DONE]\n\n" not in data:
                data += await slow.receive_some(4096)
        text, finish = _stream_text(sse_data(data))
        events = len(sse_data(data)) - 1
        print(f"\n[slow reader] {SLOW_BUDGET} tokens, {len(data) // 1024} kB, in {events} events")
        assert finish == "length"
        assert text == offline(PROMPT, temperature=0, max_tokens=SLOW_BUDGET, ignore_eos=True)
        assert events < SLOW_BUDGET // 2, "every snapshot was queued for the slow reader"
        await slow.aclose()
        await check_pool_returned(s)


# -- shutdown --------------------------------------------------------------------------------


def _ending(events: list[str]) -> str:
    """How a stream ended: "completed" (a finish_reason, then [DONE]) or "error" (an error event,
    then [DONE]); anything else fails."""
    assert events and events[-1] == "[DONE]", f"no [DONE]: {events[-2:]}"
    last = json.loads(events[-2])
    if "error" in last:
        assert last["error"]["type"] == "server_error" and last["error"]["message"]
        return "error"
    chunks = [json.loads(e) for e in events[:-1]]
    assert any(c["finish_reason"] for chunk in chunks for c in chunk["choices"]), events[-3:]
    return "completed"


async def test_sigterm_under_load_ends_every_stream_cleanly_and_the_process_exits(
    tiny_model_factory,
):
    """SIGTERM to `nanoserve serve` with three streams and a unary request in flight, an idle
    keep-alive connection that already served a request, and a client that stopped reading: the
    process exits by itself (grace 3 s; the watchdog 2 s later), each stream completes or ends
    with an error event and [DONE], and the unary request gets a whole OpenAI-shaped answer.
    (test_server.py covers each of the two obstacles alone.)"""
    model_dir = tiny_model_factory(max_position_embeddings=16384)
    async with serve_command(model_dir, "--num-kv-blocks", "8500") as (proc, server):
        assert (await server.http.get("/v1/models")).status_code == 200  # then idle, kept alive
        stalled = trio.socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await stalled.connect((server.host, server.port))
        server.raw.append(trio.SocketStream(stalled))
        long = {"prompt": PROMPT, "stream": True, "ignore_eos": True, "temperature": 0}
        await stalled.send(post_bytes(C, {**long, "max_tokens": 8000, "n": 8, "logprobs": 20}))
        streams: dict[int, list[str]] = {}
        unary: list = []

        async def read_stream(index: int, max_tokens: int) -> None:
            stream = await open_request(server, C, {**long, "max_tokens": max_tokens})
            data = b""
            while chunk := await stream.receive_some():
                data += chunk
            streams[index] = sse_data(data)

        async def post_unary() -> None:
            body = {**long, "stream": False, "max_tokens": 12000}
            unary.append(await server.http.post(C, json=body))

        with trio.fail_after(WAIT_S):
            async with trio.open_nursery() as nursery:
                for index, max_tokens in enumerate((600, 12000, 14000)):
                    nursery.start_soon(read_stream, index, max_tokens)
                nursery.start_soon(post_unary)
                # All five requests open, and the stalled reader's buffers full.
                await server.wait_until(
                    lambda h: h["open_requests"] == 5 and h["generation_tokens"] > 1600
                )
                proc.send_signal(signal.SIGTERM)
                signalled = trio.current_time()
                with trio.fail_after(3.0 + 2.0 + 5.0):  # grace, watchdog, margin
                    code = await proc.wait()
                exit_s = trio.current_time() - signalled  # reported, not asserted
        log = b""
        while chunk := await proc.stderr.receive_some():
            log += chunk
    endings = [_ending(streams[i]) for i in range(3)]
    (response,) = unary
    print(f"\n[shutdown] exit {code} after {exit_s:.1f} s; streams {endings}; unary {response}")
    assert code in (0, 1) and (code == 0 or b"shutdown is stuck" in log)
    assert b"Traceback" not in log, log.decode()[-3000:]
    assert "error" in endings  # the 12000- and 14000-token streams cannot have finished
    if response.status_code != 200:
        error = response.json()["error"]
        assert response.status_code >= 500 and "shutting down" in error["message"]
