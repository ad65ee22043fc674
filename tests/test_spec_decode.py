"""Speculative decoding (n-gram prompt lookup): the same tokens as without it, greedy and seeded,
alone and in batches, with stop strings, max_tokens, min_tokens, logprobs, penalties, structured
outputs beside it, preemption, prefix caching and tensor parallelism; a verification's logits
bitwise those of one-token decode steps; its settings refused by name; the block ledger after
every scenario."""

import re
from dataclasses import dataclass

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.config import EngineConfig, SettingError
from nanoserve.default_model import default_model_path
from nanoserve.engine import StructuredOutputsParams
from nanoserve.engine.spec.ngram import ngram_draft
from nanoserve.server.metrics import Metrics
from nanoserve.server.stats import ServingStats
from nanoserve.testing.harness import MODEL_NAME, live_server

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
POOL = dict(block_size=8, num_kv_blocks=128)
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def _prompts(count=16, seed=3):
    """Random prompts, every other one repeated four times (there the drafts are accepted)."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(count):
        length = int(torch.randint(3, 14, (1,), generator=g))
        base = torch.randint(0, 500, (length,), generator=g).tolist()
        prompts.append({"prompt_token_ids": base * 4 if i % 2 == 0 else base})
    return prompts


def _ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _check_pool(llm):
    llm.engine.audit()
    assert llm.engine.stats().free_blocks == llm.engine.num_blocks


def _check_spec_counters(llm):
    """Drafts were made; some n-gram drafts kept (the random draft model's: maybe none)."""
    s = llm.engine.stats().spec_decode
    ngram = llm.engine.config.speculative_config.method == "ngram"
    assert s.num_drafts > 0 and int(ngram) <= s.num_accepted_tokens <= s.num_draft_tokens
    assert (
        s.num_draft_tokens
        <= s.num_drafts * llm.engine.config.speculative_config.num_speculative_tokens
    )


@pytest.fixture(scope="module")
def off(tiny_model_dir):
    return LLM(str(tiny_model_dir), **POOL)


def _draft_config(factory) -> dict:
    """A draft model: a smaller random model of the same tokenizer (most drafts rejected)."""
    draft = factory(hidden_size=32, num_layers=1, intermediate_size=64, seed=1)
    return {"model": str(draft), "num_speculative_tokens": 3}


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def on(request, tiny_model_dir, tiny_model_factory):
    """Speculation by each method: every test on it holds for both."""
    spec = NGRAM if request.param == "ngram" else _draft_config(tiny_model_factory)
    return LLM(str(tiny_model_dir), speculative_config=spec, **POOL)


def test_ngram_draft_follows_the_latest_earlier_occurrence_longest_first():
    lookup = range(3, 0, -1)
    assert ngram_draft([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], lookup, 2) == [7, 5]
    assert ngram_draft([4, 1, 2, 8, 2], lookup, 3) == [8, 2]  # only the 1-gram [2] recurs
    assert ngram_draft([5, 6, 7], lookup, 3) == []
    assert ngram_draft([1, 2, 1, 2], range(2, 1, -1), 5) == [1, 2]  # stops at the sequence's end


def test_greedy_ids_equal_without_speculation_alone_and_batched(off, on):
    prompts = _prompts()
    alone = [_ids(off.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts]
    _check_pool(off)
    assert off.engine.stats().spec_decode.num_drafts == 0
    spec_alone = [_ids(on.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts]
    _check_pool(on)
    _check_spec_counters(on)
    assert spec_alone == alone
    assert _ids(on.generate(prompts, GREEDY, use_tqdm=False)) == alone
    _check_pool(on)


def test_seeded_sampling_and_penalties_equal_without_speculation(off, on):
    prompts = _prompts(8, seed=5)
    params = [
        SamplingParams(
            temperature=0.7,
            top_k=40,
            top_p=0.95,
            seed=i,
            max_tokens=30,
            ignore_eos=True,
            repetition_penalty=1.0 if i % 2 else 1.2,
            frequency_penalty=0.3 * (i % 3 == 0),
        )  # fmt: skip
        for i in range(len(prompts))
    ]
    assert _ids(on.generate(prompts, params, use_tqdm=False)) == _ids(
        off.generate(prompts, params, use_tqdm=False)
    )
    _check_pool(on)


def test_a_batch_of_speculating_and_non_speculating_requests(tiny_model_dir):
    """Repetitive and random prompts, a request with no room for a draft (max_tokens 1) and a
    constrained one (structured outputs never draft) in one batch, in GGUF blocks (no cap on a
    step's draft rows)."""
    prompts = _prompts(6, seed=9) + [{"prompt_token_ids": [5, 6] * 10}] * 2
    params = [GREEDY] * 6 + [
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(
            temperature=0, max_tokens=12,
            structured_outputs=StructuredOutputsParams(regex="[ab]{3,8}"),
        ),
    ]  # fmt: skip
    q8 = dict(POOL, quantization="q8_0")
    off, on = (
        LLM(str(tiny_model_dir), **q8),
        LLM(str(tiny_model_dir), speculative_config=NGRAM, **q8),
    )
    assert _ids(on.generate(prompts, params, use_tqdm=False)) == _ids(
        off.generate(prompts, params, use_tqdm=False)
    )
    _check_spec_counters(on)
    _check_pool(on)


def test_drafts_of_float_matrices_stay_within_the_gemv_rows(on, monkeypatch):
    """Past 4 rows a float matmul is oneDNN's, whose rows are not bitwise invariant."""
    rows = []
    prepare = on.engine.runner.prepare

    def spy(batch):
        if any(item.verifies for item in batch):
            rows.append(sum(item.num_new_tokens for item in batch if item.samples))
        return prepare(batch)

    monkeypatch.setattr(on.engine.runner, "prepare", spy)
    on.generate(_prompts(3, seed=21), GREEDY, use_tqdm=False)  # 3 decodes: 1 draft row left
    assert rows and max(rows) == 4
    _check_pool(on)


def test_stop_strings_max_tokens_min_tokens_and_logprobs_equal(off, on):
    text = off.generate(["the cat sat"], GREEDY, use_tqdm=False)[0].outputs[0]
    stop_string = text.text[12:15]
    stop_token = text.token_ids[5]
    cases = [
        SamplingParams(temperature=0, max_tokens=40, stop=[stop_string]),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_token], min_tokens=9),
        SamplingParams(temperature=0, max_tokens=25, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=4, max_tokens=25, logprobs=2, ignore_eos=True),
    ]
    for params in cases:
        prompts = ["the cat sat", "the cat sat " * 5]
        a = off.generate(prompts, params, use_tqdm=False)
        b = on.generate(prompts, params, use_tqdm=False)
        for x, y in zip(a, b, strict=True):
            x, y = x.outputs[0], y.outputs[0]
            assert (y.token_ids, y.text, y.finish_reason, y.stop_reason) == (
                x.token_ids, x.text, x.finish_reason, x.stop_reason,
            )  # fmt: skip
            assert y.logprobs == x.logprobs
        _check_pool(on)
    assert len(b[0].outputs[0].token_ids) == 25


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_preemption_under_a_small_pool(tiny_model_dir, tiny_model_factory, off, method):
    prompts = _prompts(12, seed=11)
    expected = [_ids(off.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts]
    spec = NGRAM if method == "ngram" else _draft_config(tiny_model_factory)
    with LLM(
        str(tiny_model_dir), speculative_config=spec, block_size=8, num_kv_blocks=24,
        max_num_batched_tokens=48,
    ) as small:  # fmt: skip
        assert _ids(small.generate(prompts, GREEDY, use_tqdm=False)) == expected
        assert small.engine.stats().num_preemptions > 0
        _check_spec_counters(small)
        _check_pool(small)


def test_prefix_cache_holds_only_accepted_tokens(off, on):
    """A second request whose prompt is the first's prompt and output finds the blocks the
    verifications filled in the prefix cache, and continues exactly as without speculation."""
    prompt = [7, 8, 9, 10, 11] * 6
    first = _ids(on.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False))[0]
    longer = {"prompt_token_ids": prompt + first}
    hits = on.engine.stats().num_prefix_hit_tokens
    out = on.generate([longer], GREEDY, use_tqdm=False)[0]
    assert on.engine.stats().num_prefix_hit_tokens - hits >= len(prompt + first) - 8
    assert out.outputs[0].token_ids == _ids(off.generate([longer], GREEDY, use_tqdm=False))[0]
    _check_pool(on)


@dataclass
class _Chunk:
    token_ids: list[int]
    start: int
    num_new_tokens: int
    block_table: list[int]
    verifies: bool = False
    samples: bool = True
    prompt_logprob_positions: range = range(0)
    prompt_logprobs: int = 0


def _verification_matches_decodes(llm, rows):
    """A prefill, then `rows` positions verified in one step, against the same prefill in other
    blocks and one decode step per position: bitwise equal logits."""
    runner = llm.engine.runner
    tokens = list(range(3, 50))
    step = lambda chunks: runner.execute(runner.prepare(chunks))[0]  # noqa: E731
    step([_Chunk(tokens, 0, 20, list(range(12)))])
    verified = step([_Chunk(tokens, 20, rows, list(range(12)), verifies=True)])
    step([_Chunk(tokens, 0, 20, list(range(12, 24)))])
    decoded = [step([_Chunk(tokens, 20 + j, 1, list(range(12, 24)))]) for j in range(rows)]
    assert verified.shape[0] == rows
    for j in range(rows):
        assert torch.equal(verified[j], decoded[j][0]), f"position {j} of {rows}"


@pytest.mark.parametrize("rows", [2, 4])
def test_verification_logits_are_bitwise_those_of_decode_steps(tiny_model_dir, rows):
    """Float matrices: up to the C GEMV's 4 rows, which the scheduler keeps drafts within."""
    llm = LLM(str(tiny_model_dir), block_size=4, num_kv_blocks=24)
    assert llm.engine.runner.invariant_rows == 4
    _verification_matches_decodes(llm, rows)


def test_verification_logits_in_gguf_blocks_are_bitwise_at_any_rows(tiny_model_dir):
    """The one-call C step (up to 16 rows here) and the layer-by-layer path (past them) give a
    row the same bits."""
    llm = LLM(str(tiny_model_dir), block_size=4, num_kv_blocks=24, quantization="q8_0")
    assert llm.engine.runner.invariant_rows is None
    for rows in (4, 9, 17):
        _verification_matches_decodes(llm, rows)


def test_verification_logits_on_smollm2_are_those_of_decode_steps():
    llm = LLM(str(default_model_path()), block_size=4, num_kv_blocks=24)
    assert llm.engine.runner.invariant_rows is None
    assert llm.engine.runner.verify_rows == 16  # the one-call C step's rows in GGUF blocks
    for rows in (4, 6):
        _verification_matches_decodes(llm, rows)


def test_smollm2_greedy_output_equal_and_accepted():
    text = (
        "The river runs through the old town, past the mill and the church, and under the "
        "stone bridge where the children fish in summer."
    )
    prompts = [
        f"Repeat this sentence exactly: {text}\nRepeated: ",
        "Write a short poem about the sea.",
    ]
    params = SamplingParams(temperature=0, max_tokens=32)
    path = str(default_model_path())
    a = LLM(path, num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
    spec = LLM(path, num_kv_blocks=64, speculative_config=NGRAM)
    b = [spec.generate([p], params, use_tqdm=False)[0] for p in prompts]
    assert _ids(b) == _ids(a)
    _check_spec_counters(spec)
    _check_pool(spec)


def test_tensor_parallel_greedy_equal(tiny_model_dir, off):
    prompts = _prompts(4, seed=13)
    expected = [_ids(off.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts]
    with LLM(str(tiny_model_dir), tensor_parallel_size=2, speculative_config=NGRAM, **POOL) as tp:
        assert [_ids(tp.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts] == expected
        assert _ids(tp.generate(prompts[:3], GREEDY, use_tqdm=False)) == expected[:3]
        _check_spec_counters(tp)
        _check_pool(tp)


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an"),
        (
            {"method": "eagle"},
            "speculative_config.method must be ngram or draft_model, got 'eagle'",
        ),
        ({"num_speculative_tokens": 2, "lookahead": 1}, "speculative_config.lookahead must be"),
        ({"method": "ngram", "model": "/x/d.gguf"}, "speculative_config.model must be absent"),
        ({"model": "/x/d.gguf", "prompt_lookup_max": 2}, "prompt_lookup_max must be absent"),
        ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "<= prompt_lookup_max (2), got 4"),
        ('{"method": ', "must be a JSON object"),
        ([3], "must be a JSON object (a dict)"),
    ],
)
def test_bad_speculative_configs_are_refused_by_name(value, words):
    with pytest.raises(SettingError, match=None) as e:
        EngineConfig(speculative_config=value)
    assert words in str(e.value)


def test_json_text_and_a_dict_give_the_same_config():
    text = '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2}'
    a = EngineConfig(speculative_config=text).speculative_config
    b = EngineConfig(speculative_config={"num_speculative_tokens": 5, "prompt_lookup_min": 2})
    assert a == b.speculative_config and a.num_speculative_tokens == 5 and a.prompt_lookup_max == 4


def test_metrics_use_vllms_names():
    metrics = Metrics()
    stats = ServingStats(1, 0, 10, 10, 3, 0, 0, 1, 12, 4, 10, 6)
    metrics.on_step(stats)
    text = metrics.render().decode()
    assert "nanoserve:spec_decode_num_drafts_total 4.0" in text
    assert "nanoserve:spec_decode_num_draft_tokens_total 10.0" in text
    assert "nanoserve:spec_decode_num_accepted_tokens_total 6.0" in text
    assert "nanoserve:spec_decode_draft_acceptance_rate 0.6" in text


async def test_a_server_with_speculation_answers_the_same_and_counts_drafts(tiny_model_dir, off):
    prompt = [7, 8, 9, 10, 11] * 6
    expected = off.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    async with live_server(tiny_model_dir, speculative_config=NGRAM, **POOL) as server:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 40, "temperature": 0}
        response = await server.http.post("/v1/completions", json=dict(body, ignore_eos=True))
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected.outputs[0].text
        metrics = (await server.http.get("/metrics")).text
    counts = {
        name: float(re.search(rf"^nanoserve:{name}_total (\S+)$", metrics, re.M).group(1))
        for name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                     "spec_decode_num_accepted_tokens")
    }  # fmt: skip
    assert 0 < counts["spec_decode_num_accepted_tokens"] <= counts["spec_decode_num_draft_tokens"]
    assert counts["spec_decode_num_drafts"] > 0
