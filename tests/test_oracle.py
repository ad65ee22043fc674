"""Greedy output matches Hugging Face transformers token for token, on tiny random checkpoints in
both config layouts, single and sharded files, with and without preemption."""

import pytest
import torch

from nanoserve import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

PROMPT_LENGTHS = [3, 17, 40, 9, 64, 1]
MAX_TOKENS = 24


def _prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@torch.inference_mode()
def _reference(model_dir, prompts, max_tokens=MAX_TOKENS, dtype=torch.float32):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.eval()
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            pad_token_id=0,
        )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def _ours(model_dir, prompts, **engine_args):
    llm = LLM(str(model_dir), **engine_args)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.engine.audit()
    assert llm.engine.stats().free_blocks == llm.engine.num_blocks
    return [list(o.outputs[0].token_ids) for o in outs], llm.engine.stats()


@pytest.mark.parametrize(
    "layout,shard_bytes",
    [("rope_theta", None), ("rope_parameters", None), ("rope_theta", 40_000)],
)
def test_greedy_matches_transformers(tiny_model_factory, layout, shard_bytes):
    model_dir = tiny_model_factory(config_layout=layout, shard_bytes=shard_bytes)
    if shard_bytes:
        assert (model_dir / "model.safetensors.index.json").is_file()
    prompts = _prompts(500)
    ours, _ = _ours(model_dir, prompts)
    assert ours == _reference(model_dir, prompts)


def test_greedy_matches_transformers_under_preemption(tiny_model_dir):
    prompts = _prompts(500)
    ours, stats = _ours(tiny_model_dir, prompts, block_size=8, num_kv_blocks=16)
    assert stats.num_preemptions > 0, "the pool was meant to be small enough to preempt"
    assert ours == _reference(tiny_model_dir, prompts)


def test_greedy_matches_transformers_without_chunking_or_prefix_cache(tiny_model_dir):
    prompts = _prompts(500)
    ours, _ = _ours(
        tiny_model_dir,
        prompts,
        max_num_batched_tokens=32,
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
    )
    assert ours == _reference(tiny_model_dir, prompts)


def test_greedy_matches_transformers_one_request_at_a_time(tiny_model_dir):
    """Batch-1 decodes: on the CPU every layer of a step runs in one C call (model/cpu_step.py)."""
    prompts = _prompts(500)[:3]
    ours = [_ours(tiny_model_dir, [p])[0][0] for p in prompts]
    assert ours == _reference(tiny_model_dir, prompts)


def test_greedy_matches_transformers_on_torch_paths_alone(tiny_model_dir, monkeypatch):
    """With the C kernels switched off and no oneDNN, every op takes its torch path (as on a
    GPU)."""
    from nanoserve.kernels import c_backend

    monkeypatch.setattr(c_backend, "ENABLED", False)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    prompts = _prompts(500)
    ours, _ = _ours(tiny_model_dir, prompts)
    assert ours == _reference(tiny_model_dir, prompts)
    head = LLM(str(tiny_model_dir)).engine.runner.model.weights.lm_head
    assert head.packed is None and not head.gemv  # the patches did take effect


def test_bfloat16_close_to_transformers(tiny_model_dir):
    """bf16 rounding makes exact equality a coin toss over long runs; the first tokens agree."""
    prompts = _prompts(500)[:3]
    ours, _ = _ours(tiny_model_dir, prompts, dtype="bfloat16")
    ref = _reference(tiny_model_dir, prompts, dtype=torch.bfloat16)
    assert [o[:4] for o in ours] == [r[:4] for r in ref]
