"""gpt-oss's harmony format over a real socket: a tiny random gpt-oss checkpoint whose tokenizer
has harmony's control tokens, with a small harmony chat template (so the openai_gptoss parser is
on by default), taught (`memorize`) to think on the analysis channel, then to call a tool on the
commentary channel, or to answer on the final channel. The live path makes the tokens: the
analysis comes back as reasoning_content (chat), a reasoning item (Responses) and a thinking
block (Messages); the call as tool_calls, the generation stopped at <|call|>, which is not the
checkpoint's EOS; a thinking budget forces the final channel."""

import json
from pathlib import Path

import pytest
from test_reasoning_http import _streamed, _unary

from nanoserve.llm import LLM
from nanoserve.server.chat_plan import chat_inputs, chat_plan
from nanoserve.server.protocol import ChatCompletionRequest, parse
from nanoserve.server.reasoning import HARMONY
from nanoserve.testing.harness import MODEL_NAME, live_server
from nanoserve.testing.hf_families import memorize, write_gpt_oss_chat_checkpoint
from nanoserve.tokenizer import Tokenizer

TEMPLATE = (Path(__file__).parent / "data" / "harmony_chat_template.jinja").read_text()
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip
QUESTION = "What is the capital of France?"
WEATHER = {
    "model": MODEL_NAME,
    "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
    "tools": [WEATHER_TOOL],
    "temperature": 0,
    "max_tokens": 80,
}
CAPITAL = {**WEATHER, "messages": [{"role": "user", "content": QUESTION}], "tools": None}
THOUGHT, CITY_THOUGHT, ANSWER = "Use the tool.", "Easy one.", "Paris."
CALL = ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city":"Paris"}<|call|>')  # fmt: skip
ANSWERS = [
    (WEATHER, f"<|channel|>analysis<|message|>{THOUGHT}<|end|>{CALL}"),
    (CAPITAL, f"<|channel|>analysis<|message|>{CITY_THOUGHT}<|end|>"
              f"<|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>"),
]  # fmt: skip


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    """The answers are taught after the prompts the server renders for these requests."""
    path = write_gpt_oss_chat_checkpoint(tmp_path_factory.mktemp("gpt_oss_chat"), TEMPLATE)
    tok = Tokenizer.from_dir(path)
    examples = []
    for body, answer in ANSWERS:
        inputs = chat_inputs(parse(ChatCompletionRequest, json.dumps(body)), tok.chat_template)
        _, prompt = tok.render_chat(inputs.messages, **inputs.kwargs)
        examples.append((prompt, tok.encode(answer, add_special_tokens=False)))
    memorize(path, examples)
    return path


@pytest.fixture
async def server(gpt_oss_dir):
    async with live_server(gpt_oss_dir, num_kv_blocks=32) as s:
        yield s


async def test_the_analysis_is_reasoning_and_the_commentary_a_call(server):
    """Unary and streamed; without <|call|> as a stop the random model would write on to
    max_tokens."""
    choice = await _unary(server, WEATHER)
    message = choice["message"]
    assert message["reasoning_content"] == message["reasoning"] == THOUGHT
    calls = [c["function"] for c in message["tool_calls"]]
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert message["content"] is None and choice["finish_reason"] == "tool_calls"
    assert await _streamed(server, WEATHER) == (THOUGHT, "", calls, ["tool_calls"])


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
async def test_a_required_call_comes_after_the_analysis(server, choice):
    """The grammar of the call starts where the analysis ended: the model thinks, then calls."""
    answer = await _unary(server, {**WEATHER, "tool_choice": choice})
    message = answer["message"]
    assert message["reasoning_content"] == THOUGHT
    calls = [c["function"] for c in message["tool_calls"]]
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert answer["finish_reason"] == "tool_calls"


def test_a_required_call_is_forced_where_the_model_would_answer(gpt_oss_dir):
    """Taught to answer the capital's question on the final channel, the model is made to call:
    once the analysis has taken its budget, its end and the call's header are forced (the
    arguments are then the random model's, cut short by max_tokens)."""
    llm = LLM(str(gpt_oss_dir), num_kv_blocks=32)
    tok = llm.engine.tokenizer
    body = {**CAPITAL, "tools": [WEATHER_TOOL], "tool_choice": "required",
            "thinking_token_budget": 2, "max_tokens": 40}  # fmt: skip
    req = parse(ChatCompletionRequest, json.dumps(body))
    inputs = chat_inputs(req, tok.chat_template)
    prompt, ids = tok.render_chat(inputs.messages, **inputs.kwargs)
    plan = chat_plan(req, tok, HARMONY, inputs, prompt)
    out = llm.generate([{"prompt_token_ids": ids}], plan.params, use_tqdm=False)[0].outputs[0]
    text = tok.decode(list(out.token_ids), skip_special_tokens=False)
    assert text.startswith("<|channel|>analysis<|message|>")
    assert "<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather" in text
    assert "final" not in text and ANSWER not in text


async def test_the_final_channel_is_the_answer(server):
    choice = await _unary(server, CAPITAL)
    message = choice["message"]
    assert (message["reasoning_content"], message["content"]) == (CITY_THOUGHT, ANSWER)
    assert choice["finish_reason"] == "stop" and message["tool_calls"] == []
    assert await _streamed(server, CAPITAL) == (CITY_THOUGHT, ANSWER, [], ["stop"])


async def test_the_responses_and_messages_apis_get_the_reasoning(server):
    """A reasoning item then the message (Responses); a thinking block then the text
    (Anthropic's Messages)."""
    body = {"model": MODEL_NAME, "input": QUESTION, "temperature": 0, "max_output_tokens": 80}
    response = await server.http.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    reasoning, message = response.json()["output"]
    assert reasoning["type"] == "reasoning"
    assert reasoning["content"] == [{"type": "reasoning_text", "text": CITY_THOUGHT}]
    assert message["content"][0]["text"] == ANSWER
    body = {"model": MODEL_NAME, "max_tokens": 80, "temperature": 0,
            "messages": [{"role": "user", "content": QUESTION}]}  # fmt: skip
    reply = await server.http.post("/v1/messages", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["content"] == [
        {"type": "thinking", "thinking": CITY_THOUGHT, "signature": ""},
        {"type": "text", "text": ANSWER},
    ]


async def test_a_thinking_budget_forces_the_final_channel(server):
    """Once the analysis has taken its budget, the end of it and the final channel's header are
    forced: the reasoning is cut short and the rest is the answer."""
    choice = await _unary(server, {**CAPITAL, "thinking_token_budget": 1, "max_tokens": 40})
    message = choice["message"]
    assert len(message["reasoning_content"]) < len(CITY_THOUGHT)
    assert CITY_THOUGHT.startswith(message["reasoning_content"])
    assert message["content"]
