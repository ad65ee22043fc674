"""A chat request made ready for the engine, in two halves around the template's render: what
the template gets (the messages, the tools, the thinking switched on or off), then the sampling
parameters (a required call's grammar or the request's own constraint; the thinking the engine
follows: its budget, a constraint deferred to the answer) and how the answer is read back (its
tool calls, its thinking). Owns nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanoserve.engine import SamplingParams, ThinkingParams
from nanoserve.server import harmony
from nanoserve.server.harmony import is_harmony
from nanoserve.server.protocol import ChatCompletionRequest, InvalidRequest, message_dicts
from nanoserve.server.reasoning import HARMONY, Reasoning, ReasoningSyntax, thinking_switch
from nanoserve.server.responses import ToolPlan
from nanoserve.server.tools import HARMONY_TOOLS, ToolSyntax, render_history, syntax_for
from nanoserve.tokenizer import Tokenizer


@dataclass(frozen=True)
class ChatInputs:
    """What the chat template renders: `messages` and its variables (`kwargs`); `thinking`:
    the request left the thinking on; the tools offered and their family's call syntax."""

    messages: list[dict[str, Any]]
    kwargs: dict[str, Any]
    thinking: bool
    syntax: ToolSyntax
    offered: list[dict[str, Any]] | None


def chat_inputs(req: ChatCompletionRequest, chat_template: str | None) -> ChatInputs:
    syntax, native = syntax_for(chat_template)
    messages = message_dicts(req.messages)
    if is_harmony(chat_template):  # gpt-oss's template reads an earlier turn's as `thinking`
        messages = [{**m, "thinking": m["reasoning_content"]} if "reasoning_content" in m else m
                    for m in messages]  # fmt: skip
    offered = req.offered_tools()
    given = req.chat_template_kwargs or {}
    kwargs, thinking = thinking_switch(req.reasoning_effort, given, chat_template)
    if offered or any(m["role"] == "tool" or "tool_calls" in m for m in messages):
        messages, variables = render_history(messages, offered, native, syntax)
        kwargs = {**kwargs, **variables}
    return ChatInputs(messages, kwargs, thinking, syntax, offered)


@dataclass(frozen=True)
class ChatPlan:
    """The engine's parameters, and how the answer is read back."""

    params: SamplingParams
    tools: ToolPlan | None
    reasoning: Reasoning | None


def chat_plan(
    req: ChatCompletionRequest,
    tokenizer: Tokenizer,
    parser: ReasoningSyntax | None,
    inputs: ChatInputs,
    prompt: str,
    default_budget: int | None = None,
) -> ChatPlan:
    """`prompt`: the rendered chat's text; `default_budget`: the server's thinking budget, for a
    request that gives none."""
    syntax, offered = inputs.syntax, inputs.offered
    constraint = req.constraint()
    required = req.required_tools()
    if offered and constraint is not None and req.tool_choice != "none":
        raise InvalidRequest(
            "response_format and structured outputs cannot be combined with tools unless "
            'tool_choice is "none"',
            "tools",
        )
    if offered and syntax is HARMONY_TOOLS and parser is not HARMONY:
        raise InvalidRequest(
            "tools: gpt-oss's harmony calls are read by the openai_gptoss reasoning parser, and "
            f"this server runs with --reasoning-parser {parser.name if parser else 'none'}",
            "tools",
        )
    tags = {t: i for t in syntax.tags() if (i := tokenizer.token_id(t)) is not None}
    if syntax.special and syntax.open not in tags and (offered or required):
        raise InvalidRequest(
            f"tools: the chat template calls tools with {syntax.open}, which is not a token "
            "of this model's vocabulary",
            "tools",
        )
    if required:  # a named function is called once; "required" may call several
        named = req.tool_choice != "required"
        constraint = syntax.grammar(required, req.parallel_tool_calls and not named, tags)
    params = req.sampling_params(
        req.completion_limit, req.num_logprobs, req.prompt_logprobs, constraint
    )
    if offered and syntax.special:  # the calls start with a control token: keep it in text
        params.skip_special_tokens = False
    tools = None
    if offered:
        tools = ToolPlan(syntax, frozenset(t["name"] for t in offered), bool(required))
    # A required harmony call follows the analysis message, not the final channel's header.
    answer = harmony.NEXT_MESSAGE if required and syntax is HARMONY_TOOLS else None
    reasoning = _reasoning(req, tokenizer, parser, inputs, prompt, params, default_budget, answer)
    return ChatPlan(params, tools, reasoning)


def _reasoning(
    req: ChatCompletionRequest,
    tokenizer: Tokenizer,
    parser: ReasoningSyntax | None,
    inputs: ChatInputs,
    prompt: str,
    params: SamplingParams,
    default_budget: int | None,
    answer: str | None = None,
) -> Reasoning | None:
    """How the output's thinking is read: where it starts (in the prompt, or in the output),
    and what the engine follows of it (a budget; a constraint deferred to the answer, so that the
    model thinks first; `answer`: where the engine takes that answer to start, if not at the
    parser's end tag). Sets `params` to match."""
    budget = req.thinking_token_budget
    if parser is None:
        if budget is not None:
            raise InvalidRequest(
                "thinking_token_budget needs a reasoning parser: this model's chat template "
                "writes no <think> and </think>, or the server runs with --reasoning-parser none",
                "thinking_token_budget",
            )
        return None
    budget = default_budget if budget is None else budget
    messages = inputs.messages[:-1] if req.continue_final_message else inputs.messages
    last = messages[-1]["content"] if messages else ""
    started = parser.left_open(prompt, last)
    start = tokenizer.encode(parser.start, add_special_tokens=False)
    end = tokenizer.encode(answer or parser.end, add_special_tokens=False)
    if set(start + end) & tokenizer.all_special_ids:  # the tags must stay in the text
        params.skip_special_tokens = False
    stops = [i for t in parser.stops if (i := tokenizer.token_id(t)) is not None]
    params.stop_token_ids += [i for i in stops if i not in params.stop_token_ids]
    # Thinking is on unless the request switched it off, and always where the prompt opened it;
    # the engine follows it for a budget, or to start a constraint after it.
    engine_follows = budget is not None or params.structured_outputs is not None
    if (inputs.thinking or started) and engine_follows:
        params.thinking = ThinkingParams(tuple(start), tuple(end), started, budget)
    return Reasoning(parser, started)
