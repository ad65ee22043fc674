"""gpt-oss (GptOssForCausalLM) as transformers computes it, in what differs from the other
mixtures of experts: its checkpoint's tensors under the names model/weights.py gives them (gate
and up de-interleaved and every expert matrix transposed to [rows, columns]), its router (top k
of the biased logits, then a softmax over those k) and its experts (biased projections and a
clamped SwiGLU). Its attention sinks are the kernels' (`sinks=` of the paged attention calls).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeAlias

import torch

from nanoserve.kernels import QuantizedWeight, clamped_swiglu, route_experts
from nanoserve.model import hf_mxfp4
from nanoserve.model.moe import (
    Experts,
    add_up,
    by_expert,
    down_of,
    each_expert,
    gate_up,
    in_blocks,
)

Split = Callable[[torch.Tensor], torch.Tensor]
Weight: TypeAlias = torch.Tensor | QuantizedWeight

# A stored tensor's name (after "model.layers.N.") -> the names it is kept under and how each is
# cut from it. gate_up_proj is [experts, hidden, 2 * intermediate], gate and up interleaved
# column by column; down_proj [experts, intermediate, hidden].
STORED: dict[str, list[tuple[str, Split]]] = {
    "mlp.router.weight": [("mlp.gate.weight", lambda w: w)],
    "mlp.router.bias": [("mlp.gate.bias", lambda w: w)],
    "self_attn.sinks": [("self_attn.sinks.weight", lambda w: w)],
    "mlp.experts.gate_up_proj": [
        ("mlp.experts.gate_proj.weight", lambda w: w[..., ::2].transpose(1, 2)),
        ("mlp.experts.up_proj.weight", lambda w: w[..., 1::2].transpose(1, 2)),
    ],
    "mlp.experts.gate_up_proj_bias": [
        ("mlp.experts.gate_proj.bias", lambda w: w[..., ::2]),
        ("mlp.experts.up_proj.bias", lambda w: w[..., 1::2]),
    ],
    "mlp.experts.down_proj": [("mlp.experts.down_proj.weight", lambda w: w.transpose(1, 2))],
    "mlp.experts.down_proj_bias": [("mlp.experts.down_proj.bias", lambda w: w)],
}


def _split(name: str) -> tuple[str, list[tuple[str, Split]]] | None:
    """(the layer's prefix, STORED's entry) of a stored layer tensor's name, or None."""
    head, dot, rest = name.partition(".layers.")
    number, _, local = rest.partition(".")
    if not dot or local not in STORED:
        return None
    return f"{head}.layers.{number}.", STORED[local]


def kept_names(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """The (name, shape) pairs a stored tensor is kept as (itself where STORED has no entry),
    from its header alone: for the checkpoint's check before anything loads. An MXFP4 matrix's
    blocks are kept as its float tensor would be; its scales go with them."""
    mxfp4 = hf_mxfp4.part_of(name)
    if mxfp4 is not None:
        if mxfp4[1] == "_scales":
            return []
        name, shape = mxfp4[0], hf_mxfp4.float_shape(shape)
    found = _split(name)
    if found is None:
        return [(name, shape)]
    prefix, parts = found
    meta = torch.empty(shape, device="meta")
    try:
        return [(prefix + kept, tuple(cut(meta).shape)) for kept, cut in parts]
    except IndexError:  # a tensor of too few dimensions: the shape check names it
        return [(prefix + kept, shape) for kept, _ in parts]


def stored_name(kept: str) -> str:
    """The stored tensor a kept name is cut from (itself where none is): for error messages."""
    head, dot, rest = kept.partition(".layers.")
    number, _, local = rest.partition(".")
    for stored, parts in STORED.items():
        if dot and any(local == name for name, _ in parts):
            return f"{head}.layers.{number}.{stored}"
    return kept


def as_kept(
    raw: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32, keep_blocks: bool = False
) -> dict[str, Weight]:
    """A checkpoint's tensors under the names and in the layouts model/weights.py keeps; an
    MXFP4 matrix (model/hf_mxfp4.py) in GGUF's MXFP4 blocks with keep_blocks, else in dtype."""
    out: dict[str, Weight] = {}
    for name in [n for n in raw if hf_mxfp4.part_of(n) == (n.removesuffix("_blocks"), "_blocks")]:
        stored = name.removesuffix("_blocks")
        ggml = hf_mxfp4.as_ggml(raw.pop(name), raw.pop(stored + "_scales"))
        found = _split(stored)
        if not keep_blocks or found is None:
            raw[stored] = hf_mxfp4.as_floats(ggml, dtype)
            continue
        prefix, parts = found  # each cut takes the float layout's [experts, K, rows]
        for kept, cut in parts:
            out[prefix + kept] = hf_mxfp4.kept(cut(ggml.transpose(1, 2)))
    for name in list(raw):
        found = _split(name)
        if found is None:
            out[name] = raw.pop(name)
            continue
        prefix, parts = found
        w = raw.pop(name)
        for kept, cut in parts:
            out[prefix + kept] = cut(w).contiguous()
    return out


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, experts) [tokens, top_k]: the k largest logits (torch.topk's choice at ties),
    softmaxed among themselves in float32 and rounded to the logits' dtype, as transformers does;
    on a CPU the C routing the one-call C decode step shares."""
    weights, experts = route_experts(logits, top_k, normalize=False, among_chosen=True)
    return weights.to(logits.dtype), experts


def experts_moe(
    x: torch.Tensor,
    logits: torch.Tensor,
    projections: tuple[Experts, Experts, Experts],
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    top_k: int,
    alpha: float,
    limit: float,
    one_call: bool = True,
) -> torch.Tensor:
    """The block's output [tokens, hidden] for x and its router logits (bias added): each chosen
    expert's biased gate and up, the clamped SwiGLU, the biased down, times the token's weight,
    added up expert after expert (transformers' order). Experts in blocks (a GGUF file's) take
    one C call per projection for all the chosen experts, as moe.sparse_moe's (`one_call`
    False: one per expert; the same outputs, bitwise)."""
    gate, up, down = projections
    gate_bias, up_bias, down_bias = biases
    weights, experts = route(logits, top_k)
    order, tokens, counts = by_expert(experts, logits.shape[-1])
    pair_weights = weights.flatten()[order].unsqueeze(-1)
    chosen = experts.flatten()[order]  # each pair's expert
    out = torch.zeros_like(x)
    if one_call and in_blocks(logits.shape[-1], gate, up, down):
        gu = gate_up(x.float().contiguous(), gate, up, tokens, counts)
        g, u = gu.chunk(2, dim=1)  # views: the biases added in place
        g += gate_bias[chosen]
        u += up_bias[chosen]
        h = clamped_swiglu(gu, alpha, limit)
        y = (down_of(h.float().contiguous(), down, counts) + down_bias[chosen]) * pair_weights
        return add_up(out, y, tokens, counts)
    for expert, pairs in each_expert(counts, gate.held):
        rows, e = tokens[pairs], expert - gate.held.start  # its row of the biases
        xs = x[rows]
        gu = torch.cat([gate(expert, xs) + gate_bias[e], up(expert, xs) + up_bias[e]], dim=1)
        h = clamped_swiglu(gu, alpha, limit)
        y = (down(expert, h) + down_bias[e]) * pair_weights[pairs]
        out.index_add_(0, rows, y.to(x.dtype))
    return out
