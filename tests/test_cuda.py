"""The engine on a CUDA device (skipped without one; bench/gpu_check.sh runs these on a GPU):
greedy tokens against transformers on the same GPU, sliding-window layers (Mistral v0.1's window)
too, speculative decoding's verification steps giving the plain greedy tokens, identical outputs
with and without CUDA graphs, seeded sampling reproducible, the pool sized from free device
memory."""

import pytest
import torch

from nanoserve import LLM, SamplingParams

DEVICE = "cuda"
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = [list(range(5, 5 + n)) for n in (3, 17, 40, 9, 64, 1)]


def _generate(llm, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    llm.engine.audit()
    assert llm.engine.stats().free_blocks == llm.engine.num_blocks
    return [list(o.outputs[0].token_ids) for o in outs]


@torch.inference_mode()
def _transformers_greedy(model_dir, max_tokens=16):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.to(DEVICE).eval()
    model.generation_config.eos_token_id = None
    expected = []
    for p in PROMPTS:
        ids = torch.tensor([p], device=DEVICE)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_tokens,
            pad_token_id=0,
        )
        expected.append(out[0, len(p) :].tolist())
    return expected


def test_greedy_matches_transformers_on_the_gpu(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), device=DEVICE, num_kv_blocks=256)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert _generate(llm, params) == _transformers_greedy(tiny_model_dir)


def test_sliding_window_matches_transformers_on_the_gpu(tmp_path):
    """Mistral v0.1's window of 8 on every layer, prompts of up to 64 tokens and 24 more: the
    Triton kernel's window in decode, the masked SDPA in prefill."""
    from nanoserve.testing.hf_families import write_family_checkpoint

    model_dir = write_family_checkpoint(tmp_path / "mistral", "mistral", sliding_window=8)
    llm = LLM(str(model_dir), device=DEVICE, num_kv_blocks=256, block_size=8)
    assert llm.engine.runner.model.config.layer_windows == (8, 8)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert _generate(llm, params) == _transformers_greedy(model_dir, 24)


def test_speculative_verification_gives_the_plain_greedy_tokens(tiny_model_dir):
    """n-gram drafts on prompts that repeat themselves, verified k + 1 tokens a sequence a step."""
    prompts = [list(range(5, 5 + n)) * 4 for n in (3, 7)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    results = []
    for config in (None, spec):
        llm = LLM(str(tiny_model_dir), device=DEVICE, num_kv_blocks=256, speculative_config=config)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        llm.engine.audit()
        results.append([o.outputs[0].token_ids for o in outs])
    assert llm.engine.stats().spec_decode.num_drafts > 0
    assert results[0] == results[1]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_graphs_change_nothing(tiny_model_dir, dtype):
    params = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=4, max_tokens=20, ignore_eos=True),
    ] * 3
    graphs = LLM(str(tiny_model_dir), device=DEVICE, dtype=dtype, num_kv_blocks=256)
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
