"""Fairness between requests, counted in engine steps: a long prompt (here one that scores its
prompt, several times the token budget) is computed in chunks mixed into the same steps as the
running decodes and the later arrivals' first chunks, so that neither waits for its whole length;
its prompt logprobs are still transformers' numbers."""

import itertools

import pytest
import torch
import transformers

from nanoserve import SamplingParams
from nanoserve.config import EngineConfig
from nanoserve.engine import Engine

BUDGET = 64  # max_num_batched_tokens
LONG = [(7 * i) % 900 + 5 for i in range(5 * BUDGET)]  # five budgets of prompt
GREEDY = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


def _engine(model, **settings):
    settings = {"num_kv_blocks": 64, **settings}
    return Engine(model, EngineConfig(max_num_batched_tokens=BUDGET, **settings))


def _step(engine):
    return {out.request_id: out for out in engine.step()}


def _tokens(out):
    return len(out.outputs[0].token_ids) if out is not None else 0


def test_a_long_scored_prompt_lets_decodes_and_a_later_short_request_through(tiny_model_dir):
    """A request decoding when the long prompt arrives gets a token every step; a short request
    that arrives in the long prompt's first step gets its first token in the next step, while
    the long prompt is still being computed."""
    engine = _engine(tiny_model_dir)
    engine.add_request("running", list(range(10, 30)), GREEDY)
    _step(engine)
    scored = SamplingParams(prompt_logprobs=3, max_tokens=1, temperature=0)
    engine.add_request("long", LONG, scored)
    outs, made = _step(engine), 2
    assert _tokens(outs["running"]) == made
    engine.add_request("short", [3, 1, 4, 1, 5, 9, 2, 6], SamplingParams(max_tokens=4))
    steps_to_first_token, long_done = None, None
    for step in range(1, 20):
        outs = _step(engine)
        made += 1
        assert _tokens(outs["running"]) == made, f"the running request missed step {step}"
        if steps_to_first_token is None and _tokens(outs.get("short")) > 0:
            steps_to_first_token = step
        if "long" in outs and outs["long"].finished:
            long_done, long_out = step, outs["long"]
            break
    assert steps_to_first_token == 1
    assert long_done is not None and long_done > steps_to_first_token
    _check_prompt_logprobs(tiny_model_dir, long_out.prompt_logprobs)
    engine.abort("running")
    engine.audit()
    assert engine.stats().free_blocks == engine.num_blocks


def test_running_decodes_get_a_token_every_step_beside_many_waiting_prompts(tiny_model_dir):
    """Forty queued prompts of a budget each (one client's batch): the earlier request still
    decodes every step, and the queued prompts get their first tokens one after the other."""
    engine = _engine(tiny_model_dir, num_kv_blocks=256, max_num_seqs=64)
    engine.add_request("running", list(range(10, 30)), GREEDY)
    _step(engine)
    for i in range(40):
        engine.add_request(f"queued-{i}", [i + 1] * BUDGET, SamplingParams(max_tokens=2))
    made, first_tokens = 1, {}
    for step in range(1, 80):
        outs = _step(engine)
        made += 1
        assert _tokens(outs["running"]) == made, f"the running request missed step {step}"
        for rid, out in outs.items():
            if rid.startswith("queued") and _tokens(out) > 0:
                first_tokens.setdefault(rid, step)
        if len(first_tokens) == 40:
            break
    assert len(first_tokens) == 40
    # In queue order, one every step or two: a prompt waits for those ahead of it, one budget
    # each, and for no more.
    steps = [first_tokens[f"queued-{i}"] for i in range(40)]
    assert steps[0] <= 2 and steps == sorted(steps)
    assert max(b - a for a, b in itertools.pairwise(steps)) <= 2
    engine.abort_all()
    engine.audit()


def _check_prompt_logprobs(model, prompt_logprobs, top_n=3):
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.inference_mode():
        reference = torch.log_softmax(hf(torch.tensor([LONG])).logits[0].double(), dim=-1)
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(LONG)
    for i in range(1, len(LONG)):
        row, entry = reference[i - 1], prompt_logprobs[i]
        assert set(entry) == {LONG[i], *row.topk(top_n).indices.tolist()}
        for token, lp in entry.items():
            assert lp.logprob == pytest.approx(float(row[token]), abs=1e-4)


def test_a_request_of_n_completions_does_not_hold_the_queue(tiny_model_dir):
    """While the first of n = 3 computes their shared long prompt (its siblings wait to reuse
    its blocks), a short request queued behind them gets its first token in the first step."""
    engine = _engine(tiny_model_dir)
    engine.add_request("n3", LONG[: 3 * BUDGET], SamplingParams(n=3, max_tokens=2))
    engine.add_request("short", [3, 1, 4, 1, 5], SamplingParams(max_tokens=2))
    outs = _step(engine)
    assert _tokens(outs.get("short")) == 1
    while engine.has_unfinished():
        outs = _step(engine)
    assert engine.stats().num_prefix_hit_tokens >= 2 * (3 * BUDGET - 16)  # the siblings shared
    engine.audit()
