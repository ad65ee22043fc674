"""Reasoning without a model: the thinking told apart from the answer (Qwen3's `<think>` first,
or DeepSeek-R1's thinking opened by the prompt), a stream cut anywhere adding up to the unary
answer with tool calls read from the answer only, the parser chosen from the chat template,
reasoning_effort's switch, and earlier turns' thinking rendered by Qwen3's own template."""

import json
from pathlib import Path

import pytest

from nanoserve.engine import RequestMetrics, RequestOutput, SamplingParams
from nanoserve.engine.outputs import CompletionOutput
from nanoserve.server.protocol import ChatMessage, InvalidRequest, message_dicts
from nanoserve.server.reasoning import THINK, Reasoning, parser_for, thinking_switch
from nanoserve.server.responses import ChatFormat, ToolPlan
from nanoserve.server.tools import HERMES
from nanoserve.testing.hf_families import qwen3_tokenizer
from nanoserve.tokenizer import Tokenizer

QWEN3 = (Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text()
NAMES = frozenset({"get_weather", "get_time"})
DRAFTED = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THOUGHT = f"Let me see. {DRAFTED} is what I would write."
# Qwen3's shape: the thinking (with a call drafted in it), then the answer with a real call.
WITH_CALLS = f"<think>\n{THOUGHT}\n</think>\n\nSure. {CALL}"


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(qwen3_tokenizer(), {"eos_token": "<|im_end|>"}, QWEN3)


def _snapshot(text, token_ids, finish=None):
    metrics = RequestMetrics(0.0, None, None, None, 0)
    out = CompletionOutput(0, text, list(token_ids), finish)
    return RequestOutput("r", [1], None, [out], finish is not None, 0, metrics)


def _streamed(fmt, snapshots):
    """The deltas of a stream of snapshots: reasoning, content, the calls, finish reasons."""
    choices = [c for s in snapshots for chunk in fmt.chunks(0, s) for c in chunk.choices]
    deltas = [c.delta for c in choices]
    finishes = [c.finish_reason for c in choices if c.finish_reason]
    calls = {}
    for d in deltas:
        for part in d.get("tool_calls", []):
            call = calls.setdefault(part["index"], {"name": "", "arguments": ""})
            call["name"] += part.get("function", {}).get("name", "")
            call["arguments"] += part.get("function", {}).get("arguments", "")
    reasoning = [d["reasoning_content"] for d in deltas if "reasoning_content" in d]
    assert reasoning == [d["reasoning"] for d in deltas if "reasoning" in d]
    content = "".join(d.get("content", "") for d in deltas)
    return "".join(reasoning), content, [calls[k] for k in sorted(calls)], finishes


def _formats(tokenizer, tools, started):
    plan = ToolPlan(HERMES, NAMES) if tools else None
    reasoning = Reasoning(THINK, started)
    return [ChatFormat(tokenizer, "id", "m", SamplingParams(), plan, reasoning) for _ in "ab"]


@pytest.mark.parametrize(
    "text,started,tools",
    [(WITH_CALLS, False, True), (WITH_CALLS, False, False),
     (f"{THOUGHT}\n</think>\n\nSure. {CALL}", True, True),  # DeepSeek-R1: the prompt opened it
     ("<think>\nStill thinking when max_tokens came", False, True),
     ("No thinking at all. " + CALL, False, True)],
    ids=["qwen3-tools", "qwen3-text", "opened-by-the-prompt", "cut-short", "no-thinking"],
)  # fmt: skip
def test_a_stream_cut_anywhere_adds_up_to_the_unary_answer(tokenizer, text, started, tools):
    """The text tokenized, then streamed as two snapshots cut after every token, and one token a
    snapshot: the reasoning deltas joined are the unary reasoning, the content deltas the unary
    content, the calls the unary calls; a call drafted in the thinking is never a call."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    finish = "length" if "max_tokens" in text else "stop"
    unary_fmt, _ = _formats(tokenizer, tools, started)
    message = unary_fmt.response([_snapshot(text, ids, finish)]).choices[0].message
    unary_calls = [c.function.model_dump() for c in message.tool_calls]
    assert all(c["name"] != "get_time" for c in unary_calls)  # the drafted one is no call
    streams = [[ids[:k], ids] for k in range(len(ids) + 1)]
    streams.append([ids[: k + 1] for k in range(len(ids))])
    for cuts in streams:
        fmt, _ = _formats(tokenizer, tools, started)
        snapshots = [_snapshot(tokenizer.decode(c), c, finish if c == ids else None) for c in cuts]
        reasoning, content, calls, finishes = _streamed(fmt, snapshots)
        assert reasoning == (message.reasoning_content or "")
        assert content == (message.content or "")
        assert calls == unary_calls
        assert finishes == [unary_fmt.response([_snapshot(text, ids, finish)]).choices[0]
                            .finish_reason]  # fmt: skip
    assert message.reasoning == message.reasoning_content


def test_what_the_unary_answer_says(tokenizer):
    """The thinking stripped of the whitespace around it, the answer of what leads it; calls
    only from the answer; cut short inside the thinking, the content is null, as vLLM's."""
    [fmt, _] = _formats(tokenizer, True, False)
    message = fmt.response([_snapshot(WITH_CALLS, [1], "stop")]).choices[0].message
    assert message.reasoning_content == THOUGHT and message.content == "Sure."
    assert [json.loads(c.function.arguments) for c in message.tool_calls] == [{"city": "Paris"}]
    choice = fmt.response([_snapshot("<think>\nhmm", [1], "length")]).choices[0]
    assert (choice.message.reasoning_content, choice.message.content) == ("hmm", None)
    assert choice.finish_reason == "length" and choice.message.tool_calls == []
    [plain, _] = _formats(tokenizer, False, False)
    message = plain.response([_snapshot(" Just an answer.", [1], "stop")]).choices[0].message
    assert (message.reasoning_content, message.content) == (None, " Just an answer.")


@pytest.mark.parametrize(
    "text,started,final,expected",
    [("<think>\nabc\n</think>\n\nanswer", False, True, ("abc", "answer", True)),
     ("<thi", False, False, ("", "", False)),  # perhaps the tag: held back
     ("<thi", False, True, ("", "<thi", False)),
     ("<think>\nabc\n</th", False, False, ("abc", "", True)),  # perhaps the end tag: held back
     ("<think>\nabc \n", False, False, ("abc", "", True)),  # whitespace may end it: held back
     ("<think>\nabc \n", False, True, ("abc", "", True)),
     ("abc</think>x", True, True, ("abc", "x", True)),
     ("<think>abc</think>x", True, True, ("abc", "x", True)),  # the tag again: dropped
     ("\n<think>abc</think>x", False, True, ("", "\n<think>abc</think>x", False)),
     ("x</think>y", False, True, ("", "x</think>y", False))],
)  # fmt: skip
def test_the_split(text, started, final, expected):
    split = THINK.split(text, started, final)
    assert (split.reasoning, split.content, split.thinking) == expected


def test_the_prompt_opens_the_thinking_only_after_the_clients_words():
    """DeepSeek-R1's template ends the prompt with <think>; Qwen3's with thinking off, with an
    empty one closed; a tag the user typed in the last message means nothing."""
    assert THINK.left_open("<|User|>why?<|Assistant|><think>\n", "why?")
    assert not THINK.left_open("<|im_start|>user\nwhy?<|im_end|>\n<|im_start|>assistant\n", "why?")
    assert not THINK.left_open("user\nwhy?\nassistant\n<think>\n\n</think>\n\n", "why?")
    assert not THINK.left_open("user\nwhat is <think>?\nassistant\n", "what is <think>?")
    # a continued answer: the client's own open thinking, after the question
    assert THINK.left_open("user\nwhy?\nassistant\n<think>\nbecause", "why?")


def test_the_parser_is_chosen_from_the_template_or_the_flag():
    assert parser_for(None, QWEN3) is THINK
    assert parser_for(None, "{{ messages }}") is None and parser_for(None, None) is None
    assert parser_for("none", QWEN3) is None
    assert parser_for("deepseek_r1", None) is parser_for("qwen3", None) is THINK


def test_reasoning_effort_switches_the_thinking_where_the_template_can():
    assert thinking_switch(None, {}, QWEN3) == ({}, True)
    assert thinking_switch(None, {"enable_thinking": False}, QWEN3)[1] is False
    for effort in ("none", "minimal"):
        kwargs, on = thinking_switch(effort, {}, QWEN3)
        assert kwargs == {"enable_thinking": False, "reasoning_effort": effort} and not on
    for effort in ("low", "medium", "high"):
        assert thinking_switch(effort, {}, QWEN3)[0]["enable_thinking"] is True
        assert thinking_switch(effort, {}, "{{ messages }}")[1]  # nothing to switch: accepted
    with pytest.raises(InvalidRequest, match="no switch") as refused:
        thinking_switch("none", {}, "{{ messages }}")
    assert refused.value.param == "reasoning_effort"
    with pytest.raises(InvalidRequest, match="disagree"):
        thinking_switch("high", {"enable_thinking": False}, QWEN3)


def test_earlier_turns_thinking_reaches_the_template_as_qwen3_reads_it(tokenizer):
    """reasoning_content (or reasoning) on an assistant message: Qwen3's template shows it for
    the turns after the last question only."""
    turns = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "reasoning": "Ask the tool.", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]  # fmt: skip
    messages = message_dicts([ChatMessage.model_validate(m) for m in turns])
    assert messages[1]["reasoning_content"] == "Ask the tool."
    text = tokenizer.apply_chat_template(messages)
    assert "<think>\nAsk the tool.\n</think>\n\n<tool_call>" in text  # after the last question
    later = [
        *turns,
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "Thanks"},
    ]
    text = tokenizer.apply_chat_template(
        message_dicts([ChatMessage.model_validate(m) for m in later])
    )
    assert "Ask the tool." not in text  # an old turn's thinking is dropped
    user = {"role": "user", "content": "x", "reasoning_content": "y"}
    both = {"role": "assistant", "content": "x", "reasoning": "a", "reasoning_content": "b"}
    for bad in (user, both):
        with pytest.raises(InvalidRequest):
            message_dicts([ChatMessage.model_validate(bad)])
