"""Mixtures of experts (model/moe.py): random Qwen3-MoE and Mixtral checkpoints written by
transformers give its greedy ids (with prefix caching, chunked prefill and preemption) and its
prompt logprobs, also where two experts tie for a token's last place, and at two ranks, each
keeping half the experts; the one-call C step gives the layer-by-layer path's bits; what is left
out (dense layers among sparse ones) is refused by name."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_families import POOL, _reference, check_prompt_logprobs
from test_oracle import MAX_TOKENS, _ours, _prompts

from nanoserve import LLM, SamplingParams
from nanoserve.model.config import CheckpointError
from nanoserve.testing.hf_families import write_family_checkpoint
from nanoserve.testing.llamacpp_convert import (
    convert,
    converter,
    smollm2_vocabulary,
    write_vocabulary,
)

transformers = pytest.importorskip("transformers")

MOE = {
    "qwen3_moe": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2,
                                    moe_intermediate_size=32, norm_topk_prob=True)),
    "qwen3_moe-unnormalized": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2,
                                                 moe_intermediate_size=32, norm_topk_prob=False)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2,
                                intermediate_size=64)),
}  # fmt: skip


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """`moe_dir(name)`: the checkpoint of MOE[name], written once."""
    cache = {}

    def make(name):
        if name not in cache:
            family, config = MOE[name]
            cache[name] = write_family_checkpoint(tmp_path_factory.mktemp(name), family, **config)
        return cache[name]

    return make


@pytest.mark.parametrize("engine_args", [{}, POOL], ids=["default", "preempt-chunk"])
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])  # unnormalized: its logprobs below
def test_greedy_equals_transformers(moe_dir, name, engine_args):
    model_dir, prompts = moe_dir(name), _prompts(500)
    ours, stats = _ours(model_dir, prompts, **engine_args)
    if engine_args:
        assert stats.num_preemptions > 0, "the pool was meant to be small enough to preempt"
    assert ours == _reference(model_dir, prompts)


@pytest.mark.parametrize("name", MOE)
def test_prompt_logprobs_equal_transformers(moe_dir, name):
    check_prompt_logprobs(moe_dir(name))


def test_bfloat16_runs_close_to_transformers(moe_dir):
    """bf16 rounding makes exact equality a coin toss over long runs; the first tokens agree.
    (The third prompt's third token is one: two logits tie in bfloat16 in transformers.)"""
    model_dir, prompts = moe_dir("qwen3_moe"), _prompts(500)[:2]
    ours, _ = _ours(model_dir, prompts, dtype="bfloat16")
    ref = _reference(model_dir, prompts, dtype=torch.bfloat16)
    assert [o[:4] for o in ours] == [r[:4] for r in ref]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_routing_at_ties_is_transformers(family):
    """Experts 1 and 2 have the same router row, so every token scores them equally; with expert
    0 scored above both for some tokens, they tie for the second and last place: the choice (and
    each weight) is transformers' router's, expert by expert."""
    from nanoserve.kernels import route_experts

    _, config = MOE["qwen3_moe" if family == "qwen3_moe" else "mixtral"]
    cfg = transformers.AutoConfig.for_model(family, hidden_size=64, **config)
    router_class = (
        transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter
        if family == "qwen3_moe"
        else transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter
    )
    router = router_class(cfg)
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(router.weight.shape, generator=g)
    weight[2] = weight[1]
    weight[0] = 2 * weight[1]  # first for the tokens that like expert 1: 1 and 2 tie for second
    x = torch.randn(64, 64, generator=g)
    with torch.no_grad():
        router.weight.copy_(weight)
        _, ref_weights, ref_experts = router(x)
    normalize = family == "mixtral" or cfg.norm_topk_prob
    ours_weights, ours_experts = route_experts(x @ weight.T, cfg.num_experts_per_tok, normalize)
    ties = (ref_experts == 1).any(-1) & ~(ref_experts == 2).any(-1)
    assert ties.sum() > 0, "some token was meant to tie experts 1 and 2 for its last place"
    assert torch.equal(ours_experts, ref_experts)
    torch.testing.assert_close(ours_weights, ref_weights.float(), rtol=0, atol=1e-6)


def test_greedy_at_tied_router_rows_equals_transformers(moe_dir, tmp_path):
    """The same ties through the whole model: layer 0's router gives experts 1 and 2 one row."""
    model_dir = _copy(moe_dir("qwen3_moe"), tmp_path)
    tensors = load_file(model_dir / "model.safetensors")
    router = tensors["model.layers.0.mlp.gate.weight"]
    router[2] = router[1]
    router[0] = 2 * router[1]
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    prompts = _prompts(500)
    ours, _ = _ours(model_dir, prompts, **POOL)
    assert ours == _reference(model_dir, prompts)


def _copy(model_dir, tmp_path):
    import shutil

    return shutil.copytree(model_dir, tmp_path / "copy")


def _edit_config(model_dir, **changes):
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, **changes}))


