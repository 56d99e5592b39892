"""Ollama's API (`/api/chat`, `/api/generate`, `/api/tags`, `/api/show`, `/api/version`,
`/api/ps`) over the bridge's generation core (core.py), so that Ollama's clients and the tools
built on them use an edgetp cluster as they use a local Ollama: messages, tools, `format` (json
or a schema) and `options` become the internal request; the answer streams as NDJSON (one JSON
object a line, `done: true` on the last), Ollama's default. Errors come as `{"error": ...}`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field

from edgetp.master.bridge.auth import guard
from edgetp.master.bridge.core import (
    Call,
    Finish,
    Out,
    Reasoning,
    Served,
    Text,
    Wait,
    chat_request,
    generate,
    prepare_chat,
    prepare_text,
    started,
    whole,
)
from edgetp.master.bridge.errors import ROUTE_REQUESTS, APIError
from edgetp.master.bridge.models import ModelChoice, Models
from edgetp.master.bridge.request import CompletionRequest, warn_ignored
from edgetp.master.bridge.request_parts import _Request
from edgetp.master.bridge.schema import MAX_STOP_STRINGS, SEED_LIMIT, AnyText
from edgetp.master.bridge.schema import Text as TextField

OLLAMA_VERSION = "0.12.0"  # the Ollama API this follows (its clients check the version)


# -- the requests -----------------------------------------------------------------------------
class Options(_Request):
    num_predict: int | None = Field(None, description="tokens at most; -1 or left out: no limit")
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-SEED_LIMIT, le=SEED_LIMIT)
    stop: list[TextField] | None = Field(None, max_length=MAX_STOP_STRINGS)
    repeat_penalty: float | None = Field(None, gt=0.0)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class CalledFunction(_Request):
    name: TextField
    arguments: dict[str, Any]


class OllamaToolCall(_Request):
    function: CalledFunction


class OllamaMessage(_Request):
    role: Literal["system", "user", "assistant", "tool"]
    content: AnyText | None = ""
    thinking: AnyText | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: AnyText | None = None
    images: list[str] | None = Field(None, max_length=0, description="edgetp reads text only")


class OllamaFunction(_Request):
    name: TextField
    description: AnyText | None = None
    parameters: dict[str, Any] | None = None


class OllamaTool(_Request):
    type: Literal["function"]
    function: OllamaFunction


Format = Literal["json"] | dict[str, Any] | Literal[""]


class Common(_Request):
    model: AnyText = Field(description="the served model (GET /api/tags)")
    format: Format | None = None
    options: Options | None = None
    stream: bool | None = True
    think: bool | None = None
    keep_alive: AnyText | int | float | None = None


class ChatRequest(Common):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[OllamaTool] | None = None


class GenerateRequest(Common):
    prompt: AnyText = ""
    suffix: AnyText | None = None
    system: AnyText | None = None
    raw: bool | None = False
    images: list[str] | None = Field(None, max_length=0, description="edgetp reads text only")


class ShowRequest(_Request):
    model: AnyText | None = None
    name: AnyText | None = None  # the older key


ROUTE_REQUESTS["/api/chat"] = ChatRequest
ROUTE_REQUESTS["/api/generate"] = GenerateRequest


# -- in ---------------------------------------------------------------------------------------
def _sampling(body: Common) -> dict[str, Any]:
    o = body.options or Options()
    fields: dict[str, Any] = {}
    if o.num_predict is not None and o.num_predict > 0:
        fields["max_tokens"] = o.num_predict
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"),
                         ("top_k", "top_k"), ("min_p", "min_p"), ("seed", "seed"),
                         ("stop", "stop"), ("repetition_penalty", "repeat_penalty"),
                         ("presence_penalty", "presence_penalty"),
                         ("frequency_penalty", "frequency_penalty")):  # fmt: skip
        value = getattr(o, theirs)
        if value is not None:
            fields[ours] = value
    return fields


def _format(body: Common) -> dict[str, Any]:
    if body.format == "json":
        return {"response_format": {"type": "json_object"}}
    if isinstance(body.format, dict):
        schema = {"name": "answer", "schema": body.format}
        return {"response_format": {"type": "json_schema", "json_schema": schema}}
    return {}


def chat_fields(body: ChatRequest, chat_template: str | None) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    calls_made: list[str] = []  # call ids, for the tool results that follow
    for i, m in enumerate(body.messages):
        turn: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.tool_calls:
            ids = [f"call_{i}_{j}" for j in range(len(m.tool_calls))]
            turn["tool_calls"] = [
                {"id": cid, "type": "function", "function": {
                    "name": c.function.name, "arguments": json.dumps(c.function.arguments)}}
                for cid, c in zip(ids, m.tool_calls, strict=True)
            ]  # fmt: skip
            calls_made = ids
        if m.role == "tool":
            turn["tool_call_id"] = calls_made.pop(0) if calls_made else f"call_{i}"
            if m.tool_name:
                turn["name"] = m.tool_name
        messages.append(turn)
    if not messages:
        raise APIError(400, "messages: at least one message is required", param="messages")
    fields: dict[str, Any] = {"messages": messages, **_sampling(body), **_format(body)}
    if body.tools:
        fields["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
    if body.think is not None and "enable_thinking" in (chat_template or ""):
        fields["chat_template_kwargs"] = {"enable_thinking": body.think}
    return fields


# -- out --------------------------------------------------------------------------------------
def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _counts(finish: Finish, started_ns: int) -> dict[str, Any]:
    """Ollama's figures, in nanoseconds: the prompt's tokens evaluated (those its slot did not
    hold already: prompt reuse) and the prefill's time to the first token, the tokens generated
    and the time after the first; the total from the request's arrival (its wait for a slot
    included). The model is loaded once, when the server starts: no request loads it."""
    return {
        "done_reason": "length" if finish.reason == "length" else "stop",
        "total_duration": time.perf_counter_ns() - started_ns, "load_duration": 0,
        "prompt_eval_count": finish.prompt_tokens - finish.reused_tokens,
        "prompt_eval_duration": round(finish.prefill_s * 1e9),
        "eval_count": finish.completion_tokens, "eval_duration": round(finish.decode_s * 1e9),
    }  # fmt: skip


def _call(part: Call) -> dict[str, Any]:
    return {"function": {"name": part.call.name, "arguments": json.loads(part.call.arguments)}}


def _line(value: dict[str, Any]) -> str:
    return json.dumps(value) + "\n"


async def _ndjson(
    model: str, parts: AsyncIterator[Out | Wait], chat: bool, started_ns: int
) -> AsyncIterator[str]:
    try:
        async for part in parts:
            if isinstance(part, Wait):  # not asked for (keepalive_s None): NDJSON has no comment
                continue
            head = {"model": model, "created_at": _now()}
            if isinstance(part, Finish):
                last = {"role": "assistant", "content": ""} if chat else None
                body = {"message": last} if chat else {"response": ""}
                yield _line({**head, **body, "done": True, **_counts(part, started_ns)})
                return
            if chat:
                message: dict[str, Any] = {"role": "assistant", "content": ""}
                if isinstance(part, Text):
                    message["content"] = part.text
                elif isinstance(part, Reasoning):
                    message["thinking"] = part.text
                else:
                    message["tool_calls"] = [_call(part)]
                yield _line({**head, "message": message, "done": False})
            elif isinstance(part, Text | Reasoning):
                key = "response" if isinstance(part, Text) else "thinking"
                yield _line({**head, key: part.text, "done": False})
    except APIError as exc:  # the status line is long gone: the error travels as a line
        yield _line(exc.shaped("/api/"))


def router(models: Models, api_key: str | None) -> APIRouter:
    api = APIRouter(dependencies=guard(api_key), tags=["ollama"])

    async def answer(
        served: Served, body: Common, prepared: Any, chat: bool, request: Request,
        started_ns: int,
    ) -> Any:  # fmt: skip
        """The answer, streamed or whole. A streamed one sends nothing before its first part,
        as Ollama does: NDJSON has no comment to keep a connection alive with, and an empty
        line breaks the clients that parse every line (docs/decisions.md)."""
        rid = f"ollama-{started_ns}"
        parts = await started(generate(served, prepared, rid), request)
        if parts is None:
            return Response(status_code=499)
        if body.stream is not False:
            return StreamingResponse(
                _ndjson(body.model, parts, chat, started_ns), media_type="application/x-ndjson"
            )
        collected = await whole(parts, request)
        if collected is None:
            return Response(status_code=499)
        out, finish = collected
        text = "".join(p.text for p in out if isinstance(p, Text))
        thinking = "".join(p.text for p in out if isinstance(p, Reasoning))
        head = {"model": body.model, "created_at": _now(), "done": True,
                **_counts(finish, started_ns)}  # fmt: skip
        if not chat:
            return JSONResponse({**head, "response": text,
                                 **({"thinking": thinking} if thinking else {})})  # fmt: skip
        calls = [_call(p) for p in out if isinstance(p, Call)]
        message: dict[str, Any] = {"role": "assistant", "content": "" if calls else text}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = calls
        return JSONResponse({**head, "message": message})

    @api.post("/api/chat")
    async def chat(body: ChatRequest, request: Request) -> Any:
        """Ollama's chat: a reply to messages, streamed as NDJSON unless stream is false."""
        started_ns = time.perf_counter_ns()
        served = await models.use(body.model)
        warn_ignored(body, "/api/chat")
        fields = chat_fields(body, served.tokenizer.chat_template)
        prepared = await prepare_chat(served, chat_request(fields, "messages"))
        return await answer(served, body, prepared, True, request, started_ns)

    @api.post("/api/generate")
    async def generate_(body: GenerateRequest, request: Request) -> Any:
        """Ollama's generate: a prompt under the chat template (or raw), its continuation."""
        started_ns = time.perf_counter_ns()
        served = await models.use(body.model)
        warn_ignored(body, "/api/generate")
        if body.suffix:
            raise APIError(400, "suffix: edgetp does not fill in the middle", param="suffix")
        if body.raw:
            fields: dict[str, Any] = {"prompt": body.prompt, **_sampling(body)}
            try:
                text_body = CompletionRequest.model_validate(fields)
            except ValueError as exc:
                raise APIError(400, f"options: {exc}", param="options") from exc
            prepared = await prepare_text(served, text_body)
            if "max_tokens" not in fields:  # Ollama's default: up to the context
                room = served.batcher.max_context - len(prepared.prompt)
                prepared = replace(prepared, params=replace(prepared.params, max_tokens=room))
            return await answer(served, body, prepared, False, request, started_ns)
        messages = [{"role": "user", "content": body.prompt}]
        if body.system:
            messages.insert(0, {"role": "system", "content": body.system})
        fields = {"messages": messages, **_sampling(body), **_format(body)}
        prepared = await prepare_chat(served, chat_request(fields, "prompt"))
        return await answer(served, body, prepared, False, request, started_ns)

    def details() -> dict[str, Any]:
        return {"parent_model": "", "format": "gguf", "family": "", "families": [],
                "parameter_size": "", "quantization_level": ""}  # fmt: skip

    def entry(model: ModelChoice) -> dict[str, Any]:
        modified = datetime.fromtimestamp(model.created, UTC).isoformat()
        return {"name": model.model_id, "model": model.model_id, "modified_at": modified,
                "size": 0, "digest": "", "details": details()}  # fmt: skip

    @api.get("/api/tags")
    async def tags() -> Any:
        """The models this server answers for."""
        return {"models": [entry(c) for c in models.choices]}

    @api.get("/api/ps")
    async def ps() -> Any:
        """The models loaded (none between two, or once unloaded)."""
        ids = {served.model_id for served in models.resident}
        resident = [c for c in models.choices if c.model_id in ids]
        return {"models": [{**entry(c), "expires_at": "9999-12-31T23:59:59Z", "size_vram": 0}
                           for c in resident]}  # fmt: skip

    @api.post("/api/show")
    async def show(body: ShowRequest) -> Any:
        """The named model's template and what it can do (it is loaded to be shown)."""
        served = await models.use(body.model or body.name)
        template = served.tokenizer.chat_template or ""
        capabilities = ["completion", "tools"] + (["thinking"] if "<think>" in template else [])
        return {"modelfile": "", "parameters": "", "template": template, "details": details(),
                "model_info": {"general.context_length": served.batcher.max_context},
                "capabilities": capabilities,
                "modified_at": entry(models.choice(served.model_id))["modified_at"]}  # fmt: skip

    @api.get("/api/version")
    async def version() -> Any:
        return {"version": OLLAMA_VERSION}

    return api
