"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}: an adapter at
the edge. A request's items become a chat request (messages, tools, the tool choice, the text
format as its constraint, the reasoning effort), which takes chat's one path: its template and
plan (chat_plan.py), `Serving.admit` and `Serving.generate` through the chat route's own
helpers, chat's formatter; responses_events.py renames the answer into output items and events.
So a client that hangs up aborts its request, and the limits, fairness, shutdown and metrics are
chat's.

Stored responses (`store`, true unless the request says false) are kept in memory, the newest
`--responses-store-size` of them, the oldest dropped first: each with its whole conversation,
so that `previous_response_id` puts that response's input and output items before a new input.
Owns the store; only handlers touch it, on the event loop.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio
from pydantic import PrivateAttr
from quart import Response, g, request

from nanoserve.engine import RequestRejected, SamplingParams, StructuredOutputsParams
from nanoserve.server.access import AccessRecord, printable
from nanoserve.server.chat_plan import chat_inputs, chat_plan
from nanoserve.server.errors import error_info, error_response
from nanoserve.server.protocol import ChatCompletionRequest, InvalidRequest, parse
from nanoserve.server.protocol.base import validate
from nanoserve.server.protocol.responses_api import (
    FunctionCall,
    FunctionCallOutput,
    Item,
    Message,
    Reasoning,
    ResponseBody,
    ResponsesRequest,
    input_items,
)
from nanoserve.server.responses import ChatFormat
from nanoserve.server.responses_events import ResponseWriter, new_id

if TYPE_CHECKING:
    from nanoserve.server.routes import OpenAIServer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stored:
    body: ResponseBody
    conversation: list[Item]  # its input (after the history it continued) and its output


class ResponseStore:
    """The newest `size` stored responses by id; the oldest dropped first."""

    def __init__(self, size: int):
        self.size = size
        self._kept: OrderedDict[str, Stored] = OrderedDict()

    def put(self, response_id: str, stored: Stored) -> None:
        self._kept[response_id] = stored
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)

    def get(self, response_id: str) -> Stored | None:
        return self._kept.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._kept.pop(response_id, None) is not None


class ResponsesChat(ChatCompletionRequest):
    """A chat request made from a Responses API request: its constraint is text.format's."""

    _text_format: StructuredOutputsParams | None = PrivateAttr(None)

    def constraint(self) -> StructuredOutputsParams | None:
        return self._text_format


