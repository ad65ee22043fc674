"""The one-call CPU decode step (kernels/csrc/decode_step.c) against the layer-by-layer path."""

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.kernels import c_backend


def _spy(monkeypatch, step) -> list[int]:
    """Records the rows of each C step call (and still runs it)."""
    rows: list[int] = []
    real = type(step).__call__

    def spy(self, h, *args):
        rows.append(h.shape[0])
        return real(self, h, *args)

    monkeypatch.setattr(type(step), "__call__", spy)
    return rows


def spy_rows(monkeypatch) -> list[int]:
    """Records the rows of every C step call of any engine (and still runs it)."""
    from nanoserve.model.cpu_step import CpuDecodeStep

    rows: list[int] = []
    real = CpuDecodeStep.__call__

    def spy(self, h, *args):
        rows.append(h.shape[0])
        return real(self, h, *args)

    monkeypatch.setattr(CpuDecodeStep, "__call__", spy)
    return rows


def check_six_rows_bit_for_bit(path, monkeypatch) -> None:
    """6 sequences of a file whose matrices are in blocks: all 6 rows through the one-call C
    step, and its ids and logprobs bit for bit the layer-by-layer path's."""
    rows = spy_rows(monkeypatch)
    prompts = [list(range(100 + 9 * i, 120 + 13 * i)) for i in range(6)]
    ours, theirs = (_generate(path, "float32", one_call, prompts, monkeypatch)
                    for one_call in (True, False))  # fmt: skip
    assert max(rows) == 6, "the C step was meant to take all 6 rows"
    assert bits(ours) == bits(theirs)


def bits(generated):
    """_generate's ids and logprobs as plain values, to compare exactly."""
    return [(ids, [{t: p.logprob for t, p in step.items()} for step in steps])
            for ids, steps in generated]  # fmt: skip


def _generate(
    model_dir, dtype, one_call, prompts, monkeypatch, max_tokens=20, cache_dtype=None, **engine_args
):
    """Tokens and logprobs of greedy generations; cache_dtype: the KV caches swapped for empty
    ones of that dtype before any step (prompts are prefilled whole, from their fresh keys)."""
    llm = LLM(str(model_dir), dtype=dtype, block_size=8, **engine_args)
    runner = llm.engine.runner
    assert runner.cpu_step is not None
    if cache_dtype is not None:
        runner.kv_caches = [(k.to(cache_dtype), v.to(cache_dtype)) for k, v in runner.kv_caches]
    rows = _spy(monkeypatch, runner.cpu_step)
    if not one_call:
        runner.cpu_step = None
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.engine.audit()
    assert bool(rows) == one_call  # the C step ran, or was not there to run
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch", [1, 3, 4])
def test_one_call_step_matches_layer_by_layer(tiny_model_dir, monkeypatch, dtype, batch):
    """The same tokens and logprobs, bit for bit, in float32 and bfloat16: both paths run the
    same C kernels (the gated product too). The contexts cross block boundaries (block size 8)
    and the batch is at most the C step's 4."""
    prompts = [list(range(3 + 5 * i, 3 + 5 * i + n)) for i, n in enumerate((5, 17, 8, 30))]
    ours = _generate(tiny_model_dir, dtype, True, prompts[:batch], monkeypatch)
    theirs = _generate(tiny_model_dir, dtype, False, prompts[:batch], monkeypatch)
    assert bits(ours) == bits(theirs)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_one_call_step_over_16_bit_caches_matches_layer_by_layer(
    tiny_model_dir, monkeypatch, cache_dtype
):
    """float32 activations over bfloat16 or float16 KV caches: the C step stores the keys
    rounded to the cache and attends over it, as the layer-by-layer path's kernels do: the same
    bits."""
    prompts = [list(range(3 + 5 * i, 3 + 5 * i + n)) for i, n in enumerate((5, 17, 30))]
    args = (tiny_model_dir, "float32")
    ours = _generate(*args, True, prompts, monkeypatch, cache_dtype=cache_dtype)
    theirs = _generate(*args, False, prompts, monkeypatch, cache_dtype=cache_dtype)
    assert bits(ours) == bits(theirs)


def test_one_call_step_is_used_only_where_it_applies(tiny_model_dir, monkeypatch):
    """Decode batches of up to 4 rows only: never a prefill, never 5 or more sequences."""
    llm = LLM(str(tiny_model_dir), dtype="float32")
    rows = _spy(monkeypatch, llm.engine.runner.cpu_step)
    prompts = [{"prompt_token_ids": list(range(1, 10 + i))} for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in range(2, 14, 2)]
    llm.generate(prompts, params, use_tqdm=False)
    # One prefill step, then decodes of 6, 5, 5, 4, 4, ... rows as the requests finish in turn;
    # only those of 4 rows or fewer go to the C step.
    assert rows == [4, 4, 3, 3, 2, 2, 1, 1]


def test_an_explicit_attention_backend_keeps_the_layer_by_layer_path(tiny_model_dir, monkeypatch):
    llm = LLM(str(tiny_model_dir), dtype="float32", attention_backend="torch")
    rows = _spy(monkeypatch, llm.engine.runner.cpu_step)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
    assert rows == []


def test_c_step_refuses_caches_of_another_dtype(tiny_model_dir):
    """Caches of the activations' dtype, or 16-bit ones under float32 activations, all layers
    alike."""
    llm = LLM(str(tiny_model_dir), dtype="float32")
    step, caches = llm.engine.runner.cpu_step, llm.engine.runner.kv_caches

    def copies(dtype: torch.dtype) -> list:  # new tensors: a table is rebuilt for new caches
        return [(k.to(dtype), v.to(dtype)) for k, v in caches]

    assert step.layer_table(copies(torch.float16), torch.float32) is not None
    with pytest.raises(ValueError, match=r"KV caches must be of the activations' dtype"):
        step.layer_table(copies(torch.float16), torch.bfloat16)
    with pytest.raises(ValueError, match=r"KV caches must be of the activations' dtype"):
        step.layer_table(copies(torch.float64), torch.float32)
    with pytest.raises(ValueError, match=r"of one dtype \(torch.float16\)"):
        step.layer_table([copies(torch.float16)[0], *caches[1:]], torch.float32)


def test_c_step_rejects_a_slot_outside_the_cache(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32")
    model, runner = llm.engine.runner.model, llm.engine.runner
    k = runner.kv_caches[0][0]
    bad_slot = torch.tensor([k.shape[0] * k.shape[2]])
    with pytest.raises(ValueError, match="slot_mapping"):
        c_backend.decode_layers(
            torch.zeros(1, model.config.hidden_size),
            runner.cpu_step.layer_table(runner.kv_caches, torch.float32),
            torch.tensor([0]),
            bad_slot,
            model.cos,
            model.sin,
            torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32),
            num_blocks=k.shape[0],
            block_size=k.shape[2],
            heads=model.config.num_heads,
            kv_heads=model.config.num_kv_heads,
            intermediate=model.config.intermediate_size,
            eps=1e-5,
            scale=model.scale,
        )
