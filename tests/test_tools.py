"""Tool calls without a model: each family's syntax parsed back into OpenAI's calls (what
tool_choice "auto" relies on), the syntax chosen from the chat template, the history rendered
for templates with and without tools, and a stream of snapshots cut into content and call
deltas that add up to the unary answer."""

import json
import re
from pathlib import Path

from nanoserve.demo import build_tokenizer
from nanoserve.engine import RequestMetrics, RequestOutput, SamplingParams
from nanoserve.engine.outputs import CompletionOutput
from nanoserve.server.responses import ChatFormat, ToolPlan
from nanoserve.server.tools import HERMES, LLAMA3_JSON, MISTRAL, render_history, syntax_for
from nanoserve.tokenizer import Tokenizer

NAMES = {"get_weather", "get_time"}
QWEN_LIKE = "{% if tools %}<tools>{{ tools }}</tools> answer in <tool_call></tool_call>{% endif %}"
LLAMA3_LIKE = '{% if tools %}{{ tools }}{% endif %}<|eot_id|>{"name": ..., "parameters": ...}'
MISTRAL_V3 = (Path(__file__).parent / "data" / "mistral_v3_tools.jinja").read_text()


def test_hermes_calls_and_the_content_before_them():
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
        '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n'
        "</tool_call>"
    )
    content, calls = HERMES.parse(text, NAMES)
    assert content == "Let me check."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"zone": "CET"}),
    ]


def test_what_is_not_a_call_of_a_known_tool_stays_content():
    for text in (
        "no tools here",
        '<tool_call>\n{"name": "format_disk", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": "not an object"}\n</tool_call>',
    ):
        assert HERMES.parse(text, NAMES) == (text, [])


def test_llama3_json_calls():
    content, calls = LLAMA3_JSON.parse(
        '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}', NAMES
    )
    assert content is None
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_time", {"zone": "UTC"})
    ]
    assert LLAMA3_JSON.parse("It is sunny.", NAMES) == ("It is sunny.", [])


def test_mistral_calls_are_one_list_after_the_control_token():
    text = (
        'Checking. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {"zone": "CET"}}]'
    )
    content, calls = MISTRAL.parse(text, NAMES)
    assert content == "Checking."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"zone": "CET"}),
    ]
    for other in ('[TOOL_CALLS] [{"name": "format_disk", "arguments": {}}]',
                  "[TOOL_CALLS] [1, 2]", '[TOOL_CALLS] [{"name": "get_time"'):  # fmt: skip
        assert MISTRAL.parse(other, NAMES) == (other, [])
    assert re.fullmatch("[A-Za-z0-9]{9}", MISTRAL.call_id())
    assert HERMES.call_id().startswith("call_")


def test_a_mistral_history_renders_with_ids_of_9_letters_and_digits():
    """Mistral's template raises on call ids of another length: a conversation's ids (OpenAI's
    call_..., say) are cut to their last 9 letters and digits, the call's and its result's
    alike."""
    tokenizer = Tokenizer(build_tokenizer(), {"bos_token": "<|begin_of_text|>",
                                              "eos_token": "<|eot_id|>"}, MISTRAL_V3)  # fmt: skip
    tools = [{"name": "get_time", "parameters": {"type": "object"}}]
    call = {"id": "call_5f2e8a91c3d44b7e", "type": "function",
            "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}  # fmt: skip
    messages = [
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "12:00", "tool_call_id": "call_5f2e8a91c3d44b7e"},
        {"role": "user", "content": "and now?"},
    ]
    rendered, variables = render_history(messages, tools, True, MISTRAL)
    text = tokenizer.apply_chat_template(rendered, True, **variables)
    assert (
        '[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "UTC"}, "id": "1c3d44b7e"}]'
        in text
    )
    assert '[TOOL_RESULTS] {"content": 12:00, "call_id": "1c3d44b7e"}[/TOOL_RESULTS]' in text
    assert text.endswith(
        '"parameters": {"type": "object"}}}][/AVAILABLE_TOOLS][INST] and now?[/INST]'
    )
    short = {**messages[2], "tool_call_id": "call_1"}
    assert render_history([short], tools, True, MISTRAL)[0][0]["tool_call_id"] == "0000call1"