@pytest.mark.parametrize(
    "change,named",
    [
        (dict(mlp_only_layers=[1]), "mlp_only_layers"),
        (dict(decoder_sparse_step=2), "decoder_sparse_step"),
        (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    ],
)
def test_what_is_not_implemented_is_refused_by_name(moe_dir, tmp_path, change, named):
    model_dir = _copy(moe_dir("qwen3_moe"), tmp_path)
    _edit_config(model_dir, **change)
    with pytest.raises(CheckpointError, match=named):
        LLM(str(model_dir))


def test_training_only_keys_are_ignored(moe_dir, tmp_path):
    """The router's jitter is applied by transformers in training only, its auxiliary loss is a
    training loss: a checkpoint that sets them computes the same outputs."""
    model_dir = _copy(moe_dir("mixtral"), tmp_path)
    _edit_config(model_dir, router_jitter_noise=0.1, output_router_logits=True,
                 router_aux_loss_coef=0.5)  # fmt: skip
    prompts = _prompts(500)[:2]
    assert _ours(model_dir, prompts)[0] == _reference(model_dir, prompts)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_two_ranks_each_keeping_half_the_experts_equal_transformers(moe_dir, name):
    """Expert parallelism: each rank keeps half the experts whole, runs the chosen ones it has,
    and the block's output is all-reduced."""
    model_dir, prompts = moe_dir(name), _prompts(500)[:3]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(str(model_dir), tensor_parallel_size=2) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == _reference(model_dir, prompts)


@pytest.mark.parametrize(("experts", "k"), [(4, 2), (8, 2), (60, 4), (128, 8), (128, 2), (512, 10)])
def test_the_routing_kernel_chooses_torch_topk_experts_at_ties(experts, k):
    """torch.topk is no stable sort: at equal scores its choice is libstdc++'s nth_element's (or
    partial_sort's, where k * 64 <= experts). The C routing, which both paths take on a CPU,
    makes the same choice, in the same order, over rows of few distinct logits (ties everywhere)."""
    from nanoserve.kernels import route_experts

    g = torch.Generator().manual_seed(experts + k)
    for levels in (2, 3, 7, 1000):
        logits = torch.randint(0, levels, (300, experts), generator=g).float() * 0.37
        weights, chosen = route_experts(logits, k, normalize=False)
        ref_weights, ref_chosen = torch.topk(torch.softmax(logits, -1), k)
        assert torch.equal(chosen, ref_chosen), levels
        torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_the_one_call_step_gives_the_layer_by_layer_bits(moe_dir, monkeypatch, name):
    """In float32, decode steps of up to 4 rows run the experts in the one-call C step
    (kernels/csrc/moe.c) with the layer-by-layer path's routing and kernels: the same ids and
    logprobs, bit for bit, at batch 1 and 3."""
    from test_cpu_step import _generate, bits

    prompts = _prompts(500)[:3]
    for batch in (1, 3):
        ours, theirs = (_generate(moe_dir(name), "float32", one_call, prompts[:batch], monkeypatch)
                        for one_call in (True, False))  # fmt: skip
        assert bits(ours) == bits(theirs)


def test_bfloat16_experts_decode_layer_by_layer(moe_dir, caplog):
    """The C step's experts take float32: in bfloat16 a MoE model decodes layer by layer, and
    says so."""
    import logging

    with caplog.at_level(logging.INFO):
        llm = LLM(str(moe_dir("mixtral")), dtype="bfloat16")
    assert llm.engine.runner.cpu_step is None
    assert "mixture-of-experts layers in bfloat16" in caplog.text


# -- GGUF files from llama.cpp's own converter and quantizer -------------------------------------

# At K-quant sizes (every row a multiple of 256), SmolLM2's vocabulary (which the converter knows).
CONVERTED = {
    "qwen3moe": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, head_dim=64,
                                   moe_intermediate_size=256, norm_topk_prob=True)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=256)),
}  # fmt: skip
EXPERT_FIELDS = ("experts_gate", "experts_up", "experts_down")
GGUF_EXPERTS = {"experts_gate": "ffn_gate_exps", "experts_up": "ffn_up_exps",
                "experts_down": "ffn_down_exps"}  # fmt: skip


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """`converted(name)`: (the Hugging Face checkpoint, llama.cpp's F32 GGUF of it), once."""
    if converter() is None:  # nothing is downloaded at test time
        pytest.skip("llama.cpp's converter is not fetched")
    vocab = smollm2_vocabulary()
    files = {}

    def make(name):
        if name not in files:
            family, extra = CONVERTED[name]
            model_dir = tmp_path_factory.mktemp(name)
            write_family_checkpoint(model_dir, family, vocab_size=vocab.vocab_size,
                                    hidden_size=256, tie_word_embeddings=True, **extra)  # fmt: skip
            write_vocabulary(model_dir, vocab)
            files[name] = model_dir, convert(model_dir, model_dir / "f32.gguf")
        return files[name]

    return make


