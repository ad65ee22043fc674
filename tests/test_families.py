"""The families as options of one decoder: random Llama (with attention and MLP biases), Qwen2
(tied and untied) and Qwen3 (q/k norms, head_dim apart from hidden / heads) checkpoints written by
transformers give its greedy ids (with prefix caching, preemption and chunked prefill, batch 1 in
the one-call C step, at two ranks) and its prompt logprobs; linear and YaRN RoPE scaling do
too, and GGUF files of each family (architectures llama, qwen2, qwen3 and gemma3 as llama.cpp's
own converter writes them, the qwen2 pre-tokenizer).
Every config key, tensor, dtype and shape nanoserve does not implement is a one-line refusal
naming it, from LLM(...) and from `nanoserve generate` (exit status 2)."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_oracle import MAX_TOKENS, _ours, _prompts

from nanoserve import LLM, SamplingParams, kernels
from nanoserve.demo import CORPUS
from nanoserve.model.config import CheckpointError
from nanoserve.model.gguf_file import GGUFCheckpoint
from nanoserve.testing.gguf_writer import write_gguf
from nanoserve.testing.hf_families import write_family_checkpoint

FAMILIES = {
    "llama-biases": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "mistral": ("mistral", dict(sliding_window=None)),  # Mistral 7B v0.3's
    "qwen2": ("qwen2", {}),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(head_dim=32)),
    "qwen3-biases": ("qwen3", dict(head_dim=32, attention_bias=True)),
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
ROPES = {
    "llama-linear": ("llama", {"rope_type": "linear", "factor": 4.0}),
    "llama-yarn": ("llama", YARN),
    "qwen2-yarn-mscale": ("qwen2", {**YARN, "mscale": 2.0, "mscale_all_dim": 1.0}),
    "qwen3-yarn-untruncated": ("qwen3", {**YARN, "beta_fast": 16, "truncate": False}),
}
POOL = dict(block_size=8, num_kv_blocks=16, max_num_batched_tokens=32)  # preempts and chunks


@torch.inference_mode()
def _reference(model_dir, prompts, dtype=torch.float32):
    """transformers' greedy ids, EOS a token like any other (as ignore_eos has it: test_oracle's
    min_new_tokens would forbid EOS and take the runner-up)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=MAX_TOKENS, pad_token_id=0)  # fmt: skip
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    """`family_dir(name)`: the checkpoint of FAMILIES[name] (or ROPES[name]), written once."""
    cache = {}

    def make(name):
        if name not in cache:
            path = tmp_path_factory.mktemp(name)
            if name in ROPES:
                family, rope = ROPES[name]
                extra = dict(head_dim=32) if family == "qwen3" else {}
                rope = {**rope, "rope_theta": 10000.0}
                cache[name] = write_family_checkpoint(path, family, rope_parameters=rope, **extra)
            else:
                family, config = FAMILIES[name]
                cache[name] = write_family_checkpoint(path, family, **config)
        return cache[name]

    return make


@pytest.mark.parametrize("engine_args", [{}, POOL], ids=["default", "preempt-chunk"])
@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_equals_transformers(family_dir, name, engine_args):
    model_dir, prompts = family_dir(name), _prompts(500)
    ours, stats = _ours(model_dir, prompts, **engine_args)
    if engine_args:
        assert stats.num_preemptions > 0, "the pool was meant to be small enough to preempt"
    assert ours == _reference(model_dir, prompts)


WINDOWS = {  # name: (family, config, each layer's window)
    "mistral-v0.1": ("mistral", dict(sliding_window=8), (8, 8)),
    "qwen2-use-sliding-window": (
        "qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), (0, 8),
    ),
    "qwen3-layer-types": (
        "qwen3", dict(head_dim=32, sliding_window=8, use_sliding_window=True,
                      layer_types=["sliding_attention", "full_attention"]), (8, 0),
    ),
}  # fmt: skip


