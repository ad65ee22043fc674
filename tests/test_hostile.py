"""Clients that send what a server must not trust: bytes past the request, headers that
disagree, control characters in the path, special tokens typed into a message. Real sockets."""

import contextlib

import trio

from nanoserve.testing.harness import WAIT_S, live_server

BLOCKS = 64
KEY = {"Authorization": "Bearer k"}


async def _first_status(server, data: bytes) -> bytes:
    """Send `data` on a fresh connection; the status line of the first response."""
    stream = await trio.open_tcp_stream(server.host, server.port)
    server.raw.append(stream)
    with contextlib.suppress(trio.BrokenResourceError):
        await stream.send_all(data)
    received = b""
    with trio.fail_after(WAIT_S), contextlib.suppress(trio.BrokenResourceError):
        while b"\r\n" not in received and (chunk := await stream.receive_some()):
            received += chunk
    await stream.aclose()
    return received.split(b"\r\n")[0]


def _request(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None):
    lines = [f"{method} {path} HTTP/1.1", "Host: test", *(f"{k}: {v}" for k, v in
             (headers or {}).items())]  # fmt: skip
    if body:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def test_a_refusal_before_the_body_always_arrives(tiny_model_dir):
    """401, 404 and 405 answered before the body is read, to a client whose write carries a
    body, a pipelined request or trailing bytes: 20 of 20 arrive, each with its status."""
    body = b'{"prompt": "hi", "max_tokens": 1}' * 40
    cases = {
        401: _request("POST", "/v1/completions", body),
        404: _request("POST", "/v1/nothing", body, KEY),
        405: _request("DELETE", "/v1/models", body, KEY),
    }
    async with live_server(tiny_model_dir, num_kv_blocks=BLOCKS, api_key="k") as server:
        for status, request in cases.items():
            for tail in (b"", _request("GET", "/health"), b"trailing garbage"):
                for _ in range(7):
                    line = await _first_status(server, request + tail + _request("GET", "/x"))
                    assert line.startswith(b"HTTP/1.1 %d" % status), (status, tail, line)
