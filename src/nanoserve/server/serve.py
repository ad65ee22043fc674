"""Runs the app under Hypercorn's Trio worker on a socket the command line bound, and stops it:
SIGINT or SIGTERM drains (open requests get a grace period, then fail cleanly), a second signal
stops at once, and a watchdog exits when a client that stopped reading holds shutdown past the
grace. An engine that died (its open requests already failed) stops the server the same way, with
exit status 1, so that a supervisor restarts it. Owns the signal handling of the process while
the server runs.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from quart_trio import QuartTrio

from nanoserve.config import ServerConfig
from nanoserve.engine import Engine, PoolingEngine
from nanoserve.server.bridge import Serving

log = logging.getLogger(__name__)

HARD_STOP_FLUSH_S = 0.3  # after a second signal: time for open streams to write their ending


async def serve(
    app: QuartTrio,
    serving: Serving,
    sock: socket.socket,
    graceful_timeout: float = ServerConfig.graceful_timeout,
) -> int:
    """Run `app` under Hypercorn's Trio worker on the bound `sock` until SIGINT or SIGTERM, or
    until the engine dies; returns the exit status (0, or 1 when the engine died).

    On a signal Hypercorn stops accepting; open requests get most of `graceful_timeout` to
    finish, then fail cleanly (streams end with an error event and [DONE]); Hypercorn cancels
    what is left at the deadline, and the engine task stops after its current step. A client
    that stopped reading can hold a shielded socket write past all that: a watchdog exits then.
    A second signal fails every open request at once and exits with 128 + its number. When the
    engine dies the same shutdown starts at once (its requests have failed already, so it takes
    well under the grace period), under the same watchdog.
    """
    config = HypercornConfig()
    config.bind = [f"fd://{sock.detach()}"]  # Hypercorn's socket object owns the descriptor now
    config.graceful_timeout = graceful_timeout
    config.errorlog = logging.getLogger("hypercorn.error")
    stop = trio.Event()
    async with trio.open_nursery() as nursery:

        async def run_hypercorn(task_status: trio.TaskStatus[list[str]]) -> None:
            await hypercorn_serve(app, config, shutdown_trigger=stop.wait, task_status=task_status)  # type: ignore[arg-type]
            nursery.cancel_scope.cancel()  # the signal watcher

        await nursery.start(_watch_signals, stop, serving, graceful_timeout)
        nursery.start_soon(_stop_when_the_engine_dies, stop, serving, graceful_timeout)
        binds = await nursery.start(run_hypercorn)
        log.info("ready: %s (OpenAI API at %s/v1)", binds[0], binds[0])
    if serving.dead is not None:
        log.error("stopped: the engine died (%s)", serving.dead)
        return 1
    log.info("stopped")
    return 0


def log_loaded(engine: Engine | PoolingEngine, name: str, load_s: float) -> None:
    """The start-up line of what was loaded: its KV pool, or what a pooling model serves."""
    c = engine.config
    if isinstance(engine, PoolingEngine):
        kind = "a cross-encoder" if engine.classifies else "an embedding model"
        log.info("model %r loaded in %.1f s (%s): %s (%s pooling), context %d tokens", name,
                 load_s, c.dtype, kind, engine.pooling.mode, engine.max_model_len)  # fmt: skip
        return
    log.info(
        "model %r loaded in %.1f s (%s): %d KV blocks of %d tokens (%.2f GiB, %s), context %d "
        "tokens", name, load_s, c.dtype, engine.num_blocks, c.block_size,
        engine.kv_cache_bytes / 2**30, c.kv_cache_dtype, engine.max_model_len,
    )  # fmt: skip
    if engine.worker_pids:
        pids = ", ".join(map(str, engine.worker_pids))
        log.info("tensor parallel: %d ranks, worker pids %s", len(engine.worker_pids) + 1, pids)


async def _stop_when_the_engine_dies(stop: trio.Event, serving: Serving, grace: float) -> None:
    await serving.died.wait()
    log.error("the engine died: shutting down (%s)", serving.dead)
    stop.set()
    await trio.sleep(grace + 2.0)
    log.error("shutdown is stuck (a client that stopped reading?): exiting now")
    os._exit(1)


async def _watch_signals(
    stop: trio.Event,
    serving: Serving,
    grace: float,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        signum = await anext(signals)
        log.info("%s: shutting down (grace %.1f s)", signal.Signals(signum).name, grace)
        stop.set()
        with trio.move_on_after(0.8 * grace):
            await _stop_at_once(await anext(signals), serving)
        serving.close()
        with trio.move_on_after(0.2 * grace + 2.0):
            await _stop_at_once(await anext(signals), serving)
    log.error("shutdown is stuck (a client that stopped reading?): exiting now")
    os._exit(1)


async def _stop_at_once(signum: int, serving: Serving) -> None:
    """A second signal: every open request fails now; streams get a moment to write it."""
    serving.close("the server was stopped")
    with trio.CancelScope(shield=True):  # the server may finish first: exit as promised anyway
        await trio.sleep(HARD_STOP_FLUSH_S)
    name = signal.Signals(signum).name
    print(f"nanoserve: second {name}, stopped without waiting", file=sys.stderr, flush=True)
    os._exit(128 + signum)
