"""A sparse mixture-of-experts block in place of a layer's MLP (Qwen3-MoE, Mixtral), computed as
transformers computes it: the router's logits in the activations' dtype, their softmax in float32,
the top k experts of each token (at equal scores the ones torch.topk chooses), their weights
renormalized to sum to 1 where the config says (Mixtral always), and the sum of the chosen
experts' SwiGLU outputs times their weights, added up expert after expert. On a CPU the routing
and the SwiGLU are C kernels (kernels.route_experts, gated_mul) that the one-call C decode step
(kernels/csrc/moe.c) runs too, so that a row's result is the same bits on either path.

A step's tokens are grouped by expert (the token-expert pairs sorted by expert), so that each
chosen expert multiplies all its tokens in one matmul: its weights are read once a step, not once
a token. The experts' weights stay as they were stored: one 3-D float tensor, or one run of GGUF
blocks (expert e's rows a 2-D slice at a byte offset, multiplied by the quantized kernels with
no de-quantized copy). Experts in blocks take one C call per projection for all the chosen
experts (kernels.expert_linear, llama.cpp's MUL_MAT_ID; gate and up in one): at decode a call per
expert (1-2 rows against a 1 MiB matrix, each its own parallel region) cost most of the step.
Owns nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from nanoserve.kernels import (
    QuantizedWeight,
    aligned_bytes,
    expert_linear,
    gated_mul,
    quantized_linear,
    route_experts,
    small_linear,
)


class Experts:
    """One matrix per expert: a float tensor [experts, rows, columns], or GGUF blocks of
    [experts * rows, columns] (llama.cpp's 3-D tensor, expert after expert). `experts`: how many,
    or which of the model's (a range: a tensor-parallel rank's, model/parallel.py)."""

    def __init__(self, weight: torch.Tensor | QuantizedWeight, experts: int | range) -> None:
        self.weight = weight
        self.held = experts if isinstance(experts, range) else range(experts)
        num_experts = self.num_experts = len(self.held)
        self.each: list[torch.Tensor] | list[QuantizedWeight]
        # Floats on a CPU: the C GEMV for up to 4 rows (memory speed, and each row's result
        # independent of the others': a speculative verification's rows stay one-token steps).
        self.gemv = False
        if isinstance(weight, QuantizedWeight):
            rows = weight.shape[0] // num_experts
            self.each = [_slice(weight, e * rows, rows) for e in range(num_experts)]
        else:
            self.each = list(weight.unbind(0))  # views
            self.gemv = weight.is_cpu and weight.dtype in (torch.float32, torch.bfloat16)

    def __call__(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """x @ the matrix.T of the model's expert `expert` (one of `held`)."""
        w = self.each[expert - self.held.start]
        if isinstance(w, QuantizedWeight):
            return quantized_linear(x.float().contiguous(), w)
        return small_linear(x.contiguous(), w) if self.gemv else F.linear(x, w)


def _slice(w: QuantizedWeight, start: int, rows: int) -> QuantizedWeight:
    """Rows [start, start + rows) of a matrix in blocks: a view of its bytes, or a copy where the
    slice does not start on the kernels' 64-byte boundary (an expert whose bytes are no multiple
    of 64: rare, and the copy is of the same blocks)."""
    data = w.data[start : start + rows]
    if data.data_ptr() % 64:
        data = aligned_bytes(data)
    return QuantizedWeight(data, w.qtype, (rows, w.shape[1]), w.repacked)


