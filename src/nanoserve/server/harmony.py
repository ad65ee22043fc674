"""OpenAI's harmony format (gpt-oss) read out of generated text: the output is a run of messages,
`<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...`, each
with a header (its channel, perhaps a recipient `to=functions.NAME` and a content type) and a
body. The first message's `<|start|>assistant` is the prompt's. Owns nothing.

Written here rather than taken from `openai-harmony`: its encoding is built from
o200k_base.tiktoken, downloaded at first use, and its parser reads token ids of that vocabulary.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

START, MESSAGE, CHANNEL, CALL = "<|start|>", "<|message|>", "<|channel|>", "<|call|>"
CONSTRAIN = "<|constrain|>"  # a call's header may give its content type: ` <|constrain|>json`
NEXT_MESSAGE = "<|end|>" + START + "assistant"  # a message closed and the assistant's next begun
ENDS = ("<|end|>", CALL, "<|return|>")  # what closes a message's body
STOPS = ("<|return|>", CALL)  # what ends the assistant's turn
FUNCTIONS = "functions."  # the recipient namespace of the client's functions


@dataclass(frozen=True)
class Message:
    """One message of the output: `closed`: its body is complete; `ended`: by a closing tag
    (not by the end of the output: a call cut short by max_tokens is closed, not ended)."""

    channel: str
    recipient: str
    body: str
    closed: bool
    ended: bool = False


def is_harmony(chat_template: str | None) -> bool:
    """Whether a chat template writes the harmony format (gpt-oss's)."""
    return CHANNEL in (chat_template or "") and MESSAGE in (chat_template or "")


def messages(text: str, final: bool) -> list[Message]:
    """The messages of `text` whose header is complete (a body is known to belong to its
    channel once `<|message|>` is written). While the text grows (not `final`), what may still
    become a closing tag is held back, so that each body only grows as the text does. When
    `final`, an open body is closed, and a text with no harmony in it at all is one final
    message (text before or between messages is not the answer's)."""
    found = []
    parts = text.split(START)
    for part in parts:
        at = part.find(MESSAGE)
        if at < 0:
            if final and len(parts) == 1 and "<|" not in part and part.strip():
                found.append(Message("final", "", part, True))
            continue
        header, body = part[:at], part[at + len(MESSAGE) :]
        ends = [i for i in (body.find(e) for e in ENDS) if i >= 0]
        closed = bool(ends) or final
        if ends:
            body = body[: min(ends)]
        elif not final:
            body = _held_back(body)
        found.append(Message(_channel(header), _recipient(header), body, closed, bool(ends)))
    return found


def _channel(header: str) -> str:
    match = re.search(r"<\|channel\|>\s*([A-Za-z_]+)", header)
    return match.group(1) if match else ""


def _recipient(header: str) -> str:
    match = re.search(r"\bto=([^\s<]+)", header)
    return match.group(1) if match else ""


def _held_back(body: str) -> str:
    """`body` less a tail that may begin a tag (`<|`, not yet closed by `|>`)."""
    at = body.rfind("<")
    if at >= 0 and "|>" not in body[at:] and "<|".startswith(body[at : at + 2]):
        return body[:at]
    return body
