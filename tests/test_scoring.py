"""Scoring: prompt logprobs (SamplingParams.prompt_logprobs) equal transformers' log-softmax of
its logits, however the prompt is computed (whole, in chunks, across a preemption, with its
prefix in the cache); `echo` with `logprobs` and `max_tokens: 0` through the server in the OpenAI
legacy shape that evaluation harnesses read; vLLM's tokenizer routes."""

import json

import openai
import pytest
import torch
import transformers

from nanoserve import LLM, SamplingParams
from nanoserve.config import EngineConfig
from nanoserve.engine import Engine
from nanoserve.testing.harness import MODEL_NAME, live_server, sse_data

PROMPT = list(range(5, 5 + 70))  # spans 5 blocks of 16


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """transformers' log-softmax at every prompt position (float64)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def _check(prompt_logprobs, reference, top_n=3):
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(PROMPT)
    for i in range(1, len(PROMPT)):
        row, entry = reference[i - 1], prompt_logprobs[i]
        assert set(entry) == {PROMPT[i], *row.topk(top_n).indices.tolist()}
        for token, lp in entry.items():
            assert lp.logprob == pytest.approx(float(row[token]), abs=1e-4)
            assert lp.rank == int((row > row[token]).sum()) + 1


@pytest.mark.parametrize("engine_args", [{}, {"max_num_batched_tokens": 16}])
def test_prompt_logprobs_equal_transformers(tiny_model_dir, reference, engine_args):
    llm = LLM(str(tiny_model_dir), **engine_args)
    params = SamplingParams(prompt_logprobs=3, max_tokens=4, temperature=0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    _check(out.prompt_logprobs, reference)
    assert len(out.outputs[0].token_ids) == 4
    llm.engine.audit()


def test_prompt_logprobs_survive_a_preemption(tiny_model_dir, reference):
    """A pool of 7 blocks for two requests that need 5 each: the later one is preempted in its
    prefill, recomputed, and records each position once, with the same numbers."""
    engine = Engine(tiny_model_dir, EngineConfig(num_kv_blocks=7, max_num_batched_tokens=16))
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    engine.add_request("first", list(range(100, 130)), greedy)
    engine.add_request("scored", PROMPT, SamplingParams(prompt_logprobs=3, max_tokens=2))
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert engine.stats().num_preemptions > 0
    _check(finished["scored"].prompt_logprobs, reference)


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(tiny_model_dir, reference):
    """Cached blocks hold keys and values, not logits: a request that scores its prompt skips
    the prefix cache (its own blocks are still published for others)."""
    llm = LLM(str(tiny_model_dir))
    warm = SamplingParams(max_tokens=1)
    llm.generate([{"prompt_token_ids": PROMPT}], warm, use_tqdm=False)
    before = llm.engine.stats()
    params = SamplingParams(prompt_logprobs=3, max_tokens=1)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    _check(out.prompt_logprobs, reference)
    after = llm.engine.stats()
    assert after.computed_tokens - before.computed_tokens == len(PROMPT)
    assert after.num_prefix_hit_tokens == before.num_prefix_hit_tokens
    again = llm.generate([{"prompt_token_ids": PROMPT}], warm, use_tqdm=False)[0]
    assert again.num_cached_tokens == 64  # four full blocks, published by the scored request


def test_max_tokens_zero_scores_without_generating(tiny_model_dir, reference):
    llm = LLM(str(tiny_model_dir))
    out = llm.generate(
        [{"prompt_token_ids": PROMPT}], SamplingParams(prompt_logprobs=0, max_tokens=0),
        use_tqdm=False,
    )[0]  # fmt: skip
    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    _check(out.prompt_logprobs, reference, top_n=0)
    with pytest.raises(ValueError, match="prompt_logprobs must be"):
        SamplingParams(prompt_logprobs=21)


async def test_echo_with_logprobs_through_the_openai_client(tiny_model_dir, reference):
    """What lm-eval's local-completions sends: token id prompts, echo, logprobs 1, max_tokens
    0 or 1. token_logprobs starts with None, then transformers' values; top_logprobs hold the
    prompt token and the most likely one."""
    async with (
        live_server(tiny_model_dir, num_kv_blocks=64) as server,
        openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client,
    ):
        for max_tokens in (0, 1):
            reply = await client.completions.create(
                model=MODEL_NAME, prompt=[PROMPT, PROMPT[:20]], echo=True, logprobs=1,
                max_tokens=max_tokens, temperature=0,
            )  # fmt: skip
            first, second = reply.choices
            lp = first.logprobs
            assert len(lp.tokens) == len(PROMPT) + max_tokens
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            for i in range(1, len(PROMPT)):
                assert lp.token_logprobs[i] == pytest.approx(
                    float(reference[i - 1, PROMPT[i]]), abs=1e-4
                )
                assert max(lp.top_logprobs[i].values()) == pytest.approx(
                    float(reference[i - 1].max()), abs=1e-4
                )
            assert lp.token_logprobs[1:20] == second.logprobs.token_logprobs[1:20]
            assert first.text.startswith(server.engine.tokenizer.decode(PROMPT))
        assert reply.usage.prompt_tokens == len(PROMPT) + 20


async def test_streamed_echo_sends_the_prompt_with_its_logprobs_first(tiny_model_dir):
    async with live_server(tiny_model_dir, num_kv_blocks=64) as server:
        body = {"prompt": "Hello world", "echo": True, "logprobs": 1, "max_tokens": 3,
                "temperature": 0, "stream": True}  # fmt: skip
        response = await server.http.post("/v1/completions", json=body)
        events = [json.loads(e) for e in sse_data(response.content) if e != "[DONE]"]
        unary = (await server.http.post("/v1/completions", json={**body, "stream": False})).json()
    opening = events[0]["choices"][0]
    assert opening["text"] == "Hello world" and opening["logprobs"]["token_logprobs"][0] is None
    streamed = "".join(e["choices"][0]["text"] for e in events)
    assert streamed == unary["choices"][0]["text"]
    tokens = [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]]
    assert tokens == unary["choices"][0]["logprobs"]["tokens"]


async def test_prompt_logprobs_field_and_tokenizer_routes(tiny_model_dir):
    async with live_server(tiny_model_dir, num_kv_blocks=64) as server:
        tok = server.engine.tokenizer
        body = {"prompt": PROMPT, "prompt_logprobs": 2, "max_tokens": 1}
        choice = (await server.http.post("/v1/completions", json=body)).json()["choices"][0]
        entries = choice["prompt_logprobs"]
        assert entries[0] is None and len(entries) == len(PROMPT)
        assert all(str(PROMPT[i]) in entries[i] for i in range(1, len(PROMPT)))
        tokens = (await server.http.post("/tokenize", json={"prompt": "Hello world"})).json()
        assert tokens["tokens"] == tok.encode("Hello world") and tokens["count"] == 7
        text = (await server.http.post("/detokenize", json={"tokens": tokens["tokens"]})).json()
        assert text["prompt"] == tok.decode(tokens["tokens"], skip_special_tokens=False)
        info = (await server.http.get("/tokenizer_info")).json()
        assert info["eos_token"] == "<|eot_id|>" and info["chat_template"]
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        rendered = (await server.http.post("/tokenize", json=chat)).json()["tokens"]
        assert rendered == tok.encode(tok.apply_chat_template(chat["messages"]), False)
        bad = await server.http.post("/detokenize", json={"tokens": [10**7]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
