"""Each sampling parameter changes the output the way it should; bad values are refused by name."""

import pytest
import torch
import transformers

from nanoserve import LLM, SamplingParams
from nanoserve.engine.sampling import SampleRow, sample, token_logprobs

PROMPT = {"prompt_token_ids": [5, 17, 300, 42, 9, 250, 77]}


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir))


def _tokens(llm, **params):
    params.setdefault("max_tokens", 16)
    params.setdefault("ignore_eos", True)
    out = llm.generate([PROMPT], SamplingParams(**params), use_tqdm=False)[0].outputs[0]
    llm.engine.audit()
    return out


def test_top_k_1_equals_greedy(llm):
    greedy = _tokens(llm, temperature=0).token_ids
    assert _tokens(llm, temperature=1.5, top_k=1, seed=3).token_ids == greedy


def test_tiny_top_p_and_full_min_p_equal_greedy(llm):
    greedy = _tokens(llm, temperature=0).token_ids
    assert _tokens(llm, temperature=1.0, top_p=1e-6, seed=4).token_ids == greedy
    assert _tokens(llm, temperature=1.0, min_p=1.0, seed=4).token_ids == greedy


def test_same_seed_same_text_other_seed_other_text(llm):
    a = _tokens(llm, temperature=1.0, seed=11)
    b = _tokens(llm, temperature=1.0, seed=11)
    c = _tokens(llm, temperature=1.0, seed=12)
    assert a.token_ids == b.token_ids and a.text == b.text
    assert a.token_ids != c.token_ids


