"""The experts' matmul (kernels.expert_linear, kernels/csrc/quant_experts.c): every chosen expert
of a step in one C call, each output row bitwise what quantized_linear gives for that expert's
rows alone, on every instruction-set path this CPU runs, at 1 and 2 threads."""

import pytest
import torch
from test_quant_kernels import _kquant_weight, _weight, isa  # noqa: F401 (isa: a fixture)

from nanoserve import kernels
from nanoserve.kernels import QuantizedWeight
from nanoserve.model import gpt_oss
from nanoserve.model.moe import Experts, sparse_moe

EXPERTS = 5
FORMATS = ("q4_k", "q6_k", "q8_0", "q4_1")


def _experts(qtype: str, n: int, k: int, seed: int) -> QuantizedWeight:
    """EXPERTS matrices [n, k] of qtype, one after another as a 3-D GGUF tensor is stored."""
    if qtype in ("q4_k", "q6_k"):
        return _kquant_weight(qtype, EXPERTS * n, k, seed)
    return kernels.quantize(_weight(EXPERTS * n, k, seed), qtype)


def _expert(w: QuantizedWeight, e: int) -> QuantizedWeight:
    n = w.shape[0] // EXPERTS
    data = kernels.aligned_bytes(w.data[e * n : (e + 1) * n])
    return QuantizedWeight(data, w.qtype, (n, w.shape[1]))


def _routing(tokens: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [tokens * top_k] sorted by expert, groups [G, 3] of (expert, start, count)) of a
    random top-k choice, as sparse_moe sorts its token-expert pairs; some experts unchosen."""
    g = torch.Generator().manual_seed(seed)
    chosen = torch.stack([torch.randperm(EXPERTS - 1, generator=g)[:top_k] for _ in range(tokens)])
    flat = chosen.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=EXPERTS).tolist()
    starts = [sum(counts[:e]) for e in range(EXPERTS)]
    groups = [(e, starts[e], c) for e, c in enumerate(counts) if c]
    return (order // top_k).contiguous(), torch.tensor(groups, dtype=torch.int64)


@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("tokens", [1, 3, 11, 40])
def test_each_row_is_bitwise_the_per_expert_matmul(isa, qtype, tokens):  # noqa: F811
    """Odd sizes (N = 37 rows an expert, not a multiple of a strip or a chunk), gate and up as one
    call of two weights, the down projection's rows as x itself (rows None), 1 and 2 threads;
    groups of a few rows (the VNNI paths' byte GEMV) and, at 40 tokens, of more than 8."""
    k = 512 if qtype in ("q4_k", "q6_k") else 32 * 7
    gate, up = _experts(qtype, 37, k, seed=1), _experts(qtype, 37, k, seed=2)
    rows, groups = _routing(tokens, top_k=2, seed=tokens)
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            outs = kernels.expert_linear(x, [gate, up], EXPERTS, groups, rows)
            pairs = kernels.expert_linear(x[rows].contiguous(), [gate], EXPERTS, groups)
            assert tokens < 40 or groups[:, 2].max() > 8
            for e, start, count in groups.tolist():
                xs = x[rows[start : start + count]]
                for w, out in zip((gate, up), outs, strict=True):
                    expected = kernels.quantized_linear(xs, _expert(w, e))
                    assert torch.equal(out[start : start + count], expected), (t, e)
                assert torch.equal(pairs[0][start : start + count], outs[0][start : start + count])
    finally:
        torch.set_num_threads(threads)


def test_bad_groups_and_rows_are_refused_by_name():
    w = _experts("q8_0", 4, 32, seed=1)
    x = torch.randn(2, 32)
    rows = torch.tensor([0, 1], dtype=torch.int64)
    for groups, message in (
        ([[EXPERTS, 0, 1]], "group 0"),
        ([[0, 1, 2]], "group 0"),
        ([[0, -1, 1]], "group 0"),
    ):
        with pytest.raises(ValueError, match=message):
            kernels.expert_linear(x, [w], EXPERTS, torch.tensor(groups), rows)
    with pytest.raises(ValueError, match=r"rows\[1\]"):
        kernels.expert_linear(x, [w], EXPERTS, torch.tensor([[0, 0, 2]]), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="experts"):
        kernels.expert_linear(x, [w], 3, torch.tensor([[0, 0, 2]]), rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_moe_in_one_call_is_bitwise_the_per_expert_calls(dtype):
    """model/moe.py's block experts through expert_linear against one call per expert: hidden 64,
    experts of 96, 7 tokens, top 3."""
    gen = torch.Generator().manual_seed(5)

    def experts(rows: int, columns: int) -> Experts:
        w = torch.randn(EXPERTS * rows, columns, generator=gen)
        return Experts(kernels.quantize(w, "q8_0"), EXPERTS)

    gate, up, down = experts(96, 64), experts(96, 64), experts(64, 96)
    router = torch.randn(EXPERTS, 64, generator=gen).to(dtype)
    x = torch.randn(7, 64, generator=gen).to(dtype)
    ours, theirs = (
        sparse_moe(x, lambda h: h @ router.T, gate, up, down, 3, True, False, one_call)
        for one_call in (True, False)
    )
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("up_format", ["mxfp4", "q8_0"])
def test_gpt_oss_experts_in_one_call_are_bitwise_the_per_expert_calls(dtype, up_format):
    """gpt-oss's biased experts and clamped SwiGLU through expert_linear against one call per
    expert, with gate and up in one call (both MXFP4) or in two (up in another format): hidden
    64, experts of 96, 7 tokens, top 3."""
    gen = torch.Generator().manual_seed(6)

    def experts(rows: int, columns: int, qtype: str = "mxfp4") -> Experts:
        w = torch.randn(EXPERTS * rows, columns, generator=gen)
        return Experts(kernels.quantize(w, qtype), EXPERTS)

    projections = (experts(96, 64), experts(96, 64, up_format), experts(64, 96))
    biases = tuple(torch.randn(EXPERTS, n, generator=gen).to(dtype) for n in (96, 96, 64))
    logits = torch.randn(7, EXPERTS, generator=gen).to(dtype)
    x = torch.randn(7, 64, generator=gen).to(dtype)
    ours, theirs = (
        gpt_oss.experts_moe(x, logits, projections, biases, 3, 1.702, 7.0, one_call)
        for one_call in (True, False)
    )
    assert torch.equal(ours, theirs)
