"""A chat answer as the Responses API gives it: the output items of a finished answer (its
thinking as a reasoning item, its text as a message, each call as a function_call) and, for a
stream, chat's delta chunks read as the Responses API's events (`event: TYPE` and `data: JSON`,
numbered). Chat's formatter (responses.py) reads the text apart: its thinking, its answer, its
calls, each held back until it can no longer change; this module only renames what it sends, so
a stream's items add up to the unary answer's. One `ResponseWriter` per request owns what that
request's stream has sent.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal, cast

from nanoserve.engine import CompletionOutput, RequestOutput
from nanoserve.server.protocol import ChatCompletionChunk, ChatCompletionResponse, ErrorInfo
from nanoserve.server.protocol.responses_api import (
    IncompleteDetails,
    InputTokensDetails,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTokensDetails,
    ReasoningText,
    ResponseBody,
    ResponseUsage,
)
from nanoserve.server.responses import ChatFormat


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class _Open:
    """The item a stream is writing: its place in the output, its id, what it has so far."""

    kind: Literal["reasoning", "message", "function_call"]
    index: int
    id: str
    text: str = ""  # the thinking, the message's text, or the call's arguments
    call_id: str = ""
    name: str = ""


class ResponseWriter:
    """Turns one request's snapshots into a Responses API body, or into its stream's events.
    `template`: the body in progress (the request's settings echoed, no output yet)."""

    def __init__(self, fmt: ChatFormat, template: ResponseBody, end_ids: list[int]):
        self.fmt = fmt
        self.template = template
        self.end_ids = end_ids  # the thinking's end tag, as tokens: where reasoning tokens end
        self.sequence = 0
        self.items: list[OutputItem] = []  # the stream's finished items
        self.open: _Open | None = None
        self.final: ResponseBody | None = None  # the stream's last body, once it finished

    @property
    def sent_tokens(self) -> int:
        return sum(self.fmt.sent_tokens.values())

    # -- a unary answer -----------------------------------------------------------------------

    def unary(self, final: RequestOutput) -> ResponseBody:
        choice = cast(ChatCompletionResponse, self.fmt.response([final])).choices[0]
        message = choice.message
        incomplete = choice.finish_reason == "length"
        items: list[OutputItem] = []
        if message.reasoning:
            items.append(_reasoning(new_id("rs"), message.reasoning))
        if message.content:
            items.append(_message(new_id("msg"), message.content, incomplete))
        for call in message.tool_calls:
            items.append(_call(new_id("fc"), call.id, call.function.name, call.function.arguments))
        return self._finished(items, final.outputs[0], incomplete)

    def _finished(
        self, items: list[OutputItem], c: CompletionOutput, incomplete: bool
    ) -> ResponseBody:
        usage = ResponseUsage(
            input_tokens=self.fmt.prompt_tokens,
            input_tokens_details=InputTokensDetails(
                cached_tokens=sum(self.fmt.cached_tokens.values())
            ),
            output_tokens=len(c.token_ids),
            output_tokens_details=OutputTokensDetails(reasoning_tokens=self._reasoning_tokens(c)),
            total_tokens=self.fmt.prompt_tokens + len(c.token_ids),
        )
        details = IncompleteDetails(reason="max_output_tokens") if incomplete else None
        return self.template.model_copy(update={
            "status": "incomplete" if incomplete else "completed", "incomplete_details": details,
            "output": items, "usage": usage,
        })  # fmt: skip

    def _reasoning_tokens(self, c: CompletionOutput) -> int:
        """The output's tokens up to the end of its thinking (all of them where it never
        ended); none where it did not think."""
        reasoning = self.fmt.reasoning
        if reasoning is None or not reasoning.split(c.text, final=True).thinking:
            return 0
        ids, end = c.token_ids, self.end_ids
        at = next((k for k in range(len(ids) - len(end) + 1) if ids[k : k + len(end)] == end),
                  None)  # fmt: skip
        return len(ids) if at is None else at + len(end)

    # -- a stream -----------------------------------------------------------------------------

    def opening(self) -> list[bytes]:
        body = self.template.model_dump(mode="json")
        return [
            self._event("response.created", response=body),
            self._event("response.in_progress", response=body),
        ]

    def update(self, out: RequestOutput) -> list[bytes]:
        """The events of a snapshot: chat's new deltas, each as the item it adds to; at the end,
        the open item closed and the whole response."""
        events: list[bytes] = []
        finish = None
        for chunk in self.fmt.chunks(0, out):
            for choice in cast(ChatCompletionChunk, chunk).choices:
                events += self._delta(choice.delta)
                finish = choice.finish_reason or finish
        if finish is None:
            return events
        incomplete = finish == "length"
        events += self._close(incomplete)
        self.final = self._finished(self.items, out.outputs[0], incomplete)
        kind = "response.incomplete" if incomplete else "response.completed"
        events.append(self._event(kind, response=self.final.model_dump(mode="json")))
        return events

    def failed(self, info: ErrorInfo) -> bytes:
        """A stream that failed after it started: OpenAI's error event."""
        return self._event("error", code=info.code or info.type, message=info.message,
                           param=info.param)  # fmt: skip

    def _delta(self, delta: dict[str, Any]) -> list[bytes]:
        """Chat's delta (thinking, content, a call's start or its arguments) as events."""
        if "reasoning_content" in delta:
            return self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            return self._text("message", delta["content"])
        events = []
        for part in delta.get("tool_calls", []):
            function = part.get("function", {})
            if "id" in part:
                events += self._close(incomplete=False)
                self.open = _Open("function_call", len(self.items), new_id("fc"),
                                  call_id=part["id"], name=function["name"])  # fmt: skip
                events.append(self._added(self._item(self.open, "in_progress")))
            if function.get("arguments") and self.open is not None:
                self.open.text += function["arguments"]
                kind = "response.function_call_arguments.delta"
                events.append(self._event(kind, **self._where(), delta=function["arguments"]))
        return events

    def _text(self, kind: Literal["reasoning", "message"], delta: str) -> list[bytes]:
        """A text delta of the thinking or the message: the item opened first where it is not."""
        events = []
        if self.open is None or self.open.kind != kind:
            events += self._close(incomplete=False)
            self.open = _Open(kind, len(self.items), new_id("rs" if kind == "reasoning" else "msg"))
            events.append(self._added(self._item(self.open, "in_progress")))
            events.append(self._event("response.content_part.added", **self._where(0),
                                      part=_part("", kind)))  # fmt: skip
        self.open.text += delta
        name = "reasoning_text" if kind == "reasoning" else "output_text"
        events.append(self._event(f"response.{name}.delta", **self._where(0), delta=delta,
                                  **_logprobs(kind)))  # fmt: skip
        return events

    def _close(self, incomplete: bool) -> list[bytes]:
        """The open item's done events; the item joins the output."""
        item, self.open = self.open, None
        if item is None:
            return []
        events = []
        if item.kind == "function_call":
            events.append(self._event("response.function_call_arguments.done",
                                      **self._where(item=item), arguments=item.text))  # fmt: skip
        else:
            done = "reasoning_text.done" if item.kind == "reasoning" else "output_text.done"
            events.append(self._event(f"response.{done}", **self._where(0, item), text=item.text,
                                      **_logprobs(item.kind)))  # fmt: skip
            events.append(self._event("response.content_part.done", **self._where(0, item),
                                      part=_part(item.text, item.kind)))  # fmt: skip
        finished = self._item(item, "incomplete" if incomplete else "completed")
        self.items.append(finished)
        events.append(self._event("response.output_item.done", output_index=item.index,
                                  item=finished.model_dump(mode="json")))  # fmt: skip
        return events

    def _item(self, item: _Open, status: Literal["in_progress", "completed", "incomplete"]
              ) -> OutputItem:  # fmt: skip
        if item.kind == "reasoning":
            return _reasoning(item.id, item.text) if item.text else OutputReasoning(
                id=item.id, content=[])  # fmt: skip
        if item.kind == "message":
            content = [OutputText(text=item.text)] if status != "in_progress" else []
            return OutputMessage(id=item.id, status=status, content=content)
        if status == "in_progress":
            return _call(item.id, item.call_id, item.name, "", "in_progress")
        return _call(item.id, item.call_id, item.name, item.text)

    def _added(self, item: OutputItem) -> bytes:
        assert self.open is not None
        return self._event("response.output_item.added", output_index=self.open.index,
                           item=item.model_dump(mode="json"))  # fmt: skip

    def _where(self, content_index: int | None = None, item: _Open | None = None
               ) -> dict[str, Any]:  # fmt: skip
        item = item or self.open
        assert item is not None
        where: dict[str, Any] = {"item_id": item.id, "output_index": item.index}
        if content_index is not None:
            where["content_index"] = content_index
        return where

    def _event(self, kind: str, **fields: Any) -> bytes:
        """One server-sent event, numbered: `event: TYPE`, then its JSON."""
        data = json.dumps(
            {"type": kind, "sequence_number": self.sequence, **fields}, separators=(",", ":")
        )
        self.sequence += 1
        return f"event: {kind}\ndata: {data}\n\n".encode()


def _part(text: str, kind: str) -> dict[str, Any]:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": []}


def _reasoning(item_id: str, text: str) -> OutputReasoning:
    return OutputReasoning(id=item_id, content=[ReasoningText(type="reasoning_text", text=text)])


def _message(item_id: str, text: str, incomplete: bool) -> OutputMessage:
    status: Literal["completed", "incomplete"] = "incomplete" if incomplete else "completed"
    return OutputMessage(id=item_id, status=status, content=[OutputText(text=text)])


def _call(
    item_id: str,
    call_id: str,
    name: str,
    arguments: str,
    status: Literal["in_progress", "completed"] = "completed",
) -> OutputFunctionCall:
    return OutputFunctionCall(id=item_id, call_id=call_id, name=name, arguments=arguments,
                              status=status)  # fmt: skip


def _logprobs(kind: str) -> dict[str, Any]:
    """A message's text events carry its logprobs: none asked for here."""
    return {"logprobs": []} if kind == "message" else {}