@pytest.mark.parametrize("engine_args", [{}, POOL], ids=["default", "preempt-chunk"])
@pytest.mark.parametrize("name", WINDOWS)
def test_sliding_windows_are_computed_as_transformers_computes_them(tmp_path, name, engine_args):
    """Mistral 7B v0.1's window, Qwen2's use_sliding_window from max_window_layers on and
    sliding_attention layers attend to the last `sliding_window` positions (Gemma 3's kernels):
    prompts and outputs far past the window give transformers' ids, in the one-call C step for
    batch 1 too; the context is not capped."""
    family, config, windows = WINDOWS[name]
    model_dir = write_family_checkpoint(tmp_path / name, family, **config)
    llm = LLM(str(model_dir), **engine_args)
    assert llm.engine.runner.model.config.layer_windows == windows
    assert llm.engine.max_model_len > 64
    prompts = _prompts(500)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ours = [list(o.outputs[0].token_ids) for o in outs]
    assert ours == _reference(model_dir, prompts)
    llm.engine.audit()
    if llm.engine.runner.cpu_step is not None:
        one = llm.generate([{"prompt_token_ids": prompts[4]}], params, use_tqdm=False)
        assert list(one[0].outputs[0].token_ids) == ours[4]
    if not engine_args:  # the same weights without the window answer otherwise
        unwindowed = _edited_copy(model_dir, tmp_path)
        _edit_config(unwindowed, sliding_window=None)
        assert _ours(unwindowed, prompts)[0] != ours


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_one_decodes_in_the_one_call_c_step(family_dir, name, dtype):
    """Biases and q/k norms are fields of the C step: every family decodes in one call per step,
    the same ids as layer by layer (float32: as transformers)."""
    from nanoserve.kernels import c_backend

    if not c_backend.enabled():
        pytest.skip("no C kernels here")
    model_dir, prompts = family_dir(name), _prompts(500)[:2]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm = LLM(str(model_dir), dtype=dtype)
    assert llm.engine.runner.cpu_step is not None
    ours = [list(llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
                 .outputs[0].token_ids) for p in prompts]  # fmt: skip
    llm.engine.runner.cpu_step = None  # the layer-by-layer path
    layered = [list(llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
                    .outputs[0].token_ids) for p in prompts]  # fmt: skip
    assert ours == layered
    if dtype == "float32":
        assert ours == _reference(model_dir, prompts)


def test_plain_llama_keeps_the_one_call_c_step(tiny_model_dir):
    from nanoserve.kernels import c_backend

    if not c_backend.enabled():
        pytest.skip("no C kernels here")
    assert LLM(str(tiny_model_dir)).engine.runner.cpu_step is not None


@pytest.mark.parametrize("name", ["qwen2", "qwen3-biases"])
def test_bfloat16_close_to_transformers(family_dir, name):
    model_dir, prompts = family_dir(name), _prompts(500)[:3]
    ours, _ = _ours(model_dir, prompts, dtype="bfloat16")
    ref = _reference(model_dir, prompts, dtype=torch.bfloat16)
    assert [o[:4] for o in ours] == [r[:4] for r in ref]


@pytest.mark.parametrize("name", FAMILIES)
def test_prompt_logprobs_equal_transformers(family_dir, name):
    check_prompt_logprobs(family_dir(name))


def check_prompt_logprobs(model_dir):
    """Prompt logprobs of a 70-token prompt (in chunks of 32) within 1e-4 of transformers'."""
    import transformers

    prompt = list(range(5, 75))
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        reference = torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), dim=-1)
    params = SamplingParams(prompt_logprobs=3, max_tokens=1, temperature=0)
    out = LLM(str(model_dir), max_num_batched_tokens=32).generate(
        [{"prompt_token_ids": prompt}], params, use_tqdm=False
    )[0]
    for i in range(1, len(prompt)):
        for token, lp in out.prompt_logprobs[i].items():
            assert lp.logprob == pytest.approx(float(reference[i - 1, token]), abs=1e-4)


@pytest.mark.parametrize("name", ["qwen2", "qwen3-biases"])
def test_two_ranks_equal_transformers(family_dir, name):
    model_dir, prompts = family_dir(name), _prompts(500)
    with LLM(str(model_dir), tensor_parallel_size=2, **POOL) as llm:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.engine.stats().num_preemptions > 0
    assert [list(o.outputs[0].token_ids) for o in outs] == _reference(model_dir, prompts)


