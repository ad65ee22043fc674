"""Test harness for the HTTP server: a real Hypercorn (Trio worker) on an ephemeral port, run in
the caller's nursery, a raw HTTP/1.1 client for clients that hang up, and polling helpers that ask
the server itself (/health, /metrics) whether the engine is idle.
"""

from __future__ import annotations

import json
import re
import socket
import struct
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from quart_trio import QuartTrio

from nanoserve.config import EngineConfig, ServerConfig
from nanoserve.engine import Engine, PoolingEngine
from nanoserve.server.app import create_app
from nanoserve.server.bridge import Serving
from nanoserve.tokenizer import Tokenizer

MODEL_NAME = "tiny"
WAIT_S = 30.0  # bound of every wait for the server to reach a state


@dataclass
class LiveServer:
    url: str
    host: str
    port: int
    serving: Serving
    engine: Engine | PoolingEngine
    app: QuartTrio
    http: httpx.AsyncClient  # for /health and /metrics
    raw: list[trio.SocketStream] = field(default_factory=list)  # closed before shutdown
    startup_log: str = ""  # serve_command: what the process wrote to stderr up to its ready line

    async def health(self) -> dict[str, Any]:
        return (await self.http.get("/health")).json()

    async def metric(self, name: str) -> float:
        """Sum of a metric's samples (all label sets) from /metrics."""
        text = (await self.http.get("/metrics")).text
        total, found = 0.0, False
        for line in text.splitlines():
            sample = line.split("{")[0].split(" ")[0]
            if sample == name:
                total += float(line.rsplit(" ", 1)[1])
                found = True
        assert found, f"{name} is not in /metrics"
        return total

    async def wait_until(self, predicate: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """Poll /health until `predicate` holds (fails the test after WAIT_S)."""
        with trio.fail_after(WAIT_S):
            while not predicate(health := await self.health()):
                await trio.sleep(0.002)
        return health

    async def wait_idle(self) -> dict[str, Any]:
        """Nothing running or waiting, and every KV block back in the pool."""
        return await self.wait_until(
            lambda h: (
                h["running"] == h["waiting"] == h["open_requests"] == 0
                and h["free_blocks"] == h["total_blocks"]
            )
        )


@asynccontextmanager
async def live_server(
    model_dir: Path,
    *,
    max_queue: int | None = None,
    api_key: str | None = None,
    max_body_bytes: int = ServerConfig.max_body_bytes,
    responses_store_size: int = ServerConfig.responses_store_size,
    **engine_args: Any,
) -> AsyncIterator[LiveServer]:
    """Serve the app on 127.0.0.1, port 0; ready when Hypercorn reports its binds (after the
    app's startup, which starts the engine task). The engine is closed at the end (its
    tensor-parallel workers stop)."""
    with Engine(model_dir, EngineConfig(**engine_args)) as engine:
        serving = _serving(engine, max_queue, api_key, max_body_bytes, responses_store_size)
        async with serving as server:
            yield server


@asynccontextmanager
async def live_pooling_server(
    model_dir: Path, *, max_queue: int | None = None, **engine_args: Any
) -> AsyncIterator[LiveServer]:
    """As live_server, for an embedding model or a cross-encoder (the pooling engine)."""
    engine = PoolingEngine(model_dir, EngineConfig(**engine_args))
    async with _serving(engine, max_queue, None, ServerConfig.max_body_bytes) as server:
        yield server


@asynccontextmanager
async def _serving(
    engine: Engine | PoolingEngine,
    max_queue: int | None,
    api_key: str | None,
    max_body_bytes: int,
    responses_store_size: int = ServerConfig.responses_store_size,
) -> AsyncIterator[LiveServer]:
    serving = Serving(engine, max_queue=max_queue)
    app = create_app(
        serving, MODEL_NAME, api_key=api_key, max_body_bytes=max_body_bytes,
        responses_store_size=responses_store_size,
    )  # fmt: skip
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.graceful_timeout = 1.0
    config.errorlog = None
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve, app, config, shutdown_trigger=stop.wait))
        url = binds[0]
        host, port = url.removeprefix("http://").rsplit(":", 1)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=WAIT_S) as http:
            server = LiveServer(url, host, int(port), serving, engine, app, http)
            try:
                yield server
            finally:
                # A raw client left open and unread would hold Hypercorn's (shielded) socket
                # write, and so its shutdown, forever: a failed test must not hang the run.
                for stream in server.raw:
                    await stream.aclose()
                stop.set()


