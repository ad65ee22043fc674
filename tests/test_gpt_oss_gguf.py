"""gpt-oss from GGUF (model/gguf_gpt_oss.py, model/gguf_file.py): llama.cpp's converter's F32 file
of a random GptOssForCausalLM (sinks that matter, alternating sliding layers, YaRN, biases) reads
as the checkpoint's config and gives transformers' greedy ids; llama.cpp's quantizer's MXFP4_MOE
file keeps its experts in their MXFP4 blocks and gives the ids of the same file de-quantized; YaRN
keys nanoserve does not run are refused by name."""

import pytest
from safetensors.torch import load_file, save_file
from test_families import _reference
from test_moe import GGUF_EXPERTS, GGUF_PROMPTS, _greedy

from nanoserve.model.config import ModelConfig
from nanoserve.model.gguf_gpt_oss import yarn_rope
from nanoserve.testing.hf_families import write_family_checkpoint
from nanoserve.testing.llamacpp_convert import (
    convert,
    converter,
    smollm2_vocabulary,
    write_vocabulary,
)

pytest.importorskip("transformers")

# Rows of 32-value blocks everywhere (MXFP4's), llama.cpp's SwiGLU limit (7, transformers' default),
# and YaRN truncated as ggml computes it (gpt-oss's own checkpoints say truncate: false).
GPT_OSS = dict(
    hidden_size=64, num_hidden_layers=3, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
    intermediate_size=64, sliding_window=8, tie_word_embeddings=False,
    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                     "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True,
                     "original_max_position_embeddings": 512},
)  # fmt: skip
SINK_GAIN = 6.0  # as test_gpt_oss.py: some sinks outweigh the scores


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(the Hugging Face checkpoint, llama.cpp's F32 GGUF of it) in SmolLM2's vocabulary."""
    if converter() is None:  # nothing is downloaded at test time
        pytest.skip("llama.cpp's converter is not fetched")
    vocab = smollm2_vocabulary()
    model_dir = tmp_path_factory.mktemp("gpt_oss_gguf")
    write_family_checkpoint(model_dir, "gpt_oss", vocab_size=vocab.vocab_size, **GPT_OSS)
    file = model_dir / "model.safetensors"
    tensors = load_file(file)
    for name in tensors:
        if name.endswith("self_attn.sinks"):
            tensors[name] = tensors[name] * SINK_GAIN
    save_file(tensors, file, metadata={"format": "pt"})
    write_vocabulary(model_dir, vocab)
    return model_dir, convert(model_dir, model_dir / "f32.gguf")


def test_the_f32_file_is_its_checkpoint(converted):
    """The file's config is the checkpoint's (but the tokenizer's EOS and eps in float32), and
    its greedy ids are transformers'."""
    from nanoserve.model.gguf_file import GGUFCheckpoint

    model_dir, path = converted
    ours, theirs = GGUFCheckpoint(path).config, ModelConfig.from_dir(model_dir)
    differ = {f for f in theirs.__dataclass_fields__ if getattr(ours, f) != getattr(theirs, f)}
    assert differ == {"eos_token_ids", "rms_norm_eps"}
    assert ours.layer_windows == (8, 0, 8) and ours.rope.rope_type == "yarn"
    _, ids = _greedy(path)
    assert ids == [r[:16] for r in _reference(model_dir, GGUF_PROMPTS)]


def test_an_mxfp4_file_keeps_its_experts_in_their_blocks(converted, tmp_path):
    """llama.cpp's MXFP4_MOE quantization: every experts tensor stays its MXFP4 bytes, and greedy
    ids through the blocks equal the same file de-quantized to float32."""
    from nanoserve.kernels import QuantizedWeight
    from nanoserve.model.gguf_file import GGUFCheckpoint
    from nanoserve.testing.llamacpp_convert import quantize, quantizer_available

    if not quantizer_available():
        pytest.skip("llama.cpp's quantizer (llama-cpp-python) is not installed")
    path = quantize(converted[1], tmp_path / "mxfp4.gguf", "MXFP4_MOE")
    tensors = GGUFCheckpoint(path).tensors
    llm, kept = _greedy(path)
    for i, layer in enumerate(llm.engine.runner.model.weights.layers):
        for field, name in GGUF_EXPERTS.items():
            w = getattr(layer, field).weight
            assert isinstance(w, QuantizedWeight) and w.qtype == "mxfp4"
            assert w.data.nbytes == tensors[f"blk.{i}.{name}.weight"]["bytes"]
    assert kept == _greedy(path, quantization="none")[1]


def test_an_mxfp4_file_decodes_in_the_one_call_step_bit_for_bit(converted, tmp_path, monkeypatch):
    """MXFP4 experts, Q8_0 attention with biases and sinks, windowed layers: 6 sequences through
    the one-call C step give the layer-by-layer path's ids and logprobs, bit for bit."""
    from test_cpu_step import check_six_rows_bit_for_bit

    from nanoserve.testing.llamacpp_convert import quantize, quantizer_available

    if not quantizer_available():
        pytest.skip("llama.cpp's quantizer (llama-cpp-python) is not installed")
    check_six_rows_bit_for_bit(
        quantize(converted[1], tmp_path / "mxfp4.gguf", "MXFP4_MOE"), monkeypatch
    )


class _Refused(Exception):
    pass


@pytest.mark.parametrize(
    ("key", "value"),
    [("yarn_ext_factor", 0.5), ("yarn_log_multiplier", 0.1), ("factor", 0.0)],
)
def test_yarn_keys_not_run_are_refused_by_name(key, value):
    meta = {"rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 512}
    meta[f"rope.scaling.{key}"] = value

    def refused(name, got, implemented):
        return _Refused(f"{name} = {got!r}")

    with pytest.raises(_Refused, match=f"rope.scaling.{key} = {value!r}"):
        yarn_rope(lambda k, default=None: meta.get(k, default), 1e4, refused)
