"""Anthropic's Messages API: POST /v1/messages (unary and SSE) and /v1/messages/count_tokens,
an adapter at the edge. A request is read into the chat completion request that serves it
(protocol/anthropic.py) and goes the chat path's way: its template inputs and plan
(chat_plan.py), `Serving.admit` and `Serving.generate` through the OpenAI routes' `_submit`;
the answer is read apart by the chat path's format and put in Anthropic's shape
(anthropic_format.py). A client that leaves cancels the handler or closes the stream, which
leaves the `generate` block and aborts the request, as on the chat route.

Errors on these paths are Anthropic's (`{"type": "error", "error": {"type", "message"}}`): the
app's OpenAI-shaped error bodies are reshaped after the request (a full queue is 529
overloaded_error), and a refusal names the field as the client wrote it.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, contextmanager

import trio
from quart import Response, g, request

from nanoserve.engine import RequestOutput, RequestRejected, SamplingParams
from nanoserve.server.access import AccessRecord, printable
from nanoserve.server.anthropic_format import MessageEvents, message, sse
from nanoserve.server.chat_plan import ChatInputs, ChatPlan, chat_inputs, chat_plan
from nanoserve.server.errors import error_info
from nanoserve.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    InvalidRequest,
    parse,
)
from nanoserve.server.protocol.anthropic import (
    CountTokensRequest,
    MessagesRequest,
    chat_body,
    parse_anthropic,
)
from nanoserve.server.responses import ChatFormat
from nanoserve.server.routes import OpenAIServer

log = logging.getLogger(__name__)

PATH = "/v1/messages"
# Anthropic's error types by status (others: invalid_request_error below 500, api_error above).
ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
# The chat request's fields (and the prompt) by the names this API gives them, for refusals.
RENAMED = {
    "prompt": "messages",
    "stop": "stop_sequences",
    "thinking_token_budget": "thinking.budget_tokens",
    "reasoning_effort": "output_config.effort",
    "chat_template_kwargs.enable_thinking": "thinking",
    "response_format.json_schema.schema": "output_config.format.schema",
    "response_format": "output_config.format",
}


class AnthropicServer:
    """The routes, on the OpenAI routes' checks, template and submission (`api`)."""

    def __init__(self, api: OpenAIServer):
        self.api = api
        # Whether the template can switch the thinking off (thinking {"type": "disabled"})
        self.switchable = "enable_thinking" in (api.tokenizer.chat_template or "")

    async def messages(self) -> Response:
        req: MessagesRequest = parse_anthropic(MessagesRequest, await request.get_data(cache=False))
        with anthropic_names():
            chat, ids, plan = await self._prepare(req)
            omit = req.thinking is not None and req.thinking.display == "omitted"
            msg_id = f"msg_{uuid.uuid4().hex}"
            fmt = ChatFormat(
                self.api.tokenizer, msg_id, self.api.model_name, plan.params, plan.tools,
                plan.reasoning,
            )  # fmt: skip
            fmt.prompt_tokens = g.access.tokens_in = len(ids)
            if not chat.stream:
                return await self._unary(fmt, ids, plan.params, omit)
            stream = MessageEvents(msg_id, self.api.model_name, omit)
            events = self._events(fmt, stream, ids, plan.params, g.access)
            await anext(events)  # submits: a refusal raises here and gets its own status
        response = Response(
            events, mimetype="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        response.timeout = None  # Quart's RESPONSE_TIMEOUT would cut a long stream
        return response

    async def count_tokens(self) -> Response:
        """The rendered prompt's tokens (system, tools, thinking switch and all)."""
        body = await request.get_data(cache=False)
        req: CountTokensRequest = parse_anthropic(CountTokensRequest, body)
        with anthropic_names():
            *_, ids = await self._render(self._chat(req))
        g.access.tokens_in = len(ids)
        return Response(json.dumps({"input_tokens": len(ids)}), mimetype="application/json")

    def _chat(self, req: CountTokensRequest) -> ChatCompletionRequest:
        self.api._check_model(req.model)
        chat: ChatCompletionRequest = parse(
            ChatCompletionRequest, json.dumps(chat_body(req, self.switchable))
        )
        return chat

    async def _render(self, chat: ChatCompletionRequest) -> tuple[ChatInputs, str, list[int]]:
        """The chat request's template inputs, and its rendered prompt's text and ids."""
        inputs = chat_inputs(chat, self.api.tokenizer.chat_template)
        prompt, ids = await self.api._encode_chat(
            inputs.messages, chat.add_generation_prompt, inputs.kwargs, chat.continue_final_message
        )
        return inputs, prompt, ids

    async def _prepare(
        self, req: MessagesRequest
    ) -> tuple[ChatCompletionRequest, list[int], ChatPlan]:
        """The chat request, its prompt's ids and its plan, as the chat route makes them."""
        chat = self._chat(req)
        inputs, prompt, ids = await self._render(chat)
        plan = chat_plan(
            chat,
            self.api.tokenizer,
            self.api.reasoning,
            inputs,
            prompt,
            self.api.serving.thinking_token_budget,
        )
        return chat, ids, plan

    async def _unary(
        self, fmt: ChatFormat, ids: list[int], params: SamplingParams, omit: bool
    ) -> Response:
        try:
            async with AsyncExitStack() as stack:
                (outputs,) = await self.api._submit(stack, [ids], params)
                final = await _last(outputs)
        except trio.Cancelled:  # the client left: no response, so log it here
            g.access.write("499 (client left)")
            raise
        g.access.tokens_out = sum(len(c.token_ids) for c in final.outputs)
        chat = fmt.response([final])
        assert isinstance(chat, ChatCompletionResponse)
        body = message(fmt.id, fmt.model, chat, final, omit)
        return Response(body.model_dump_json(), mimetype="application/json")

    async def _events(
        self,
        fmt: ChatFormat,
        stream: MessageEvents,
        ids: list[int],
        params: SamplingParams,
        access: AccessRecord,
    ) -> AsyncIterator[bytes]:
        """The SSE body. The `generate` block closes with this generator: on a disconnect it is
        cancelled, or closed (GeneratorExit) while suspended at a yield."""
        ending = None  # until submitted, a refusal is logged with its own status
        try:
            async with AsyncExitStack() as stack:
                (outputs,) = await self.api._submit(stack, [ids], params)
                ending = "200 (client left)"
                yield b""
                try:
                    for event in stream.opening(len(ids)):
                        yield sse(event)
                    async for out in outputs:
                        for event in stream.events(fmt.chunks(0, out), out):
                            yield sse(event)
                    ending = "200"
                except Exception as e:  # mid-stream: the status line is gone, report in it
                    status, info = error_info(e)
                    log.warning(
                        "stream %s failed (%d): %s", fmt.id, status, printable(info.message)
                    )
                    ending = f"200 (failed: {status})"
                    error = {"type": error_type(status), "message": info.message}
                    yield sse(("error", {"type": "error", "error": error}))
        finally:
            if ending is not None:
                access.tokens_out = stream.output_tokens
                access.write(ending)

    async def reshape_errors(self, response: Response) -> Response:
        """An error on these paths in Anthropic's shape: the OpenAI body's message (naming the
        field, if it does not already) under the type for its status."""
        if not request.path.startswith(PATH) or response.status_code < 400:
            return response
        if response.mimetype != "application/json":
            return response
        body = json.loads(await response.get_data())
        error = body.get("error") if isinstance(body, dict) else None
        if not isinstance(error, dict):
            return response
        status = response.status_code
        if status == 503 and error.get("code") == "overloaded":
            status = 529  # Anthropic's status for a full queue; Retry-After stays
        message, param = str(error.get("message")), error.get("param")
        if param and param not in message:
            message = f"{param}: {message}"
        shaped = {"type": "error", "error": {"type": error_type(status), "message": message}}
        response.set_data(json.dumps(shaped))
        response.status_code = status
        return response


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


@contextmanager
def anthropic_names() -> Iterator[None]:
    """A refusal of the chat request (or of its prompt) names the field this API calls it."""
    try:
        yield
    except (InvalidRequest, RequestRejected) as e:
        message = e.message if isinstance(e, InvalidRequest) else str(e)
        param = e.param
        for chat, ours in RENAMED.items():
            if param is not None and (param == chat or param.startswith(chat + ".")):
                param = ours + param[len(chat) :]
            elif "_" not in chat:  # a common word ("stop"), unless it is the field's own name
                continue
            message = re.sub(rf"\b{re.escape(chat)}\b", ours, message)
        raise InvalidRequest(message, param) from None


async def _last(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = None
    async for last in outputs:  # noqa: B007
        pass
    assert last is not None and last.finished
    return last
