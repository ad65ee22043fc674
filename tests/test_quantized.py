"""Weights kept in GGUF blocks: a GGUF's Q8_0/Q4_0/Q4_1 matrices stay as they are (and in about
the file's bytes), a float checkpoint quantized at load equals the same blocks read from a GGUF,
a request's tokens do not depend on its batch, and on SmolLM2 the blocks agree with the
de-quantized float32 model over thousands of positions of real text."""

from pathlib import Path

import gguf
import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.config import QUANTIZATIONS, EngineConfig, SettingError
from nanoserve.default_model import default_model_path
from nanoserve.kernels import QUANT_TYPES, QuantizedWeight
from nanoserve.model import resolve_dtype
from nanoserve.model.checkpoint import open_checkpoint
from nanoserve.model.gguf_file import GGUFCheckpoint
from nanoserve.model.quantized import QuantLinear
from nanoserve.model.weights import LAYER, matrices
from nanoserve.testing.gguf_writer import write_gguf

SMOLLM = default_model_path()
REPO = Path(__file__).resolve().parents[1]
PROMPTS = [{"prompt_token_ids": list(range(7 + 3 * i, 40 + 11 * i))} for i in range(5)]


def _weights(llm: LLM) -> list:
    w = llm.engine.runner.model.weights
    return [*(m for x in w.layers for m in matrices(x)), w.lm_head]


def _held_bytes(llm: LLM) -> int:
    """Bytes of every weight the model holds (blocks, floats, oneDNN's packed copies)."""
    w = llm.engine.runner.model.weights
    seen: dict[int, int] = {}
    norms = [getattr(y, name) for y in w.layers for name, t in LAYER if t.kind == "norm"]
    for m in [*_weights(llm), *norms]:
        for t in (getattr(m, "weight", m), getattr(m, "packed", None)):
            t = t.data if isinstance(t, QuantizedWeight) else t
            if isinstance(t, torch.Tensor):  # oneDNN's packed copies have no data_ptr()
                key = t.data_ptr() if t.layout == torch.strided else id(t)
                seen[key] = t.numel() * t.element_size()
    return sum(seen.values()) + w.norm.nbytes