def test_stop_string_cuts_exactly(llm):
    full = _tokens(llm, temperature=0, max_tokens=24)
    text = full.text
    assert len(text) > 6
    stop = text[3:6]  # usually spans tokens; the text before it is what must come back
    out = _tokens(llm, temperature=0, max_tokens=24, stop=[stop])
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_stop_token_ids_and_min_tokens(llm):
    full = _tokens(llm, temperature=0, max_tokens=16).token_ids
    target = full[4]
    out = _tokens(llm, temperature=0, stop_token_ids=[target])
    first = full.index(target)
    assert out.token_ids == full[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target
    late = _tokens(llm, temperature=0, stop_token_ids=[target], min_tokens=first + 2)
    assert target not in late.token_ids[: first + 2]
    assert len(late.token_ids) >= first + 2


def test_max_tokens_finishes_with_length(llm):
    out = _tokens(llm, temperature=0, max_tokens=5)
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_eos_stops_unless_ignored(tiny_model_dir):
    """A greedy run's fifth token is made the EOS: generation stops on it (the token is kept in
    token_ids, not in the text) unless ignore_eos, which runs to max_tokens instead."""
    llm = LLM(str(tiny_model_dir))
    full = _tokens(llm, temperature=0, max_tokens=12)
    eos = full.token_ids[4]
    first = full.token_ids.index(eos)
    llm.engine.eos_token_ids = {eos}
    stopped = _tokens(llm, temperature=0, max_tokens=12, ignore_eos=False)
    assert stopped.token_ids == full.token_ids[: first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    assert full.text.startswith(stopped.text) and len(stopped.text) < len(full.text)
    ignored = _tokens(llm, temperature=0, max_tokens=12, ignore_eos=True)
    assert ignored.token_ids == full.token_ids and ignored.finish_reason == "length"
    held = _tokens(llm, temperature=0, max_tokens=12, ignore_eos=False, min_tokens=first + 2)
    assert eos not in held.token_ids[: first + 2]  # banned until min_tokens


def test_penalties_push_away_from_repeats():
    logits = torch.tensor([[2.0, 1.9, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    base = SampleRow(SamplingParams(temperature=0), 0, 1, [3], [0])
    assert sample(logits, [base])[0].token_id == 0
    for params in (
        SamplingParams(temperature=0, presence_penalty=0.5),
        SamplingParams(temperature=0, frequency_penalty=0.5),
        SamplingParams(temperature=0, repetition_penalty=1.2),
    ):
        row = SampleRow(params, 0, 1, [3], [0])
        assert sample(logits, [row])[0].token_id == 1, params


def test_logprobs_report_chosen_and_top_n(llm, tiny_model_dir):
    """Each entry holds the sampled token and the top 3 of the model's own distribution, with
    the values and ranks of transformers' log-softmax at that position."""
    out = _tokens(llm, temperature=1.0, seed=1, logprobs=3, max_tokens=6)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = torch.tensor([PROMPT["prompt_token_ids"] + list(out.token_ids)])
    with torch.inference_mode():
        logits = model(ids).logits[0, len(PROMPT["prompt_token_ids"]) - 1 : -1]
    expected = torch.log_softmax(logits.double(), dim=-1)
    assert len(out.logprobs) == 6
    for token, entry, row in zip(out.token_ids, out.logprobs, expected, strict=True):
        top = row.topk(3).indices.tolist()
        assert set(entry) == {token, *top}
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(float(row[t]), abs=1e-4)
            assert lp.rank == int((row > row[t]).sum()) + 1


@pytest.mark.parametrize(
    "field,value",
    [
        ("n", 0),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 2.0),
        ("presence_penalty", 3.0),
        ("frequency_penalty", float("inf")),
        ("repetition_penalty", 0.0),
        ("seed", 1.5),
        ("max_tokens", -1),
        ("min_tokens", -1),
        ("stop", [""]),
        ("stop_token_ids", [-3]),
        ("logprobs", 21),
        ("logprobs", -2),
        ("prompt_logprobs", -1),
    ],
)
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be"):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(ValueError, match="min_tokens must be"):
        SamplingParams(min_tokens=10, max_tokens=5)


def test_logit_bias_and_allowed_token_ids_steer_every_row_alone():
    """A bias of 100 makes its token the greedy pick, -100 bans the greedy pick; allowed ids are
    the only ones sampled, greedy or not; the logprobs stay the model's own; other rows of the
    batch are untouched."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g)
    top = logits.argmax(dim=-1).tolist()
    rows = [
        SampleRow(SamplingParams(temperature=0, logit_bias={7: 100.0}, logprobs=1), 1, 0, [], []),
        SampleRow(SamplingParams(temperature=0, logit_bias={top[1]: -100.0}), 1, 0, [], []),
        SampleRow(SamplingParams(temperature=1.0, allowed_token_ids=[3, 9], seed=1), 1, 0, [], []),
        SampleRow(SamplingParams(temperature=0), 1, 0, [], []),
    ]
    out = sample(logits, rows)
    assert out[0].token_id == 7
    assert out[0].logprobs[7].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[7]))
    assert out[1].token_id != top[1]
    assert out[3].token_id == top[3]
    for seed in range(20):
        row = SampleRow(SamplingParams(allowed_token_ids=[3, 9], seed=seed), seed, 0, [], [])
        assert sample(logits[2:3], [row])[0].token_id in (3, 9)


@pytest.mark.parametrize(
    "kwargs",
    [{"logit_bias": {3: 101.0}}, {"logit_bias": {-1: 1.0}}, {"allowed_token_ids": []},
     {"logit_bias": {i: 1.0 for i in range(1025)}}],
)  # fmt: skip
def test_logit_bias_and_allowed_token_ids_are_checked(kwargs):
    with pytest.raises(ValueError, match=f"^{next(iter(kwargs))} must be"):
        SamplingParams(**kwargs)


def test_whole_vocabulary_logprobs_are_every_token_with_ties_sharing_a_rank():
    """logprobs -1: an entry for every token of the row, the values log_softmax's; a rank counts
    the tokens more likely, so tied tokens share one (and the chosen token's agrees with it)."""
    logits = torch.tensor([[2.0, 1.0, 1.0, float("-inf"), 1.0, float("-inf")], [0.0] * 6])
    assert SamplingParams(logprobs=-1).logprobs == -1
    first, flat = token_logprobs(logits, torch.tensor([2, 5]), [-1, -1])
    expected = torch.log_softmax(logits, dim=-1)
    assert set(first) == set(flat) == set(range(6))
    assert {t: e.rank for t, e in first.items()} == {0: 1, 1: 2, 2: 2, 4: 2, 3: 5, 5: 5}
    assert all(e.logprob == pytest.approx(float(expected[0, t])) for t, e in first.items())
    assert {e.rank for e in flat.values()} == {1}
    (top_two,) = token_logprobs(logits[:1], torch.tensor([3]), [2])  # one of the tied three
    assert len(top_two) == 3 and top_two[3].rank == 5 and top_two[0].rank == 1
    assert {e.rank for t, e in top_two.items() if t not in (0, 3)} == {2}
