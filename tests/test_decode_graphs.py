"""The CUDA path's CPU-side parts, exercised on the CPU without capture: a batch padded up to a
captured size gives the tokens of the plain eager path, and padding rows touch no cache block; the
step the pool is sized by stays within the model's positions."""

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.engine.cuda_graphs import DecodeGraphs
from nanoserve.engine.model_runner import largest_step


def _generate(llm, count=5):
    prompts = [{"prompt_token_ids": list(range(3 + i, 20 + 3 * i))} for i in range(count)]
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=3, max_tokens=9, ignore_eos=True),
    ] * count
    outs = llm.generate(prompts, params[:count], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_padded_decode_matches_eager(tiny_model_dir):
    eager = LLM(str(tiny_model_dir), max_num_seqs=8)
    expected = _generate(eager)

    padded = LLM(str(tiny_model_dir), max_num_seqs=8)
    runner = padded.engine.runner
    graphs = DecodeGraphs(padded.engine.config, runner.max_model_len, runner.device)
    runner.graphs = graphs
    used = []
    original = graphs.pack

    def counting_pack(batch):
        used.append(len(batch))
        return original(batch)

    graphs.pack = counting_pack
    assert _generate(padded) == expected
    assert used and any(n not in graphs.sizes for n in used), "no batch was padded"
    padded.engine.audit()
    assert padded.engine.stats().free_blocks == padded.engine.num_blocks


def test_the_profiled_step_fits_the_positions(tiny_model_factory):
    """CUDA sizes its pool by running the largest step first: max_num_batched_tokens tokens of
    prompts, each within the model's positions (a single 8192-token prompt on a model of 4096
    positions read past the RoPE table, a device-side assert on an H200). The C RoPE checks
    positions, so the same step runs here."""
    model_dir = tiny_model_factory(max_position_embeddings=100)
    llm = LLM(str(model_dir), max_num_batched_tokens=450, block_size=16, num_kv_blocks=64)
    runner = llm.engine.runner
    dummies = largest_step(450, 100, 16)
    assert [d.num_new_tokens for d in dummies] == [96, 96, 96, 96, 66]
    blocks = [b for d in dummies for b in d.block_table]
    assert blocks == list(range(len(blocks)))
    logits = runner._forward(runner._pack(dummies), runner._cache(len(blocks)))
    assert logits.shape[0] == len(dummies) and torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="position"):
        one = largest_step(450, 450, 16)
        runner._forward(runner._pack(one), runner._cache(29))