def test_a_ggufs_matrices_stay_in_their_blocks_in_about_the_files_bytes():
    llm = LLM(str(SMOLLM))
    formats = {m.weight.qtype for m in _weights(llm)}
    assert all(isinstance(m, QuantLinear) for m in _weights(llm)) and formats == {"q4_1", "q8_0"}
    assert llm.engine.runner.cpu_step is not None  # the one-call step takes blocks
    file_bytes = sum(i["bytes"] for i in GGUFCheckpoint(SMOLLM).tensors.values())
    assert _held_bytes(llm) <= 1.25 * file_bytes, (_held_bytes(llm), file_bytes)
    none = LLM(str(SMOLLM), quantization="none")
    assert not any(isinstance(m, QuantLinear) for m in _weights(none))


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q5_0", "f16", "bf16"])
def test_quantized_at_load_equals_the_same_blocks_from_a_gguf(tiny_model_factory, tmp_path, qtype):
    """--quantization on a float checkpoint makes gguf's own bytes: the same tokens and logprobs
    as that checkpoint converted to a quantized GGUF by llama.cpp's Python quantizer. (Plain
    RoPE: llama3 scaling would reach the GGUF as a rope_freqs tensor, rounded differently.)"""
    model_dir = tiny_model_factory(tie_word_embeddings=False, rope_scaling=None)
    path = write_gguf(model_dir, tmp_path / "t.gguf", gguf.GGMLQuantizationType[qtype.upper()])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)

    def run(**kw):
        outs = LLM(**kw).generate(PROMPTS, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    assert run(model=str(model_dir), quantization=qtype) == run(model=str(path))


@pytest.mark.parametrize("qtype", ["q4_0", "bf16"])
def test_a_requests_tokens_do_not_depend_on_its_batch(tiny_model_factory, qtype):
    """Bitwise, for batches the one-call decode step takes (up to 4 sequences): the block
    matmuls quantize each row's activations on their own (16-bit floats take them as they are)
    and sum in a fixed order."""
    model_dir = tiny_model_factory(tie_word_embeddings=False)
    # No prefix cache: the later runs would read the first one's blocks, another computation.
    llm = LLM(str(model_dir), quantization=qtype, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    together = llm.generate(PROMPTS[:4], params, use_tqdm=False)
    alone = [llm.generate([p], params, use_tqdm=False)[0] for p in PROMPTS[:4]]
    for a, b in zip(together, alone, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def _real_text_ids(tokenizer, count: int) -> list[int]:
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text() + (REPO / "README.md").read_text()
    ids = tokenizer.encode(text)
    assert len(ids) > count
    return ids[:count]


def _agreement(path, capsys, label: str, kv: str = "float32") -> tuple[float, float]:
    """Teacher-forced over 2,000 positions of this repository's own prose: how often the most
    likely next token with the file's blocks (and a KV cache of `kv`) is the de-quantized float32
    model's (float32 cache), and the largest difference of the actual token's logprob."""
    blocks = LLM(str(path), kv_cache_dtype=kv)
    floats = LLM(str(path), quantization="none", kv_cache_dtype="float32")
    ids = _real_text_ids(blocks.engine.tokenizer, 2001)
    params = SamplingParams(prompt_logprobs=1, max_tokens=0)
    a, b = (
        m.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0] for m in (blocks, floats)
    )
    tops = [[min(e, key=lambda t: e[t].rank) for e in out.prompt_logprobs[1:]] for out in (a, b)]
    agree = sum(x == y for x, y in zip(*tops, strict=True)) / len(tops[0])
    diff = max(
        abs(a.prompt_logprobs[i][ids[i]].logprob - b.prompt_logprobs[i][ids[i]].logprob)
        for i in range(1, len(ids))
    )
    with capsys.disabled():
        print(f"\n[{label}] top-1 agreement {agree:.4f} over {len(ids) - 1} positions; "
              f"largest logprob difference {diff:.4f}")  # fmt: skip
    return agree, diff


def test_smollm2_blocks_agree_with_the_dequantized_model_on_real_text(capsys):
    """The default model's Q4_1 blocks against its de-quantized float32 self."""
    agree, diff = _agreement(SMOLLM, capsys, "q4_1")
    assert agree >= AGREEMENT and diff < LOGPROB_DIFF


def test_smollm2_blocks_with_their_default_float16_cache_agree_too(capsys):
    """What the server runs by default: the Q4_1 blocks over a float16 KV cache (llama.cpp's)."""
    agree, diff = _agreement(SMOLLM, capsys, "q4_1, float16 KV", kv="auto")
    assert agree >= AGREEMENT and diff < LOGPROB_DIFF_KV16


def test_smollm2_blocks_with_a_q8_0_cache_agree_too(capsys):
    """The Q4_1 blocks over a q8_0 KV cache (llama.cpp's -ctk q8_0 -ctv q8_0)."""
    agree, diff = _agreement(SMOLLM, capsys, "q4_1, q8_0 KV", kv="q8_0")
    assert agree >= AGREEMENT_KV8 and diff < LOGPROB_DIFF_KV8


def test_smollm2_q4_k_m_by_llama_cpp_agrees_with_the_dequantized_model(capsys, tmp_path):
    """SmolLM2 as llama.cpp's converter (F16) and quantizer (Q4_K_M) make it: Q5_0, Q8_0, Q4_K
    and Q6_K matrices (its 576-wide rows are mostly no multiple of 256), each kept in its blocks."""
    from nanoserve.testing.hf_families import smollm2_checkpoint
    from nanoserve.testing.llamacpp_convert import (
        convert,
        converter,
        quantize,
        quantizer_available,
    )

    if converter() is None or not quantizer_available():
        pytest.skip("llama.cpp's converter is not fetched or its quantizer is not installed")
    f16 = convert(smollm2_checkpoint(tmp_path / "hf"), tmp_path / "f16.gguf", "f16")
    path = quantize(f16, tmp_path / "q4_k_m.gguf", "Q4_K_M")
    assert GGUFCheckpoint(path).block_formats() == ["q4_k", "q5_0", "q6_k", "q8_0"]
    agree, diff = _agreement(path, capsys, "Q4_K_M")
    assert agree >= AGREEMENT and diff < LOGPROB_DIFF


# Measured with int16 activations: 0.9995 and 0.0029 (AVX-512 VNNI, lanes along N; 1.0000 and 0.0019
# with the earlier lanes along K); int8 activations, llama.cpp's: 0.9595 and 0.40, which flips
# "What is the capital of France?" to "L'Étoile, ...".
AGREEMENT, LOGPROB_DIFF = 0.995, 0.01
# With the float16 cache: 1.0000 and 0.0370 (Q4_1), 0.9995 and 0.0240 (Q4_K_M): a float16 key
# differs from float32 by up to 2^-11 of itself, and SmolLM2's largest keys are large.
LOGPROB_DIFF_KV16 = 0.06
# With the q8_0 cache (Q4_1, AVX-512 VNNI): 0.9870 and 0.4298, against the float16 cache's 1.0000
# and 0.0289 and the float32 cache's 1.0000 and 0.0026 in the same run: a block's step is 1/127
# of its largest value, and SmolLM2's keys have a few large channels beside many small ones.
AGREEMENT_KV8, LOGPROB_DIFF_KV8 = 0.98, 0.6


def test_dtype_auto_picks_the_fastest_correct_dtype(tiny_model_dir, monkeypatch):
    import nanoserve.model.load as runner

    auto = EngineConfig(dtype="auto")
    hf, ggufd = open_checkpoint(tiny_model_dir), open_checkpoint(SMOLLM)
    for native, expected in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(runner, "onednn_packs", lambda dtype, n=native: n)
        assert resolve_dtype(auto, hf).dtype == expected
        assert resolve_dtype(auto, ggufd).dtype == "float32"  # blocks take float32 activations
    assert resolve_dtype(EngineConfig(dtype="bfloat16"), ggufd).dtype == "bfloat16"


def test_quantization_needs_float32_on_a_cpu(tiny_model_dir):
    with pytest.raises(ValueError, match="quantization='q8_0' needs dtype float32"):
        LLM(str(tiny_model_dir), quantization="q8_0", dtype="bfloat16")
    with pytest.raises(ValueError, match="quantization must be one of auto, none, q8_0"):
        EngineConfig(quantization="q2_k")


def test_a_quantized_gguf_is_not_quantized_again():
    """Its blocks stay as the file has them: another format is refused by name, not crashed on."""
    with pytest.raises(SettingError, match=r"^quantization must be auto or none for a file whose"):
        LLM(str(SMOLLM), quantization="q8_0")


def test_the_settings_offer_the_kernels_formats():
    """config.py, which imports no torch, lists the C kernels' formats itself: the same ones."""
    assert ("auto", "none", *QUANT_TYPES) == QUANTIZATIONS
