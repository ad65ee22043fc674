"""The padded decode path that CUDA graphs replay, exercised on the CPU without capture: a batch
padded up to a captured size gives the tokens of the plain eager path, and padding rows touch no
cache block."""

from nanoserve import LLM, SamplingParams
from nanoserve.engine.cuda_graphs import DecodeGraphs


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
