"""A request of n > 1 completions that scores a prompt already in the prefix cache: only the first
of the n computes the prompt's logprobs (cached blocks have no logits), the others reuse its
blocks. Every output of the group carries the whole prompt's logprobs, in the engine and through
the server, streamed and not, with echo and with prompt_logprobs."""

import json

import pytest
import torch
import transformers

from nanoserve.config import EngineConfig
from nanoserve.engine import Engine, SamplingParams
from nanoserve.testing.harness import live_server, sse_data

BUDGET = 64  # max_num_batched_tokens: the prompt takes more than one turn of the first request
PROMPT = [(11 * i) % 900 + 5 for i in range(100)]
WARM = SamplingParams(max_tokens=1, temperature=0)
URL = "/v1/completions"
BASE = {"prompt": PROMPT, "n": 4, "max_tokens": 3, "temperature": 0, "ignore_eos": True}


def _reference(model):
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0].double(), dim=-1)


def test_every_output_of_a_cached_scoring_group_has_the_whole_prompt(tiny_model_dir):
    engine = Engine(tiny_model_dir, EngineConfig(max_num_batched_tokens=BUDGET, num_kv_blocks=64))
    engine.add_request("warm", PROMPT, WARM)
    while engine.has_unfinished():
        engine.step()
    params = SamplingParams(n=4, prompt_logprobs=3, max_tokens=3, temperature=0, ignore_eos=True)
    engine.add_request("group", PROMPT, params)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert outputs and outputs[-1].finished
    for out in outputs:
        assert len(out.prompt_logprobs) == len(PROMPT), "an output before the prompt was scored"
    reference = _reference(tiny_model_dir)
    last = outputs[-1].prompt_logprobs
    for i in range(1, len(PROMPT)):
        assert last[i][PROMPT[i]].logprob == pytest.approx(
            float(reference[i - 1, PROMPT[i]]), abs=1e-4
        )
    assert all(len(c.token_ids) == 3 for c in outputs[-1].outputs)
    assert outputs[-1].num_cached_tokens == 0  # the scoring one computed its prompt
    engine.audit()


def _events(response):
    assert response.status_code == 200, response.text
    data = sse_data(response.content)
    assert data[-1] == "[DONE]", data[-3:]
    return [json.loads(e) for e in data[:-1]]


async def test_streamed_prompt_logprobs_of_a_cached_prompt_with_n_4(tiny_model_dir):
    """The prompt is sent once first (it is then in the prefix cache), then with
    prompt_logprobs and n = 4, unary and streamed: each choice has the whole prompt's entries,
    the streamed ones those of the unary answer."""
    async with live_server(
        tiny_model_dir, max_num_batched_tokens=BUDGET, num_kv_blocks=128
    ) as server:
        assert (await server.http.post(URL, json={**BASE, "n": 1})).status_code == 200
        scored = {**BASE, "prompt_logprobs": 5}
        unary = (await server.http.post(URL, json=scored)).json()["choices"]
        streamed = {}
        for event in _events(await server.http.post(URL, json={**scored, "stream": True})):
            for choice in event["choices"]:
                if choice.get("prompt_logprobs") is not None:
                    assert choice["index"] not in streamed
                    streamed[choice["index"]] = choice["prompt_logprobs"]
        assert sorted(streamed) == [0, 1, 2, 3]
        for choice in unary:
            assert len(choice["prompt_logprobs"]) == len(PROMPT)
            assert streamed[choice["index"]] == choice["prompt_logprobs"]
        await server.wait_idle()


async def test_streamed_echo_with_logprobs_of_a_cached_prompt_with_n_4(tiny_model_dir):
    """As above with echo and logprobs 20: the stream ends in [DONE], not in an error, and
    each choice's logprobs (the prompt's, then the 3 tokens') are the unary answer's."""
    async with live_server(
        tiny_model_dir, max_num_batched_tokens=BUDGET, num_kv_blocks=128
    ) as server:
        assert (await server.http.post(URL, json={**BASE, "n": 1})).status_code == 200
        echoed = {**BASE, "echo": True, "logprobs": 20}
        unary = (await server.http.post(URL, json=echoed)).json()["choices"]
        streamed = {i: [] for i in range(4)}
        for event in _events(await server.http.post(URL, json={**echoed, "stream": True})):
            for choice in event["choices"]:
                streamed[choice["index"]] += choice["logprobs"]["token_logprobs"]
        for choice in unary:
            assert len(choice["logprobs"]["token_logprobs"]) == len(PROMPT) + 3
            assert streamed[choice["index"]] == choice["logprobs"]["token_logprobs"]
        await server.wait_idle()
