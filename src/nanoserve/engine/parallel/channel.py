"""Tensor parallelism's transport: meeting in the process group, and the messages by which rank 0
asks every other rank to run a method of its runner. A message is one int64 tensor broadcast over
a CPU (gloo) group: a kind (stop, or which method) and a payload, the method's one argument packed
(`to_message`: a step's inputs) or nothing. Owns the group's message buffer and the wire layout.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from nanoserve import env
from nanoserve.engine.inputs import PromptScoring, StepInputs
from nanoserve.model import AttentionMetadata, Parallel, PrefillChunk

# A rank waiting longer than this in a collective of a step: another rank hung; the step fails.
TIMEOUT_S = env.tp_timeout_s()
# A worker waiting for rank 0's next message waits as long as the server idles.
IDLE = timedelta(days=365)
FIRST = 512  # int64s of a message's first broadcast (a decode step of a few sequences fits)
STOP = 0  # the message kind that stops a worker; a method's kind is its index in METHODS + 1
# The runner methods rank 0 runs on every rank. Each takes a step's inputs or nothing.
METHODS = ("execute", "cache_blocks", "take_kv_cache")
GATHERED = {"cache_blocks"}  # methods whose result, an int on each rank, comes back to rank 0
ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


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
    """Rank 0 to every other rank: one call at a time. A message of up to FIRST - 2 values takes
    one broadcast; a longer one a second for the rest. Waiting for the next message never times
    out."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.buffer = torch.zeros(FIRST, dtype=torch.int64)

    def call(self, method: str, args: tuple[Any, ...]) -> None:
        """Rank 0: every worker is to run `runner.method(*args)`."""
        payload = to_message(*args) if args else torch.zeros(0, dtype=torch.int64)
        self._send(METHODS.index(method) + 1, payload)

    def stop(self) -> None:
        self._send(STOP, torch.zeros(0, dtype=torch.int64))

    def receive(self, device: torch.device, backend: str) -> tuple[str, tuple[Any, ...]] | None:
        """A worker: the next call's method and arguments (on `device`), or None for stop."""
        kind, payload = self._receive()
        if kind == STOP:
            return None
        if not 0 < kind <= len(METHODS):
            raise ValueError(f"unknown message kind {kind}")
        args = (from_message(payload, device, backend),) if payload.numel() else ()
        return METHODS[kind - 1], args

    def gather(self, value: int) -> list[int]:
        """Every rank's `value`, rank 0 first, on rank 0 (the others get an empty list)."""
        mine = torch.tensor([value], dtype=torch.int64)
        first = dist.get_rank(self.group) == 0
        size = dist.get_world_size(self.group)
        parts = [torch.empty_like(mine) for _ in range(size)] if first else None
        dist.gather(mine, parts, group=self.group, group_dst=0)
        return [int(p) for p in parts] if parts is not None else []

    def _send(self, kind: int, payload: torch.Tensor) -> None:
        n = payload.shape[0]
        head = min(n, FIRST - 2)
        self.buffer[0], self.buffer[1] = kind, n
        self.buffer[2 : 2 + head] = payload[:head]
        dist.broadcast(self.buffer, group_src=0, group=self.group)
        if n > head:
            dist.broadcast(payload[head:].contiguous(), group_src=0, group=self.group)

    def _receive(self) -> tuple[int, torch.Tensor]:
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


# -- a step's inputs as one message ---------------------------------------------------------------

_HEADER = 6  # tokens, decodes, table width, prefill chunks, logits rows, scoring rows


def to_message(inputs: StepInputs) -> torch.Tensor:
    """The inputs of a step as one int64 CPU tensor. Everything but what only rank 0 (the
    sampler's) reads: the scoring targets and the count of padding rows."""
    m = inputs.meta
    tables = m.decode_block_tables
    scoring = inputs.scoring.rows if inputs.scoring is not None else inputs.logits_rows[:0]
    header = [inputs.input_ids.shape[0], m.num_decode, tables.shape[1], len(m.prefills)]
    header += [inputs.logits_rows.shape[0], scoring.shape[0]]
    chunks = [(c.start, c.length, c.context_len, c.block_table.shape[0]) for c in m.prefills]
    parts = [
        torch.tensor(header + [v for chunk in chunks for v in chunk], dtype=torch.int64),
        inputs.input_ids,
        inputs.positions,
        m.slot_mapping,
        tables.flatten(),
        m.decode_context_lens,
        *(c.block_table for c in m.prefills),
        inputs.logits_rows,
        scoring,
    ]
    return torch.cat([p.to("cpu", torch.int64) for p in parts])


def from_message(message: torch.Tensor, device: torch.device, backend: str = "auto") -> StepInputs:
    """`to_message`'s inputs on `device`. A prompt-scoring step comes back with its rows and no
    targets (`PromptScoring.chunks` empty): the logits of those rows are still computed."""
    message = message.to(device)
    tokens, decodes, width, num_chunks, rows, scored = message[:_HEADER].tolist()
    chunks = message[_HEADER : _HEADER + 4 * num_chunks].view(-1, 4).tolist()
    sizes = [tokens, tokens, tokens, decodes * width, decodes]
    sizes += [table_len for *_, table_len in chunks] + [rows, scored]
    parts = message[_HEADER + 4 * num_chunks :].split(sizes)
    ids, positions, slots, tables, lens, *prefill_tables = parts[: 5 + num_chunks]
    prefills = tuple(
        PrefillChunk(start, length, context_len, table.to(torch.int32))
        for (start, length, context_len, _), table in zip(chunks, prefill_tables, strict=True)
    )
    meta = AttentionMetadata(
        slot_mapping=slots,
        num_decode=decodes,
        decode_block_tables=tables.to(torch.int32).view(decodes, width),
        decode_context_lens=lens.to(torch.int32),
        prefills=prefills,
        backend=backend,
    )
    scoring = PromptScoring(parts[-1], ()) if scored else None
    return StepInputs(ids, positions, meta, parts[-2], scoring)