GGUF_PROMPTS = [list(range(100 + 9 * i, 140 + 9 * i)) for i in range(3)]


def _greedy(path, **engine_args):
    llm = LLM(str(path), dtype="float32", **engine_args)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in GGUF_PROMPTS], params, use_tqdm=False)
    return llm, [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("name", CONVERTED)
def test_a_gguf_written_by_llama_cpp_equals_transformers(converted, name):
    """The converter's F32 file (qwen3moe; llama with expert_count, its Q/K rows interleaved):
    greedy ids equal transformers' on the checkpoint it was written from."""
    from nanoserve.model.gguf_file import GGUFCheckpoint

    model_dir, path = converted(name)
    config = GGUFCheckpoint(path).config
    assert (config.family, config.num_experts) == (
        "qwen3moe" if name == "qwen3moe" else "llama",
        8 if name == "qwen3moe" else 4,
    )
    _, ours = _greedy(path)
    assert ours == [r[:16] for r in _reference(model_dir, GGUF_PROMPTS)]


def test_a_gguf_at_two_ranks_equals_transformers(converted):
    """llama.cpp's F32 Qwen3-MoE file split two ways: each rank reads its half of the stacked
    experts tensors."""
    model_dir, path = converted("qwen3moe")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with LLM(str(path), tensor_parallel_size=2) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in GGUF_PROMPTS], params, use_tqdm=False)
    ours = [list(o.outputs[0].token_ids) for o in outs]
    assert ours == [r[:16] for r in _reference(model_dir, GGUF_PROMPTS)]


def test_a_gguf_choosing_more_experts_than_it_has_is_refused_by_name(converted, tmp_path):
    """expert_used_count above expert_count: refused as the file is read, naming the key (not
    the first step's failure in the router's top-k)."""
    import struct

    from nanoserve.model.gguf_file import GGUFError

    data = bytearray(converted("qwen3moe")[1].read_bytes())
    key = b"qwen3moe.expert_used_count"
    at = data.index(key) + len(key) + 4  # after the key, its uint32 value's type
    struct.pack_into("<I", data, at, 9)  # of 8 experts
    path = tmp_path / "nine.gguf"
    path.write_bytes(data)
    with pytest.raises(GGUFError, match=r"qwen3moe.expert_used_count = 9 must be .* \(8\)"):
        LLM(str(path))


