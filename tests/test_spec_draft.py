"""Speculative decoding by a draft model: the target drafting for itself (every greedy draft
accepted: the draft's cache is right) and the same output as without speculation."""

from nanoserve import LLM, SamplingParams

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