def sparse_moe(
    x: torch.Tensor,
    router: Callable[[torch.Tensor], torch.Tensor],
    gate: Experts,
    up: Experts,
    down: Experts,
    top_k: int,
    normalize: bool,
    weights_in_float32: bool,
    one_call: bool = True,
) -> torch.Tensor:
    """The block's output [tokens, hidden] for x [tokens, hidden]. `weights_in_float32`: the
    experts' outputs are weighted in float32 and rounded once (Mixtral's router keeps float32
    weights); else the weights are rounded to x's dtype first (Qwen3-MoE's). `one_call`: experts
    in blocks take one C call per projection (False: one per expert, for bench/bench_moe.py to
    measure beside it; the same outputs, bitwise). Experts that hold a tensor-parallel rank's
    range give that range's share of the output, for the caller to all-reduce."""
    logits = router(x)
    weights, experts = route_experts(logits, top_k, normalize)
    if not weights_in_float32:
        weights = weights.to(logits.dtype)
    order, tokens, counts = by_expert(experts, logits.shape[-1])
    pair_weights = weights.flatten()[order].unsqueeze(-1)
    out = torch.zeros_like(x)
    if one_call and in_blocks(logits.shape[-1], gate, up, down):
        h = gated_mul(gate_up(x.float().contiguous(), gate, up, tokens, counts))
        h = h.to(x.dtype).float().contiguous()
        y = (down_of(h, down, counts).to(x.dtype) * pair_weights).to(x.dtype)
        return add_up(out, y, tokens, counts)
    for expert, pairs in each_expert(counts, gate.held):
        rows = tokens[pairs]
        xs = x[rows]
        h = gated_mul(torch.cat([gate(expert, xs), up(expert, xs)], dim=1))
        y = down(expert, h.to(x.dtype)).to(x.dtype) * pair_weights[pairs]
        out.index_add_(0, rows, y.to(x.dtype))
    return out


def by_expert(
    experts: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The token-expert pairs of experts [tokens, top_k] sorted by expert (stable: each expert's
    tokens in their order): (order, the pairs' indices into experts.flatten(); tokens, their
    tokens; counts, the pairs of each expert)."""
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return order, order // experts.shape[1], counts


def each_expert(counts: list[int], held: range | None = None) -> Iterator[tuple[int, slice]]:
    """(expert, its pairs) of each chosen expert (of those `held`; None: all), for pairs sorted
    by expert (by_expert)."""
    start = 0
    for expert, n in enumerate(counts):
        if n and (held is None or expert in held):
            yield expert, slice(start, start + n)
        start += n


def add_up(out: torch.Tensor, y: torch.Tensor, tokens: torch.Tensor, counts: list[int]):
    """out with each pair's y [pairs, hidden] added at its token, expert after expert: one
    index_add_ in float32; in 16 bits rounded after each expert, as transformers does (one
    index_add_ would sum a token's experts in float32 and round once)."""
    if out.dtype == torch.float32:
        return out.index_add_(0, tokens, y.float())
    for _, pairs in each_expert(counts):
        out.index_add_(0, tokens[pairs], y[pairs].to(out.dtype))
    return out


def in_blocks(num_experts: int, *projections: Experts) -> bool:
    """Whether every projection is in blocks and holds all the model's `num_experts`: one C call
    each for all the chosen experts."""
    return all(
        isinstance(m.weight, QuantizedWeight) and m.num_experts == num_experts for m in projections
    )


def _groups(counts: list[int]) -> torch.Tensor:
    """expert_linear's groups [G, 3]: (expert, first pair, pairs) of each chosen expert."""
    groups = [(e, pairs.start, pairs.stop - pairs.start) for e, pairs in each_expert(counts)]
    return torch.tensor(groups, dtype=torch.int64).reshape(-1, 3)


def gate_up(
    x: torch.Tensor, gate: Experts, up: Experts, tokens: torch.Tensor, counts: list[int]
) -> torch.Tensor:
    """The chosen experts' gate and up outputs side by side, [pairs, 2 rows] float32, for x
    [tokens, hidden] float32 and the pairs sorted by expert (pair p is token tokens[p]'s,
    counts[e] pairs expert e's), as Experts.__call__ gives them expert after expert: one C call
    where the two share a format, else one each."""
    groups = _groups(counts)
    g, u = gate.weight, up.weight
    assert isinstance(g, QuantizedWeight) and isinstance(u, QuantizedWeight)
    rows = g.shape[0] // gate.num_experts
    out = torch.empty((tokens.shape[0], 2 * rows), dtype=torch.float32)
    if g.kernel_qtype == u.kernel_qtype and g.shape == u.shape:
        expert_linear(x, [g, u], gate.num_experts, groups, tokens, out)
        return out
    expert_linear(x, [g], gate.num_experts, groups, tokens, out[:, :rows])
    expert_linear(x, [u], up.num_experts, groups, tokens, out[:, rows:])
    return out


def down_of(h: torch.Tensor, down: Experts, counts: list[int]) -> torch.Tensor:
    """The chosen experts' down outputs [pairs, hidden] float32 for h [pairs, rows] float32,
    pair by pair as gate_up's."""
    assert isinstance(down.weight, QuantizedWeight)
    return expert_linear(h, [down.weight], down.num_experts, _groups(counts))[0]