def test_a_mixtral_gguf_in_bfloat16_routes_as_its_checkpoint(converted):
    """In bfloat16, llama.cpp's Mixtral file (architecture llama) keeps its routing weights in
    float32 as the Hugging Face Mixtral does: the same prompt logprobs, bit for bit (not Qwen3-MoE's
    weights rounded to bfloat16)."""
    model_dir, path = converted("mixtral")
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, ignore_eos=True)
    logprobs = []
    for source in (model_dir, path):
        llm = LLM(str(source), dtype="bfloat16")
        outs = llm.generate([{"prompt_token_ids": p} for p in GGUF_PROMPTS], params, use_tqdm=False)
        logprobs.append([[e.logprob for d in o.prompt_logprobs[1:] for e in d.values()]
                         for o in outs])  # fmt: skip
    assert logprobs[0] == logprobs[1]


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K_M"])
@pytest.mark.parametrize("name", CONVERTED)
def test_a_quantized_gguf_keeps_its_experts_in_their_blocks(converted, tmp_path, name, quant):
    """llama.cpp's quantizer on the F32 file: every experts tensor stays one run of blocks in the
    file's format (its bytes, no de-quantized copy), and greedy ids through the blocks equal the
    same file de-quantized to float32."""
    from nanoserve.kernels import QuantizedWeight
    from nanoserve.model.ggml_types import GGMLType
    from nanoserve.model.gguf_file import GGUFCheckpoint
    from nanoserve.testing.llamacpp_convert import quantize, quantizer_available

    if not quantizer_available():
        pytest.skip("llama.cpp's quantizer (llama-cpp-python) is not installed")
    path = quantize(converted(name)[1], tmp_path / f"{quant}.gguf", quant)
    tensors = GGUFCheckpoint(path).tensors
    llm, kept = _greedy(path)
    for i, layer in enumerate(llm.engine.runner.model.weights.layers):
        for field in EXPERT_FIELDS:
            w = getattr(layer, field).weight
            info = tensors[f"blk.{i}.{GGUF_EXPERTS[field]}.weight"]
            assert isinstance(w, QuantizedWeight)
            assert w.qtype == GGMLType(info["type"]).name.lower()
            assert w.data.nbytes == info["bytes"]
    file_bytes = sum(i["bytes"] for i in tensors.values())
    assert _held_bytes(llm) <= 1.1 * file_bytes, (_held_bytes(llm), file_bytes)
    floats = _greedy(path, quantization="none")[1]
    assert kept == floats


@pytest.mark.parametrize("name", CONVERTED)
def test_a_quantized_gguf_decodes_in_the_one_call_step_bit_for_bit(
    converted, tmp_path, monkeypatch, name
):
    """Q4_K_M experts (gate and up one C call, down another format) in the C step: the
    layer-by-layer path's ids and logprobs, bit for bit, for 6 sequences (the float32 router
    beside blocks takes the C step's rows through the GEMV 4 at a time, as the layer path
    multiplies it)."""
    from test_cpu_step import check_six_rows_bit_for_bit

    from nanoserve.testing.llamacpp_convert import quantize, quantizer_available

    if not quantizer_available():
        pytest.skip("llama.cpp's quantizer (llama-cpp-python) is not installed")
    check_six_rows_bit_for_bit(
        quantize(converted(name)[1], tmp_path / "q4_k_m.gguf", "Q4_K_M"), monkeypatch
    )


def test_a_float_gguf_quantized_at_load_quantizes_its_experts(converted):
    """quantization="q8_0" on llama.cpp's F32 file: its stacked experts tensors are quantized
    too (one run of q8_0 blocks each, not float32 beside q8_0 attention), to the blocks the
    Hugging Face checkpoint's experts quantize to: the same greedy ids."""
    from nanoserve.kernels import QuantizedWeight

    model_dir, path = converted("qwen3moe")
    llm, ours = _greedy(path, quantization="q8_0")
    for layer in llm.engine.runner.model.weights.layers:
        for field in EXPERT_FIELDS:
            w = getattr(layer, field).weight
            assert isinstance(w, QuantizedWeight) and w.qtype == "q8_0", (field, type(w))
    assert ours == _greedy(model_dir, quantization="q8_0")[1]


def _held_bytes(llm) -> int:
    """Bytes of every weight the model holds (blocks, floats, oneDNN's packed copies), each
    storage once."""
    import torch

    from nanoserve.kernels import QuantizedWeight

    w = llm.engine.runner.model.weights
    held = [w.embed, w.lm_head, w.norm, *(v for x in w.layers for v in vars(x).values())]
    seen: dict[int, int] = {}
    for m in held:
        for t in (getattr(m, "weight", m), getattr(m, "packed", None)):
            t = t.data if isinstance(t, QuantizedWeight) else t
            if isinstance(t, torch.Tensor):  # oneDNN's packed copies have no data_ptr()
                key = t.data_ptr() if t.layout == torch.strided else id(t)
                seen[key] = t.numel() * t.element_size()
    return sum(seen.values())


