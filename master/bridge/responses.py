"""OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`) over the
bridge's generation core (core.py), as vLLM's `serving_responses.py` serves it beside chat
completions: input items (messages, function_call, function_call_output) and instructions
become the internal chat request, `text.format` its response format, function tools and
tool_choice its tools; the answer's parts become output items (reasoning, message,
function_call) or the documented stream of events, which the openai SDK's `responses.stream()`
accumulates.

A response stored (`store`, true by default as at OpenAI) keeps its conversation, so a request
with `previous_response_id` goes on from it; the store is in memory and bounded (the oldest go
first), and a server restart empties it.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field

from edgetp.master.bridge.auth import guard
from edgetp.master.bridge.core import (
    KEEPALIVE,
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
from edgetp.master.bridge.schema import AnyText
from edgetp.master.bridge.schema import Text as TextField

log = logging.getLogger(__name__)

STORED = 256  # responses kept for previous_response_id and GET, the oldest dropped first


# -- the request ------------------------------------------------------------------------------
class FunctionToolParam(_Request):
    type: Literal["function"]
    name: TextField
    description: AnyText | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Request):
    type: Literal["function"]
    name: TextField


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: AnyText | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: AnyText | None = None


class TextConfig(_Request):
    format: TextFormat | None = None


class ReasoningConfig(_Request):
    effort: AnyText | None = None
    summary: AnyText | None = None


class ResponsesRequest(_Request):
    model: AnyText | None = None
    input: AnyText | list[dict[str, Any]] = Field(
        description="text, or items: messages, function_call, function_call_output, reasoning"
    )
    instructions: AnyText | None = None
    tools: list[FunctionToolParam] | None = Field(None, description="function tools only")
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    store: bool | None = True
    previous_response_id: AnyText | None = None
    stream: bool | None = False
    metadata: dict[str, AnyText] | None = None
    user: AnyText | None = None
    # The Agents SDK sends it on every turn; edgetp has no extra output data to add.
    include: list[AnyText] | None = Field(None, description="accepted, changes nothing")


ROUTE_REQUESTS["/v1/responses"] = ResponsesRequest


# -- in ---------------------------------------------------------------------------------------
def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: must be a string or a list of text parts", param=where)
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("text"), str):
            raise APIError(
                400,
                f"{where}.{i}: a content part must be {{'type': 'input_text', 'text': ...}} "
                f"(edgetp's models read text only)",
                param=f"{where}.{i}",
            )
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"{where}.{key}: a string is required", param=f"{where}.{key}")
    return value


def messages_of(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as the internal request's messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}.role: one of user, assistant, system, developer",
                               param=f"{where}.role")  # fmt: skip
            out.append({"role": role, "content": _content_text(item.get("content"),
                                                                f"{where}.content")})  # fmt: skip
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {"name": _string(item, "name", where),
                             "arguments": _string(item, "arguments", where)},
            }  # fmt: skip
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            elif out and out[-1]["role"] == "assistant":
                out[-1]["tool_calls"] = [call]
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _content_text(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                        "content": text})  # fmt: skip
        elif kind == "reasoning":
            continue  # the model's own earlier thoughts: templates drop them too
        else:
            raise APIError(
                400,
                f"{where}.type: {json.dumps(kind)} is not supported: edgetp takes message, "
                f"function_call, function_call_output and reasoning items",
                param=f"{where}.type",
                code="unsupported_value",
            )
    return out


def internal(body: ResponsesRequest, earlier: list[dict[str, Any]]) -> dict[str, Any]:
    messages = [*earlier, *messages_of(body.input)]
    if body.instructions:  # not carried over from a previous response, as at OpenAI
        messages = [{"role": "system", "content": body.instructions}, *messages]
    fields: dict[str, Any] = {"messages": messages}
    if body.tools:
        tools = [(t.name, t.description, t.parameters) for t in body.tools]
        fields["tools"] = tool_definitions(tools)
        choice = body.tool_choice
        if isinstance(choice, NamedFunction):
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        elif choice is not None:
            fields["tool_choice"] = choice
        if body.parallel_tool_calls is not None:
            fields["parallel_tool_calls"] = body.parallel_tool_calls
    form = body.text.format if body.text else None
    if form is not None and form.type == "json_object":
        fields["response_format"] = {"type": "json_object"}
    elif form is not None and form.type == "json_schema":
        fields["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": form.name or "answer",
                            **({"schema": form.schema_} if form.schema_ is not None else {})},
        }  # fmt: skip
    if body.max_output_tokens is not None:
        fields["max_tokens"] = body.max_output_tokens
    for name in ("temperature", "top_p"):
        if getattr(body, name) is not None:
            fields[name] = getattr(body, name)
    return fields


# -- out --------------------------------------------------------------------------------------
def _item(part: Out, rid: str, n: int) -> dict[str, Any]:
    """An output item for a part, completed."""
    if isinstance(part, Text):
        return {"type": "message", "id": f"msg_{rid}_{n}", "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": part.text, "annotations": [],
                             "logprobs": []}]}  # fmt: skip
    if isinstance(part, Reasoning):
        return {"type": "reasoning", "id": f"rs_{rid}_{n}", "summary": [],
                "content": [{"type": "reasoning_text", "text": part.text}]}  # fmt: skip
    assert isinstance(part, Call)
    return {"type": "function_call", "id": f"fc_{rid}_{n}", "call_id": part.call.id,
            "name": part.call.name, "arguments": part.call.arguments,
            "status": "completed"}  # fmt: skip


class Store:
    """Responses kept for GET and previous_response_id: each with its conversation so far."""

    def __init__(self, size: int = STORED) -> None:
        self._kept: collections.OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]]
        self._kept = collections.OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        with self._lock:
            self._kept[response["id"]] = (response, conversation)
            while len(self._kept) > self._size:
                self._kept.popitem(last=False)

    def get(self, rid: str, param: str = "response_id") -> tuple[dict[str, Any], list[Any]]:
        with self._lock:
            if rid not in self._kept:
                raise APIError(
                    404,
                    f"no response {rid!r} is stored here: it was made with store false, "
                    f"deleted, dropped for newer ones (the last {self._size} are kept) or made "
                    f"before the server restarted",
                    param=param,
                    code="not_found",
                )
            return self._kept[rid]

    def delete(self, rid: str) -> None:
        self.get(rid)
        with self._lock:
            self._kept.pop(rid, None)


def _conversation(
    messages: list[dict[str, Any]], output: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The conversation with the answer's items as the assistant's turn (instructions left
    out: they are the request's own)."""
    said = "".join(c["text"] for o in output if o["type"] == "message" for c in o["content"])
    calls = [{"id": o["call_id"], "type": "function",
              "function": {"name": o["name"], "arguments": o["arguments"]}}
             for o in output if o["type"] == "function_call"]  # fmt: skip
    turn: dict[str, Any] = {"role": "assistant", "content": said}
    if calls:
        turn["tool_calls"] = calls
    return [*messages, turn]


