"""The engine on a CUDA device (skipped without one; bench/gpu_check.sh runs these on a GPU):
greedy tokens against transformers on the same GPU, identical outputs with and without CUDA graphs,
seeded sampling reproducible, the pool sized from free device memory."""

import pytest
import torch

from nanoserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = [list(range(5, 5 + n)) for n in (3, 17, 40, 9, 64, 1)]


def _generate(llm, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    llm.engine.audit()
    assert llm.engine.stats().free_blocks == llm.engine.num_blocks
    return [o.outputs[0].token_ids for o in outs]


@torch.inference_mode()
def test_greedy_matches_transformers_on_the_gpu(tiny_model_dir):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.to("cuda").eval()
    expected = []
    for p in PROMPTS:
        ids = torch.tensor([p], device="cuda")
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=16,
            min_new_tokens=16,
            pad_token_id=0,
        )
        expected.append(tuple(out[0, len(p) :].tolist()))
    llm = LLM(str(tiny_model_dir), device="cuda", num_kv_blocks=256)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert _generate(llm, params) == expected


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_graphs_change_nothing(tiny_model_dir, dtype):
    params = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=4, max_tokens=20, ignore_eos=True),
    ] * 3
    graphs = LLM(str(tiny_model_dir), device="cuda", dtype=dtype, num_kv_blocks=256)
    assert graphs.engine.runner.graphs.graphs, "no graph was captured"
    eager = LLM(
        str(tiny_model_dir), device="cuda", dtype=dtype, num_kv_blocks=256, cuda_graphs=False
    )
    assert _generate(graphs, params) == _generate(eager, params)
    assert _generate(graphs, params) == _generate(graphs, params)  # seeded: reproducible


def test_pool_is_sized_from_free_device_memory(tiny_model_dir):
    total = torch.cuda.get_device_properties(0).total_memory
    sizes = []
    for share in (0.05, 0.10):
        llm = LLM(str(tiny_model_dir), device="cuda", gpu_memory_utilization=share)
        engine = llm.engine
        assert engine.num_blocks * engine.runner.block_bytes <= share * total
        sizes.append(engine.num_blocks)
        del llm, engine
        torch.cuda.empty_cache()
    assert 0 < sizes[0] < sizes[1]