@pytest.mark.parametrize("name", ROPES)
def test_rope_scaling_equals_transformers(family_dir, name):
    model_dir, prompts = family_dir(name), _prompts(500)
    ours, _ = _ours(model_dir, prompts)
    assert ours == _reference(model_dir, prompts)


def test_yarn_in_the_published_qwen2_5_layout(family_dir, tmp_path):
    """Qwen2.5's config.json: `rope_theta` and `rope_scaling` with "type": "yarn"."""
    model_dir = _edited_copy(family_dir("qwen2"), tmp_path)
    _edit_config(model_dir, rope_theta=10000.0, rope_parameters=None,
                 rope_scaling={"factor": 4.0, "original_max_position_embeddings": 64,
                               "type": "yarn"})  # fmt: skip
    prompts = _prompts(500)
    ours, _ = _ours(model_dir, prompts)
    assert ours == _reference(model_dir, prompts)
    assert ours != _ours(family_dir("qwen2"), prompts)[0], "the scaling changed nothing"


def test_model_type_llama_without_architectures_loads(tiny_model_dir, tmp_path):
    model_dir = _edited_copy(tiny_model_dir, tmp_path)
    _edit_config(model_dir, architectures=None)
    prompts = _prompts(500)[:2]
    assert _ours(model_dir, prompts)[0] == _reference(model_dir, prompts)


@pytest.mark.parametrize("name", ["llama-biases", "qwen2", "qwen2-tied", "qwen3-biases"])
def test_a_gguf_of_each_family_equals_transformers(family_dir, tmp_path, name):
    """llama.cpp's layout: a llama's Q and K rows (and biases) interleaved, qwen2's and qwen3's
    as they are; biases and q/k norms under their GGUF names."""
    model_dir, prompts = family_dir(name), _prompts(500)
    family = FAMILIES[name][0]
    path = write_gguf(model_dir, tmp_path / "m.gguf", architecture=family)
    assert GGUFCheckpoint(path).config.family == family
    assert _ours(path, prompts)[0] == _reference(model_dir, prompts)


