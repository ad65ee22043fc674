"""The one input packer: a scheduled batch (decodes first, then prefill chunks) as the tensors of
one forward pass. A speculative verification is packed as decodes: one row per position, each
attending to the cache up to itself, so that each position's logits are those a one-token decode
step at that position computes (the decode kernels are batch invariant). Eager steps, CUDA-graph
steps (padded to a captured size and table width) and the memory profile (one dummy prefill) all
come through `pack`. Under tensor parallelism the packed inputs travel to the other ranks as one
message (engine/parallel/channel.py). Owns nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from nanoserve.engine.kv_cache import cdiv, slot
from nanoserve.model import AttentionMetadata, PrefillChunk


@dataclass(frozen=True)
class Chunk:
    """What the packer reads of a sequence's part of a step: `num_new_tokens` of its `token_ids`
    from position `start` on (the scheduler's ScheduledRequest.chunk(), a draft model's step, the
    dummy prompts CUDA sizes its pool by)."""

    token_ids: Sequence[int]
    start: int  # tokens already in the cache
    num_new_tokens: int
    block_table: Sequence[int]
    samples: bool = True  # the chunk ends at the sequence's last token
    prompt_logprob_positions: range = range(0)  # positions whose logits score the prompt
    prompt_logprobs: int = 0  # alternatives wanted at each prompt position
    verifies: bool = False  # decode rows whose every position's logits are wanted


@dataclass(frozen=True)
class PromptScoring:
    """Rows whose logits score prompt tokens: chunk `index` of the batch owns rows
    [first, first + len(targets)) of `rows`; `targets` are the prompt tokens they predict."""

    rows: torch.Tensor  # packed-batch rows, every chunk's in order
    chunks: tuple[tuple[int, int, list[int], int], ...]  # (batch index, first, targets, top n)


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # rows whose next-token logits are wanted, increasing
    scoring: PromptScoring | None = None
    padding: int = 0  # the last logits rows are padding (a CUDA graph's size): dropped


@dataclass
class _Lists:
    """The packed batch as lists, row by row, before they become tensors."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # rows whose next-token logits are wanted
    tables: list[list[int]] = field(default_factory=list)  # per decode row
    lens: list[int] = field(default_factory=list)  # per decode row
    prefills: list[PrefillChunk] = field(default_factory=list)
    scoring_rows: list[int] = field(default_factory=list)
    scoring: list[tuple[int, int, list[int], int]] = field(default_factory=list)


def pack(
    batch: Sequence[Chunk],
    block_size: int,
    device: torch.device,
    backend: str = "auto",
    pad_to: int | None = None,
    table_width: int | None = None,
) -> StepInputs:
    """Decodes (one new token each, or a verification's rows) must come first. `pad_to` adds
    decode rows that write no cache slot (-1), attend to one token and sample (`padding`: their
    logits are dropped); `table_width` fixes the decode tables' width (default: the longest)."""
    lists = _Lists()
    for index, chunk in enumerate(batch):
        _add(lists, index, chunk, block_size, device)
    padding = 0
    if pad_to is not None:
        if lists.prefills:
            raise ValueError("only a batch of decodes is padded")
        padding = pad_to - len(lists.ids)
        _pad(lists, padding)
    ids, positions, slots, rows = _tensors(
        [lists.ids, lists.positions, lists.slots, lists.rows], torch.int64, device
    )
    meta = _metadata(lists, slots, device, backend, table_width)
    return StepInputs(ids, positions, meta, rows, _scoring(lists, device), padding)


def _add(lists: _Lists, index: int, chunk: Chunk, block_size: int, device: torch.device) -> None:
    """Chunk `index` of the batch: its tokens' rows, and the rows that score its prompt."""
    row = len(lists.ids)
    positions = chunk.prompt_logprob_positions
    if positions:
        targets = list(chunk.token_ids[positions.start + 1 : positions.stop + 1])
        lists.scoring.append((index, len(lists.scoring_rows), targets, chunk.prompt_logprobs))
        lists.scoring_rows += [row + p - chunk.start for p in positions]
    start, n = chunk.start, chunk.num_new_tokens
    lists.ids += chunk.token_ids[start : start + n]
    lists.positions += range(start, start + n)
    lists.slots += [slot(chunk.block_table, p, block_size) for p in range(start, start + n)]
    if chunk.verifies:
        lists.rows += range(row, row + n)
    elif chunk.samples:
        lists.rows.append(row + n - 1)
    if n == 1 or chunk.verifies:
        decode_table = list(chunk.block_table)
        lists.tables += [decode_table] * n
        lists.lens += range(start + 1, start + n + 1)
    else:
        table = chunk.block_table[: cdiv(start + n, block_size)]
        prefill = PrefillChunk(row, n, start + n, _tensor(table, torch.int32, device))
        lists.prefills.append(prefill)


def _metadata(
    lists: _Lists, slots: torch.Tensor, device: torch.device, backend: str, table_width: int | None
) -> AttentionMetadata:
    width = table_width or max((len(t) for t in lists.tables), default=0)
    tables = [i for t in lists.tables for i in t + [0] * (width - len(t))]
    flat, lens = _tensors([tables, lists.lens], torch.int32, device)
    return AttentionMetadata(
        slot_mapping=slots,
        num_decode=len(lists.tables),
        decode_block_tables=flat.view(len(lists.tables), width),
        decode_context_lens=lens,
        prefills=tuple(lists.prefills),
        backend=backend,
    )


def _scoring(lists: _Lists, device: torch.device) -> PromptScoring | None:
    if not lists.scoring:
        return None
    return PromptScoring(_tensor(lists.scoring_rows, torch.int64, device), tuple(lists.scoring))


def _pad(lists: _Lists, count: int) -> None:
    for _ in range(count):
        lists.rows.append(len(lists.ids))
        lists.ids.append(0)
        lists.positions.append(0)
        lists.slots.append(-1)
        lists.tables.append([])
        lists.lens.append(1)


def _tensors(
    parts: list[list[int]], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """The lists as contiguous views of one tensor: one copy (one transfer to a GPU) where a
    decode step made six, whose Python calls each cost a step tens of microseconds on a CPU (their
    caches cold after the weights stream through)."""
    joined = _tensor([v for part in parts for v in part], dtype, device)
    return joined.split([len(part) for part in parts])


def _tensor(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.tensor(list(values), dtype=dtype)
    return torch.tensor(list(values), dtype=dtype, pin_memory=True).to(device, non_blocking=True)
