"""Tensor parallelism across processes. Rank 0 is the engine's own process: it spawns the other
ranks (or, with MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK set, waits for ranks started by
`nanoserve worker`), sends each step's inputs as one message, watches that every worker lives and
stops them all. A worker joins the group, builds its runner (its slices, its heads' KV cache) and
runs what rank 0 sends until told to stop or until rank 0 is gone. Owns the processes, the group.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nanoserve import env
from nanoserve.config import EngineConfig
from nanoserve.engine.inputs import StepInputs, from_message, to_message
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.model.checkpoint import open_checkpoint
from nanoserve.model.parallel import Parallel

STEP, STOP, CACHE_BLOCKS = 1, 2, 3  # what a message asks of the workers
# A rank waiting longer than this in a collective of a step: another rank hung; the step fails.
TIMEOUT_S = env.tp_timeout_s()
# A worker waiting for rank 0's next message waits as long as the server idles.
IDLE = timedelta(days=365)
JOIN_S = 5.0  # at shutdown, time the workers get to stop by themselves before they are killed
FIRST = 512  # int64s of a message's first broadcast (a decode step of a few sequences fits)
ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


class WorkerFailed(RuntimeError):
    """A tensor-parallel worker died or stopped answering: the engine cannot step any more."""


def rendezvous() -> str:
    """`env://` when the launcher's variables are set (ranks on several machines), else a free
    TCP port on this machine."""
    if all(name in os.environ for name in ENV):
        return "env://"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def rank_device(device: str, local_rank: int) -> torch.device:
    """CPU ranks share the CPU; CUDA rank r takes device index (config's, default 0) + r."""
    d = torch.device(device)
    return d if d.type == "cpu" else torch.device("cuda", (d.index or 0) + local_rank)


class Channel:
    """Rank 0 to every other rank: one int64 message at a time (a kind and a payload) by
    broadcast over a CPU (gloo) group. A message of up to FIRST - 2 values takes one broadcast;
    a longer one a second for the rest. Waiting for the next message never times out."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.buffer = torch.zeros(FIRST, dtype=torch.int64)

    def send(self, kind: int, payload: torch.Tensor | None = None) -> None:
        payload = torch.zeros(0, dtype=torch.int64) if payload is None else payload
        n = payload.shape[0]
        head = min(n, FIRST - 2)
        self.buffer[0], self.buffer[1] = kind, n
        self.buffer[2 : 2 + head] = payload[:head]
        dist.broadcast(self.buffer, group_src=0, group=self.group)
        if n > head:
            dist.broadcast(payload[head:].contiguous(), group_src=0, group=self.group)

    def receive(self) -> tuple[int, torch.Tensor]:
        options = dist.BroadcastOptions()
        options.rootRank, options.timeout = 0, IDLE
        self.group.broadcast([self.buffer], options).wait()
        kind, n = self.buffer[:2].tolist()
        head = min(n, FIRST - 2)
        if n == head:
            return kind, self.buffer[2 : 2 + n].clone()
        rest = torch.empty(n - head, dtype=torch.int64)
        dist.broadcast(rest, group_src=0, group=self.group)
        return kind, torch.cat([self.buffer[2 : 2 + head], rest])


def join_group(method: str, rank: int, size: int) -> Channel:
    """Join the group (gloo: the messages are CPU tensors). Its collectives time out after
    TIMEOUT_S; with env:// the rank and size come from the environment."""
    timeout = timedelta(seconds=TIMEOUT_S)
    if method == "env://":  # RANK and WORLD_SIZE from the environment
        dist.init_process_group("gloo", init_method=method, timeout=timeout)
    else:
        dist.init_process_group(
            "gloo", init_method=method, timeout=timeout, rank=rank, world_size=size
        )
    if dist.get_world_size() != size:
        raise ValueError(
            f"WORLD_SIZE {dist.get_world_size()} differs from tensor_parallel_size {size}"
        )
    return Channel(dist.group.WORLD)


def model_group(channel: Channel, device: torch.device) -> Parallel:
    """The group of the forward pass's collectives: NCCL between CUDA devices (every rank
    creates it at the same point), else the gloo group of the messages."""
    rank, size = dist.get_rank(), dist.get_world_size()
    if device.type != "cuda":
        return Parallel(rank, size, channel.group)
    torch.cuda.set_device(device)
    group = dist.new_group(backend="nccl", timeout=timedelta(seconds=TIMEOUT_S))
    return Parallel(rank, size, group)


# -- rank 0 ---------------------------------------------------------------------------------------


@dataclass
class _Workers:
    """What shutting down needs (kept apart from TensorParallel for its finalizer)."""

    processes: list[Any]  # multiprocessing.Process, rank i + 1 at index i (none with env://)
    threads: int  # rank 0's torch threads before the workers took their share
    channel: Channel | None = None
    broken: str | None = None  # why the group cannot run another step
    closed: bool = field(default=False)


class TensorParallel:
    """Rank 0's side: `launch` starts the group; the runner calls `send_step` before each
    forward pass; `close` (or garbage collection, or the interpreter's exit) stops every worker."""

    def __init__(self, workers: _Workers, parallel: Parallel, device: torch.device) -> None:
        self._workers = workers
        self.parallel = parallel
        self.device = device
        self._finalizer = weakref.finalize(self, _shutdown, workers)

    @classmethod
    def launch(cls, model: str | Path, config: EngineConfig) -> TensorParallel:
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
            share = max(1, threads // size)
            workers.processes = _spawn(model, method, size, share)
            torch.set_num_threads(share)
        try:
            workers.channel = join_group(method, 0, size)
            dist.broadcast_object_list([config], group_src=0, group=workers.channel.group)
            parallel = model_group(workers.channel, device)
        except BaseException as e:
            failure = _failure(workers, e)  # before the workers are stopped
            workers.broken = f"start-up failed: {_describe(e)}"
            _shutdown(workers)
            if failure is e:
                raise
            raise failure from e
        return cls(workers, parallel, device)

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids, rank 1 first (empty when they were started by hand)."""
        return [p.pid for p in self._workers.processes]

    def check(self) -> None:
        """Raise WorkerFailed if a worker has exited or an earlier step broke the group."""
        w = self._workers
        if w.broken is None:
            dead = _dead(w.processes)
            if dead:
                w.broken = dead
        if w.broken is not None:
            raise WorkerFailed(f"tensor parallelism is down: {w.broken}")

    def send_step(self, inputs: StepInputs) -> None:
        self.check()
        assert self._workers.channel is not None
        self._workers.channel.send(STEP, to_message(inputs))

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        """Around rank 0's part of a step. A failure inside leaves the ranks out of step for
        good, and is named (`failure`). In the main thread a first Ctrl-C waits for the step's
        end, which the workers reach too (a chat stops an answer and goes on); a second one
        interrupts at once."""
        with _sigint_after_the_step():
            try:
                yield
            except BaseException as e:
                failure = self.failure(e)
                if failure is e:
                    raise
                raise failure from e

    def failure(self, error: BaseException) -> BaseException:
        """What a step that raised means: the group is out of step for good; a dead worker (or a
        collective's error or timeout) is named as the cause."""
        if self._workers.broken is None:
            self._workers.broken = f"a step failed: {_describe(error)}"
        return _failure(self._workers, error)

    def cache_blocks(self, own: int) -> list[int]:
        """KV blocks in each rank's cache (rank 0's is `own`); -1 for a rank whose layers
        disagree. A collective: call between steps."""
        self.check()
        assert self._workers.channel is not None
        self._workers.channel.send(CACHE_BLOCKS)
        return _gather_blocks(self._workers.channel, own, self.parallel)

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


def _gather_blocks(channel: Channel, own: int, parallel: Parallel) -> list[int]:
    mine = torch.tensor([own], dtype=torch.int64)
    parts = [torch.empty_like(mine) for _ in range(parallel.size)] if parallel.first else None
    dist.gather(mine, parts, group=channel.group, group_dst=0)
    return [int(p) for p in parts] if parts is not None else []


def _shutdown(workers: _Workers) -> None:
    """Stop message (if the group still works), JOIN_S for the workers to exit, then kill what
    remains; leave the process group; give rank 0 its threads back. Runs once."""
    if workers.closed:
        return
    workers.closed = True
    broken, workers.broken = workers.broken, workers.broken or "the engine was closed"
    if workers.channel is not None and broken is None and _dead(workers.processes) is None:
        with contextlib.suppress(Exception):  # a worker that did not get it is killed below
            workers.channel.send(STOP)
    deadline = time.monotonic() + JOIN_S
    for p in workers.processes:
        p.join(max(0.0, deadline - time.monotonic()))
    _kill(workers.processes)
    if dist.is_initialized():
        dist.destroy_process_group()
    torch.set_num_threads(workers.threads)


# -- ranks 1..N-1 -------------------------------------------------------------------------------


def run_worker(
    model: str,
    method: str,
    rank: int,
    size: int,
    threads: int | None = None,
    started: Any = None,
) -> None:
    """A worker's life: join the group, take rank 0's engine settings, build this rank's runner,
    then run every step rank 0 sends until STOP. Spawned by rank 0 (with `threads`, its share of
    the CPU, and `started`, the pipe that says it is up), or run by `nanoserve worker` with the
    env:// variables."""
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
        _serve_steps(runner, channel, config.attention_backend)
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
def _serve_steps(runner: ModelRunner, channel: Channel, backend: str) -> None:
    while True:
        kind, payload = channel.receive()
        if kind == STOP:
            return
        if kind == STEP:
            runner.execute(from_message(payload, runner.device, backend))
        elif kind == CACHE_BLOCKS:
            _gather_blocks(channel, runner.cache_blocks(), runner.parallel)
        else:
            raise ValueError(f"unknown message kind {kind}")


def _exit_with_parent() -> None:
    """A spawned worker exits as soon as rank 0's process is gone, whatever it is doing (even
    blocked in a collective): a thread waits on the pipe the parent holds open."""
    parent = multiprocessing.parent_process()
    assert parent is not None

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
