"""Tensor parallelism's executor, rank 0's side. Rank 0 is the engine's own process: it spawns the
other ranks (worker.py; or, with MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK set, waits
for ranks started by `nanoserve worker`), builds its own runner as they build theirs, sends each
call of a runner method to them before running it itself (channel.py), watches that every
worker lives, names what broke a call, and stops them all. Owns the processes and the group.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nanoserve.config import EngineConfig
from nanoserve.engine.memory import check_weights_fit, headroom
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.parallel.channel import (
    GATHERED,
    Channel,
    join_group,
    model_group,
    rank_device,
    rendezvous,
)
from nanoserve.engine.parallel.worker import run_worker
from nanoserve.model import Checkpoint, Parallel, weight_bytes

JOIN_S = 5.0  # at shutdown, time the workers get to stop by themselves before they are killed


class WorkerFailed(RuntimeError):
    """A tensor-parallel worker died or stopped answering: the engine cannot step any more."""


@dataclass
class _Workers:
    """What shutting down needs (kept apart from TensorParallelExecutor for its finalizer)."""

    processes: list[Any]  # multiprocessing.Process, rank i + 1 at index i (none with env://)
    threads: int  # rank 0's torch threads before the workers took their share
    channel: Channel | None = None
    broken: str | None = None  # why the group cannot run another step
    closed: bool = field(default=False)


class TensorParallelExecutor:
    """Rank 0's executor: `launch` starts the group and builds rank 0's runner; `call` and `gather`
    run a runner method on every rank; `close` (or garbage collection, or the interpreter's exit)
    stops every worker."""

    def __init__(self, workers: _Workers, channel: Channel, runner: ModelRunner) -> None:
        self._workers = workers
        self.channel = channel
        self.runner = runner
        self._finalizer = weakref.finalize(self, _shutdown, workers)

    @classmethod
    def launch(
        cls, model: str | Path, checkpoint: Checkpoint, config: EngineConfig
    ) -> TensorParallelExecutor:
        size, method = config.tensor_parallel_size, rendezvous()
        if dist.is_initialized():  # the process group is the process's one default group
            raise RuntimeError(
                "torch.distributed is in use in this process (another tensor-parallel engine?): "
                "close it first (LLM.close(), Engine.close())"
            )
        if method == "env://" and os.environ["RANK"] != "0":
            raise ValueError(f"the engine is rank 0; RANK is {os.environ['RANK']}")
        device = rank_device(config.device, int(os.environ.get("LOCAL_RANK", "0")))
        _check_devices(device, size, method)
        threads = torch.get_num_threads()
        workers = _Workers([], threads)
        if method != "env://":  # this machine's CPU threads, shared among its ranks
            if device.type == "cpu":  # each rank reads the whole checkpoint, all at once
                whole = weight_bytes(checkpoint, config, Parallel(size=size))
                check_weights_fit(checkpoint.path, size * whole, headroom(), ranks=size)
            share = max(1, threads // size)
            workers.processes = _spawn(model, method, size, share)
            torch.set_num_threads(share)
        try:
            workers.channel = channel = join_group(method, 0, size)
            dist.broadcast_object_list([config], group_src=0, group=channel.group)
            # Every rank builds its runner now (the pool's size is agreed on by a collective).
            runner = ModelRunner(checkpoint, config, model_group(channel, device), device)
        except BaseException as e:
            failure = _failure(workers, e)  # before the workers are stopped
            workers.broken = f"start-up failed: {_describe(e)}"
            _shutdown(workers)
            if failure is e:
                raise
            raise failure from e
        return cls(workers, channel, runner)

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids, rank 1 first (empty when they were started by hand)."""
        return [p.pid for p in self._workers.processes]

    def check(self) -> None:
        """Raise WorkerFailed if a worker has exited or an earlier call broke the group."""
        w = self._workers
        if w.broken is None:
            dead = _dead(w.processes)
            if dead:
                w.broken = dead
        if w.broken is not None:
            raise WorkerFailed(f"tensor parallelism is down: {w.broken}")

    def call(self, method: str, *args: Any) -> Any:
        """`runner.method(*args)` on every worker, then here; rank 0's result."""
        assert method not in GATHERED, f"{method}: the workers send its result; use gather"
        with self._calling():
            self.check()
            self.channel.call(method, args)
            return getattr(self.runner, method)(*args)

    def gather(self, method: str) -> list[int]:
        """`runner.method()` (an int) on every rank; every rank's result, rank 0 first."""
        assert method in GATHERED, f"{method}: the workers keep its result; use call"
        with self._calling():
            self.check()
            self.channel.call(method, ())
            return self.channel.gather(getattr(self.runner, method)())

    @contextlib.contextmanager
    def _calling(self) -> Iterator[None]:
        """Around rank 0's part of a call. A failure inside leaves the ranks out of step for
        good, and is named (a dead worker, or a collective's error or timeout, as WorkerFailed).
        In the main thread a first Ctrl-C waits for the call's end, which the workers reach too
        (a chat stops an answer and goes on); a second one interrupts at once."""
        with _sigint_after_the_step():
            try:
                yield
            except BaseException as e:
                if self._workers.broken is None:
                    self._workers.broken = f"a step failed: {_describe(e)}"
                failure = _failure(self._workers, e)
                if failure is e:
                    raise
                raise failure from e

    def close(self) -> None:
        self._finalizer()


@contextlib.contextmanager
def _sigint_after_the_step() -> Iterator[None]:
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        # Signals reach the main thread only (the server's steps run in a thread of their own),
        # and a handler other than Python's KeyboardInterrupt is its owner's business.
        yield
        return
    pending: list[int] = []

    def defer(signum: int, frame: Any) -> None:
        if pending:
            raise KeyboardInterrupt
        pending.append(signum)

    previous = signal.signal(signal.SIGINT, defer)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pending:
        raise KeyboardInterrupt


def _check_devices(device: torch.device, size: int, method: str) -> None:
    if device.type != "cuda" or method == "env://":
        return
    have = torch.cuda.device_count()
    if (device.index or 0) + size > have:
        raise ValueError(
            f"tensor_parallel_size {size} from {device} needs CUDA devices up to index "
            f"{(device.index or 0) + size - 1}; torch sees {have}"
        )


def _spawn(model: str | Path, method: str, size: int, threads: int) -> list[Any]:
    """Ranks 1..size-1 as daemonic processes (spawned: a fresh interpreter, no forked locks).
    Returns once each has started up and is about to join the group, so that one which fails
    on its way there (an import, a script without a `__main__` guard) is reported at once
    rather than after the rendezvous times out."""
    context = multiprocessing.get_context("spawn")
    processes, ready = [], []
    for rank in range(1, size):
        reader, writer = context.Pipe(duplex=False)
        process = context.Process(
            target=run_worker,
            args=(str(model), method, rank, size, threads, writer),
            name=f"nanoserve-tp-rank{rank}",
            daemon=True,
        )
        process.start()
        writer.close()
        processes.append(process)
        ready.append(reader)
    waiting = set(ready)
    while waiting:
        for event in multiprocessing.connection.wait([*waiting, *(p.sentinel for p in processes)]):
            if event in waiting:
                waiting.discard(event)  # type: ignore[arg-type]
            elif (dead := _dead(processes)) is not None:
                _kill(processes)
                raise WorkerFailed(f"tensor-parallel {dead} while starting")
    return processes


def _kill(processes: list[Any]) -> None:
    for p in processes:
        if p.exitcode is None:
            p.kill()
            p.join(1.0)


def _dead(processes: list[Any]) -> str | None:
    for rank, p in enumerate(processes, start=1):
        if p.exitcode is not None:
            how = (
                f"killed by {signal.Signals(-p.exitcode).name}"
                if p.exitcode < 0
                else f"exit status {p.exitcode}"
            )
            return f"worker rank {rank} (pid {p.pid}) died ({how})"
    return None


def _failure(workers: _Workers, error: BaseException) -> BaseException:
    """A dead worker named (its exit may trail the broken connection by a moment), else a
    collective's error as WorkerFailed, else `error` itself."""
    if isinstance(error, WorkerFailed):
        return error
    alive = [p.sentinel for p in workers.processes if p.exitcode is None]
    if alive:
        multiprocessing.connection.wait(alive, timeout=1.0)
    dead = _dead(workers.processes)
    if dead is not None:
        workers.broken = dead
        return WorkerFailed(f"tensor-parallel {dead}")
    if isinstance(error, RuntimeError | dist.DistError):
        return WorkerFailed(f"a tensor-parallel collective failed: {error}")
    return error


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _shutdown(workers: _Workers) -> None:
    """Stop message (if the group still works), JOIN_S for the workers to exit, then kill what
    remains; leave the process group; give rank 0 its threads back. Runs once."""
    if workers.closed:
        return
    workers.closed = True
    broken, workers.broken = workers.broken, workers.broken or "the engine was closed"
    if workers.channel is not None and broken is None and _dead(workers.processes) is None:
        with contextlib.suppress(Exception):  # a worker that did not get it is killed below
            workers.channel.stop()
    deadline = time.monotonic() + JOIN_S
    for p in workers.processes:
        p.join(max(0.0, deadline - time.monotonic()))
    _kill(workers.processes)
    if dist.is_initialized():
        dist.destroy_process_group()
    torch.set_num_threads(workers.threads)
