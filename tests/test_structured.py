"""Structured outputs in the engine: every constrained output matches its constraint (JSON
schemas validated by the jsonschema package, regexes full-matched, choices exact) at temperature
1 with several seeds, on a random model that left alone would write anything; the constraint
survives preemption, n > 1, prefix caching and a batch of others; bad constraints are refused
naming the field."""

import json
import re

import jsonschema
import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.engine import RequestRejected, StructuredOutputsParams
from nanoserve.engine.structured import GrammarError

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "address": {
                "type": "object",
                "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "array": {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 2,
        "maxItems": 4,
    },
    "enum_anyof": {
        "type": "object",
        "properties": {
            "kind": {"enum": ["cat", "dog"]},
            "value": {
                "anyOf": [{"type": "boolean"}, {"type": "integer", "maximum": 99, "minimum": 0}]
            },
        },
        "required": ["kind", "value"],
        "additionalProperties": False,
    },  # fmt: skip
    "bounded_integers": {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 30}},
        "required": ["age"],
        "additionalProperties": False,
    },
}
SEEDS = range(3)


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(model=str(tiny_model_factory()), num_kv_blocks=256, max_num_seqs=16)


def _generate(llm, constraint, n=1, temperature=1.0, seeds=SEEDS, **kwargs):
    prompts = [f"Write item {i}:" for i in range(2)]
    texts = []
    for seed in seeds:
        params = SamplingParams(
            n=n, temperature=temperature, seed=seed, max_tokens=400,
            structured_outputs=constraint, **kwargs,
        )  # fmt: skip
        for out in llm.generate(prompts, params, use_tqdm=False):
            for c in out.outputs:
                assert c.finish_reason == "stop", (c.finish_reason, c.text)
                texts.append(c.text)
    return texts


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_json_output_validates_against_its_schema(llm, name):
    schema = SCHEMAS[name]
    for text in _generate(llm, StructuredOutputsParams(json=schema), n=2):
        jsonschema.validate(json.loads(text), schema)


def test_a_random_model_alone_writes_no_json(llm):
    """The control: without the constraint the same model does not write valid JSON, so the
    tests above show the mask at work."""
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=40)
    text = llm.generate(["Write item 0:"], params, use_tqdm=False)[0].outputs[0].text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_regexes_full_match_and_choices_are_exact(llm):
    pattern = r"[a-c]{2}-[0-9]{3}"
    for text in _generate(llm, StructuredOutputsParams(regex=pattern)):
        assert re.fullmatch(pattern, text), text
    choices = ["red", "green", "light blue"]
    texts = _generate(llm, StructuredOutputsParams(choice=choices), n=3)
    assert set(texts) <= set(choices)
    json_object = _generate(llm, StructuredOutputsParams(json_object=True), seeds=[0])
    assert all(isinstance(json.loads(t), dict) for t in json_object)


def test_a_lark_grammar_and_a_gbnf_one(llm):
    lark = StructuredOutputsParams(grammar='start: "x=" NUM\nNUM: /[0-9]{1,3}/')
    assert all(re.fullmatch(r"x=[0-9]{1,3}", t) for t in _generate(llm, lark))
    gbnf = StructuredOutputsParams(grammar='root ::= "y=" [0-9] [0-9]?')
    assert all(re.fullmatch(r"y=[0-9]{1,2}", t) for t in _generate(llm, gbnf))


def test_whitespace_pattern_and_none(llm):
    schema = SCHEMAS["bounded_integers"]
    tight = StructuredOutputsParams(json=schema, whitespace_pattern="")
    assert all(" " not in t and "\n" not in t for t in _generate(llm, tight))


def test_the_output_does_not_depend_on_the_batch_or_on_preemption(tiny_model_factory):
    """Greedy and seeded constrained outputs alone equal the same requests in a crowd that
    forces preemptions (a pool too small for all of them)."""
    schema = SCHEMAS["nested"]
    constraint = StructuredOutputsParams(json=schema)
    model = str(tiny_model_factory())
    prompts = [f"Item {i}: " + "word " * (i * 7) for i in range(8)]
    params = [
        SamplingParams(temperature=t, seed=i, max_tokens=400, structured_outputs=constraint)
        for i, t in enumerate([0.0, 1.0] * 4)
    ]
    alone = LLM(model=model, num_kv_blocks=256, max_num_seqs=16)
    expected = [alone.generate([p], q, use_tqdm=False)[0].outputs[0].text
                for p, q in zip(prompts, params, strict=True)]  # fmt: skip
    crowded = LLM(model=model, num_kv_blocks=64, block_size=8, max_num_seqs=8)
    outs = crowded.generate(prompts, params, use_tqdm=False)
    assert crowded.engine.stats().num_preemptions > 0
    assert [o.outputs[0].text for o in outs] == expected
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    for text in expected:
        jsonschema.validate(json.loads(text), schema)
    crowded.engine.audit()


def test_max_tokens_mid_object_ends_with_length(llm):
    params = SamplingParams(
        temperature=1.0, seed=0, max_tokens=3,
        structured_outputs=StructuredOutputsParams(json=SCHEMAS["nested"]),
    )  # fmt: skip
    out = llm.generate(["x"], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_logprobs_are_of_the_masked_distribution(llm):
    """The chosen tokens' alternatives are all tokens the grammar allows: with a choice of two
    one-character answers, the top alternatives hold just those."""
    params = SamplingParams(
        temperature=0.0, max_tokens=5, logprobs=5,
        structured_outputs=StructuredOutputsParams(choice=["A", "B"]),
    )  # fmt: skip
    out = llm.generate(["x"], params, use_tqdm=False)[0].outputs[0]
    (entry,) = out.logprobs
    finite = {t for t, lp in entry.items() if lp.logprob > float("-inf")}
    allowed = {llm.engine.tokenizer.encode(c, add_special_tokens=False)[0] for c in "AB"}
    assert finite <= allowed
    assert sum(2.718281828**lp.logprob for t, lp in entry.items() if t in allowed) == (
        pytest.approx(1.0, abs=1e-4)
    )


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"json": {"type": "nonsense"}}, "structured_outputs.json"),
        ({"regex": "[a-"}, "structured_outputs.regex"),
        ({"grammar": "start: missing_rule"}, "structured_outputs.grammar"),
        ({"choice": []}, "structured_outputs.choice"),
        ({}, "exactly one of"),
        ({"regex": "a", "choice": ["a"]}, "exactly one of"),
    ],
)
def test_a_bad_constraint_is_refused_naming_it(llm, fields, message):
    with pytest.raises((RequestRejected, GrammarError), match=re.escape(message)):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(**fields)))