# -- a raw HTTP/1.1 client ----------------------------------------------------------------------


def post_bytes(
    path: str, body: dict[str, Any] | bytes, headers: dict[str, str] | None = None
) -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    lines = [
        f"POST {path} HTTP/1.1",
        "Host: test",
        "Content-Type: application/json",
        f"Content-Length: {len(data)}",
        "Connection: close",
        *(f"{k}: {v}" for k, v in (headers or {}).items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + data


async def open_request(server: LiveServer, path: str, body: dict[str, Any]) -> trio.SocketStream:
    """Send a request on a fresh connection and return it, response unread."""
    stream = await trio.open_tcp_stream(server.host, server.port)
    server.raw.append(stream)
    await stream.send_all(post_bytes(path, body))
    return stream


async def read_until(stream: trio.SocketStream, marker: bytes) -> bytes:
    """Read from `stream` until `marker` has arrived (fails the test after WAIT_S)."""
    data = b""
    with trio.fail_after(WAIT_S):
        while marker not in data:
            chunk = await stream.receive_some()
            assert chunk, f"connection closed before {marker!r}: {data!r}"
            data += chunk
    return data


async def hang_up(stream: trio.SocketStream, reset: bool = False) -> None:
    """Close the connection: a FIN, or with `reset` an RST (as a client process that dies)."""
    if reset:
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    await stream.aclose()


def sse_data(raw: bytes) -> list[str]:
    """The `data:` payloads of an SSE response read off the socket (each event is one chunk of
    the chunked body, so the framing never splits one)."""
    return [m.decode() for m in re.findall(rb"data: (.*?)\n\n", raw)]


def chat_token_ids(tokenizer: Tokenizer, messages: list[dict[str, Any]]) -> list[int]:
    """The prompt ids the server computes for a chat request (the template carries the BOS)."""
    return tokenizer.encode_chat(messages)


@asynccontextmanager
async def serve_command(
    model_dir: Path | None, *flags: str
) -> AsyncIterator[tuple[Any, LiveServer]]:
    """`nanoserve serve MODEL_DIR --port 0 ...` (without a MODEL_DIR: the default model) in a
    subprocess; yields (process, client) once it logged its ready line. The client's connection
    stays open (idle keep-alive). The LiveServer has no in-process engine: only its HTTP side is
    usable. The pool is 1100 blocks unless the flags size it."""
    model = [] if model_dir is None else [str(model_dir)]
    sized = {"--num-kv-blocks", "--kv-cache-memory"} & {f.split("=")[0] for f in flags}
    pool = [] if sized else ["--num-kv-blocks", "1100"]
    command = [sys.executable, "-m", "nanoserve.cli", "serve", *model, "--port", "0", *pool, *flags]
    proc = await trio.lowlevel.open_process(command, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    try:
        log = b""
        with trio.fail_after(60):
            while b"ready: " not in log:
                chunk = await proc.stderr.receive_some()
                assert chunk, log.decode()
                log += chunk
        url = log.split(b"ready: ", 1)[1].split()[0].decode()
        host, port = url.removeprefix("http://").rsplit(":", 1)
        async with httpx.AsyncClient(base_url=url, timeout=WAIT_S) as http:
            server = LiveServer(url, host, int(port), None, None, None, http)  # type: ignore[arg-type]
            server.startup_log = log.decode(errors="replace")
            try:
                yield proc, server
            finally:
                for stream in server.raw:
                    await stream.aclose()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
