"""The scheduler's bound on a request that scores its prompt, without a model: beside requests of
other groups it computes at most `scoring_turn` positions a step, so that their steps do not grow
with the scored prompt's length; alone it takes the whole budget."""

from nanoserve.engine.kv_manager import KVCacheManager
from nanoserve.engine.request import Request
from nanoserve.engine.sampling import SamplingParams
from nanoserve.engine.scheduler import Scheduler

BUDGET, TURN = 512, 64
LONG = 2000  # tokens of the scored prompt: about four budgets


def _scheduler():
    kv = KVCacheManager(num_blocks=1024, block_size=16)
    return Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=BUDGET, scoring_turn=TURN)


def _request(rid, num_tokens, prompt_logprobs=None, max_tokens=4):
    params = SamplingParams(max_tokens=max_tokens, prompt_logprobs=prompt_logprobs)
    prompt = [(7 * i + len(rid)) % 1000 for i in range(num_tokens)]
    return Request(rid, rid, 0, prompt, params, 0, max_tokens, detokenizer=None)


def _step(scheduler):
    """One step as the engine runs it: the chunks it got (by request id), prompt logprobs
    recorded, a token appended to each request that samples, finished ones removed."""
    batch = scheduler.schedule()
    for item in batch:
        if item.request.prompt_logprobs is not None:
            item.request.prompt_logprobs += [{}] * len(item.chunk().prompt_logprob_positions)
    scheduler.after_step(batch)
    for item in batch:
        request = item.request
        if item.samples:
            request.token_ids.append(1)
            if request.num_output_tokens >= request.output_limit:
                scheduler.remove(request)
    return {item.request.request_id: item.num_new_tokens for item in batch}


def test_a_lone_scoring_request_takes_the_whole_budget():
    scheduler = _scheduler()
    scheduler.add(_request("scored", LONG, prompt_logprobs=5))
    assert [_step(scheduler)["scored"] for _ in range(3)] == [BUDGET] * 3


def test_a_scoring_request_takes_its_turn_beside_other_groups():
    """A running decode, then a short request arriving mid-prompt: every step while they are
    there the scored prompt gets at most TURN tokens; once it is alone, the whole budget."""
    scheduler = _scheduler()
    scheduler.add(_request("running", 20, max_tokens=6))
    _step(scheduler)
    scored = _request("scored", LONG, prompt_logprobs=5)
    scheduler.add(scored)
    chunks = [_step(scheduler) for _ in range(2)]
    scheduler.add(_request("short", 8, max_tokens=4))
    while "short" in {r.request_id for r in scheduler.running + list(scheduler.waiting)}:
        chunks.append(_step(scheduler))
    assert all(step["scored"] <= TURN for step in chunks)
    assert all(step.get("running") == 1 for step in chunks[:4])
    assert "short" in chunks[2]
    computed = scored.num_computed_tokens
    assert computed < 10 * TURN
    assert _step(scheduler)["scored"] == min(BUDGET, LONG - computed)
    assert len(scored.prompt_logprobs) - 1 == scored.num_computed_tokens


def test_a_group_of_its_own_is_not_other_requests():
    """The first of n = 2 scores the prompt alone: its sibling waits and does not bound it."""
    scheduler = _scheduler()
    params = SamplingParams(n=2, max_tokens=2, prompt_logprobs=5)
    prompt = list(range(LONG))
    for index in range(2):
        scheduler.add(Request(f"g-{index}", "g", index, prompt, params, 0, 2, None))
    assert _step(scheduler) == {"g-0": BUDGET}