def test_a_file_too_large_for_memory_is_refused_before_loading(converted, tmp_path, monkeypatch):
    """With less memory free than its weights take (the probe patched), a Q8_0 MoE file is
    refused by name, with the bytes it needs (every tensor's in the file: the experts' blocks
    included, the F32 norms and routers as they are) and the bytes free, before any loads."""
    import gguf

    from nanoserve.engine import ModelTooLarge, memory, model_runner
    from nanoserve.testing.llamacpp_convert import quantize, quantizer_available

    if not quantizer_available():
        pytest.skip("llama.cpp's quantizer (llama-cpp-python) is not installed")
    path = quantize(converted("qwen3moe")[1], tmp_path / "big.gguf", "Q8_0")
    needed = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    monkeypatch.delenv("NANOSERVE_MEMORY_LIMIT_BYTES", raising=False)
    monkeypatch.setattr(memory, "meminfo_available", lambda path=None: needed - 1)
    monkeypatch.setattr(memory, "cgroup_dirs", lambda *args: [])

    def not_loaded(*args, **kwargs):
        raise AssertionError("the weights were being loaded")

    monkeypatch.setattr(model_runner, "load_model", not_loaded)
    with pytest.raises(ModelTooLarge, match=f"big.gguf: its weights need {needed} bytes .* but "
                       f"{needed - 1} bytes .* may be taken \\(MemAvailable\\)"):  # fmt: skip
        LLM(str(path))
    monkeypatch.setattr(memory, "meminfo_available", lambda path=None: needed)
    with pytest.raises(AssertionError, match="being loaded"):  # it fits: the load goes on
        LLM(str(path))


def test_quantized_at_load_keeps_experts_in_blocks(moe_dir):
    """--quantization on a float MoE checkpoint quantizes each expert's matrix and stacks their
    blocks: the experts are multiplied in blocks, and the greedy ids are close to the floats'."""
    from nanoserve.kernels import QuantizedWeight

    model_dir, prompts = moe_dir("qwen3_moe"), _prompts(500)[:3]
    llm = LLM(str(model_dir), quantization="q8_0")
    layer = llm.engine.runner.model.weights.layers[0]
    assert all(isinstance(getattr(layer, f).weight, QuantizedWeight) for f in EXPERT_FIELDS)
    assert layer.experts_gate.weight.shape == (8 * 32, 64)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    floats, _ = _ours(model_dir, prompts)
    assert [list(o.outputs[0].token_ids) for o in outs] == [f[:4] for f in floats]


def test_ngram_speculation_gives_the_same_ids(moe_dir):
    """MoE only replaces the MLP: n-gram drafts verified through the experts (each expert's few
    rows through the C GEMV, row-invariant) give the ids plain decoding gives, and some are
    accepted (repetitive prompts)."""
    model_dir = moe_dir("mixtral")
    prompts = [list(range(10, 20)) * 4, list(range(300, 306)) * 6]
    plain, _ = _ours(model_dir, prompts)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    llm = LLM(str(model_dir), speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == plain
    drafts = llm.engine.stats().spec_decode
    assert drafts.num_drafts > 0 and drafts.num_accepted_tokens > 0
    llm.engine.audit()


def test_the_c_step_refuses_experts_without_their_sizes(moe_dir):
    """A table of MoE layers run without the experts' sizes (or a dense MLP missing) is a
    ValueError naming the layer, not a read of absent weights."""
    from nanoserve.kernels import c_backend

    llm = LLM(str(moe_dir("mixtral")), dtype="float32")
    runner = llm.engine.runner
    model, k = runner.model, runner.kv_caches[0][0]
    c = model.config
    args = dict(num_blocks=k.shape[0], block_size=k.shape[2], heads=c.num_heads,
                kv_heads=c.num_kv_heads, intermediate=c.intermediate_size, eps=1e-5,
                scale=model.scale)  # fmt: skip
    table = runner.cpu_step.layer_table(runner.kv_caches, torch.float32)
    h = torch.zeros(1, c.hidden_size)
    one = (torch.tensor([0]), torch.tensor([0]), model.cos, model.sin,
           torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32))  # fmt: skip
    with pytest.raises(ValueError, match=r"layers\[0\] has experts, but the step has no expert"):
        c_backend.decode_layers(h, table, *one, **args)
    sizes = (c.num_experts, c.experts_per_token, c.expert_size, c.norm_topk_prob)
    c_backend.decode_layers(h, table, *one, **args, moe=sizes)  # the same call, with them
    dense = [{**w, "router": (0, 0)} for w in runner.cpu_step.weights]
    layers = [{**w, "k_cache": (kv.data_ptr(), 0), "v_cache": (vv.data_ptr(), 0)}
              for w, (kv, vv) in zip(dense, runner.kv_caches, strict=True)]  # fmt: skip
    with pytest.raises(ValueError, match=r"layers\[0\] needs gate_up and down, or a router"):
        c_backend.decode_layers(h, c_backend.layer_table(layers), *one, **args, moe=sizes)
