"""Anthropic's bodies, from what the chat path makes: a finished chat completion as a message,
and a stream's chat chunks as Anthropic's events (message_start and a ping; per block its
start, deltas and stop; message_delta with the stop reason and usage; message_stop). The chat
path has read the thinking and the tool calls apart already, so a block here is one kind of
delta there. One `MessageEvents` per stream owns which block is open; nothing else.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from nanoserve.engine import RequestOutput
from nanoserve.server.protocol import ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse
from nanoserve.server.protocol.anthropic import Message, Usage

Event = tuple[str, dict[str, Any]]  # the SSE event's name, and its data (whose type is its name)


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def stop_reason(finish: str | None, stop: str | int | None) -> tuple[str | None, str | None]:
    """Anthropic's stop_reason and stop_sequence for a chat choice's finish_reason and
    stop_reason (a stop string, or the token id that ended it)."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if finish is None:
        return None, None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def usage(out: RequestOutput) -> Usage:
    """The prompt as Anthropic counts it: what was computed (input_tokens) and what the prefix
    cache held (cache_read_input_tokens)."""
    cached = out.num_cached_tokens
    return Usage(
        input_tokens=len(out.prompt_token_ids) - cached,
        output_tokens=sum(len(c.token_ids) for c in out.outputs),
        cache_read_input_tokens=cached,
    )


def message(
    request_id: str,
    model: str,
    response: ChatCompletionResponse,
    out: RequestOutput,
    omit_thinking: bool = False,
) -> Message:
    """A unary answer: its thinking, its text (none when empty) and its calls, in that order."""
    choice = response.choices[0]
    m = choice.message
    content: list[dict[str, Any]] = []
    if m.reasoning_content is not None:
        thinking = "" if omit_thinking else m.reasoning_content
        content.append({"type": "thinking", "thinking": thinking, "signature": ""})
    if m.content:
        content.append({"type": "text", "text": m.content})
    for call in m.tool_calls:
        content.append({"type": "tool_use", "id": tool_use_id(), "name": call.function.name,
                        "input": json.loads(call.function.arguments)})  # fmt: skip
    reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason)
    return Message(
        id=request_id, model=model, content=content, stop_reason=reason,
        stop_sequence=sequence, usage=usage(out),
    )  # fmt: skip


def _event(name: str, **fields: Any) -> Event:
    return name, {"type": name, **fields}


class MessageEvents:
    """One stream's events. A chat delta's reasoning_content goes to a thinking block, its
    content to a text block, each tool call to a tool_use block (its name at the start, its
    input as one input_json_delta); a block of another kind closes the one open (a thinking
    block ends with its signature_delta, empty: this server signs nothing)."""

    def __init__(self, request_id: str, model: str, omit_thinking: bool = False):
        self.id = request_id
        self.model = model
        self.omit_thinking = omit_thinking
        self.index = -1  # the block open (or last closed)
        self.open: str | None = None  # its type
        self.output_tokens = 0

    def opening(self, prompt_tokens: int) -> list[Event]:
        """message_start (the prompt's tokens; the prefix cache's share comes at the end, in
        message_delta), then a ping, as Anthropic sends them."""
        start = Message(id=self.id, model=self.model, content=[],
                        usage=Usage(input_tokens=prompt_tokens, output_tokens=0))  # fmt: skip
        return [_event("message_start", message=start.model_dump()), _event("ping")]

    def events(self, chunks: Sequence[BaseModel], out: RequestOutput) -> list[Event]:
        """The events of a snapshot's chat chunks (`out`: the snapshot, for the usage)."""
        self.output_tokens = sum(len(c.token_ids) for c in out.outputs)
        result: list[Event] = []
        for chunk in chunks:
            assert isinstance(chunk, ChatCompletionChunk)
            for choice in chunk.choices:
                result += self._delta(choice.delta)
                if choice.finish_reason is not None:
                    result += self._close() + self._end(choice, out)
        return result

    def _delta(self, delta: dict[str, Any]) -> list[Event]:
        result: list[Event] = []
        if thinking := delta.get("reasoning_content"):
            result += self._ensure({"type": "thinking", "thinking": "", "signature": ""})
            if not self.omit_thinking:
                result.append(self._block_delta(type="thinking_delta", thinking=thinking))
        if text := delta.get("content"):
            result += self._ensure({"type": "text", "text": ""})
            result.append(self._block_delta(type="text_delta", text=text))
        for call in delta.get("tool_calls", []):
            function = call.get("function", {})
            if "id" in call:  # a call starts: its name; then its arguments
                block = {"type": "tool_use", "id": tool_use_id(), "name": function["name"],
                         "input": {}}  # fmt: skip
                result += self._close() + self._open(block)
            elif function.get("arguments"):
                partial = function["arguments"]
                result.append(self._block_delta(type="input_json_delta", partial_json=partial))
        return result

    def _ensure(self, block: dict[str, Any]) -> list[Event]:
        """A block of `block`'s type open: the one open, or a new one."""
        if self.open == block["type"]:
            return []
        return self._close() + self._open(block)

    def _open(self, block: dict[str, Any]) -> list[Event]:
        self.index += 1
        self.open = block["type"]
        return [_event("content_block_start", index=self.index, content_block=block)]

    def _close(self) -> list[Event]:
        if self.open is None:
            return []
        result = []
        if self.open == "thinking":
            result.append(self._block_delta(type="signature_delta", signature=""))
        self.open = None
        return [*result, _event("content_block_stop", index=self.index)]

    def _block_delta(self, **delta: Any) -> Event:
        return _event("content_block_delta", index=self.index, delta=delta)

    def _end(self, choice: ChatChunkChoice, out: RequestOutput) -> list[Event]:
        reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        return [
            _event("message_delta", delta=delta, usage=usage(out).model_dump()),
            _event("message_stop"),
        ]


def sse(event: Event) -> bytes:
    name, data = event
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()