def router(models: Models, api_key: str | None) -> APIRouter:
    api = APIRouter(dependencies=guard(api_key), tags=["openai"])
    store = Store()

    def response(
        body: ResponsesRequest, rid: str, created: int, status: str,
        output: list[dict[str, Any]], finish: Finish | None,
    ) -> dict[str, Any]:  # fmt: skip
        form = body.text.format.model_dump(by_alias=True, exclude_none=True) if (
            body.text and body.text.format) else {"type": "text"}  # fmt: skip
        usage = None
        if finish is not None:
            usage = {
                "input_tokens": finish.prompt_tokens,
                "input_tokens_details": {"cached_tokens": finish.reused_tokens},
                "output_tokens": finish.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": finish.prompt_tokens + finish.completion_tokens,
            }
        incomplete = finish is not None and finish.reason == "length"
        return {
            "id": rid, "object": "response", "created_at": created,
            "status": "incomplete" if incomplete and status == "completed" else status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "model": models.choice(body.model).model_id, "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": body.store is not False,
            "temperature": body.temperature, "top_p": body.top_p,
            "text": {"format": form},
            "tool_choice": (body.tool_choice.model_dump() if isinstance(body.tool_choice,
                            NamedFunction) else body.tool_choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
            "truncation": "disabled", "usage": usage, "metadata": body.metadata or {},
            "user": body.user,
        }  # fmt: skip

    async def events(
        body: ResponsesRequest, rid: str, created: int, parts: AsyncIterator[Out | Wait],
        messages: list[dict[str, Any]],
    ) -> AsyncIterator[str]:  # fmt: skip
        """The documented sequence: created, in_progress; per item output_item.added, its
        content part or arguments with their deltas and dones, output_item.done; completed.
        While the first part is late, an SSE comment (which clients skip) now and then."""
        seq = 0

        def event(kind: str, /, **data: Any) -> str:
            nonlocal seq
            seq += 1
            payload = {"type": kind, "sequence_number": seq - 1, **data}
            return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

        output: list[dict[str, Any]] = []
        yield event("response.created", response=response(body, rid, created, "in_progress",
                                                           [], None))  # fmt: skip
        yield event("response.in_progress", response=response(body, rid, created,
                                                              "in_progress", [], None))  # fmt: skip
        open_item: dict[str, Any] | None = None
        text = ""

        def close() -> list[str]:
            nonlocal open_item, text
            if open_item is None:
                return []
            at, item, sent = len(output), open_item, []
            if item["type"] == "message":
                part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
                item["content"] = [part]
                sent.append(event("response.output_text.done", item_id=item["id"],
                                  output_index=at, content_index=0, text=text,
                                  logprobs=[]))  # fmt: skip
                sent.append(event("response.content_part.done", item_id=item["id"],
                                  output_index=at, content_index=0, part=part))  # fmt: skip
            else:
                part = {"type": "reasoning_text", "text": text}
                item["content"] = [part]
                sent.append(event("response.reasoning_text.done", item_id=item["id"],
                                  output_index=at, content_index=0, text=text))  # fmt: skip
                sent.append(event("response.content_part.done", item_id=item["id"],
                                  output_index=at, content_index=0, part=part))  # fmt: skip
            item["status"] = "completed"
            sent.append(event("response.output_item.done", output_index=at, item=item))
            output.append(item)
            open_item, text = None, ""
            return sent

        try:
            async for part in parts:
                if isinstance(part, Wait):
                    yield KEEPALIVE
                    continue
                if isinstance(part, Finish):
                    for sent in close():
                        yield sent
                    done = response(body, rid, created, "completed", output, part)
                    if body.store is not False:
                        store.put(done, _conversation(messages, output))
                    name = "response.completed" if done["status"] == "completed" else (
                        "response.incomplete")  # fmt: skip
                    yield event(name, response=done)
                    return
                if isinstance(part, Text) and open_item is None and not part.text.strip():
                    continue  # whitespace before the answer
                kind = "message" if isinstance(part, Text) else (
                    "reasoning" if isinstance(part, Reasoning) else "function_call")  # fmt: skip
                if open_item is not None and open_item["type"] != kind:
                    for sent in close():
                        yield sent
                at = len(output)
                if isinstance(part, Call):
                    item = _item(part, rid, at)
                    args = item["arguments"]
                    yield event(
                        "response.output_item.added",
                        output_index=at,
                        item={**item, "arguments": "", "status": "in_progress"},
                    )
                    yield event(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=at,
                        delta=args,
                    )
                    yield event(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=at,
                        arguments=args,
                        name=item["name"],
                    )
                    yield event("response.output_item.done", output_index=at, item=item)
                    output.append(item)
                    continue  # fmt: skip
                assert isinstance(part, Text | Reasoning)
                if open_item is None:
                    open_item = _item(part, rid, at)
                    open_item["content"] = []
                    open_item["status"] = "in_progress"
                    yield event("response.output_item.added", output_index=at,
                                item=({**open_item, "status": "in_progress"}
                                      if kind == "message" else {**open_item}))  # fmt: skip
                    empty = ({"type": "output_text", "text": "", "annotations": [],
                              "logprobs": []} if kind == "message"
                             else {"type": "reasoning_text", "text": ""})  # fmt: skip
                    yield event(
                        "response.content_part.added",
                        item_id=open_item["id"],
                        output_index=at,
                        content_index=0,
                        part=empty,
                    )
                text += part.text
                name = ("response.output_text.delta" if kind == "message"
                        else "response.reasoning_text.delta")  # fmt: skip
                yield event(
                    name,
                    item_id=open_item["id"],
                    output_index=at,
                    content_index=0,
                    delta=part.text,
                    **({"logprobs": []} if kind == "message" else {}),
                )
        except APIError as exc:  # the status line is long gone: the error travels as an event
            error = exc.body.error
            yield event("error", code=error.code, message=error.message, param=error.param)

    @api.post("/v1/responses")
    async def create(body: ResponsesRequest, request: Request) -> Any:
        """OpenAI's Responses: a reply to input items, as output items."""
        served = await models.use(body.model)
        warn_ignored(body, "/v1/responses")
        earlier: list[dict[str, Any]] = []
        if body.previous_response_id:
            earlier = store.get(body.previous_response_id, "previous_response_id")[1]
        fields = internal(body, earlier)
        chat = chat_request(fields, "input")
        prepared = await prepare_chat(served, chat)
        rid, created = f"resp_{uuid.uuid4().hex[:24]}", int(time.time())
        wait = served.keepalive_s if body.stream else None
        parts = await started(generate(served, prepared, rid), request, wait)
        if parts is None:
            return Response(status_code=499)
        messages = fields["messages"][1:] if body.instructions else fields["messages"]
        if body.stream:
            return StreamingResponse(
                events(body, rid, created, parts, messages),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        collected = await whole(parts, request)
        if collected is None:
            return Response(status_code=499)
        out, finish = collected
        kept = [p for p in out if not isinstance(p, Text) or p.text.strip()]
        output = [_item(p, rid, i) for i, p in enumerate(kept)]
        done = response(body, rid, created, "completed", output, finish)
        if body.store is not False:
            store.put(done, _conversation(messages, output))
        return JSONResponse(done)

    @api.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> Any:
        """A stored response."""
        return JSONResponse(store.get(response_id)[0])

    @api.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> Any:
        """Forget a stored response."""
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return api
