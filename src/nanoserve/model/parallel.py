"""Tensor parallelism inside the model, Megatron-style: which slice of each weight a rank keeps
(column-parallel: whole heads of the fused q/k/v, the same rows of gate and of up; row-parallel:
the matching input columns of o and down; vocabulary-parallel: a range of the embedding's and the
output projection's rows; expert-parallel: a range of a mixture's experts, whole) and the
collectives of a forward pass (an all-reduce after each row-parallel matmul, after a mixture of
experts and after the embedding, one gather of the logits to rank 0). Knows no engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from nanoserve.model.config import ModelConfig
from nanoserve.model.weights import Tensor, listed


@dataclass(frozen=True)
class Parallel:
    """This process's place in a tensor-parallel group: `rank` of `size`. `group` is the process
    group of the forward pass's collectives (None when the model runs in one process)."""

    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed.ProcessGroup

    @property
    def first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of x, in place (every rank gets the same bits)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def embed(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the embedding whose vocabulary range `table` holds on this rank."""
        if self.size == 1:
            return table[ids]  # a copy: the forward pass adds into it
        return self.all_reduce(vocab_embedding(table, ids, self.rank))

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Rank 0: the whole logits [rows, vocab_size] from every rank's vocabulary slice. Other
        ranks send theirs and get it back unchanged (they have no use for logits)."""
        if self.size == 1:
            return local
        if local.numel() == 0:  # no rows: nothing to send (every rank knows it)
            return local.new_empty(0, vocab_size) if self.first else local
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.first else None
        dist.gather(local, parts, group=self.group, group_dst=0)
        if parts is None:
            return local
        return torch.cat(parts, dim=-1)[:, :vocab_size]

    def min(self, value: int, device: torch.device) -> int:
        """The smallest `value` over the ranks (e.g. KV blocks that fit on every device)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


SINGLE = Parallel()


def check_divisible(config: ModelConfig, size: int) -> None:
    """Refuse, in one line, a model whose heads, MLP or experts cannot be split evenly `size`
    ways."""
    counts = {"num_heads": config.num_heads, "num_kv_heads": config.num_kv_heads}
    if config.moe:
        counts["num_experts"] = config.num_experts
    else:
        counts["intermediate_size"] = config.intermediate_size
    bad = [name for name, n in counts.items() if n % size]
    if bad:
        listed = ", ".join(f"{name} {n}" for name, n in counts.items())
        raise ValueError(
            f"tensor_parallel_size {size} must divide the model's {' and '.join(bad)} "
            f"({listed}): each rank keeps whole heads and whole experts"
        )


def held_experts(num_experts: int, rank: int, size: int) -> range:
    """The experts rank `rank` of `size` keeps whole (expert parallelism: each chosen expert
    runs on one rank, and the block's output is all-reduced as a row-parallel matmul's)."""
    n = num_experts // size
    return range(rank * n, (rank + 1) * n)


# -- slices of the weights ([out_features, in_features], as in torch) ---------------------------


def column_parallel(
    weight: torch.Tensor, parts: Sequence[int], rank: int, size: int
) -> torch.Tensor:
    """Megatron's column-parallel slice (output features) of a fused matrix made of `parts` row
    blocks (q, k, v; or gate, up): slice `rank` of every part, in order. A copy."""
    if sum(parts) != weight.shape[0]:
        raise ValueError(f"parts {list(parts)} do not add up to {weight.shape[0]} rows")
    slices, start = [], 0
    for n in parts:
        step = n // size
        slices.append(weight[start + rank * step : start + (rank + 1) * step])
        start += n
    return torch.cat(slices)


def row_parallel(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Megatron's row-parallel slice (input features): the columns that multiply this rank's
    part of a column-parallel output. Its products are partial sums, to be all-reduced."""
    step = weight.shape[1] // size
    return weight[:, rank * step : (rank + 1) * step].contiguous()


def vocab_parallel(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rows [rank * n, (rank + 1) * n) of an embedding or output projection, n = the vocabulary
    rounded up to a multiple of `size`, divided by it; rows past the vocabulary are zeros."""
    vocab = weight.shape[0]
    n = -(-vocab // size)
    shard = weight.new_zeros(n, weight.shape[1])
    rows = weight[rank * n : min((rank + 1) * n, vocab)]
    shard[: rows.shape[0]] = rows
    return shard


def vocab_embedding(table: torch.Tensor, ids: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's part of an embedding lookup: its rows for the ids in its range, zeros for the
    others. The sum over ranks is the whole lookup."""
    n = table.shape[0]
    local = ids - rank * n
    inside = (local >= 0) & (local < n)
    h = table[local.clamp(0, n - 1)]
    return h.mul_(inside.unsqueeze(-1).to(h.dtype))


def shard(
    tensors: list[torch.Tensor], config: ModelConfig, parallel: Parallel
) -> list[torch.Tensor]:
    """The loader's flat list (model/weights.py's `listed` order) cut to this rank's part, each
    tensor as its description's `shard` says. Slices are copies, so that the whole matrices can
    be freed; a tensor listed twice (a tied output projection) is cut once and stays one."""
    if parallel.size == 1:
        return tensors
    check_divisible(config, parallel.size)
    cut: dict[int, torch.Tensor] = {}
    out = []
    for (_, _, t), w in zip(listed(config), tensors, strict=True):
        if id(w) not in cut:
            cut[id(w)] = _slice(t, w, config, parallel)
        out.append(cut[id(w)])
    return out


def _slice(t: Tensor, w: torch.Tensor, config: ModelConfig, p: Parallel) -> torch.Tensor:
    if t.shard == "column":
        return column_parallel(w, t.rows(config), p.rank, p.size)
    if t.shard == "row":
        return row_parallel(w, p.rank, p.size)
    if t.shard == "vocab":
        return vocab_parallel(w, p.rank, p.size)
    if t.shard == "experts":  # stacked [experts, ...] (floats: blocks stay whole in one process)
        held = held_experts(config.num_experts, p.rank, p.size)
        return w[held.start : held.stop].contiguous()
    return w
