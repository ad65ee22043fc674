"""Decode steps replayed from CUDA graphs, captured once at a few batch sizes.

A decode batch (every request adds one token) is packed padded up to the next captured size and to
a fixed table width (engine/inputs.py): padding rows write no cache slot and attend to one token,
and their logits are dropped. Eager decode on CUDA takes the same padded path, so outputs are
identical with and without graphs. On a CPU the same path runs without capture, which is how the
tests exercise it. The runner records the graphs (its own forward pass, captured) and asks for a
replay; this object owns the graphs and the static input buffers they read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from nanoserve.config import EngineConfig
from nanoserve.engine.inputs import Chunk, StepInputs, pack
from nanoserve.engine.kv_cache import cdiv

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


class DecodeGraphs:
    def __init__(self, config: EngineConfig, max_model_len: int, device: torch.device):
        self.config = config
        self.device = device
        self.sizes = [s for s in BATCH_SIZES if s <= config.max_num_seqs] or [config.max_num_seqs]
        self.width = cdiv(max_model_len, config.block_size)
        self.static = self._pack([], self.sizes[-1])  # the captured graphs read these buffers
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def fits(self, batch: Sequence[Chunk]) -> bool:
        return len(batch) <= self.sizes[-1] and all(item.num_new_tokens == 1 for item in batch)

    def pack(self, batch: Sequence[Chunk]) -> StepInputs:
        """A batch that fits, padded to the next captured size and to the table width."""
        return self._pack(batch, next(s for s in self.sizes if s >= len(batch)))

    def rows(self, size: int) -> StepInputs:
        """The static buffers' first `size` rows: the inputs a graph of that size is captured on."""
        return _rows(self.static, size)

    def add(self, size: int, graph: torch.cuda.CUDAGraph, logits: torch.Tensor) -> None:
        """A graph captured on `rows(size)`, whose forward pass wrote `logits`."""
        self.graphs[size] = (graph, logits)

    def has(self, inputs: StepInputs) -> bool:
        """A padded decode step of a size that has a graph."""
        m = inputs.meta
        return (
            not m.prefills
            and inputs.input_ids.shape[0] in self.graphs
            and m.decode_block_tables.shape[1] == self.width
        )

    def replay(self, inputs: StepInputs) -> torch.Tensor:
        """The logits of every row (padding too) of a step this object `has`."""
        size = inputs.input_ids.shape[0]
        _copy_into(self.rows(size), inputs)
        graph, logits = self.graphs[size]
        graph.replay()
        return logits

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
