"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) over the bridge's
generation core (core.py), as llama.cpp's server serves it: the request becomes the internal
chat request (system, text, tool_use and tool_result blocks as messages, calls and results;
`tool_choice` any and tool forced by the same grammar as OpenAI's required and named choices),
and the answer's parts become content blocks (text, thinking, tool_use) or Anthropic's stream of
events. Errors come in Anthropic's shape (errors.py); the key as `x-api-key`.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field

from edgetp.master.bridge.auth import guard
from edgetp.master.bridge.core import (
    Call,
    Finish,
    Out,
    Reasoning,
    Text,
    Wait,
    chat_request,
    generate,
    prepare_chat,
    started,
    tool_definitions,
    whole,
)
from edgetp.master.bridge.errors import ROUTE_REQUESTS, APIError
from edgetp.master.bridge.models import Models
from edgetp.master.bridge.request import warn_ignored
from edgetp.master.bridge.request_parts import _Request
from edgetp.master.bridge.schema import MAX_STOP_STRINGS, AnyText
from edgetp.master.bridge.schema import Text as TextField

log = logging.getLogger(__name__)

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _stop_reason(finish: Finish) -> str:
    """Anthropic's stop_reason: "stop_sequence" when one of the request's stop_sequences ended
    the answer (named beside it in `stop_sequence`), else the end's own."""
    if finish.reason == "stop" and finish.stop_string is not None:
        return "stop_sequence"
    return STOP_REASONS[finish.reason]


# -- the request ------------------------------------------------------------------------------
class TextBlock(_Request):
    type: Literal["text"]
    text: AnyText


class ImageBlock(_Request):
    type: Literal["image", "document"]


class ToolUseBlock(_Request):
    type: Literal["tool_use"]
    id: TextField
    name: TextField
    input: dict[str, Any]


class ToolResultBlock(_Request):
    type: Literal["tool_result"]
    tool_use_id: TextField
    content: AnyText | list[TextBlock] | None = None
    is_error: bool | None = None


class ThinkingBlock(_Request):
    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
    Field(discriminator="type"),
]


class Message(_Request):
    role: Literal["user", "assistant"]
    content: AnyText | list[Block]


class Tool(_Request):
    name: TextField
    description: AnyText | None = None
    input_schema: dict[str, Any] = Field(description="the JSON schema of the tool's input")


class ToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: TextField | None = Field(None, description="with type 'tool': the tool to call")
    disable_parallel_tool_use: bool | None = None


class Thinking(_Request):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class CountTokensRequest(_Request):
    model: AnyText | None = None
    messages: list[Message] = Field(min_length=1)
    system: AnyText | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, description="tokens to generate at most (required)")
    stop_sequences: list[TextField] | None = Field(None, max_length=MAX_STOP_STRINGS)
    stream: bool | None = False
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = None


ROUTE_REQUESTS["/v1/messages"] = MessagesRequest
ROUTE_REQUESTS["/v1/messages/count_tokens"] = CountTokensRequest


