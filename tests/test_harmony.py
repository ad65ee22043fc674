"""gpt-oss's harmony format without a model: the analysis channel told apart from the final one
and from the commentary calls, whole and streamed (every character and every token a cut), an
output that never reaches its final channel; the parser and the call syntax chosen from the chat
template or the flag; the stop tokens; and what a harmony chat template reads (reasoning_effort,
tools, builtin_tools, an earlier turn's thinking), rendered by a small harmony template."""

import json
from pathlib import Path

import pytest
from test_reasoning import _snapshot, _streamed

from nanoserve.engine import SamplingParams
from nanoserve.server.chat_plan import chat_inputs, chat_plan
from nanoserve.server.protocol import ChatCompletionRequest, InvalidRequest, parse
from nanoserve.server.reasoning import HARMONY, PARSERS, Reasoning, parser_for
from nanoserve.server.responses import ChatFormat, ToolPlan
from nanoserve.server.tools import HARMONY_TOOLS, syntax_for
from nanoserve.testing.hf_families import harmony_tokenizer
from nanoserve.tokenizer import Tokenizer

TEMPLATE = (Path(__file__).parent / "data" / "harmony_chat_template.jinja").read_text()
NAMES = frozenset({"get_weather", "get_time"})
THOUGHT = "The user wants the weather. I could call get_time too, but no."
ANALYSIS = f"<|channel|>analysis<|message|>{THOUGHT}<|end|>"
CALL = ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city":"Paris"}')  # fmt: skip
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris."
# The recipient may come before the channel, and a preamble to the user before the call.
PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Let me look.<|end|>"
CALL_FIRST = ("<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>"
              '{"zone": "CET"}')  # fmt: skip
# A call that max_tokens cut short is no call: its text is left as the content.
CUT_CALL = '<|channel|>commentary to=functions.get_weather<|message|>{"city":"Paris"}'
BROWSE = '<|start|>assistant<|channel|>analysis to=browser.search code<|message|>{"q": "x"}'
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(harmony_tokenizer(), {"eos_token": "<|return|>"}, TEMPLATE)


def _format(tokenizer, tools):
    plan = ToolPlan(HARMONY_TOOLS, NAMES) if tools else None
    params = SamplingParams(skip_special_tokens=False)
    return ChatFormat(tokenizer, "id", "m", params, plan, Reasoning(HARMONY))


