"""Gemma 3 text (Gemma3ForCausalLM) as options of the one decoder: random checkpoints written by
transformers, with sliding-window layers (a window of 16, shorter than the prompts) interleaved
with global ones, give its greedy ids (with prefix caching, preemption and chunked prefill) and
its prompt logprobs; the window is computed as such (no cap on the context), in the C and torch
decode kernels and in the prefill mask; what is not implemented is refused by name."""

import json

import pytest
import torch
from test_families import POOL, _edit_config, _edited_copy, _reference, check_prompt_logprobs
from test_oracle import MAX_TOKENS, _ours, _prompts

from nanoserve import LLM, SamplingParams
from nanoserve.kernels import paged_attention_decode
from nanoserve.model.config import CheckpointError
from nanoserve.testing.hf_families import write_family_checkpoint

ROPES = {
    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
}
GEMMA = dict(
    head_dim=32, sliding_window=16, query_pre_attn_scalar=24, rope_parameters=ROPES,
    layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
)  # fmt: skip
VARIANTS = {
    "gemma3": GEMMA,
    "gemma3-tied-softcap": {**GEMMA, "tie_word_embeddings": True, "final_logit_softcapping": 2.0},
    "gemma3-linear-global-bias": {
        **GEMMA, "num_hidden_layers": 3, "attention_bias": True,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {**ROPES, "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                        "rope_theta": 1e6}},
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    cache = {}

    def make(name):
        if name not in cache:
            path = tmp_path_factory.mktemp(name)
            cache[name] = write_family_checkpoint(path, "gemma3_text", **VARIANTS[name])
        return cache[name]

    return make


@pytest.mark.parametrize("engine_args", [{}, POOL], ids=["default", "preempt-chunk"])
@pytest.mark.parametrize("name", VARIANTS)
def test_greedy_equals_transformers(gemma_dir, name, engine_args):
    model_dir, prompts = gemma_dir(name), _prompts(500)
    assert max(len(p) for p in prompts) + MAX_TOKENS > 3 * VARIANTS[name]["sliding_window"]
    ours, stats = _ours(model_dir, prompts, **engine_args)
    if engine_args:
        assert stats.num_preemptions > 0, "the pool was meant to be small enough to preempt"
    assert ours == _reference(model_dir, prompts)


def test_the_window_is_computed_not_capped(gemma_dir, tmp_path):
    """The context is not capped to the window, and the window changes the ids (the same weights
    with a window longer than every sequence give others)."""
    model_dir = gemma_dir("gemma3")
    llm = LLM(str(model_dir))
    assert llm.engine.max_model_len > 16
    wide = _edited_copy(model_dir, tmp_path)
    _edit_config(wide, sliding_window=4096)
    prompts = _prompts(500)
    assert _ours(wide, prompts)[0] != _ours(model_dir, prompts)[0]


@pytest.mark.parametrize("name", ["gemma3", "gemma3-tied-softcap"])
def test_prompt_logprobs_equal_transformers(gemma_dir, name):
    check_prompt_logprobs(gemma_dir(name))


def test_bfloat16_close_to_transformers(gemma_dir):
    model_dir, prompts = gemma_dir("gemma3"), _prompts(500)[:3]
    ours, _ = _ours(model_dir, prompts, dtype="bfloat16")
    ref = _reference(model_dir, prompts, dtype=torch.bfloat16)
    assert [o[:4] for o in ours] == [r[:4] for r in ref]


@pytest.mark.parametrize("backend", ["torch", "c", "triton"])
@pytest.mark.parametrize("window", [1, 5, 8, 13, 100])
def test_decode_kernels_window_equals_attention_over_the_last_positions(backend, window):
    """A windowed decode equals full attention over the last `window` positions alone; Triton's
    with splits of 16 tokens, so that whole splits and tiles fall before the window."""
    from nanoserve.kernels import available_backends

    if backend not in available_backends():
        pytest.skip(f"no {backend} backend here (Triton: see the interpreter test below)")
    torch.manual_seed(0)
    block, heads, kv_heads, dim, lens = 4, 4, 2, 16, [1, 3, 9, 21, 30, 70]
    k_cache = torch.randn(128, kv_heads, block, dim)
    v_cache = torch.randn(128, kv_heads, block, dim)
    tables = torch.randperm(128, dtype=torch.int32)[: len(lens) * 18].view(len(lens), 18)
    q = torch.randn(len(lens), heads, dim)
    ctx = torch.tensor(lens, dtype=torch.int32)
    if backend == "triton":
        from nanoserve.kernels import triton_decode

        out = torch.empty_like(q)
        triton_decode.paged_attention_decode(
            q, k_cache, v_cache, tables, ctx, 0.3, out, window, tokens_per_split=32, block_n=16
        )
    else:
        out = paged_attention_decode(q, k_cache, v_cache, tables, ctx, 0.3, backend=backend,
                                     window=window)  # fmt: skip
    for i, n in enumerate(lens):
        slots = [int(tables[i, p // block]) * block + p % block for p in range(n)][-window:]
        k = k_cache.transpose(1, 2).reshape(-1, kv_heads, dim)[slots].repeat_interleave(2, 1)
        v = v_cache.transpose(1, 2).reshape(-1, kv_heads, dim)[slots].repeat_interleave(2, 1)
        probs = torch.softmax(torch.einsum("hd,thd->ht", q[i], k) * 0.3, dim=-1)
        torch.testing.assert_close(out[i], torch.einsum("ht,thd->hd", probs, v))


def test_triton_window_in_the_interpreter():
    """The Triton cases above, in a child process where TRITON_INTERPRET=1 is set before triton
    is imported (the only way its kernels run on CPU tensors)."""
    import os
    import subprocess
    import sys

    from nanoserve.kernels import triton_decode

    if triton_decode.INTERPRETED:
        pytest.skip("this process interprets: ran in-process")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", __file__, "-k", "decode_kernels and triton"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert result.returncode == 0 and "5 passed" in result.stdout, result.stdout[-2000:]


REFUSED = {
    "attn-softcap": (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    "bidirectional": (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    "activation": (dict(hidden_activation="gelu"), "hidden_activation 'gelu'"),
    "rope-per-layer": (
        dict(rope_parameters={**ROPES, "sliding_attention": {"rope_type": "dynamic",
                                                              "factor": 2.0, "rope_theta": 1e4}}),
        "sliding_attention layers: rope_parameters.rope_type 'dynamic' is not implemented",
    ),
    "multimodal": (dict(architectures=["Gemma3ForConditionalGeneration"]),
                   "'Gemma3ForConditionalGeneration'"),
}  # fmt: skip


@pytest.mark.parametrize("name", REFUSED)
def test_what_is_not_implemented_is_refused_by_name(gemma_dir, tmp_path, name):
    changes, words = REFUSED[name]
    model_dir = _edited_copy(gemma_dir("gemma3"), tmp_path)
    _edit_config(model_dir, **changes)
    with pytest.raises(CheckpointError) as e:
        LLM(str(model_dir))
    assert "\n" not in str(e.value) and words in str(e.value), str(e.value)


def test_the_published_layout_loads(gemma_dir, tmp_path):
    """google/gemma-3-1b-it's config.json keys: rope_theta, rope_local_base_freq, rope_scaling
    null, sliding_window_pattern instead of layer_types (layer i slides unless i + 1 is a
    multiple of it)."""
    model_dir = _edited_copy(gemma_dir("gemma3"), tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    _edit_config(model_dir, rope_parameters=None, layer_types=None, rope_theta=1e6,
                 rope_local_base_freq=1e4, sliding_window_pattern=2)  # fmt: skip
    assert "layer_types" not in json.loads((model_dir / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    prompts = _prompts(500)[:3]
    assert _ours(model_dir, prompts)[0] == _ours(gemma_dir("gemma3"), prompts)[0]


def test_prefix_cache_hits_past_the_window_equal_transformers(gemma_dir):
    """Prompts sharing a 40-token prefix (more than twice the window), one after the other: the
    later ones start from cached blocks, and a chunk after a cached prefix is masked by the
    window as a whole prompt is."""
    model_dir = gemma_dir("gemma3")
    shared = _prompts(500)[4][:40]
    prompts = [shared + tail for tail in ([7, 8, 9], [100] * 20, [3])]
    llm = LLM(str(model_dir), block_size=8)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ours = [
        list(llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
             .outputs[0].token_ids) for p in prompts
    ]  # fmt: skip
    assert llm.engine.stats().num_prefix_hit_tokens >= 2 * 40 - 16
    assert ours == _reference(model_dir, prompts)


@pytest.mark.parametrize("name", ["gemma3", "gemma3-tied-softcap", "gemma3-linear-global-bias"])
def test_batch_one_decodes_in_the_one_call_c_step(gemma_dir, name):
    """Float32: Gemma's options (GELU-tanh, output norms, windows with their RoPE tables, the
    attention scale) in the C step, past the window: the same ids as layer by layer and as
    transformers. bfloat16 (float32 norm weights) decodes layer by layer."""
    from nanoserve.kernels import c_backend

    if not c_backend.enabled():
        pytest.skip("no C kernels here")
    model_dir, prompts = gemma_dir(name), [p for p in _prompts(500) if len(p) > 16][:2]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm = LLM(str(model_dir))
    assert llm.engine.runner.cpu_step is not None
    ours = [list(llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
                 .outputs[0].token_ids) for p in prompts]  # fmt: skip
    llm.engine.runner.cpu_step = None  # the layer-by-layer path
    layered = [list(llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
                    .outputs[0].token_ids) for p in prompts]  # fmt: skip
    assert ours == layered == _reference(model_dir, prompts)
    assert LLM(str(model_dir), dtype="bfloat16").engine.runner.cpu_step is None


def test_two_ranks_equal_transformers(gemma_dir):
    model_dir, prompts = gemma_dir("gemma3"), _prompts(500)
    with LLM(str(model_dir), tensor_parallel_size=2, **POOL) as llm:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.engine.stats().num_preemptions > 0
    assert [list(o.outputs[0].token_ids) for o in outs] == _reference(model_dir, prompts)


def test_gemma_3_1b_config_reads_as_transformers_reads_it():
    """The shapes and keys of google/gemma-3-1b-it's config.json (no layer_types: every sixth
    layer global), and of a 4B-style linear scaling of the global layers' RoPE."""
    import transformers

    from nanoserve.model.config import ModelConfig

    published = dict(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=262144,
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000,
        rope_local_base_freq=10000, rope_scaling=None, sliding_window=512,
        sliding_window_pattern=6, query_pre_attn_scalar=256, final_logit_softcapping=None,
        attn_logit_softcapping=None, attention_bias=False, eos_token_id=[1, 106],
    )  # fmt: skip
    c = ModelConfig.from_dict(published)
    hf = transformers.Gemma3TextConfig(
        **{k: v for k, v in published.items() if k != "architectures"}
    )
    assert c.layer_windows == tuple(512 if t == "sliding_attention" else 0 for t in hf.layer_types)
    assert c.layer_windows[:6] == (512,) * 5 + (0,)
    assert (c.rope.theta, c.local_rope and c.local_rope.theta) == (1e6, 1e4)
    assert c.tie_word_embeddings and c.attn_scale == 256**-0.5
    assert c.max_position_embeddings == 32768  # not capped by the windows
    scaled = ModelConfig.from_dict({**published, "rope_scaling": {"rope_type": "linear",
                                                                 "factor": 8.0}})  # fmt: skip
    assert (scaled.rope.rope_type, scaled.rope.factor) == ("linear", 8.0)
    assert scaled.local_rope == c.local_rope


def test_an_embedding_quantized_at_load_is_scaled_too(gemma_dir):
    model_dir, ids = gemma_dir("gemma3"), torch.arange(0, 500, 7)
    floats = LLM(str(model_dir)).engine.runner.model.embed(ids)
    blocks = LLM(str(model_dir), quantization="q8_0").engine.runner.model
    assert type(blocks.weights.embed).__name__ == "QuantizedWeight"
    torch.testing.assert_close(blocks.embed(ids), floats, atol=0.05, rtol=0.05)


def test_a_rows_logits_are_the_same_bits_in_either_decode_path(gemma_dir):
    """GELU-tanh is one C kernel for the one-call C step (up to 16 rows in GGUF blocks) and the
    layer-by-layer path (past them): verifying 17 positions in one step gives each the bits of
    its own one-row decode step."""
    from test_spec_decode import _verification_matches_decodes

    llm = LLM(str(gemma_dir("gemma3")), block_size=4, num_kv_blocks=24, quantization="q8_0")
    assert llm.engine.runner.cpu_step is not None
    for rows in (4, 17):
        _verification_matches_decodes(llm, rows)
