"""Reasoning: a reasoning model's thinking (`<think>…</think>`: Qwen3, DeepSeek-R1's distills,
SmolLM3; gpt-oss's harmony analysis channel) told apart from its answer, which is what the
client gets as `content` and what tool calls are read from. The parser is on where the chat
template writes both tags (or harmony's), unless --reasoning-parser says otherwise; a
request's `reasoning_effort` and `chat_template_kwargs.enable_thinking` switch the thinking off
where the template has the switch. Owns nothing.

The thinking starts either in the output (Qwen3 writes `<think>` first) or in the prompt
(DeepSeek-R1's templates end it with `<think>`; a continued assistant message may hold an open
one): then the whole output is thinking until `</think>`. An output cut short inside its thinking
is all reasoning, and its content is null, as vLLM answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanoserve.server import harmony
from nanoserve.server.protocol import InvalidRequest

# OpenAI's reasoning_effort values that ask for (next to) no thinking: the template renders with
# enable_thinking false (a Qwen3 model cannot think a little); the others leave it on.
EFFORTS_OFF = ("none", "minimal")


@dataclass(frozen=True)
class Split:
    """An output's text as thinking and answer. `thinking`: the output has (or starts in) a
    thinking, so `reasoning` is its text; otherwise `content` is the whole text."""

    reasoning: str
    content: str
    thinking: bool


@dataclass(frozen=True)
class ReasoningSyntax:
    name: str
    start: str
    end: str
    stops: tuple[str, ...] = ()  # tokens that end the assistant's turn, where the format has them

    def split(self, text: str, started: bool, final: bool, cut: bool = False) -> Split:
        """The thinking and the answer in an output's text (`started`: the prompt left a
        thinking open, so the text starts in it). While the text grows (not `final`), what may
        still become a tag and the whitespace that may end the thinking are held back, so that
        each part only grows as the text does: a stream's deltas add up to the final split.
        Whitespace around the thinking and before the answer is dropped."""
        if text.startswith(self.start):
            body = text[len(self.start) :]
        elif not final and self.start.startswith(text):
            return Split("", "", started)  # the start tag, perhaps: wait for it
        elif started:
            body = text
        else:
            return Split("", text, False)  # no thinking: the text is the answer, as it is
        at = body.find(self.end)
        if at >= 0:
            return Split(body[:at].strip(), body[at + len(self.end) :].lstrip(), True)
        if not final:
            body = body[: len(body) - _partial(body, self.end)]
        return Split(body.strip(), "", True)

    def left_open(self, prompt: str, last: str) -> bool:
        """Whether a rendered chat ends inside an open thinking: a start tag after the last end
        tag, in what the template wrote after `last` (the client's last words, in which a typed
        tag means nothing; all of `prompt` where they cannot be found)."""
        words = last.strip()
        at = prompt.rfind(words) if words else -1
        tail = prompt[at + len(words) :] if at >= 0 else prompt
        return tail.rfind(self.start) > tail.rfind(self.end)


def _partial(text: str, tag: str) -> int:
    """How many characters at the end of `text` may begin `tag` (0 if none)."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])),
                0)  # fmt: skip


