"""Engine behaviour: batch invariance under preemption, prefix caching, aborts, refusals, and the
block ledger after every scenario."""

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.engine import RequestRejected


def _mixed_requests(count=16):
    g = torch.Generator().manual_seed(7)
    requests = []
    for i in range(count):
        prompt = torch.randint(0, 500, (int(torch.randint(2, 60, (1,), generator=g)),), generator=g)
        if i % 3 == 0:
            params = SamplingParams(temperature=0, max_tokens=10 + i, ignore_eos=True)
        else:
            params = SamplingParams(
                temperature=0.8, top_p=0.9, top_k=50, seed=i, max_tokens=10 + i, ignore_eos=True
            )
        requests.append(({"prompt_token_ids": prompt.tolist()}, params))
    return requests


def _check_pool(llm):
    llm.engine.audit()
    assert llm.engine.stats().free_blocks == llm.engine.num_blocks


def test_tokens_do_not_depend_on_the_batch_or_on_preemption(tiny_model_dir):
    requests = _mixed_requests()
    alone = LLM(str(tiny_model_dir), block_size=8, num_kv_blocks=64)
    solo = [alone.generate([p], [s], use_tqdm=False)[0] for p, s in requests]
    _check_pool(alone)

    crowded = LLM(str(tiny_model_dir), block_size=8, num_kv_blocks=20, max_num_batched_tokens=64)
    together = crowded.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    stats = crowded.engine.stats()
    assert stats.num_preemptions > 0 and stats.num_recomputed_tokens > 0
    assert stats.peak_running >= 4
    _check_pool(crowded)
    for a, b in zip(solo, together, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_prefix_cache_hit_computes_fewer_tokens_and_changes_nothing(tiny_model_dir):
    shared = list(range(100, 150))  # 50 tokens: three full blocks of 16
    first = {"prompt_token_ids": shared + [7, 8]}
    second = {"prompt_token_ids": shared + [9]}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    cached = LLM(str(tiny_model_dir))
    cached.generate([first], params, use_tqdm=False)
    before = cached.engine.stats().computed_tokens
    with_cache = cached.generate([second], params, use_tqdm=False)[0]
    computed = cached.engine.stats().computed_tokens - before
    assert with_cache.num_cached_tokens == 48
    assert computed == 51 + 12 - 1 - 48  # prompt tail, then one position per later token
    _check_pool(cached)

    plain = LLM(str(tiny_model_dir), enable_prefix_caching=False)
    plain.generate([first], params, use_tqdm=False)
    without = plain.generate([second], params, use_tqdm=False)[0]
    assert without.num_cached_tokens == 0
    assert with_cache.outputs[0].token_ids == without.outputs[0].token_ids


def test_n_completions_share_the_prompt_blocks(tiny_model_dir):
    llm = LLM(str(tiny_model_dir))
    prompt = {"prompt_token_ids": list(range(10, 74))}  # 64 tokens: four full blocks
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "three seeded samples identical"
    stats = llm.engine.stats()
    assert stats.num_prefix_hit_tokens == 2 * 48  # the later two reuse the first's blocks
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    _check_pool(llm)


def test_abort_waiting_and_running_frees_everything(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), max_num_seqs=1)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    engine.add_request("running", list(range(1, 40)), params)
    engine.add_request("waiting", list(range(1, 30)), params)
    engine.step()
    engine.step()
    assert engine.stats().free_blocks < engine.num_blocks
    assert [r.request_id for r in engine.scheduler.running] == ["running"]
    engine.audit()
    out = engine.abort("waiting")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert out.outputs[0].token_ids == []
    out = engine.abort("running")
    assert out.outputs[0].finish_reason == "abort" and len(out.outputs[0].token_ids) == 2
    assert not engine.has_unfinished()
    assert engine.step() == []
    _check_pool(llm)


def test_requests_that_could_never_fit_are_refused_with_numbers(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), block_size=16, num_kv_blocks=8, max_model_len=200)
    engine = llm.engine
    with pytest.raises(RequestRejected, match=r"prompt \(100 tokens\) \+ max_tokens \(150\)") as e:
        engine.add_request("a", list(range(1, 101)), SamplingParams(max_tokens=150))
    assert e.value.param == "max_tokens"
    with pytest.raises(RequestRejected, match=r"needs 9 KV blocks .* pool has 8") as e:
        engine.add_request("b", list(range(1, 101)), SamplingParams(max_tokens=30))
    with pytest.raises(RequestRejected, match="prompt has 200 tokens") as e:
        engine.add_request("c", [5] * 200, SamplingParams(max_tokens=1))
    assert e.value.param == "prompt"
    with pytest.raises(RequestRejected, match="outside the vocabulary"):
        engine.add_request("d", [10**6], SamplingParams())
    with pytest.raises(RequestRejected, match="empty"):
        engine.add_request("e", [], SamplingParams())
    engine.add_request("f", [1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(RequestRejected, match="already in use"):
        engine.add_request("f", [1, 2, 3], SamplingParams(max_tokens=4))
    assert len(engine.scheduler.waiting) == 1
    llm.engine.abort("f")
    _check_pool(llm)


def test_long_prompt_runs_past_the_token_budget(tiny_model_dir):
    prompt = {"prompt_token_ids": list(range(1, 301))}
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    reference = LLM(str(tiny_model_dir)).generate([prompt], params, use_tqdm=False)[0]
    for chunked in (True, False):
        llm = LLM(str(tiny_model_dir), max_num_batched_tokens=64, enable_chunked_prefill=chunked)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == reference.outputs[0].token_ids
        _check_pool(llm)


def test_waiting_requests_are_served_first_come_first_served(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), max_num_seqs=2)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for i in range(5):
        engine.add_request(str(i), list(range(1, 10 + i)), params)
    finished = []
    while engine.has_unfinished():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["0", "1", "2", "3", "4"]
    _check_pool(llm)


def test_outputs_are_lists_as_in_vllm(tiny_model_dir):
    llm = LLM(str(tiny_model_dir))
    out = llm.generate("Hello", SamplingParams(max_tokens=3, logprobs=1), use_tqdm=False)[0]
    bos = llm.engine.tokenizer.bos_token_id
    assert type(out.prompt_token_ids) is list and out.prompt_token_ids[0] == bos
    assert type(out.outputs) is list and type(out.outputs[0].token_ids) is list
    assert type(out.outputs[0].logprobs) is list and len(out.outputs[0].logprobs) == 3
