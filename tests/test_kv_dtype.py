"""The KV cache's dtype (kv_cache_dtype, vLLM's --kv-cache-dtype): what "auto" resolves to, the
pool's tokens per GiB, and, for every dtype, outputs that depend on neither the batch, nor a
preemption, nor a prefix hit, with prompt logprobs close to transformers' float32 ones."""

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType

from nanoserve import LLM, SamplingParams
from nanoserve.config import EngineConfig, SettingError
from nanoserve.model import open_checkpoint, resolve_dtype
from nanoserve.testing.gguf_writer import write_gguf

KV_DTYPES = ("float32", "bfloat16", "float16")
PROMPT = list(range(5, 5 + 70))  # spans 5 blocks of 16


def _requests(count=10):
    g = torch.Generator().manual_seed(3)
    requests = []
    for i in range(count):
        n = int(torch.randint(2, 50, (1,), generator=g))
        prompt = torch.randint(0, 500, (n,), generator=g).tolist()
        params = SamplingParams(
            temperature=0 if i % 2 else 0.8, seed=i, max_tokens=8 + i, ignore_eos=True
        )
        requests.append(({"prompt_token_ids": prompt}, params))
    return requests


def _pool_is_whole(llm):
    llm.engine.audit()
    assert llm.engine.stats().free_blocks == llm.engine.num_blocks


def test_an_unknown_dtype_is_refused_by_name():
    with pytest.raises(SettingError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")


def test_auto_is_float16_for_gguf_blocks_and_the_activations_dtype_for_floats(
    tiny_model_dir, tmp_path
):
    floats = open_checkpoint(tiny_model_dir)
    assert resolve_dtype(EngineConfig(), floats).kv_cache_dtype == "float32"
    as_bf16 = resolve_dtype(EngineConfig(dtype="bfloat16"), floats)
    assert as_bf16.kv_cache_dtype == "bfloat16"
    chosen = resolve_dtype(EngineConfig(kv_cache_dtype="float16"), floats)
    assert chosen.kv_cache_dtype == "float16"
    gguf = write_gguf(tiny_model_dir, tmp_path / "tiny.gguf", GGMLQuantizationType.Q8_0)
    blocks = resolve_dtype(EngineConfig(), open_checkpoint(gguf))
    assert (blocks.dtype, blocks.kv_cache_dtype) == ("float32", "float16")
    dequantized = resolve_dtype(EngineConfig(quantization="none"), open_checkpoint(gguf))
    assert dequantized.kv_cache_dtype == "float32"


def test_cuda_takes_the_activations_dtype_only(tiny_model_dir):
    config = EngineConfig(device="cuda", dtype="bfloat16", kv_cache_dtype="float16")
    with pytest.raises(SettingError, match="kv_cache_dtype"):
        resolve_dtype(config, open_checkpoint(tiny_model_dir))


def test_a_16_bit_cache_holds_twice_the_tokens_in_the_same_memory(tiny_model_dir):
    engines = {
        kv: LLM(str(tiny_model_dir), kv_cache_memory_gb=0.01, kv_cache_dtype=kv).engine
        for kv in ("float32", "float16")
    }
    half, full = engines["float16"], engines["float32"]
    assert half.num_blocks // 2 == full.num_blocks  # each as many as fit, rounded down
    assert 0 <= half.kv_cache_bytes - full.kv_cache_bytes <= half.runner.block_bytes
    caches = engines["float16"].runner.kv_caches
    assert {t.dtype for pair in caches for t in pair} == {torch.float16}


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_outputs_depend_on_neither_the_batch_nor_a_preemption(tiny_model_dir, kv):
    requests = _requests()
    alone = LLM(str(tiny_model_dir), block_size=8, num_kv_blocks=64, kv_cache_dtype=kv)
    solo = [alone.generate([p], [s], use_tqdm=False)[0] for p, s in requests]
    crowded = LLM(
        str(tiny_model_dir), block_size=8, num_kv_blocks=16, max_num_batched_tokens=48,
        kv_cache_dtype=kv,
    )  # fmt: skip
    together = crowded.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    assert crowded.engine.stats().num_preemptions > 0
    for a, b in zip(solo, together, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    _pool_is_whole(alone)
    _pool_is_whole(crowded)


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_a_prefix_hit_changes_nothing(tiny_model_dir, kv):
    shared = list(range(100, 150))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = []
    for caching in (True, False):
        llm = LLM(str(tiny_model_dir), kv_cache_dtype=kv, enable_prefix_caching=caching)
        llm.generate([{"prompt_token_ids": shared + [7, 8]}], params, use_tqdm=False)
        out = llm.generate([{"prompt_token_ids": shared + [9]}], params, use_tqdm=False)[0]
        assert out.num_cached_tokens == (48 if caching else 0)
        outputs.append(out.outputs[0].token_ids)
        _pool_is_whole(llm)
    assert outputs[0] == outputs[1]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def _prompt_logprobs(model_dir, **engine_args) -> list[float]:
    llm = LLM(str(model_dir), **engine_args)
    params = SamplingParams(prompt_logprobs=0, max_tokens=1)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    return [out.prompt_logprobs[i][PROMPT[i]].logprob for i in range(1, len(PROMPT))]


def _worst(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("kv", KV_DTYPES)
@pytest.mark.parametrize("chunk", [2048, 16])
def test_prompt_logprobs_equal_the_torch_reference_and_stay_near_transformers(
    tiny_model_dir, reference, kv, chunk
):
    """Whole and in chunks of 16 (each chunk reading the earlier ones from the cache): the C
    kernels close to the torch reference kernels over the same cache dtype; within 1e-4 of
    transformers with a float32 cache, within the rounding of a 16-bit one (this random model's
    attention logits are large, so its rounding shows more than a trained model's)."""
    ours = _prompt_logprobs(tiny_model_dir, kv_cache_dtype=kv, max_num_batched_tokens=chunk)
    torch_ref = _prompt_logprobs(
        tiny_model_dir, kv_cache_dtype=kv, max_num_batched_tokens=chunk, attention_backend="torch"
    )
    # Within 1e-6 at the first layer; a later layer's 16-bit rounding of its keys may put two
    # paths' keys an ulp apart where they differed by 1e-6 (measured 5e-4 at float16).
    assert _worst(ours, torch_ref) <= (1e-4 if kv == "float32" else 2e-3)
    theirs = [float(reference[i - 1, PROMPT[i]]) for i in range(1, len(PROMPT))]
    worst = _worst(ours, theirs)
    assert worst <= {"float32": 1e-4, "float16": 0.05, "bfloat16": 0.3}[kv]
    if kv != "float32":
        assert worst > 1e-6  # the cache really is rounded
