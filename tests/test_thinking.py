"""A reasoning model's thinking in the engine, on token ids (a random model and made-up tags):
the thinking budget forces the end tag (its tokens, in order) once the thinking has taken that
many tokens, counted from the prompt's open thinking or from the start tag the model writes; a
constraint waits for the end of the thinking, the start tag allowed beside it before anything
is written; the state survives preemption; bad parameters are refused naming the field."""

import re

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.engine import RequestRejected, StructuredOutputsParams, ThinkingParams

START, END = 5, (6, 7)  # made-up tags: a start of one token, an end of two
YES_NO = StructuredOutputsParams(choice=["yes", "no"])
PROMPT = "The lighthouse keeper"


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(model=str(tiny_model_factory()), num_kv_blocks=256, max_num_seqs=16)


def _tokens(llm, **kwargs) -> list[int]:
    return _output(llm, **kwargs).token_ids


def _output(llm, **kwargs):
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 12, **kwargs})
    return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("budget", [0, 1, 4])
def test_the_budget_forces_the_end_tag_after_that_many_tokens(llm, budget, temperature):
    """The prompt opened the thinking: its first `budget` tokens are the model's own (as they
    would have been without a budget), then the end tag's tokens, then the model again."""
    free = _tokens(llm, temperature=temperature, seed=3)
    thinking = ThinkingParams((START,), END, started=True, budget=budget)
    tokens = _tokens(llm, temperature=temperature, seed=3, thinking=thinking)
    assert tokens[:budget] == free[:budget]
    assert tokens[budget : budget + 2] == list(END)
    assert len(tokens) == 12


def test_the_budget_counts_from_the_start_tag_the_model_writes(llm):
    """Not opened by the prompt: the thinking starts with the start tag (biased to come first;
    a tag of two tokens has its second forced), and the budget counts the tokens after it."""
    bias = {START: 100.0}
    thinking = ThinkingParams((START, 9), END, budget=2)
    tokens = _tokens(llm, logit_bias=bias, thinking=thinking)
    assert tokens[:2] == [START, 9] and tokens[4:6] == list(END)
    # a first token that is not the start tag: no thinking, no budget, nothing forced
    plain = _tokens(llm, logit_bias={START: -100.0})
    tokens = _tokens(llm, logit_bias={START: -100.0}, thinking=thinking)
    assert tokens == plain and START not in tokens


def test_without_a_budget_or_a_constraint_the_engine_changes_nothing(llm):
    thinking = ThinkingParams((START,), END, started=True)
    assert _tokens(llm, thinking=thinking) == _tokens(llm)


def test_a_constraint_starts_after_the_thinking(llm):
    """Deferred: the thinking runs free, its end is forced by the budget, then the constraint
    holds and completes the output ("stop")."""
    for temperature, seed in [(0.0, 0), (1.0, 1), (1.0, 2)]:
        thinking = ThinkingParams((START,), (6,), started=True, budget=3)
        out = _output(llm, temperature=temperature, seed=seed, structured_outputs=YES_NO,
                      thinking=thinking, max_tokens=40)  # fmt: skip
        assert out.token_ids[3] == 6 and out.finish_reason == "stop"
        answer = llm.engine.tokenizer.decode(out.token_ids[4:])
        assert answer in ("yes", "no")


def test_the_end_tag_the_model_writes_starts_the_constraint(llm):
    thinking = ThinkingParams((START,), (6,), started=True, budget=100)
    out = _output(llm, logit_bias={6: 100.0}, structured_outputs=YES_NO, thinking=thinking)
    assert out.token_ids[0] == 6 and out.finish_reason == "stop"
    assert llm.engine.tokenizer.decode(out.token_ids[1:]) in ("yes", "no")


def test_before_anything_the_start_tag_is_allowed_beside_the_constraint(llm):
    """The model may think first (the start tag, biased here) or answer at once within the
    constraint (the start tag biased away): the constraint's first token or the tag."""
    thinking = ThinkingParams((START,), (6,), budget=2)
    out = _output(llm, logit_bias={START: 100.0}, structured_outputs=YES_NO, thinking=thinking)
    assert out.token_ids[0] == START and out.token_ids[3] == 6 and out.finish_reason == "stop"
    assert llm.engine.tokenizer.decode(out.token_ids[4:]) in ("yes", "no")
    out = _output(llm, logit_bias={START: -100.0}, structured_outputs=YES_NO, thinking=thinking)
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    # without thinking parameters the tag is no exception to the constraint
    out = _output(llm, logit_bias={START: 100.0}, structured_outputs=YES_NO)
    assert START not in out.token_ids and out.text in ("yes", "no")


def test_the_thinking_survives_preemption(tiny_model_factory):
    """Alone, and in a crowd that forces preemptions, the same tokens: the forced end tag at the
    same place, the deferred constraint's answer the same."""
    model = str(tiny_model_factory())
    prompts = [f"Item {i}: " + "word " * (i * 7) for i in range(8)]
    params = [
        SamplingParams(temperature=t, seed=i, max_tokens=80, structured_outputs=YES_NO,
                       thinking=ThinkingParams((START,), END, started=True, budget=40 + i))
        for i, t in enumerate([0.0, 1.0] * 4)
    ]  # fmt: skip
    alone = LLM(model=model, num_kv_blocks=256, max_num_seqs=16)
    expected = [alone.generate([p], q, use_tqdm=False)[0].outputs[0].token_ids
                for p, q in zip(prompts, params, strict=True)]  # fmt: skip
    crowded = LLM(model=model, num_kv_blocks=64, block_size=8, max_num_seqs=8)
    outs = crowded.generate(prompts, params, use_tqdm=False)
    assert crowded.engine.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    for i, tokens in enumerate(expected):
        assert tokens[40 + i : 42 + i] == list(END)
        assert re.fullmatch("yes|no", alone.engine.tokenizer.decode(tokens[42 + i :]))
    crowded.engine.audit()


@pytest.mark.parametrize(
    "thinking",
    [ThinkingParams((), END), ThinkingParams((START,), END, budget=-1),
     ThinkingParams((START,), (-6,)), "budget 3"],
)  # fmt: skip
def test_bad_thinking_parameters_are_refused(thinking):
    with pytest.raises(ValueError, match="^thinking must be"):
        SamplingParams(thinking=thinking)


def test_tags_outside_the_vocabulary_are_refused(llm):
    thinking = ThinkingParams((START,), (10**6,), budget=1)
    with pytest.raises(RequestRejected, match="thinking") as refused:
        llm.engine.admit("x", SamplingParams(thinking=thinking))
    assert refused.value.param == "thinking"