def test_the_syntax_follows_the_chat_template():
    assert syntax_for(QWEN_LIKE) == (HERMES, True)
    assert syntax_for(LLAMA3_LIKE) == (LLAMA3_JSON, True)
    assert syntax_for(MISTRAL_V3) == (MISTRAL, True)
    assert syntax_for("{{ messages }}") == (HERMES, False)  # SmolLM2: no tools in its template
    assert syntax_for(None) == (HERMES, False)


def test_history_for_a_template_without_tools_is_hermes_text():
    tools = [{"name": "get_time", "parameters": {"type": "object"}}]
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}  # fmt: skip
    messages = [
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "12:00", "tool_call_id": "call_1"},
    ]
    rendered, variables = render_history(messages, tools, native=False)
    assert variables == {}
    assert rendered[0]["role"] == "system" and '"name": "get_time"' in rendered[0]["content"]
    assert rendered[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
    }
    assert rendered[3] == {"role": "user", "content": "<tool_response>\n12:00\n</tool_response>"}
    native, variables = render_history(messages, tools, native=True)
    assert variables["tools"] == [{"type": "function", "function": tools[0]}]
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"zone": "UTC"}


def _snapshot(text, finish=None):
    metrics = RequestMetrics(0.0, None, None, None, 0)
    out = CompletionOutput(0, text, list(range(len(text))), finish)
    return RequestOutput("r", [1], None, [out], finish is not None, 0, metrics)


def test_a_stream_of_snapshots_becomes_content_then_calls():
    tokenizer = Tokenizer(build_tokenizer(300))
    plan = ToolPlan(HERMES, frozenset(NAMES))
    final = 'Sure. <tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    fmt = ChatFormat(tokenizer, "id", "m", SamplingParams(), plan)
    deltas, finishes = [], []
    for end in range(1, len(final) + 1):
        snapshot = _snapshot(final[:end], "stop" if end == len(final) else None)
        for chunk in fmt.chunks(0, snapshot):
            deltas += [c.delta for c in chunk.choices]
            finishes += [c.finish_reason for c in chunk.choices if c.finish_reason]
    content = "".join(d.get("content", "") for d in deltas)
    assert content == "Sure."  # as the unary answer has it
    parts = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert parts[0]["function"] == {"name": "get_time", "arguments": ""} and parts[0]["id"]
    assert "".join(p["function"]["arguments"] for p in parts) == '{"zone": "UTC"}'
    assert finishes == ["tool_calls"]
    unary = ChatFormat(tokenizer, "id", "m", SamplingParams(), plan).response(
        [_snapshot(final, "stop")]
    )
    message = unary.choices[0].message
    assert (
        message.content == "Sure." and message.tool_calls[0].function.arguments == '{"zone": "UTC"}'
    )
    assert unary.choices[0].finish_reason == "tool_calls"


def test_a_tag_that_is_a_token_of_the_vocabulary_is_named_by_its_id():
    """Qwen's <tool_call> is an added token, which llguidance reads as itself, never as its text:
    the grammar names it (and Mistral's control token) by id; other text stays a string."""
    tools = [{"name": "get_time", "parameters": {"type": "object"}}]
    lark = HERMES.grammar(tools, False, {"<tool_call>": 7, "</tool_call>": 8}).grammar
    assert lark.startswith('start: call\ncall: <[7]> "\\n" body "\\n" <[8]>\n')
    plain = HERMES.grammar(tools, False).grammar
    assert plain.startswith('start: call\ncall: "<tool_call>\\n" body "\\n</tool_call>"\n')
    assert MISTRAL.grammar(tools, True, {"[TOOL_CALLS]": 5}).grammar.startswith("start: <[5]> ")