@dataclass(frozen=True)
class HarmonySyntax(ReasoningSyntax):
    """gpt-oss's harmony messages (server/harmony.py): the analysis channel is the thinking,
    the final channel (and commentary to no one: a preamble) the answer. A call of a client's
    function (`to=functions.NAME`) is written in the answer as
    `<|channel|>commentary to=functions.NAME<|message|>ARGUMENTS<|call|>` for the tools' parser
    (server/tools.py) to read; a call of a built-in tool (browser, python) is thinking.
    `start` and `end` are what the engine follows of the thinking: a forced end moves on to the
    final channel."""

    def split(self, text: str, started: bool, final: bool, cut: bool = False) -> Split:
        if started:
            text = self.start + text
        reasoning: list[str] = []
        content = ""
        for m in harmony.messages(text, final):
            if m.recipient.startswith(harmony.FUNCTIONS):
                # A call the output stopped in (the engine stops at <|call|>) is whole; one that
                # max_tokens cut short (`cut`) is not a call.
                close = harmony.CALL if m.ended or (m.closed and not cut) else ""
                content += f"{harmony.CHANNEL}commentary to={m.recipient}{harmony.MESSAGE}"
                content += m.body + close
            elif m.channel == "analysis" or m.recipient:
                reasoning.append(m.body)
            else:
                content += ("\n" if content else "") + m.body
        return Split("\n".join(reasoning), content, started or bool(reasoning))

    def left_open(self, prompt: str, last: str) -> bool:
        """Whether the rendered chat ends inside an analysis message."""
        words = last.strip()
        at = prompt.rfind(words) if words else -1
        tail = prompt[at + len(words) :] if at >= 0 else prompt
        return tail.rfind(self.start) > max(tail.rfind(e) for e in harmony.ENDS)


THINK = ReasoningSyntax("think", "<think>", "</think>")
HARMONY = HarmonySyntax(
    "openai_gptoss", "<|channel|>analysis<|message|>",
    "<|end|><|start|>assistant<|channel|>final<|message|>", harmony.STOPS,
)  # fmt: skip
# vLLM's names: deepseek_r1 and qwen3 are one parser; openai_gptoss is harmony's
PARSERS = {"think": THINK, "deepseek_r1": THINK, "qwen3": THINK, "openai_gptoss": HARMONY}


def parser_for(name: str | None, chat_template: str | None) -> ReasoningSyntax | None:
    """The parser --reasoning-parser names ("none": none), or without one, the chat template's:
    harmony where it writes harmony's messages (gpt-oss's), `think` where it writes both tags."""
    if name is not None:
        return PARSERS.get(name)
    template = chat_template or ""
    if harmony.is_harmony(template):
        return HARMONY
    return THINK if THINK.start in template and THINK.end in template else None


@dataclass(frozen=True)
class Reasoning:
    """A chat request's reasoning: its parser, and whether the output starts in the thinking."""

    syntax: ReasoningSyntax
    started: bool = False

    def split(self, text: str, final: bool, cut: bool = False) -> Split:
        """`cut`: the output finished for its length (max_tokens), not at a stop."""
        return self.syntax.split(text, self.started, final, cut)

    def answer(self, text: str, cut: bool = False) -> tuple[str | None, str | None]:
        """A finished output's reasoning and content, as a unary response gives them: no
        reasoning is null; a thinking with no answer after it (cut short inside it) has a null
        content; an output without thinking is all content, as it is."""
        split = self.split(text, final=True, cut=cut)
        if not split.thinking:
            return None, split.content
        return split.reasoning or None, split.content or None


def thinking_switch(
    effort: str | None, kwargs: dict[str, Any], chat_template: str | None
) -> tuple[dict[str, Any], bool]:
    """The chat template's variables with `reasoning_effort` applied, and whether the thinking
    is on. "none" and "minimal" render with enable_thinking false, "low", "medium" and "high"
    with it true, and the template gets reasoning_effort itself (gpt-oss's reads it); a 400
    where the effort asks for no thinking and the template has no switch, or where it and
    chat_template_kwargs.enable_thinking disagree."""
    given = kwargs.get("enable_thinking")
    if effort is None:
        return kwargs, given is not False
    on = effort not in EFFORTS_OFF
    if isinstance(given, bool) and given != on:
        raise InvalidRequest(
            f"reasoning_effort {effort!r} and chat_template_kwargs.enable_thinking {given} "
            "disagree: give one", "reasoning_effort",
        )  # fmt: skip
    if not on and "enable_thinking" not in (chat_template or ""):
        raise InvalidRequest(
            f"reasoning_effort {effort!r} asks for no thinking, and this model's chat template "
            "has no switch for it (enable_thinking)", "reasoning_effort",
        )  # fmt: skip
    return {**kwargs, "enable_thinking": on, "reasoning_effort": effort}, on
