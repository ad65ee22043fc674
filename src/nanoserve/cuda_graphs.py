"""Decode steps replayed from CUDA graphs, captured once at a few batch sizes.

A decode batch (every request adds one token) is padded up to the next captured size: padding rows
write no cache slot (slot -1) and attend to one token, and their logits are dropped. Eager decode
on CUDA takes the same padded path, so outputs are identical with and without graphs. On a CPU the
same path runs without capture, which is how the tests exercise it.
"""

from __future__ import annotations

import torch

from nanoserve.attention import AttentionMetadata
from nanoserve.config import EngineConfig
from nanoserve.model.llama import Llama
from nanoserve.scheduler import ScheduledRequest

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


class DecodeGraphs:
    def __init__(
        self,
        model: Llama,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        config: EngineConfig,
        max_model_len: int,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = config.block_size
        self.backend = config.attention_backend
        self.device = kv_caches[0][0].device
        self.sizes = [s for s in BATCH_SIZES if s <= config.max_num_seqs] or [config.max_num_seqs]
        largest, width = self.sizes[-1], -(-max_model_len // config.block_size)
        on = self.device
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=on)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=on)
        self.slots = torch.full((largest,), -1, dtype=torch.int64, device=on)
        self.tables = torch.zeros(largest, width, dtype=torch.int32, device=on)
        self.lens = torch.ones(largest, dtype=torch.int32, device=on)
        self.rows = torch.arange(largest, device=on)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def fits(self, batch: list[ScheduledRequest]) -> bool:
        return len(batch) <= self.sizes[-1] and all(item.num_new_tokens == 1 for item in batch)

    def capture(self) -> None:
        """Record one graph per batch size, largest first, sharing one memory pool."""
        pool = None
        for size in reversed(self.sizes):
            self._forward(size)  # warm-up: compiles kernels, settles allocations
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = (graph, logits)

    def run(self, batch: list[ScheduledRequest]) -> torch.Tensor:
        n = len(batch)
        size = next(s for s in self.sizes if s >= n)
        self._fill(batch, size)
        if size in self.graphs:
            graph, logits = self.graphs[size]
            graph.replay()
        else:
            logits = self._forward(size)
        return logits[:n]

    def _fill(self, batch: list[ScheduledRequest], size: int) -> None:
        bs, width = self.block_size, self.tables.shape[1]
        pad = size - len(batch)
        ids, positions, slots, lens, tables = [], [], [], [], []
        for item in batch:
            r = item.request
            p = r.num_computed_tokens
            ids.append(r.token_ids[p])
            positions.append(p)
            slots.append(r.block_table[p // bs] * bs + p % bs)
            lens.append(p + 1)
            tables.append(r.block_table + [0] * (width - len(r.block_table)))
        self._copy(self.input_ids, ids + [0] * pad)
        self._copy(self.positions, positions + [0] * pad)
        self._copy(self.slots, slots + [-1] * pad)
        self._copy(self.lens, lens + [1] * pad)
        self._copy(self.tables, tables + [[0] * width] * pad)

    def _copy(self, buffer: torch.Tensor, values: list) -> None:
        host = torch.tensor(values, dtype=buffer.dtype, pin_memory=self.device.type == "cuda")
        buffer[: len(values)].copy_(host, non_blocking=True)

    def _forward(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slots[:size],
            num_decode=size,
            decode_block_tables=self.tables[:size],
            decode_context_lens=self.lens[:size],
            prefills=(),
            backend=self.backend,
        )
        return self.model.forward(
            self.input_ids[:size], self.positions[:size], self.kv_caches, meta, self.rows[:size]
        )