class ResponsesAPI:
    """The Responses API's routes, over the chat route's server (`api`)."""

    def __init__(self, api: OpenAIServer, store_size: int):
        self.api = api
        self.store = ResponseStore(store_size)

    async def create(self) -> Response:
        req: ResponsesRequest = parse(ResponsesRequest, await request.get_data(cache=False))
        api = self.api
        api._check_model(req.model)
        history: list[Item] = []
        if req.previous_response_id is not None:
            previous = self.store.get(req.previous_response_id)
            if previous is None:
                return error_response(
                    404, f"Previous response with id '{req.previous_response_id}' not found.",
                    param="previous_response_id", code="previous_response_not_found",
                )  # fmt: skip
            history = previous.conversation
        items = history + req.items()
        with _responses_names():
            chat = chat_request(req, items)
            inputs = chat_inputs(chat, api.tokenizer.chat_template)
            prompt, token_ids = await api._encode_chat(inputs.messages, True, inputs.kwargs)
            plan = chat_plan(
                chat,
                api.tokenizer,
                api.reasoning,
                inputs,
                prompt,
                api.serving.thinking_token_budget,
            )
        response_id = new_id("resp")
        fmt = ChatFormat(
            api.tokenizer, response_id, api.model_name, plan.params, plan.tools, plan.reasoning
        )
        fmt.prompt_tokens = g.access.tokens_in = len(token_ids)
        end = api.reasoning.end if api.reasoning is not None else ""
        end_ids = api.tokenizer.encode(end, add_special_tokens=False) if end else []
        writer = ResponseWriter(fmt, _template(req, response_id, api.model_name), end_ids)
        conversation = Conversation(self.store, req.store, items)
        if not req.stream:
            return await self._unary(writer, token_ids, plan.params, conversation)
        events = self._events(writer, token_ids, plan.params, conversation, g.access)
        await anext(events)  # submits: a refusal raises here and gets its own status
        response = Response(
            events, mimetype="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        response.timeout = None  # Quart's RESPONSE_TIMEOUT would cut a long stream
        return response

    async def retrieve(self, response_id: str) -> Response:
        stored = self.store.get(response_id)
        if stored is None:
            return _not_found(response_id)
        return Response(stored.body.model_dump_json(), mimetype="application/json")

    async def delete(self, response_id: str) -> Response:
        if not self.store.delete(response_id):
            return _not_found(response_id)
        body = {"id": response_id, "object": "response", "deleted": True}
        return Response(json.dumps(body), mimetype="application/json")

    async def _unary(
        self,
        writer: ResponseWriter,
        token_ids: list[int],
        params: SamplingParams,
        conversation: Conversation,
    ) -> Response:
        final = None
        try:
            async with AsyncExitStack() as stack:
                with _responses_names():
                    (outputs,) = await self.api._submit(stack, [token_ids], params)
                async for final in outputs:  # noqa: B007
                    pass
        except trio.Cancelled:  # the client left: no response, so log it here
            g.access.write("499 (client left)")
            raise
        assert final is not None and final.finished
        g.access.tokens_out = len(final.outputs[0].token_ids)
        body = writer.unary(final)
        conversation.keep(body)
        return Response(body.model_dump_json(), mimetype="application/json")

    async def _events(
        self,
        writer: ResponseWriter,
        token_ids: list[int],
        params: SamplingParams,
        conversation: Conversation,
        access: AccessRecord,
    ) -> AsyncIterator[bytes]:
        """The SSE body, as the chat route's: the `generate` block closes with this generator
        (cancelled, or closed while suspended at a yield, when the client leaves)."""
        ending = None  # until submitted, a refusal is logged with its own status
        try:
            async with AsyncExitStack() as stack:
                with _responses_names():
                    (outputs,) = await self.api._submit(stack, [token_ids], params)
                ending = "200 (client left)"
                yield b""
                try:
                    for event in writer.opening():
                        yield event
                    async for out in outputs:
                        for event in writer.update(out):
                            yield event
                    assert writer.final is not None
                    conversation.keep(writer.final)
                    ending = "200"
                except Exception as e:  # mid-stream: the status line is gone, report in it
                    status, info = error_info(e)
                    log.warning("stream %s failed (%d): %s", writer.template.id, status,
                                printable(info.message))  # fmt: skip
                    ending = f"200 (failed: {status})"
                    yield writer.failed(info)
        finally:
            if ending is not None:
                access.tokens_out = writer.sent_tokens
                access.write(ending)


@dataclass(frozen=True)
class Conversation:
    """Where a finished response is kept (if the request asked), after the items it answered."""

    store: ResponseStore
    stored: bool
    items: list[Item]

    def keep(self, body: ResponseBody) -> None:
        if self.stored:
            output = input_items([item.model_dump() for item in body.output], "output")
            self.store.put(body.id, Stored(body, self.items + output))


def chat_request(req: ResponsesRequest, items: list[Item]) -> ResponsesChat:
    """The chat request a Responses API request asks for."""
    tools = req.function_tools()
    named = req.named_function(tools)
    messages = chat_messages(req.instructions, items)
    if not messages:
        raise InvalidRequest("input is empty: give at least one message", "input")
    chat = validate(ResponsesChat, {
        "model": req.model, "messages": messages,
        "tools": [{"type": "function", "function": t.model_dump(exclude={"type"})}
                  for t in tools] or None,
        "tool_choice": {"type": "function", "function": {"name": named}} if named
        else req.tool_choice,
        "parallel_tool_calls": req.parallel_tool_calls,
        "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
        "top_p": req.top_p, "stream": req.stream, "reasoning_effort": req.effort,
        "top_k": req.top_k, "min_p": req.min_p, "repetition_penalty": req.repetition_penalty,
        "frequency_penalty": req.frequency_penalty, "presence_penalty": req.presence_penalty,
        "stop": req.stop,
    })  # fmt: skip
    chat._text_format = req.constraint()
    chat.check()
    return chat


def chat_messages(instructions: str | None, items: list[Item]) -> list[dict[str, Any]]:
    """Items as chat messages: `instructions` a first system message; an assistant's message
    and the function calls after it one assistant turn with tool_calls; each call's output a
    tool message; a reasoning item's text the reasoning_content of the assistant turn that
    follows it (a user's words in between drop it: it answered nothing of theirs)."""
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    turn: dict[str, Any] | None = None  # the assistant turn that calls join
    thinking: list[str] = []  # reasoning waiting for its assistant turn
    for item in items:
        if isinstance(item, Reasoning):
            thinking.append(item.text())
            turn = None
            continue
        if isinstance(item, FunctionCall):
            if turn is None:
                turn = _assistant(None, thinking)
                messages.append(turn)
            call = {"name": item.name, "arguments": item.arguments}
            turn.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": call}
            )
        elif isinstance(item, FunctionCallOutput):
            content = item.output if isinstance(item.output, str) else ""
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": content})
            turn, thinking = None, []
        elif isinstance(item, Message) and item.role == "assistant":
            turn = _assistant(item.text(""), thinking)
            messages.append(turn)
        else:
            messages.append({"role": item.role, "content": item.text("")})
            turn, thinking = None, []
    return messages


