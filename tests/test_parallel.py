"""Tensor parallelism's pieces in one process: the column-, row- and vocabulary-parallel slices
against the unsharded layers (the all-reduce simulated by a sum over the ranks' results, the
gather by a concatenation), the step message's round trip, and the refusals."""

import pytest
import torch
import torch.nn.functional as F

from nanoserve.config import EngineConfig
from nanoserve.engine import Engine
from nanoserve.engine.inputs import pack
from nanoserve.engine.parallel.channel import from_message, to_message
from nanoserve.model.config import ModelConfig
from nanoserve.model.parallel import (
    check_divisible,
    column_parallel,
    row_parallel,
    shard,
    vocab_embedding,
    vocab_parallel,
)

HIDDEN, HEAD_DIM, HEADS, KV_HEADS = 64, 8, 8, 4


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("size", [1, 2, 4])
def test_column_parallel_fused_qkv_keeps_whole_heads_of_each_part(size):
    """Rank r's q, k and v outputs are heads [r * n, (r + 1) * n) of the whole layer's, for each
    of the three parts: every rank can run attention on its own heads."""
    g = torch.Generator().manual_seed(0)
    parts = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM)
    weight = torch.randn(sum(parts), HIDDEN, generator=g)
    x = torch.randn(5, HIDDEN, generator=g)
    q, k, v = F.linear(x, weight).split(parts, dim=-1)
    for rank in range(size):
        local = F.linear(x, column_parallel(weight, parts, rank, size))
        lq, lk, lv = local.split([p // size for p in parts], dim=-1)
        for whole, mine, heads in ((q, lq, HEADS), (k, lk, KV_HEADS), (v, lv, KV_HEADS)):
            n = heads // size
            expected = whole.view(5, heads, HEAD_DIM)[:, rank * n : (rank + 1) * n]
            _close(mine.view(5, n, HEAD_DIM), expected)


def test_column_then_row_parallel_mlp_sums_to_the_unsharded_mlp():
    """gate/up split by column, down by row: the sum over ranks (the all-reduce) of each rank's
    SwiGLU MLP is the whole MLP."""
    g = torch.Generator().manual_seed(1)
    inter = 96
    gate_up = torch.randn(2 * inter, HIDDEN, generator=g) / 8
    down = torch.randn(HIDDEN, inter, generator=g) / 10
    x = torch.randn(7, HIDDEN, generator=g)

    def mlp(gu, d):
        gate, up = F.linear(x, gu).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, d)

    for size in (2, 4):
        partials = [
            mlp(column_parallel(gate_up, (inter, inter), r, size), row_parallel(down, r, size))
            for r in range(size)
        ]
        _close(sum(partials), mlp(gate_up, down))


def test_row_parallel_partial_products_sum_to_the_whole_product():
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(HIDDEN, HEADS * HEAD_DIM, generator=g)
    x = torch.randn(3, HEADS * HEAD_DIM, generator=g)
    half = x.shape[1] // 2
    partials = [
        F.linear(x[:, r * half : (r + 1) * half], row_parallel(weight, r, 2)) for r in (0, 1)
    ]
    _close(partials[0] + partials[1], F.linear(x, weight))


@pytest.mark.parametrize("vocab", [1000, 1001, 1003])
def test_vocab_parallel_embedding_and_logits_equal_the_unsharded_ones(vocab):
    """A vocabulary that does not divide by the ranks is padded with zero rows: the lookups sum
    (all-reduce) to the whole embedding; the logits, gathered and cut, are the whole logits."""
    g = torch.Generator().manual_seed(3)
    table = torch.randn(vocab, HIDDEN, generator=g)
    ids = torch.tensor([0, 1, vocab // 4, vocab // 2, vocab // 2 + 1, vocab - 2, vocab - 1])
    h = torch.randn(4, HIDDEN, generator=g)
    for size in (2, 4):
        shards = [vocab_parallel(table, r, size) for r in range(size)]
        assert {s.shape[0] for s in shards} == {-(-vocab // size)}
        lookup = sum(vocab_embedding(s, ids, r) for r, s in enumerate(shards))
        assert torch.equal(lookup, table[ids])  # one rank's row plus zeros: exact
        logits = torch.cat([F.linear(h, s) for s in shards], dim=-1)[:, :vocab]
        _close(logits, F.linear(h, table))


def _config(**changes) -> ModelConfig:
    fields = dict(
        vocab_size=1001, hidden_size=HIDDEN, intermediate_size=96, num_layers=2,
        num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-5,
        max_position_embeddings=256, rope=None, tie_word_embeddings=True,
    )  # fmt: skip
    return ModelConfig(**{**fields, **changes})


def test_shard_cuts_every_matrix_keeps_norms_whole_and_a_tied_head_tied():
    from nanoserve.model.parallel import Parallel

    c = _config()
    g = torch.Generator().manual_seed(4)
    embed = torch.randn(c.vocab_size, HIDDEN, generator=g)
    qkv_rows = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    layer = [
        torch.ones(HIDDEN),
        torch.randn(qkv_rows, HIDDEN, generator=g),
        torch.randn(HIDDEN, HEADS * HEAD_DIM, generator=g),
        torch.ones(HIDDEN),
        torch.randn(2 * c.intermediate_size, HIDDEN, generator=g),
        torch.randn(HIDDEN, c.intermediate_size, generator=g),
    ]
    tensors = [embed, embed, torch.ones(HIDDEN), *layer, *layer]
    mine = shard(tensors, c, Parallel(rank=1, size=2))
    assert mine[0] is mine[1] and mine[0].shape == (501, HIDDEN)
    shapes = [tuple(t.shape) for t in mine[3:9]]
    assert shapes == [(HIDDEN,), (qkv_rows // 2, HIDDEN), (HIDDEN, 32), (HIDDEN,), (96, HIDDEN),
                      (HIDDEN, 48)]  # fmt: skip
    assert mine[3] is layer[0] and all(t.is_contiguous() for t in mine)
    assert shard(tensors, c, Parallel()) is tensors


def test_the_loader_lists_and_cuts_what_the_description_says_and_refuses_a_wrong_shape():
    """fuse (model/loader.py) takes each tensor by its Hugging Face names, fuses the parts, and
    refuses a layer tensor whose shape is not the config's, naming it."""
    from nanoserve.model.loader import fuse
    from nanoserve.model.weights import listed

    c = _config(num_layers=1, tie_word_embeddings=False)
    g = torch.Generator().manual_seed(5)
    raw = {"model.embed_tokens.weight": torch.randn(c.vocab_size, HIDDEN, generator=g),
           "lm_head.weight": torch.randn(c.vocab_size, HIDDEN, generator=g),
           "model.norm.weight": torch.ones(HIDDEN)}  # fmt: skip
    for prefix, _, t in listed(c):
        if t.parts is not None:
            for name, shape in zip(t.hf, t.parts(c), strict=True):
                raw[f"{prefix}{name}.weight"] = torch.randn(shape, generator=g)
    k = raw["model.layers.0.self_attn.k_proj.weight"]
    tensors = fuse(dict(raw), c)
    assert [tuple(t.shape) for t in tensors] == [
        (c.vocab_size, HIDDEN), (c.vocab_size, HIDDEN), (HIDDEN,), (HIDDEN,),
        ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), (HIDDEN, HEADS * HEAD_DIM), (HIDDEN,),
        (2 * c.intermediate_size, HIDDEN), (HIDDEN, c.intermediate_size),
    ]  # fmt: skip
    assert torch.equal(tensors[4][HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM], k)
    raw["model.layers.0.self_attn.k_proj.weight"] = k[:-1]
    with pytest.raises(ValueError, match=r"0\.self_attn\.k_proj\.weight has shape \[31, 64\]"):
        fuse(raw, c)


def test_a_size_that_does_not_divide_the_heads_is_refused_in_one_line(tiny_model_factory):
    with pytest.raises(ValueError) as e:
        check_divisible(_config(num_kv_heads=2), 4)
    assert str(e.value) == (
        "tensor_parallel_size 4 must divide the model's num_kv_heads (num_heads 8, num_kv_heads 2, "
        "intermediate_size 96): each rank keeps whole heads and whole experts"
    )
    with pytest.raises(ValueError, match=r"divide the model's num_experts \(.*num_experts 6\)"):
        check_divisible(_config(num_experts=6, experts_per_token=2, expert_size=32), 4)
    check_divisible(
        _config(num_experts=8, experts_per_token=2, expert_size=32, intermediate_size=6), 4
    )
    model_dir = tiny_model_factory()  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match="tensor_parallel_size 4 must divide") as e:
        Engine(model_dir, EngineConfig(tensor_parallel_size=4))  # refused before any spawn
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1, got 0"):
        EngineConfig(tensor_parallel_size=0)


def test_the_cli_refuses_it_before_loading(tiny_model_dir):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "nanoserve.cli", "generate", str(tiny_model_dir), "--prompt", "x",
         "--tensor-parallel-size", "3"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith("nanoserve: tensor_parallel_size 3 must divide the model's num_heads")
    assert "num_kv_heads 2" in line


class _Chunk:
    def __init__(self, tokens, start, n, table, scored=range(0), top=0):
        self.token_ids, self.start, self.num_new_tokens, self.block_table = tokens, start, n, table
        self.samples = start + n == len(tokens)
        self.prompt_logprob_positions, self.prompt_logprobs = scored, top
        self.verifies = False


def test_a_step_message_carries_every_input_but_the_scoring_targets():
    """Decodes, prefill chunks (one after a cached prefix, one scoring its prompt), the logits
    rows: the worker's inputs equal rank 0's."""
    batch = [
        _Chunk(list(range(40)), 39, 1, [3, 1, 4]),
        _Chunk(list(range(7)), 6, 1, [9]),
        _Chunk(list(range(50)), 32, 18, [5, 6, 7, 8]),
        _Chunk(list(range(30)), 0, 20, [10, 11], range(0, 20), 2),
    ]
    inputs = pack(batch, 16, torch.device("cpu"))
    message = to_message(inputs)
    assert message.dtype == torch.int64 and message.dim() == 1
    back = from_message(message, torch.device("cpu"))
    for name in ("input_ids", "positions", "logits_rows"):
        assert torch.equal(getattr(back, name), getattr(inputs, name)), name
    m, b = inputs.meta, back.meta
    for name in ("slot_mapping", "decode_block_tables", "decode_context_lens"):
        mine, theirs = getattr(m, name), getattr(b, name)
        assert torch.equal(theirs, mine) and theirs.dtype == mine.dtype, name
    assert b.num_decode == m.num_decode == 2 and len(b.prefills) == 2
    for a, c in zip(m.prefills, b.prefills, strict=True):
        assert (a.start, a.length, a.context_len) == (c.start, c.length, c.context_len)
        assert torch.equal(a.block_table, c.block_table) and c.block_table.dtype == torch.int32
    assert torch.equal(back.scoring.rows, inputs.scoring.rows) and back.scoring.chunks == ()
