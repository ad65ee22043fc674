"""Speculative decoding by a draft model: the target drafting for itself (every greedy draft
accepted: the draft's cache is right), the same output as without speculation, and the drafts
that cannot propose the target's tokens refused by name. (Every test of test_spec_decode.py on
its `on` fixture also runs with a smaller random draft model.)"""

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.config import SettingError

POOL = dict(block_size=8, num_kv_blocks=128)
GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


def test_target_as_its_own_draft_accepts_every_greedy_draft(tiny_model_dir):
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 12, 20)]
    off = LLM(str(tiny_model_dir), **POOL)
    spec = {"model": str(tiny_model_dir), "num_speculative_tokens": 3}
    on = LLM(str(tiny_model_dir), speculative_config=spec, **POOL)
    expected = [o.outputs[0].token_ids for o in off.generate(prompts, GREEDY, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in on.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == expected
    s = on.engine.stats().spec_decode
    assert s.num_drafts > 0 and s.num_accepted_tokens == s.num_draft_tokens
    on.engine.audit()
    assert on.engine.stats().free_blocks == on.engine.num_blocks


@pytest.mark.parametrize(
    ("draft", "words"),
    [
        (dict(vocab_size=1100), "vocabulary of 1024 tokens (the draft's has 1100)"),
        (dict(max_position_embeddings=64), "whose context (64 tokens) holds max_model_len"),
    ],
)
def test_a_draft_that_cannot_propose_the_targets_tokens_is_refused(
    tiny_model_dir, tiny_model_factory, draft, words
):
    spec = {"model": str(tiny_model_factory(num_layers=1, **draft))}
    with pytest.raises(SettingError) as e:
        LLM(str(tiny_model_dir), speculative_config=spec, **POOL)
    assert "speculative_config.model" in str(e.value) and words in str(e.value)


def test_a_missing_draft_is_refused_naming_the_setting(tiny_model_dir, tmp_path):
    spec = {"model": str(tmp_path / "draft.gguf")}
    with pytest.raises(SettingError, match=r"speculative_config.model must be a model \(no model"):
        LLM(str(tiny_model_dir), speculative_config=spec, **POOL)


def test_a_draft_model_under_tensor_parallelism(tiny_model_dir, tiny_model_factory):
    """The draft runs whole in rank 0's process; the target's verification on both ranks."""
    draft = tiny_model_factory(hidden_size=32, num_layers=1, intermediate_size=64, seed=1)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n)) * 2} for n in (5, 12)]
    expected = [o.outputs[0].token_ids for o in LLM(str(tiny_model_dir), **POOL).generate(
        prompts, GREEDY, use_tqdm=False)]  # fmt: skip
    for spec in ({"model": str(tiny_model_dir)}, {"model": str(draft)}):
        with LLM(
            str(tiny_model_dir), tensor_parallel_size=2, speculative_config=spec, **POOL
        ) as tp:
            got = [o.outputs[0].token_ids for o in tp.generate(prompts, GREEDY, use_tqdm=False)]
            assert got == expected
            assert tp.engine.stats().spec_decode.num_drafts > 0
            tp.engine.audit()
            assert tp.engine.stats().free_blocks == tp.engine.num_blocks
