"""`nanoserve serve --data-parallel-size N`: N replicas of the server, each a `nanoserve serve`
process of its own on its own CPUs (or its own GPU), behind smg, an existing router (the
`nanoserve[router]` extra), on the address the command line gave. smg keeps each conversation's
prefix on the replica that caches it (`--router-policy cache_aware`) and reads every replica's
load at /v1/loads.

The replicas start one after the other, each once the one before answers /health: each then
sizes its KV pool against the memory the others already hold, as one server does. Supervised
here: a replica that exits is logged and started again after a backoff (1 s, doubling to 30 s,
back to 1 s once it has run a minute) while smg routes around it; SIGINT or SIGTERM stops the
replicas first (each drains its open requests, as `nanoserve serve` does), then the router, and
exits 0. Owns the child processes and the signal handling of this process.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import trio

log = logging.getLogger(__name__)

BACKOFF_S, MAX_BACKOFF_S, STEADY_S = 1.0, 30.0, 60.0  # restarts, and when one counts as healthy
START_TIMEOUT_S = 600.0  # a replica that loads a large model on a busy machine


class RouterMissing(RuntimeError):
    pass


@dataclass(frozen=True)
class Replica:
    index: int
    port: int
    argv: list[str]
    cpus: frozenset[int] | None  # its CPUs; None on CUDA, where `argv` names its device

    def env(self) -> dict[str, str]:
        threads = {"OMP_NUM_THREADS": str(len(self.cpus))} if self.cpus else {}
        return {**os.environ, **threads}

    def pin(self) -> None:
        """In the child, before it runs: its CPUs only (torch's threads follow OMP_NUM_THREADS)."""
        if self.cpus:
            os.sched_setaffinity(0, self.cpus)


def router_binary() -> str:
    """smg's executable: beside this Python's (a virtual environment's bin/), or on PATH."""
    beside = Path(sys.executable).parent / "smg"
    found = str(beside) if beside.is_file() else shutil.which("smg")
    if found is None:
        raise RouterMissing(
            "--data-parallel-size needs the smg router: pip install 'nanoserve[router]'"
        )
    return found


def cpu_sets(n: int) -> list[frozenset[int]]:
    """n disjoint sets of this process's CPUs: a NUMA node each where there are n or more nodes,
    else consecutive CPUs (a core's hyper-threads are numbered apart on Linux, so consecutive
    numbers are distinct cores where there are no more replicas than cores)."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < n:
        raise ValueError(f"--data-parallel-size {n}: this process may run on {len(allowed)} CPUs")
    nodes = [cpus & set(allowed) for cpus in _numa_nodes()]
    nodes = [cpus for cpus in nodes if cpus]
    if len(nodes) >= n:
        return [frozenset(cpus) for cpus in nodes[:n]]
    return [
        frozenset(allowed[len(allowed) * i // n : len(allowed) * (i + 1) // n]) for i in range(n)
    ]


def _numa_nodes() -> list[set[int]]:
    nodes = sorted(Path("/sys/devices/system/node").glob("node[0-9]*"))
    return [_cpu_list((node / "cpulist").read_text()) for node in nodes]


def _cpu_list(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in filter(None, text.strip().split(",")):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def router_argv(
    binary: str, host: str, port: int, policy: str, replicas: list[Replica]
) -> list[str]:
    urls = [f"http://127.0.0.1:{r.port}" for r in replicas]
    return [
        binary, "launch", "--host", host, "--port", str(port), "--policy", policy,
        "--worker-urls", *urls, "--load-monitor-interval", "1", "--health-check-interval-secs", "2",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        "--log-level", "warn",
    ]  # fmt: skip


async def run(replicas: list[Replica], router: list[str], grace: float) -> int:
    """Start the replicas and the router, keep them running until SIGINT or SIGTERM, then stop
    them in that order; the exit status is 0 after a signal, 1 when the router itself failed."""
    failed = trio.Event()  # the router exited by itself
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            replica_scope, router_scope = trio.CancelScope(), trio.CancelScope()
            stopped = trio.Event()  # the replicas have exited
            nursery.start_soon(
                _run_all, replicas, router, grace, replica_scope, router_scope, stopped, failed
            )
            async with trio.open_nursery() as first:  # a signal or the router's failure

                async def on_signal() -> None:
                    signum = await anext(signals)
                    log.info(
                        "%s: stopping the replicas, then the router", signal.Signals(signum).name
                    )
                    first.cancel_scope.cancel()

                async def on_failure() -> None:
                    await failed.wait()
                    first.cancel_scope.cancel()

                first.start_soon(on_signal)
                first.start_soon(on_failure)
            replica_scope.cancel()
            await stopped.wait()
            router_scope.cancel()
    return 1 if failed.is_set() else 0


async def _run_all(
    replicas: list[Replica],
    router: list[str],
    grace: float,
    replica_scope: trio.CancelScope,
    router_scope: trio.CancelScope,
    stopped: trio.Event,
    failed: trio.Event,
) -> None:
    async with trio.open_nursery() as nursery:
        with replica_scope:
            async with trio.open_nursery() as kept:
                for replica in replicas:  # one after the other: each sizes its pool in turn
                    await kept.start(_keep, replica, grace)
                log.info("%d replicas ready; the router starts", len(replicas))
                nursery.start_soon(_route, router, router_scope, failed)
        stopped.set()


async def _keep(replica: Replica, grace: float, task_status: trio.TaskStatus[None]) -> None:
    """Run the replica, and run it again whenever it exits; started once it first answers."""
    backoff, first = BACKOFF_S, True
    while True:
        began = trio.current_time()
        async with trio.open_nursery() as nursery:
            process = await nursery.start(partial(
                trio.run_process, replica.argv, check=False, env=replica.env(),
                preexec_fn=replica.pin, deliver_cancel=partial(_drain, grace=grace),
            ))  # fmt: skip
            if first:
                await _wait_healthy(replica.port, process)
                task_status.started()
                first = False
                log.info("replica %d ready on port %d (pid %d)", replica.index, replica.port,
                         process.pid)  # fmt: skip
        if trio.current_time() - began > STEADY_S:
            backoff = BACKOFF_S
        log.error("replica %d (pid %d) exited with status %s: starting it again in %.0f s",
                  replica.index, process.pid, process.returncode, backoff)  # fmt: skip
        await trio.sleep(backoff)
        backoff = min(2 * backoff, MAX_BACKOFF_S)


async def _drain(process: trio.Process, grace: float) -> None:
    """How a replica is stopped: SIGTERM (it drains its open requests), then SIGKILL when it
    outlives its own grace period and shutdown watchdog."""
    process.terminate()
    with trio.move_on_after(grace + 5.0):
        await process.wait()
        return
    process.kill()


async def _route(router: list[str], scope: trio.CancelScope, failed: trio.Event) -> None:
    with scope:
        stop = partial(_drain, grace=2.0)
        result = await trio.run_process(router, check=False, deliver_cancel=stop)
        log.error("the router exited with status %d: stopping", result.returncode)
        failed.set()


async def _wait_healthy(port: int, process: trio.Process) -> None:
    with trio.fail_after(START_TIMEOUT_S):
        while process.returncode is None and not await _healthy(port):
            await trio.sleep(0.2)
    if process.returncode is not None:
        raise RuntimeError(f"replica on port {port} exited with status {process.returncode}")


async def _healthy(port: int) -> bool:
    try:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
    except OSError:
        return False
    try:
        async with stream:
            await stream.send_all(b"GET /health HTTP/1.0\r\nHost: replica\r\n\r\n")
            head = await stream.receive_some(64)
    except (OSError, trio.BrokenResourceError):
        return False
    return head.startswith(b"HTTP/1.1 200") or head.startswith(b"HTTP/1.0 200")


def replica_argv(index: int, port: int, base: list[str], device: str | None) -> list[str]:
    device_flag = ["--device", device] if device else []
    return [sys.executable, "-m", "nanoserve.cli", "serve", *base, "--host", "127.0.0.1",
            "--port", str(port), *device_flag]  # fmt: skip


def plan(n: int, base: list[str], device: str) -> list[Replica]:
    """The replicas: on CUDA one device each (cuda:0, cuda:1 ...), else disjoint CPU sets."""
    if device.startswith("cuda"):
        if device != "cuda":
            raise ValueError(f"--data-parallel-size {n} with --device {device}: give --device cuda")
        return [Replica(i, p := free_port(), replica_argv(i, p, base, f"cuda:{i}"), None)
                for i in range(n)]  # fmt: skip
    return [Replica(i, p := free_port(), replica_argv(i, p, base, None), cpus)
            for i, cpus in enumerate(cpu_sets(n))]  # fmt: skip


def describe(replicas: list[Replica]) -> Any:
    return "; ".join(
        f"replica {r.index} on port {r.port}"
        + (f", CPUs {','.join(map(str, sorted(r.cpus)))}" if r.cpus else "")
        for r in replicas
    )