def test_a_qwen2_gguf_reads_as_transformers_reads_it(family_dir, tmp_path):
    """transformers' own GGUF reader (an independent one) on the same file: the same tensors,
    and the same ids from the qwen2 pre-tokenizer (digits one by one)."""
    import transformers

    path = write_gguf(family_dir("qwen2"), tmp_path / "m.gguf", architecture="qwen2", pre="qwen2")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    )
    expected, checkpoint = hf.state_dict(), GGUFCheckpoint(path)
    ours = checkpoint.read_tensors(torch.float32, "cpu")
    assert sorted(ours) == sorted(expected)
    assert all(torch.equal(t, expected[name]) for name, t in ours.items())
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    tokenizer = checkpoint.tokenizer()
    for text in [*CORPUS.splitlines(), "12345 apples on 2026-12-02, it's 3.14!"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == hf_tokenizer.encode(text, add_special_tokens=False), text


# -- refusals: one line naming the key or the tensor -------------------------------------------


def _edited_copy(model_dir, tmp_path):
    import shutil

    copy = tmp_path / "edited"
    shutil.copytree(model_dir, copy)
    return copy


def _edit_config(model_dir, **changes):
    file = model_dir / "config.json"
    config = json.loads(file.read_text())
    config.update(changes)
    file.write_text(json.dumps({k: v for k, v in config.items() if v is not None}))


def _edit_tensors(model_dir, edit):
    file = model_dir / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


Q = "model.layers.0.self_attn.q_proj"


def _fp8(t):
    t[Q + ".weight"] = t[Q + ".weight"].to(torch.float8_e4m3fn)
    t[Q + ".weight_scale"] = torch.ones(1)


def _awq(t):
    w = t.pop(Q + ".weight")
    t[Q + ".qweight"] = torch.zeros(w.shape[1], w.shape[0] // 8, dtype=torch.int32)
    t[Q + ".scales"] = torch.ones(1, w.shape[0])


def _bnb_4bit(t):
    w = t.pop(Q + ".weight")
    t[Q + ".weight"] = torch.zeros(w.numel() // 2, 1, dtype=torch.uint8)
    t[Q + ".weight.absmax"] = torch.ones(w.numel() // 64)


REFUSED = {
    # name: (family checkpoint, config changes, tensor edit, words of the one line)
    "gelu": ("qwen2", dict(hidden_act="gelu_pytorch_tanh"), None, ["hidden_act"]),
    "awq-config": (
        "qwen2", dict(quantization_config={"quant_method": "awq", "bits": 4}), None,
        ["quantization_config (awq)"],
    ),
    "fp8": ("qwen2", {}, _fp8, [Q + ".weight is F8_E4M3"]),
    "awq-tensors": ("qwen2", {}, _awq, [Q + ".qweight is not part of a qwen2 model"]),
    "bnb-4bit": ("qwen2", {}, _bnb_4bit, [Q + ".weight is U8"]),
    "scale-tensor": (
        "qwen3", {}, lambda t: t.update({Q + ".weight_scale": torch.ones(1)}),
        [Q + ".weight_scale is not part"],
    ),
    "bias-not-in-config": (
        "llama-biases", dict(attention_bias=False), None, ["_proj.bias is not part of a llama"],
    ),
    "missing": ("qwen2", {}, lambda t: t.pop("model.norm.weight"), ["no tensor model.norm"]),
    "shape": (
        "qwen3", dict(intermediate_size=96), None,
        ["down_proj.weight has shape [64, 128], but the config makes it [64, 96]"],
    ),
    "untied-without-head": (
        "qwen2-tied", dict(tie_word_embeddings=False), None,
        ["lm_head.weight and tie_word_embeddings is false"],
    ),
    "rope-dynamic": (
        "qwen2", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                       "rope_theta": 10000.0}), None,
        ["rope_type 'dynamic' is not implemented"],
    ),
    "partial-rotary": (
        "qwen2", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                       "partial_rotary_factor": 0.5}), None,
        ["partial_rotary_factor"],
    ),
    "phi3": (
        "qwen2", dict(architectures=["Phi3ForCausalLM"]), None, ["'Phi3ForCausalLM'"],
    ),
}  # fmt: skip


def _refused_copy(family_dir, tmp_path, name):
    family, changes, edit, words = REFUSED[name]
    model_dir = _edited_copy(family_dir(family), tmp_path)
    if changes:
        _edit_config(model_dir, **changes)
    if edit:
        _edit_tensors(model_dir, edit)
    return model_dir, words


@pytest.mark.parametrize("name", REFUSED)
def test_what_is_not_implemented_is_refused_by_name(family_dir, tmp_path, name):
    model_dir, words = _refused_copy(family_dir, tmp_path, name)
    with pytest.raises(CheckpointError) as e:
        LLM(str(model_dir))
    message = str(e.value)
    assert "\n" not in message and str(model_dir) in message
    assert all(w in message for w in words), message


@pytest.mark.parametrize("name", ["gelu", "fp8", "awq-tensors", "bnb-4bit", "shape"])
def test_generate_refuses_in_one_line(family_dir, tmp_path, name):
    model_dir, words = _refused_copy(family_dir, tmp_path, name)
    result = subprocess.run(
        [sys.executable, "-m", "nanoserve.cli", "generate", str(model_dir), "--prompt", "x"],
        capture_output=True, text=True, timeout=120,
        env={"NANOSERVE_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nanoserve: "), result.stderr
    assert all(w in lines[0] for w in words), lines[0]
    assert result.stdout == ""


@pytest.mark.parametrize(
    "key,value",
    [
        ("expert_count", 4),
        ("attention.clamp_kqv", 8.0),
        ("attention.sliding_window", 16),
        ("attention.logit_softcapping", 50.0),
        ("attention.scale", 0.5),
    ],  # fmt: skip
)
def test_gguf_metadata_not_implemented_is_refused_by_name(
    family_dir, tmp_path, monkeypatch, key, value
):
    from nanoserve.testing import gguf_writer

    add = gguf_writer._add_hyperparameters

    def with_key(w, cfg):
        add(w, cfg)
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"qwen2.{key}", value)

    monkeypatch.setattr(gguf_writer, "_add_hyperparameters", with_key)
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path / "cache"))
    path = write_gguf(family_dir("qwen2"), tmp_path / "m.gguf", architecture="qwen2")
    with pytest.raises(ValueError, match=f"m.gguf: qwen2.{key} = {value} is not implemented"):
        LLM(str(path))


