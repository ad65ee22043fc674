"""gpt-oss (GptOssForCausalLM) from a Hugging Face directory, in float32 on the CPU: a random
checkpoint written by transformers (alternating sliding-window and full layers, YaRN, attention
sinks, biases, a clamped SwiGLU that clamps) gives its greedy ids (C decode and prefill kernels,
or the torch reference; chunked prefill, preemption) and its prompt logprobs; the attention
sinks of the decode and prefill kernels against a float64 softmax, row for row the same bits in
any batch or chunk; the one-call C step gives the layer-by-layer path's bits; and CUDA refused by
name. MXFP4 experts: test_gpt_oss_mxfp4.
"""

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_families import POOL, _reference, check_prompt_logprobs
from test_kernels import make_case as decode_case
from test_oracle import MAX_TOKENS, _ours, _prompts
from test_prefill_attention import _floats
from test_prefill_attention import make_case as prefill_case

import nanoserve.kernels as kernels
from nanoserve import LLM, SamplingParams
from nanoserve.model.config import CheckpointError, ModelConfig
from nanoserve.testing.hf_families import write_family_checkpoint

transformers = pytest.importorskip("transformers")

GPT_OSS = dict(
    num_hidden_layers=3, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
    intermediate_size=32, sliding_window=8, swiglu_limit=1.5,
    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                     "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 512},
)  # fmt: skip
SINK_GAIN = 6.0  # the redrawn sinks (about 0.5) times this: some outweigh the scores


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    path = write_family_checkpoint(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss", **GPT_OSS)
    file = path / "model.safetensors"
    tensors = load_file(file)
    for name in tensors:
        if name.endswith("self_attn.sinks"):
            tensors[name] = tensors[name] * SINK_GAIN
    save_file(tensors, file, metadata={"format": "pt"})
    return path


def test_the_checkpoint_is_what_the_tests_mean(gpt_oss_dir):
    config = ModelConfig.from_dir(gpt_oss_dir)
    assert config.layer_windows == (8, 0, 8)
    assert config.rope.rope_type == "yarn" and not config.rope.truncate
    assert (config.swiglu_alpha, config.swiglu_limit) == (1.702, 1.5)
    assert config.qkv_bias and config.o_bias and config.norm_topk_prob


@pytest.mark.parametrize(
    "engine_args",
    [{}, POOL, {"attention_backend": "torch", **POOL}],
    ids=["default", "preempt-chunk", "torch-attention"],
)
def test_greedy_equals_transformers(gpt_oss_dir, engine_args):
    prompts = _prompts(500)
    ours, stats = _ours(gpt_oss_dir, prompts, **engine_args)
    if engine_args:
        assert stats.num_preemptions > 0, "the pool was meant to be small enough to preempt"
    assert ours == _reference(gpt_oss_dir, prompts)


def test_two_ranks_equal_transformers(gpt_oss_dir):
    """Each rank keeps half the heads (and their sinks) and half the experts (and their biases)."""
    prompts = _prompts(500)[:3]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(str(gpt_oss_dir), tensor_parallel_size=2) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == _reference(gpt_oss_dir, prompts)


def test_prompt_logprobs_equal_transformers(gpt_oss_dir):
    check_prompt_logprobs(gpt_oss_dir)


def test_the_one_call_step_gives_the_layer_by_layer_bits(gpt_oss_dir, monkeypatch):
    """In float32 the one-call C step takes gpt-oss's layers (sinks, windows of 8 here, biases,
    its routing and clamped SwiGLU in kernels/csrc/moe.c): the layer-by-layer path's ids and
    logprobs, bit for bit, at batch 1 and 3, the contexts past the window."""
    from test_cpu_step import _generate, bits

    prompts = [list(range(20 + 7 * i, 40 + 11 * i)) for i in range(3)]
    for batch in (1, 3):
        ours, theirs = (_generate(gpt_oss_dir, "float32", one_call, prompts[:batch], monkeypatch)
                        for one_call in (True, False))  # fmt: skip
        assert bits(ours) == bits(theirs)


def _edited(model_dir, tmp_path, **changes):
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
    return tmp_path


@pytest.mark.parametrize(
    "name",
    ["model.layers.1.self_attn.sinks", "model.layers.0.mlp.experts.gate_up_proj_bias",
     "model.layers.2.mlp.router.bias"],
)  # fmt: skip
def test_a_missing_tensor_is_refused_by_its_stored_name(gpt_oss_dir, tmp_path, name):
    from nanoserve.model.checkpoint import HFCheckpoint

    path = _edited(gpt_oss_dir, tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors[name]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"no tensor {re.escape(name)}$"):
        HFCheckpoint(path)


# The kernels' sinks.


def _with_sinks(logits: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """softmax over [logits, sink] in float64, the sink's column dropped; logits [heads, ..., n]."""
    column = sinks.double().view(-1, *[1] * (logits.dim() - 1)).expand(*logits.shape[:-1], 1)
    return torch.softmax(torch.cat([logits, column], dim=-1), dim=-1)[..., :-1]


def decode_reference(case, sinks: torch.Tensor, window: int) -> torch.Tensor:
    q, k_cache, v_cache = (t.double() for t in (case.q, case.k_cache, case.v_cache))
    block_size, group = k_cache.shape[2], q.shape[1] // k_cache.shape[1]
    out = torch.empty_like(q)
    for i, n in enumerate(case.context_lens.tolist()):
        first = max(n - window, 0) if window else 0
        blocks = case.block_tables[i, torch.arange(first, n) // block_size].long()
        offsets = torch.arange(first, n) % block_size
        k = k_cache[blocks, :, offsets].repeat_interleave(group, dim=1)  # [n, heads, head_dim]
        v = v_cache[blocks, :, offsets].repeat_interleave(group, dim=1)
        weights = _with_sinks(torch.einsum("hd,thd->ht", q[i], k) * case.scale, sinks)
        out[i] = torch.einsum("ht,thd->hd", weights, v)
    return out


def prefill_reference(case, sinks: torch.Tensor, window: int) -> torch.Tensor:
    tokens, heads, _ = case.q.shape
    block_size, group = case.k_cache.shape[2], heads // case.k_cache.shape[1]
    positions = torch.arange(case.context_len)
    blocks, offsets = case.block_table[positions // block_size].long(), positions % block_size
    k, v = (_floats(c[blocks, :, offsets]).repeat_interleave(group, dim=1) for c in case.caches)
    logits = torch.einsum("thd,chd->htc", case.q.double(), k) * case.scale
    rows = torch.arange(tokens).unsqueeze(1) + case.context_len - tokens
    hidden = (positions > rows) | ((positions <= rows - window) if window else False)
    weights = _with_sinks(logits.masked_fill(hidden, float("-inf")), sinks)
    return torch.einsum("htc,chd->thd", weights, v)


def _sinks(heads: int, gen: torch.Generator) -> torch.Tensor:
    """Sinks from far below the scores to far above them (the kernels' other branch)."""
    return torch.randn(heads, generator=gen) * 4 + torch.linspace(-6, 12, heads)


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(38)


@pytest.mark.parametrize("backend", ["c", "torch"])
@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("shape", [(6, 2, 24, 16), (5, 5, 40, 8), (8, 1, 64, 16)])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)], ids=str)
def test_decode_sinks_match_float64(gen, backend, window, shape, dtype, atol):
    heads, kv_heads, head_dim, block_size = shape
    case = decode_case(gen, [1, 9, 33, 70], heads, kv_heads, head_dim, block_size, dtype)
    sinks = _sinks(heads, gen)
    out = kernels.paged_attention_decode(*case.args(), backend=backend, window=window, sinks=sinks)
    torch.testing.assert_close(out.double(), decode_reference(case, sinks, window),
                               atol=atol, rtol=0)  # fmt: skip


@pytest.mark.parametrize("backend", ["c", "torch"])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("tokens,cached", [(1, 0), (13, 0), (37, 21)])
@pytest.mark.parametrize("shape", [(6, 2, 24, 8), (5, 5, 40, 16)])
def test_prefill_sinks_match_float64(gen, backend, window, tokens, cached, shape):
    case = prefill_case(gen, tokens, cached, shape)
    sinks = _sinks(shape[0], gen)
    out = kernels.paged_attention_prefill(*case.args(), backend=backend, window=window, sinks=sinks)
    torch.testing.assert_close(out.double(), prefill_reference(case, sinks, window),
                               atol=2e-5, rtol=0)  # fmt: skip


def test_sinks_change_the_output(gen):
    """The references above would pass a kernel that dropped small sinks only where they weigh
    little: here they weigh a lot."""
    case = decode_case(gen, [9, 33], 6, 2, 24, 16, torch.float32)
    plain = kernels.paged_attention_decode(*case.args(), backend="c")
    sunk = kernels.paged_attention_decode(*case.args(), backend="c", sinks=_sinks(6, gen))
    assert (plain - sunk).abs().max() > 0.1


def test_decode_rows_are_invariant_to_the_batch(gen):
    case = decode_case(gen, [1, 17, 40, 129, 300], 6, 2, 24, 16, torch.float32)
    sinks = _sinks(6, gen)
    batch = kernels.paged_attention_decode(*case.args(), backend="c", window=7, sinks=sinks)
    for i in range(5):
        alone = case.select([i], own_blocks=True)
        one = kernels.paged_attention_decode(*alone.args(), backend="c", window=7, sinks=sinks)
        assert torch.equal(one[0], batch[i])


def test_prefill_rows_are_invariant_to_the_chunk(gen):
    case = prefill_case(gen, 70, 11, (6, 2, 24, 8))
    sinks = _sinks(6, gen)
    whole = kernels.paged_attention_prefill(*case.args(), backend="c", window=5, sinks=sinks)
    for last in (1, 9, 33):
        q = case.q[-last:].contiguous()
        part = kernels.paged_attention_prefill(
            q, case.k_cache, case.v_cache, case.block_table, case.context_len, case.scale,
            backend="c", window=5, sinks=sinks,
        )  # fmt: skip
        assert torch.equal(part, whole[-last:])


@pytest.mark.parametrize(
    "sinks,error,words",
    [
        (torch.zeros(5), ValueError, "sinks has 5 entries, q has 6 heads"),
        (torch.zeros(6, dtype=torch.float64), TypeError, "sinks dtype must be one of float32"),
        (torch.zeros(6, 1), ValueError, r"sinks must be \[num_q_heads\]"),
    ],
)
def test_bad_sinks_are_refused_by_name(gen, sinks, error, words):
    case = decode_case(gen, [9], 6, 2, 24, 16, torch.float32)
    with pytest.raises(error, match=words):
        kernels.paged_attention_decode(*case.args(), sinks=sinks)
    with pytest.raises(error, match=words):
        kernels.paged_attention_prefill(
            case.q, case.k_cache, case.v_cache, case.block_tables[0], 9, case.scale, sinks=sinks
        )


def test_cuda_is_refused_by_name(gpt_oss_dir):
    """Before any GPU is touched: the Triton decode kernel has no sinks."""
    from nanoserve.config import EngineConfig, SettingError
    from nanoserve.model.checkpoint import open_checkpoint
    from nanoserve.model.load import load_model
    from nanoserve.model.parallel import SINGLE

    config = EngineConfig(device="cuda", dtype="float32")
    with pytest.raises(SettingError, match="cpu for gpt-oss, whose attention sinks"):
        load_model(open_checkpoint(gpt_oss_dir), config, torch.device("cuda"), SINGLE, 64)


def test_bfloat16_runs_close_to_transformers(gpt_oss_dir):
    """bf16 runs, but only near transformers: its gpt-oss takes the attention's and the router's
    softmax in bfloat16 (nanoserve's are float32), so only the first tokens agree (the second
    prompt's fourth does not)."""
    prompts = _prompts(500)[:2]
    ours, _ = _ours(gpt_oss_dir, prompts, dtype="bfloat16")
    ref = _reference(gpt_oss_dir, prompts, dtype=torch.bfloat16)
    assert [o[:2] for o in ours] == [r[:2] for r in ref]