# -- in ---------------------------------------------------------------------------------------
def _text(content: str | list[Any] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(b.text for b in content if isinstance(b, TextBlock))


def internal(body: CountTokensRequest, chat_template: str | None) -> dict[str, Any]:
    """The internal chat request's fields for a Messages request."""
    messages: list[dict[str, Any]] = []
    if body.system:
        messages.append({"role": "system", "content": _text(body.system)})
    for m in body.messages:
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
            continue
        for block in m.content:
            if isinstance(block, ToolResultBlock):
                result = _text(block.content)
                messages.append(
                    {"role": "tool", "tool_call_id": block.tool_use_id, "content": result}
                )
        text = _text(m.content)
        calls = [
            {"id": b.id, "type": "function",
             "function": {"name": b.name, "arguments": json.dumps(b.input)}}
            for b in m.content if isinstance(b, ToolUseBlock)
        ]  # fmt: skip
        if (
            text
            or calls
            or m.role == "assistant"
            and not any(isinstance(b, ToolResultBlock) for b in m.content)
        ):
            message: dict[str, Any] = {"role": m.role, "content": text}
            if calls:
                message["tool_calls"] = calls
            messages.append(message)
    fields: dict[str, Any] = {"messages": messages}
    if body.tools:
        tools = [(t.name, t.description, t.input_schema) for t in body.tools]
        fields["tools"] = tool_definitions(tools)
    choice = body.tool_choice
    if choice is not None and body.tools:
        if choice.type == "tool":
            if not choice.name:
                raise APIError(400, "tool_choice.name: required with type 'tool'",
                               param="tool_choice.name")  # fmt: skip
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            fields["tool_choice"] = {"any": "required"}.get(choice.type, choice.type)
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    if body.thinking is not None and "enable_thinking" in (chat_template or ""):
        fields["chat_template_kwargs"] = {"enable_thinking": body.thinking.type != "disabled"}
    if isinstance(body, MessagesRequest):
        fields["max_tokens"] = body.max_tokens
        for name in ("temperature", "top_p", "top_k"):
            if getattr(body, name) is not None:
                fields[name] = getattr(body, name)
        if body.stop_sequences:
            fields["stop"] = list(body.stop_sequences)
    return fields


# -- out --------------------------------------------------------------------------------------
def _block(part: Out) -> dict[str, Any]:
    if isinstance(part, Text):
        return {"type": "text", "text": part.text}
    if isinstance(part, Reasoning):
        return {"type": "thinking", "thinking": part.text, "signature": ""}
    assert isinstance(part, Call)
    return {
        "type": "tool_use",
        "id": _tool_id(part),
        "name": part.call.name,
        "input": json.loads(part.call.arguments),
    }


def _tool_id(part: Call) -> str:
    return "toolu_" + part.call.id.removeprefix("call_")


def _usage(finish: Finish) -> dict[str, int]:
    """As Anthropic counts: `input_tokens` are those after the cache (the prompt's tokens not
    reused, which were prefilled), `cache_read_input_tokens` those reused from a slot's cache;
    together the prompt. The cache is written without being asked for (prompt reuse), so no
    token counts as a cache write."""
    return {
        "input_tokens": finish.prompt_tokens - finish.reused_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": finish.reused_tokens,
        "output_tokens": finish.completion_tokens,
    }


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n"


async def _events(
    head: dict[str, Any], parts: AsyncIterator[Out | Wait], prompt_tokens: int
) -> AsyncIterator[str]:
    """Anthropic's stream: message_start, ping, a content block per part (text and thinking
    grow by deltas, a call comes whole as one input_json_delta), message_delta, message_stop;
    a ping now and then while the first part is late. message_start counts the whole prompt
    as input (what its slot reuses is not known before it takes one); message_delta's usage,
    whose counts are the totals, splits it into input and cache reads."""
    usage = {"input_tokens": prompt_tokens, "output_tokens": 0}
    start = {**head, "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}
    yield _event("message_start", {"message": start})
    yield _event("ping", {})
    index, open_kind = -1, ""
    try:
        async for part in parts:
            if isinstance(part, Wait):
                yield _event("ping", {})
                continue
            if isinstance(part, Finish):
                if open_kind:
                    yield _event("content_block_stop", {"index": index})
                delta = {"stop_reason": _stop_reason(part), "stop_sequence": part.stop_string}
                yield _event("message_delta", {"delta": delta, "usage": _usage(part)})
                yield _event("message_stop", {})
                return
            kind = type(part).__name__
            if isinstance(part, Text) and not open_kind and not part.text.strip():
                continue  # whitespace before the answer's first block
            if kind != open_kind or isinstance(part, Call):
                if open_kind:
                    yield _event("content_block_stop", {"index": index})
                index, open_kind = index + 1, kind
                block = _block(part)
                if isinstance(part, Call):
                    block["input"] = {}
                elif isinstance(part, Text):
                    block["text"] = ""
                else:
                    block["thinking"] = ""
                yield _event("content_block_start", {"index": index, "content_block": block})
            if isinstance(part, Text):
                delta = {"type": "text_delta", "text": part.text}
            elif isinstance(part, Reasoning):
                delta = {"type": "thinking_delta", "thinking": part.text}
            else:
                delta = {"type": "input_json_delta", "partial_json": part.call.arguments}
            yield _event("content_block_delta", {"index": index, "delta": delta})
    except APIError as exc:  # the status line is long gone: the error travels as an event
        yield _event("error", {"error": exc.shaped("/v1/messages")["error"]})


# -- the routes -------------------------------------------------------------------------------
def router(models: Models, api_key: str | None) -> APIRouter:
    api = APIRouter(dependencies=guard(api_key, x_api_key=True), tags=["anthropic"])

    @api.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Any:
        """Anthropic's Messages: a reply to a conversation, in content blocks."""
        served = await models.use(body.model)
        warn_ignored(body, "/v1/messages")
        chat = chat_request(internal(body, served.tokenizer.chat_template), "messages")
        prepared = await prepare_chat(served, chat)
        mid = f"msg_{uuid.uuid4().hex[:24]}"
        head = {"id": mid, "type": "message", "role": "assistant", "model": served.model_id}
        wait = served.keepalive_s if body.stream else None
        parts = await started(generate(served, prepared, mid), request, wait)
        if parts is None:
            return Response(status_code=499)
        if body.stream:
            return StreamingResponse(
                _events(head, parts, len(prepared.prompt)),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        collected = await whole(parts, request)
        if collected is None:
            return Response(status_code=499)
        out, finish = collected
        content = [_block(p) for p in out if not isinstance(p, Text) or p.text.strip()]
        return JSONResponse({
            **head, "content": content, "stop_reason": _stop_reason(finish),
            "stop_sequence": finish.stop_string, "usage": _usage(finish),
        })  # fmt: skip

    @api.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> Any:
        """The prompt's tokens as /v1/messages would render it, without generating."""
        served = await models.use(body.model)
        chat = chat_request(internal(body, served.tokenizer.chat_template), "messages")
        prepared = await prepare_chat(served, chat)
        return {"input_tokens": len(prepared.prompt)}

    return api