@pytest.fixture(scope="module")
def converter():
    from nanoserve.testing import llamacpp_convert

    if llamacpp_convert.converter() is None:  # nothing is downloaded at test time
        pytest.skip(
            "llama.cpp's converter is not fetched: python -m nanoserve.testing.llamacpp_convert"
        )
    return llamacpp_convert.converter()


# Not qwen2: transformers 5 loads a qwen2 checkpoint's tokenizer as its Qwen2Tokenizer whatever
# tokenizer_class says, and the converter does not recognize that one's splitting of SmolLM2's
# vocabulary. Gemma 3 as llama.cpp computes it: q.k scaled by head_dim ** -0.5 and every sixth
# layer global (the converter writes neither query_pre_attn_scalar nor layer_types), its
# sliding layers' own RoPE base; a window of 16, shorter than the long prompt.
GEMMA_ROPES = {
    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
}
CONVERTED = {
    "llama": ("llama", "llama", {}),
    "qwen3": ("qwen3", "qwen3", dict(head_dim=32)),
    "gemma3": ("gemma3_text", "gemma3", dict(
        head_dim=32, query_pre_attn_scalar=32, sliding_window=16, num_hidden_layers=6,
        rope_parameters=GEMMA_ROPES, final_logit_softcapping=8.0,
    )),
}  # fmt: skip


@pytest.mark.parametrize("name", CONVERTED)
def test_a_gguf_written_by_llama_cpp_equals_transformers(converter, tmp_path, name):
    """llama.cpp's own convert_hf_to_gguf.py (its tensor names, its Q/K row order for a llama,
    Gemma's norms stored as 1 + w, its metadata) on a random checkpoint with SmolLM2's tokenizer,
    which the converter knows (pre-tokenizer "smollm"): text tokenized as transformers tokenizes
    it, greedy ids equal."""
    import transformers

    from nanoserve.testing.llamacpp_convert import convert, smollm2_vocabulary, write_vocabulary

    family, arch, extra = CONVERTED[name]
    tokenizer = smollm2_vocabulary()
    model_dir = tmp_path / name
    write_family_checkpoint(model_dir, family, vocab_size=tokenizer.vocab_size, **extra)
    write_vocabulary(model_dir, tokenizer)
    (model_dir / "special_tokens_map.json").unlink(missing_ok=True)
    path = convert(model_dir, tmp_path / "m.gguf")
    assert GGUFCheckpoint(path).config.family == arch
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    llm = LLM(str(path))
    texts = ["The capital of France is", "def fib(n):\n    return 12345", CORPUS[:400]]
    prompts = [llm.engine.tokenizer.encode(t) for t in texts]
    assert prompts == [hf_tokenizer(t)["input_ids"] for t in texts]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == _reference(model_dir, prompts)


@pytest.fixture(scope="module")
def quantizer():
    from nanoserve.testing.llamacpp_convert import quantizer_available

    if not quantizer_available():
        pytest.skip("llama.cpp's quantizer (llama-cpp-python) is not installed")


@pytest.fixture(scope="module")
def converted_f32(converter, tmp_path_factory):
    """Each family's random checkpoint at K-quant sizes (every row a multiple of 256) as
    llama.cpp's converter writes it in F32, once per family."""
    from nanoserve.testing.llamacpp_convert import convert, smollm2_vocabulary, write_vocabulary

    vocab = smollm2_vocabulary()
    files = {}

    def make(name):
        if name not in files:
            family, _, extra = CONVERTED[name]
            model_dir = tmp_path_factory.mktemp(name)
            sizes = dict(hidden_size=256, intermediate_size=512, head_dim=64,
                         query_pre_attn_scalar=64, tie_word_embeddings=True)  # fmt: skip
            if family != "gemma3_text":
                del sizes["query_pre_attn_scalar"]
            write_family_checkpoint(
                model_dir, family, vocab_size=vocab.vocab_size, **{**extra, **sizes}
            )
            write_vocabulary(model_dir, vocab)
            files[name] = convert(model_dir, model_dir / "f32.gguf")
        return files[name]

    return make