@pytest.mark.parametrize(
    "text,finish,tools,expected",
    [(ANALYSIS + FINAL, "stop", True, (THOUGHT, "It is sunny in Paris.", [])),
     (ANALYSIS + CALL, "stop", True,
      (THOUGHT, None, [{"name": "get_weather", "arguments": '{"city": "Paris"}'}])),
     (ANALYSIS + PREAMBLE + CALL_FIRST, "stop", True,
      (THOUGHT, "Let me look.", [{"name": "get_time", "arguments": '{"zone": "CET"}'}])),
     (ANALYSIS + BROWSE + "<|call|>", "stop", False, (f'{THOUGHT}\n{{"q": "x"}}', None, [])),
     (ANALYSIS + CALL, "length", True, (THOUGHT, CUT_CALL, [])),  # max_tokens cut the call
     (ANALYSIS[:-10], "length", True, (THOUGHT[:-3], None, [])),  # cut short in the analysis
     (ANALYSIS + "<|start|>assistant<|channel|>fin", "length", True, (THOUGHT, None, [])),
     ("Plain words, no harmony.", "stop", False, (None, "Plain words, no harmony.", []))],
    ids=["final", "call", "preamble-and-call", "builtin-tool", "cut-call", "cut-in-analysis",
         "cut-in-header", "no-harmony"],
)  # fmt: skip
def test_a_stream_cut_anywhere_adds_up_to_the_unary_answer(tokenizer, text, finish, tools,
                                                           expected):  # fmt: skip
    """The unary message; the same text streamed as two snapshots cut after every token, and one
    token a snapshot: the deltas add up to it, the calls to its calls, one finish reason."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    choice = _format(tokenizer, tools).response([_snapshot(text, ids, finish)]).choices[0]
    message = choice.message
    calls = [c.function.model_dump() for c in message.tool_calls]
    assert (message.reasoning_content, message.content, calls) == expected
    assert choice.finish_reason == ("tool_calls" if calls else finish)
    streams = [[ids[:k], ids] for k in range(len(ids) + 1)]
    streams.append([ids[: k + 1] for k in range(len(ids))])
    for cuts in streams:
        snapshots = [_snapshot(tokenizer.decode(c, skip_special_tokens=False), c,
                               finish if c == ids else None) for c in cuts]  # fmt: skip
        reasoning, content, streamed_calls, finishes = _streamed(_format(tokenizer, tools),
                                                                 snapshots)  # fmt: skip
        assert (reasoning, content) == (message.reasoning_content or "", message.content or "")
        assert streamed_calls == calls and finishes == [choice.finish_reason]


TIME_CALL = '<|channel|>commentary to=functions.get_time<|message|>{"zone": "CET"}<|call|>'


@pytest.mark.parametrize(
    "text,content",
    [(ANALYSIS + FINAL, "It is sunny in Paris."),
     (ANALYSIS + PREAMBLE + CALL_FIRST + "<|call|>", "Let me look." + TIME_CALL),
     (f"stray<|start|>assistant{ANALYSIS}{FINAL}", "It is sunny in Paris.")],
)  # fmt: skip
def test_every_prefix_only_grows(text, content):
    """Cut at every character (a tag cut in two too): the reasoning and the answer of each
    prefix begin the next's, and the text's own; stray text before the first header is
    neither. A call reaches the tools' parser in one form, whichever the header's order."""
    last = HARMONY.split("", False, False)
    for k in range(1, len(text) + 1):
        split = HARMONY.split(text[:k], False, k == len(text))
        assert split.reasoning.startswith(last.reasoning), text[:k]
        assert split.content.startswith(last.content), text[:k]
        last = split
    assert (last.reasoning, last.content) == (THOUGHT, content)


def test_a_prompt_that_leaves_the_analysis_open():
    """A continued analysis message: the output starts in it."""
    prompt = "<|start|>user<|message|>hi<|end|><|start|>assistant<|channel|>analysis<|message|>So"
    assert HARMONY.left_open(prompt, "hi")
    assert not HARMONY.left_open(prompt + " yes<|end|><|start|>assistant", "hi")
    split = HARMONY.split(" it goes.<|end|>" + FINAL, True, True)
    assert (split.reasoning, split.content) == (" it goes.", "It is sunny in Paris.")


def test_the_parser_and_the_calls_are_chosen_from_the_template_or_the_flag():
    assert parser_for(None, TEMPLATE) is HARMONY
    assert parser_for("openai_gptoss", None) is HARMONY
    assert parser_for("none", TEMPLATE) is None
    assert parser_for(None, "<think></think>") is not HARMONY
    assert syntax_for(TEMPLATE) == (HARMONY_TOOLS, True)


def _request(**body):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    return parse(ChatCompletionRequest, json.dumps({"messages": messages, **body}))


def test_the_plan_stops_at_return_and_call_and_keeps_the_control_tokens(tokenizer):
    req = _request(tools=[WEATHER_TOOL])
    inputs = chat_inputs(req, TEMPLATE)
    prompt, _ = tokenizer.render_chat(inputs.messages, **inputs.kwargs)
    plan = chat_plan(req, tokenizer, HARMONY, inputs, prompt)
    stops = {tokenizer.token_id("<|return|>"), tokenizer.token_id("<|call|>")}
    assert set(plan.params.stop_token_ids) == stops and None not in stops
    assert not plan.params.skip_special_tokens
    assert plan.tools is not None and plan.tools.syntax is HARMONY_TOOLS


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_required_call_is_a_grammar_the_engine_starts_after_the_analysis(tokenizer, choice):
    """One call on the commentary channel, its control tokens named by id, deferred to where the
    analysis message has ended and the next begun (not to the final channel's header)."""
    req = _request(tools=[WEATHER_TOOL], tool_choice=choice)
    inputs = chat_inputs(req, TEMPLATE)
    prompt, _ = tokenizer.render_chat(inputs.messages, **inputs.kwargs)
    plan = chat_plan(req, tokenizer, HARMONY, inputs, prompt)
    assert plan.params.structured_outputs is not None and plan.params.thinking is not None
    grammar = plan.params.structured_outputs.grammar or ""
    channel, message, call = (
        tokenizer.token_id(t) for t in ("<|channel|>", "<|message|>", "<|call|>")
    )
    assert grammar.startswith(f'start: (<[{channel}]> "commentary to=functions.get_weather" (')
    assert f"<[{message}]> body0 <[{call}]>)\nbody0: %json " in grammar
    end = tokenizer.encode("<|end|><|start|>assistant", add_special_tokens=False)
    assert plan.params.thinking.end_ids == tuple(end)
    auto = _request(tools=[WEATHER_TOOL])
    plan = chat_plan(auto, tokenizer, HARMONY, chat_inputs(auto, TEMPLATE), prompt)
    assert plan.params.structured_outputs is None


@pytest.mark.parametrize("parser", [None, PARSERS["think"]])
def test_tools_without_the_harmony_parser_are_refused_by_name(tokenizer, parser):
    """The harmony calls are read out of the text the harmony reasoning parser rewrites: under
    --reasoning-parser none (or think) a gpt-oss template's calls would be lost in the content."""
    req = _request(tools=[WEATHER_TOOL])
    inputs = chat_inputs(req, TEMPLATE)
    prompt, _ = tokenizer.render_chat(inputs.messages, **inputs.kwargs)
    with pytest.raises(InvalidRequest, match="openai_gptoss") as e:
        chat_plan(req, tokenizer, parser, inputs, prompt)
    assert e.value.param == "tools"
    assert chat_plan(req, tokenizer, HARMONY, inputs, prompt).tools is not None


def test_the_template_gets_what_it_reads(tokenizer):
    """reasoning_effort, the tools, chat_template_kwargs' builtin_tools, and an earlier turn's
    reasoning_content as its analysis message before its call, then the call's result."""
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "reasoning_content": "Ask the tool.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    req = parse(ChatCompletionRequest, json.dumps({
        "messages": history, "tools": [WEATHER_TOOL], "reasoning_effort": "high",
        "chat_template_kwargs": {"builtin_tools": ["browser"]}}))  # fmt: skip
    inputs = chat_inputs(req, TEMPLATE)
    prompt, _ = tokenizer.render_chat(inputs.messages, **inputs.kwargs)
    assert "Reasoning: high" in prompt and "## browser" in prompt
    assert "# Instructions\n\nBe brief." in prompt
    assert "type get_weather = " in prompt and "// The weather in a city" in prompt
    assert prompt.endswith(
        "<|start|>assistant<|channel|>analysis<|message|>Ask the tool.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Paris"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"'
        "<|end|><|start|>assistant"
    )
    default = chat_inputs(_request(), TEMPLATE)
    assert "Reasoning: medium" in tokenizer.render_chat(default.messages, **default.kwargs)[0]


def test_calls_of_offered_functions_only_and_their_arguments_as_written():
    """A call's arguments are re-written as the other syntaxes give them where they are JSON,
    passed on as written where not; a call of a function not offered stays content."""
    text = "Sure." + TIME_CALL + TIME_CALL.replace('{"zone": "CET"}', "zone=CET")
    assert HARMONY_TOOLS.parse(text, {"get_time"}) == ("Sure.", [
        {"name": "get_time", "arguments": '{"zone": "CET"}'},
        {"name": "get_time", "arguments": "zone=CET"}])  # fmt: skip
    assert HARMONY_TOOLS.parse(text, {"get_weather"}) == (text, [])
