"""A tensor-parallel worker: ranks 1..N-1. It joins the group, takes rank 0's engine settings,
builds its runner (its slices, its heads' KV cache) and runs every call of a runner method that
rank 0 sends (channel.py) until told to stop or until rank 0 is gone. It never samples:
its part of a step is the collectives; only a gathered method's result (an int) goes back.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nanoserve.config import EngineConfig
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.parallel.channel import (
    ENV,
    GATHERED,
    Channel,
    join_group,
    model_group,
    rank_device,
)
from nanoserve.model import open_checkpoint


def run_worker(
    model: str,
    method: str,
    rank: int,
    size: int,
    threads: int | None = None,
    started: Any = None,
) -> None:
    """A worker's life: join the group, take rank 0's engine settings, build this rank's runner,
    then run every call rank 0 sends until it says stop. Spawned by rank 0 (with `threads`, its
    share of the CPU, and `started`, the pipe that says it is up), or run by `nanoserve worker`
    with the env:// variables."""
    if started is not None:
        # Ctrl-C reaches every process of the terminal's group: rank 0 stops the workers.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _exit_with_parent()
        started.send(True)
        started.close()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        channel = join_group(method, rank, size)
        received: list[Any] = [None]
        dist.broadcast_object_list(received, group_src=0, group=channel.group)
        config: EngineConfig = received[0]
        device = rank_device(config.device, int(os.environ.get("LOCAL_RANK", rank)))
        runner = ModelRunner(open_checkpoint(model), config, model_group(channel, device), device)
        _serve(runner, channel, config.attention_backend)
    except Exception as e:
        print(f"nanoserve tp worker rank {rank}: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def worker_from_env(model: str | Path) -> None:
    """`nanoserve worker`: rank RANK of WORLD_SIZE, meeting rank 0 (the server, started with
    the same variables and RANK=0) at MASTER_ADDR:MASTER_PORT. Returns when rank 0 stops it."""
    missing = [name for name in ENV if name not in os.environ]
    if missing:
        raise ValueError(f"a worker needs {', '.join(missing)} in its environment")
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not 0 < rank < size:
        raise ValueError(f"a worker's RANK must be in 1..{size - 1} (rank 0 is the server)")
    run_worker(str(model), "env://", rank, size)


@torch.inference_mode()
def _serve(runner: ModelRunner, channel: Channel, backend: str) -> None:
    while (call := channel.receive(runner.device, backend)) is not None:
        method, args = call
        result = getattr(runner, method)(*args)
        if method in GATHERED:
            channel.gather(result)


def _exit_with_parent() -> None:
    """A spawned worker exits as soon as rank 0's process is gone, whatever it is doing (even
    blocked in a collective): a thread waits on the pipe the parent holds open."""
    parent = multiprocessing.parent_process()
    assert parent is not None

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