def _assistant(content: str | None, thinking: list[str]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if thinking:
        message["reasoning_content"] = "\n".join(thinking)
        thinking.clear()
    return message


def _template(req: ResponsesRequest, response_id: str, model: str) -> ResponseBody:
    """The body before any output: the request's settings, echoed as OpenAI echoes them."""
    fmt = req.text.format if req.text is not None else None
    effort = req.reasoning.effort if req.reasoning is not None else None
    summary = req.reasoning.summary if req.reasoning is not None else None
    return ResponseBody(
        id=response_id, created_at=int(time.time()), status="in_progress",
        instructions=req.instructions, max_output_tokens=req.max_output_tokens,
        metadata=req.metadata or {}, model=model, output=[],
        parallel_tool_calls=req.parallel_tool_calls,
        previous_response_id=req.previous_response_id,
        reasoning={"effort": effort, "summary": summary}, store=req.store,
        temperature=1.0 if req.temperature is None else req.temperature,
        text={"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt
              else {"type": "text"}},
        tool_choice=req.tool_choice or "auto",
        tools=[t.model_dump() for t in req.function_tools()],
        top_p=1.0 if req.top_p is None else req.top_p, user=req.user,
    )  # fmt: skip


# Chat's names of the fields a Responses API request gives under its own names.
_NAMES = {
    "messages": "input", "prompt": "input", "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens", "reasoning_effort": "reasoning.effort",
    "response_format": "text.format",
}  # fmt: skip


@contextmanager
def _responses_names() -> Iterator[None]:
    """A refusal that chat's path names by chat's field names named by the Responses API's
    (a message's place among the items is not the input's: it names the input)."""
    try:
        yield
    except (InvalidRequest, RequestRejected) as e:
        given = e.param or ""
        head = given.split(".", 1)[0]
        if head not in _NAMES:
            raise
        name = _NAMES[head] if head in ("messages", "prompt") else _NAMES[head] + given[len(head) :]
        message = e.message if isinstance(e, InvalidRequest) else str(e)
        raise InvalidRequest(message.replace(given, name, 1), name) from None


def _not_found(response_id: str) -> Response:
    return error_response(404, f"Response with id '{response_id}' not found.", code="not_found")
