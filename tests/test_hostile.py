"""Clients that send what a server must not trust: bytes past the request, headers that
disagree, control characters in the path, special tokens typed into a message. Real sockets."""

import contextlib
import logging
import signal

import trio

from nanoserve.server.access import PrintableFormatter
from nanoserve.testing.harness import WAIT_S, live_server, serve_command

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


async def test_a_request_with_both_length_headers_is_answered_then_closed(tiny_model_dir):
    """RFC 9112 6.1: Content-Length beside Transfer-Encoding may be a smuggling attempt; the
    server answers and closes the connection, so nothing after it is read as a request."""
    body = b'{"prompt": "hi", "max_tokens": 1}'
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    headers = {"Transfer-Encoding": "chunked", "Content-Length": str(len(chunked))}
    request = _request("POST", "/v1/completions", headers=headers) + chunked
    smuggled = _request("GET", "/v1/models")
    async with live_server(tiny_model_dir, num_kv_blocks=BLOCKS) as server:
        stream = await trio.open_tcp_stream(server.host, server.port)
        server.raw.append(stream)
        await stream.send_all(request + smuggled)
        received = b""
        with trio.fail_after(WAIT_S):
            while chunk := await stream.receive_some():  # the server closes
                received += chunk
    assert received.startswith(b"HTTP/1.1 200") and b"connection: close" in received.lower()
    assert received.count(b"HTTP/1.1") == 1  # the smuggled request was never answered


async def test_control_characters_from_a_client_never_start_a_log_line(tiny_model_factory):
    """The access log of `nanoserve serve` (what an operator reads): a percent-encoded newline
    in the path stays encoded, and a control character in a logged message is escaped."""
    async with serve_command(tiny_model_factory()) as (proc, server):
        await _first_status(server, _request("GET", "/v1/models%0AFORGED%20LINE"))
        await _first_status(server, _request("GET", "/v1/models\x0bFORGED"))
        await server.http.get("/health")
        proc.send_signal(signal.SIGTERM)
        with trio.fail_after(WAIT_S):
            await proc.wait()
            log = b""
            while chunk := await proc.stderr.receive_some():
                log += chunk
    lines = log.decode(errors="replace").splitlines()
    assert not [line for line in lines if line.startswith("FORGED")], lines
    assert any("/v1/models%0AFORGED%20LINE" in line for line in lines), lines


def test_the_log_format_escapes_control_characters():
    record = logging.LogRecord("x", logging.INFO, "", 0, "field %s", ("a\nb\x1b[2Jc\u2028",), None)
    line = PrintableFormatter("%(levelname)s %(message)s").format(record)
    assert line == "INFO field a\\x0ab\\x1b[2Jc\\u2028"
