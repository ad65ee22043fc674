"""Decode steps replayed from CUDA graphs, captured once at a few batch sizes.

A decode batch (every request adds one token) is packed padded up to the next captured size and to
a fixed table width (engine/inputs.py): padding rows write no cache slot and attend to one token,
and their logits are dropped. Eager decode on CUDA takes the same padded path, so outputs are
identical with and without graphs. On a CPU the same path runs without capture, which is how the
tests exercise it. Owns the graphs and their static input buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from nanoserve.config import EngineConfig
from nanoserve.engine.inputs import Chunk, StepInputs, pack
from nanoserve.engine.kv_cache import cdiv

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)

Forward = Callable[[StepInputs], torch.Tensor]


class DecodeGraphs:
    def __init__(
        self, forward: Forward, config: EngineConfig, max_model_len: int, device: torch.device
    ):
        self.forward = forward
        self.config = config
        self.device = device
        self.sizes = [s for s in BATCH_SIZES if s <= config.max_num_seqs] or [config.max_num_seqs]
        self.width = cdiv(max_model_len, config.block_size)
        self.static = self._pack([], self.sizes[-1])  # the captured graphs read these buffers
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def fits(self, batch: Sequence[Chunk]) -> bool:
        return len(batch) <= self.sizes[-1] and all(item.num_new_tokens == 1 for item in batch)

    def capture(self) -> None:
        """Record one graph per batch size, largest first, sharing one memory pool."""
        pool = None
        for size in reversed(self.sizes):
            inputs = _rows(self.static, size)
            self.forward(inputs)  # warm-up: compiles kernels, settles allocations
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.forward(inputs)
            pool = graph.pool()
            self.graphs[size] = (graph, logits)

    def run(self, batch: Sequence[Chunk]) -> torch.Tensor:
        n = len(batch)
        size = next(s for s in self.sizes if s >= n)
        inputs = self._pack(batch, size)
        if size not in self.graphs:
            return self.forward(inputs)[:n]
        _copy_into(_rows(self.static, size), inputs)
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:n]

    def _pack(self, batch: Sequence[Chunk], size: int) -> StepInputs:
        c = self.config
        return pack(batch, c.block_size, self.device, c.attention_backend, size, self.width)


def _rows(inputs: StepInputs, n: int) -> StepInputs:
    """The first n rows of a padded decode batch (views of the same buffers)."""
    m = inputs.meta
    meta = replace(
        m,
        slot_mapping=m.slot_mapping[:n],
        num_decode=n,
        decode_block_tables=m.decode_block_tables[:n],
        decode_context_lens=m.decode_context_lens[:n],
    )
    return StepInputs(inputs.input_ids[:n], inputs.positions[:n], meta, inputs.logits_rows[:n])


def _copy_into(static: StepInputs, inputs: StepInputs) -> None:
    m, s = inputs.meta, static.meta
    pairs = [
        (static.input_ids, inputs.input_ids),
        (static.positions, inputs.positions),
        (s.slot_mapping, m.slot_mapping),
        (s.decode_block_tables, m.decode_block_tables),
        (s.decode_context_lens, m.decode_context_lens),
        (static.logits_rows, inputs.logits_rows),
    ]
    for buffer, values in pairs:
        buffer.copy_(values, non_blocking=True)