# What llama.cpp's quantizer makes of matrices whose rows are whole super-blocks.
QUANT_FORMATS = {"Q4_K_M": {"q4_k", "q6_k"}, "Q5_K_M": {"q5_k", "q6_k"}, "Q6_K": {"q6_k"}}


@pytest.mark.parametrize("quant", QUANT_FORMATS)
@pytest.mark.parametrize("name", CONVERTED)
def test_a_gguf_quantized_by_llama_cpp_keeps_its_blocks(
    converted_f32, quantizer, tmp_path, caplog, name, quant
):
    """llama.cpp's own quantizer on its converter's F32 file: every matrix stays in the format
    llama.cpp chose (none de-quantized), and greedy ids through the blocks (int16 activations,
    the one-call C step) equal the same file de-quantized to float32, which is transformers'
    computation (the test above, for the F32 file; gguf's de-quantizers, test_gguf.py)."""
    import logging

    from nanoserve.testing.llamacpp_convert import quantize

    path = quantize(converted_f32(name), tmp_path / f"{quant}.gguf", quant)
    assert GGUFCheckpoint(path).block_formats() == sorted(QUANT_FORMATS[quant])
    prompts = [list(range(100 + 9 * i, 140 + 9 * i)) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def greedy(**kw):
        llm = LLM(str(path), dtype="float32", **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return llm, [list(o.outputs[0].token_ids) for o in outs]

    with caplog.at_level(logging.INFO):
        llm, kept = greedy()
    assert "; de-quantized to torch.float32: none; repacked: " in caplog.text
    # the K-quants in groups of 16 rows (quant_r16.c), on the AVX-512 path
    assert ("repacked: 0" in caplog.text) == (kernels.cpu_isa() != "avx512")
    assert llm.engine.runner.cpu_step is not None
    assert kept == greedy(quantization="none")[1]


def test_gemma3_gguf_layer_pattern_as_llama_cpp_reads_it(converter, tmp_path):
    """The converter writes the window but not the layer types: every sixth layer is global
    unless attention.sliding_window_pattern (an int, or a flag per layer) says otherwise."""
    from nanoserve.model.gguf_file import GGUFError
    from nanoserve.testing.llamacpp_convert import convert, smollm2_vocabulary

    family, _, extra = CONVERTED["gemma3"]
    vocab = smollm2_vocabulary()
    model_dir = write_family_checkpoint(
        tmp_path / "g", family, vocab_size=vocab.vocab_size, **{**extra, "num_hidden_layers": 7}
    )
    (model_dir / "tokenizer.json").write_text(vocab.backend_json())
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"})
    )
    checkpoint = GGUFCheckpoint(convert(model_dir, tmp_path / "g.gguf"))
    assert checkpoint.config.layer_windows == (16, 16, 16, 16, 16, 0, 16)
    assert checkpoint.config.local_rope.theta == 1e4 and checkpoint.config.rope.theta == 1e6
    assert checkpoint.config.attn_scale == 32**-0.5 and not checkpoint.config.norm_plus_one
    key = "gemma3.attention.sliding_window_pattern"
    checkpoint.meta[key] = 2
    assert checkpoint._model_config().layer_windows == (16, 0, 16, 0, 16, 0, 16)
    checkpoint.meta[key] = [True, False, False, True, True, True, False]
    assert checkpoint._model_config().layer_windows == (16, 0, 0, 16, 16, 16, 0)
    checkpoint.meta[key] = [True, False]
    with pytest.raises(GGUFError, match="sliding_window_pattern has 2 entries for 7 layers"):
        checkpoint._model_config()
