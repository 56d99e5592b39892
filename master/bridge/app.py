"""The REST bridge: OpenAI's chat and completions API over the master's generation loop.

Handlers run on the event loop; the engine runs on the batcher's thread. Each request gets an
asyncio queue that the batcher feeds through `call_soon_threadsafe`. A client that goes away
(the connection closes) cancels its request: the batcher drops it before its next step.
Errors come back in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with a
message that says what to change.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic.json_schema import models_json_schema
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from master.batcher import (
    Batcher,
    BusyError,
    Delta,
    Event,
    Failed,
    Finished,
    NodeLost,
    ShuttingDown,
    Ticket,
)
from master.bridge.schema import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ClusterFigures,
    Completion,
    CompletionChunk,
    CompletionRequest,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
    SamplingFields,
)
from master.cluster import ClusterError
from master.figures import cluster_figures, generation_figures
from master.sampling import SamplingParams
from master.session import chat_tokens
from models.errors import ModelError
from models.tokenizer import Tokenizer

log = logging.getLogger(__name__)

MIN_TEMPERATURE = 1e-4  # below it, sampling is the argmax anyway; dividing by it may overflow
# Any top_p below the likeliest token's probability (>= 1/vocabulary) keeps that token alone;
# a top_p that rounds to 0 in float32 (5e-324) would make the sampler drop every token.
MIN_TOP_P = 1e-6
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class APIError(Exception):
    """An error to send in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def response(self) -> JSONResponse:
        body = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=self.status)


@dataclass
class Served:
    """What the bridge serves: one model, its tokenizer, and the loop that owns the engine."""

    batcher: Batcher
    tokenizer: Tokenizer
    model_id: str
    aliases: tuple[str, ...] = ()  # other names a request may use for the model
    created: int = 0  # the model file's time, for /v1/models


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    words = {
        400: "the request is invalid; the message says what to change",
        401: "missing or wrong API key",
        404: "no such model",
        429: "every slot is busy and the waiting line is full",
        503: "the cluster is down or the server is shutting down",
    }
    return {s: {"model": ErrorResponse, "description": words[s]} for s in statuses}


def _stream_doc(chunk: str) -> dict[str, Any]:
    """The 200 response's text/event-stream content: the schema of each event."""
    payload = {"contentMediaType": "application/json"}
    data = {
        "type": "string",
        "description": f"a JSON {chunk}, or ErrorResponse if generation failed mid-stream; the "
        f"last event is the literal [DONE]",
        "anyOf": [
            {"const": "[DONE]"},
            {**payload, "contentSchema": {"$ref": f"#/components/schemas/{chunk}"}},
            {**payload, "contentSchema": {"$ref": "#/components/schemas/ErrorResponse"}},
        ],
    }
    return {
        "text/event-stream": {
            "schema": {
                "type": "object",
                "description": "with stream: true, one event per piece of text",
                "properties": {"event": {"type": "string"}, "data": data},
                "required": ["data"],
            }
        }
    }


def create_app(served: Served, api_key: str | None = None) -> FastAPI:
    """The ASGI app; `api_key` (if given) is required as `Authorization: Bearer KEY` on /v1."""
    app = FastAPI(
        title="edgetp REST bridge",
        version=_version(),
        description="OpenAI-compatible chat and completions over an edgetp cluster.",
    )
    bearer = HTTPBearer(auto_error=False, description="the key given to edgetp serve --api-key")

    async def check_key(
        credentials: HTTPAuthorizationCredentials | None = Depends(bearer),  # noqa: B008
    ) -> None:
        given = credentials.credentials if credentials else ""
        if not hmac.compare_digest(given.encode(), (api_key or "").encode()):
            raise APIError(
                401,
                "missing or wrong API key: send the key given to `edgetp serve --api-key` as "
                "the header 'Authorization: Bearer KEY'",
                type="authentication_error",
                code="invalid_api_key",
            )

    guarded: list[Any] = [Depends(check_key)] if api_key else []
    auth_errors = (401,) if api_key else ()

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400:  # FastAPI could not read the body at all (not UTF-8 JSON)
            message = "the request body is not UTF-8 JSON: send one JSON object"
            return APIError(400, message, code="invalid_json").response()
        kind = "not_found" if exc.status_code == 404 else None
        return APIError(exc.status_code, str(exc.detail), code=kind).response()

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return APIError(500, f"internal error: {exc}", type="server_error").response()

    @app.get("/health", response_model=Health, responses=_errors(503), tags=["server"])
    async def health() -> Any:
        """Liveness and the generation counters; 503 when the cluster is down."""
        stats = served.batcher.stats()
        if stats.down:
            raise APIError(503, stats.down, type="server_error", code="cluster_down")
        return {"model": served.model_id, "generation": generation_figures(stats)}

    @app.get(
        "/v1/models",
        response_model=ModelList,
        responses=_errors(*auth_errors),
        dependencies=guarded,
        tags=["openai"],
    )
    async def list_models() -> Any:
        """The one model this server runs."""
        return {"data": [_card(served)]}

    @app.get(
        "/v1/models/{model}",
        response_model=ModelCard,
        responses=_errors(*auth_errors, 404),
        dependencies=guarded,
        tags=["openai"],
    )
    async def retrieve_model(model: str) -> Any:
        _check_model(served, model)
        return _card(served)

    @app.get(
        "/v1/cluster",
        response_model=ClusterFigures,
        responses=_errors(*auth_errors),
        dependencies=guarded,
        tags=["server"],
    )
    async def cluster() -> Any:
        """The nodes and their live figures, the allreduce latency, the generation counters."""
        stats = served.batcher.stats()
        return cluster_figures(served.batcher.session, served.model_id, stats)

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletion,
        responses={
            200: {"content": _stream_doc("ChatCompletionChunk")},
            **_errors(400, *auth_errors, 404, 429, 503),
        },
        dependencies=guarded,
        tags=["openai"],
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        """A reply to a conversation, rendered with the model's own chat template."""
        _check_model(served, body.model)
        messages = [
            {
                "role": "system" if m.role == "developer" else m.role,
                "content": m.content
                if isinstance(m.content, str)
                else "".join(p.text for p in m.content),
            }
            for m in body.messages
        ]
        try:
            prompt = await run_in_threadpool(chat_tokens, served.tokenizer, messages)
        except ModelError as exc:
            raise APIError(400, str(exc), param="messages") from exc
        limit = body.max_completion_tokens or body.max_tokens
        return await _generate(served, request, "chat", body, prompt, limit, "messages", "")

    @app.post(
        "/v1/completions",
        response_model=Completion,
        responses={
            200: {"content": _stream_doc("CompletionChunk")},
            **_errors(400, *auth_errors, 404, 429, 503),
        },
        dependencies=guarded,
        tags=["openai"],
    )
    async def completions(body: CompletionRequest, request: Request) -> Any:
        """The continuation of a text (or of token ids), without a chat template."""
        _check_model(served, body.model)
        vocab = min(served.tokenizer.vocab_size, served.batcher.config.vocab_size)
        prompt, text = await run_in_threadpool(
            _completion_prompt, served.tokenizer, body.prompt, vocab
        )
        limit = body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
        echo = text if body.echo else ""
        return await _generate(served, request, "text", body, prompt, limit, "prompt", echo)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        # Validation errors are OpenAI-style 400s here, not FastAPI's 422s.
        for path in schema.get("paths", {}).values():
            for op in path.values():
                op.get("responses", {}).pop("422", None)
        schemas = schema.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        # The streamed chunks, which no route returns as its JSON model.
        _, defs = models_json_schema(
            [(ChatCompletionChunk, "serialization"), (CompletionChunk, "serialization")],
            ref_template="#/components/schemas/{model}",
        )
        for name, definition in defs.get("$defs", {}).items():
            schemas.setdefault(name, definition)
        # Bounds that depend on the model served: the context and the vocabulary.
        vocab = min(served.tokenizer.vocab_size, served.batcher.config.vocab_size)
        for name in ("ChatCompletionRequest", "CompletionRequest"):
            props = schemas.get(name, {}).get("properties", {})
            for field in ("max_tokens", "max_completion_tokens"):
                _set_maximum(props.get(field), served.batcher.max_context - 1)
            _set_maximum(props.get("prompt"), vocab - 1)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def _set_maximum(schema: Any, maximum: int) -> None:
    """Give every integer in a JSON schema (and its anyOf/items) an upper bound."""
    if isinstance(schema, dict):
        if schema.get("type") == "integer":
            schema["maximum"] = maximum
        for key in ("anyOf", "items"):
            sub = schema.get(key)
            for s in sub if isinstance(sub, list) else [sub]:
                _set_maximum(s, maximum)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("edgetp")
    except PackageNotFoundError:
        return "0"


def _card(served: Served) -> dict[str, Any]:
    return {"id": served.model_id, "created": served.created, "owned_by": "edgetp"}


def _check_model(served: Served, model: str | None) -> None:
    if model is None or model == served.model_id or model in served.aliases:
        return
    raise APIError(
        404,
        f"model {model!r} is not served here: use {served.model_id!r} (GET /v1/models), or "
        f"leave the field out",
        param="model",
        code="model_not_found",
    )


def _completion_prompt(tokenizer: Tokenizer, prompt: Any, vocab: int) -> tuple[list[int], str]:
    """(token ids, text) for the one prompt a completions request carries."""
    if isinstance(prompt, list) and isinstance(prompt[0], str | list):  # a list of one
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt), prompt
    bad = [t for t in prompt if t >= vocab]
    if bad:
        raise APIError(
            400,
            f"token id {bad[0]} is outside the vocabulary: ids must be below {vocab}",
            param="prompt",
        )
    return list(prompt), tokenizer.decode(prompt)


def _params(
    body: SamplingFields, prompt_len: int, limit: int | None, context: int, prompt_param: str
) -> SamplingParams:
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    room = context - prompt_len
    if room < 1:
        raise APIError(
            400,
            f"the prompt has {prompt_len} tokens but the context holds {context}: shorten it, "
            f"or restart edgetp serve with a larger --context",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if limit is not None and limit > room:
        raise APIError(
            400,
            f"the prompt has {prompt_len} tokens and max_tokens asks for {limit} more, but the "
            f"context holds {context}: ask for at most {room} tokens, shorten the prompt, or "
            f"restart edgetp serve with a larger --context",
            param="max_tokens",
            code="context_length_exceeded",
        )
    temperature = 1.0 if body.temperature is None else body.temperature
    try:
        return SamplingParams(
            temperature=0.0 if temperature < MIN_TEMPERATURE else temperature,
            top_k=body.top_k or 0,
            top_p=1.0 if body.top_p is None else max(body.top_p, MIN_TOP_P),
            repetition_penalty=body.repetition_penalty or 1.0,
            seed=body.seed,
            max_tokens=limit or room,
            stop=stop,
            ignore_eos=bool(body.ignore_eos),
        )
    except ValueError as exc:  # the schema's ranges should have caught it first
        raise APIError(400, str(exc)) from exc


async def _generate(
    served: Served,
    request: Request,
    kind: str,
    body: SamplingFields,
    prompt: list[int],
    limit: int | None,
    prompt_param: str,
    echo: str,
) -> Response:
    """Submit to the batcher; answer with one JSON object or a stream of server-sent events."""
    context = served.batcher.max_context
    params = _params(body, len(prompt), limit, context, prompt_param)
    rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Event] = asyncio.Queue()

    def on_event(event: Event) -> None:  # on the batcher's thread
        try:
            loop.call_soon_threadsafe(queue.put_nowait, event)
        except RuntimeError:  # the event loop has closed (shutdown): nobody is waiting
            pass

    try:
        ticket = served.batcher.submit(prompt, params, on_event, rid)
    except ModelError as exc:
        raise APIError(400, str(exc), param=prompt_param, code="context_length_exceeded") from exc
    except BusyError as exc:
        raise APIError(429, str(exc), type="server_error", code="busy") from exc
    except ClusterError as exc:
        raise _failure(Failed(exc)) from exc

    gone = asyncio.ensure_future(_disconnected(request))
    try:
        if body.stream:
            first = await _next(queue, gone)
            if first is None:
                ticket.cancel()
                return Response(status_code=499)
            if isinstance(first, Failed):
                raise _failure(first)
            gone.cancel()  # from here the streaming response watches the connection itself
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            chunks = _sse(served, kind, rid, first, queue, ticket, include_usage, echo)
            return StreamingResponse(
                chunks,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        text: list[str] = [echo]
        while True:
            event = await _next(queue, gone)
            if event is None:
                ticket.cancel()
                return Response(status_code=499)
            if isinstance(event, Delta):
                text.append(event.text)
            elif isinstance(event, Failed):
                raise _failure(event)
            else:
                return JSONResponse(_whole(served, kind, rid, "".join(text), event))
    except asyncio.CancelledError:
        ticket.cancel()
        raise
    finally:
        gone.cancel()


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _next(queue: asyncio.Queue[Event], gone: asyncio.Future[None]) -> Event | None:
    """The request's next event, or None once the client has gone."""
    if not queue.empty():
        return queue.get_nowait()
    get = asyncio.ensure_future(queue.get())
    await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
    if get.done():
        return get.result()
    get.cancel()
    return None


def _failure(event: Failed) -> APIError:
    if isinstance(event.error, ShuttingDown):
        return APIError(503, str(event.error), type="server_error", code="shutting_down")
    if isinstance(event.error, NodeLost):  # this request is lost; the next ones are served
        return APIError(503, str(event.error), type="server_error", code="node_lost")
    if isinstance(event.error, ClusterError):
        return APIError(503, str(event.error), type="server_error", code="cluster_down")
    return APIError(500, f"generation failed: {event.error}", type="server_error")


def _usage(done: Finished) -> dict[str, int]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
    }


def _whole(served: Served, kind: str, rid: str, text: str, done: Finished) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": done.finish_reason}
    if kind == "chat":
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {
        "id": rid,
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": int(time.time()),
        "model": served.model_id,
        "choices": [choice],
        "usage": _usage(done),
    }


async def _sse(
    served: Served,
    kind: str,
    rid: str,
    first: Event,
    queue: asyncio.Queue[Event],
    ticket: Ticket,
    include_usage: bool,
    echo: str,
) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk shapes; cancels the request if the stream stops."""
    created = int(time.time())

    def chunk(text: str | None, finish: str | None = None, role: bool = False) -> str:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if kind == "chat":
            delta: dict[str, str] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        return _data(
            {
                "id": rid,
                "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                "created": created,
                "model": served.model_id,
                "choices": [choice],
            }
        )

    try:
        if kind == "chat":
            yield chunk("", role=True)
        elif echo:
            yield chunk(echo)
        event: Event = first
        while True:
            if isinstance(event, Delta):
                yield chunk(event.text)
            elif isinstance(event, Finished):
                yield chunk(None, event.finish_reason)
                if include_usage:
                    yield _data(
                        {
                            "id": rid,
                            "object": "chat.completion.chunk"
                            if kind == "chat"
                            else "text_completion",
                            "created": created,
                            "model": served.model_id,
                            "choices": [],
                            "usage": _usage(event),
                        }
                    )
                yield "data: [DONE]\n\n"
                return
            else:  # the status line is long gone: the error travels as an event
                error = _failure(event)
                body = {"message": error.message, "type": error.type, "param": None}
                yield _data({"error": {**body, "code": error.code}})
                return
            event = await queue.get()
    finally:
        ticket.cancel()  # a no-op once finished; a client that went away frees its slot here


def _data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


_EXPECTED = {
    "stop": "a string or a list of strings",
    "prompt": "a string, a list of token ids, or a list of one of either",
    "content": "a string or a list of {'type': 'text', 'text': ...} parts",
}


def _validation_error(errors: Any) -> APIError:
    """One 400 for pydantic's errors: the first field at fault, what it got, what it takes."""
    errors = list(errors)
    first = errors[0]
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return APIError(
            400,
            f"the request body is not valid JSON ({detail}): send one JSON object",
            code="invalid_json",
        )
    loc = [str(x) for x in first["loc"]][1:]  # ("body", field, ...)
    if not loc:
        return APIError(
            400,
            "the request body must be a JSON object (Content-Type: application/json), "
            f"got {_show(first.get('input'))}",
            code="invalid_body",
        )
    # A union reports one error per branch; name the field once, with what it accepts.
    field_path = _field_path(loc)
    param = ".".join(field_path)
    if first["type"] == "extra_forbidden":
        return APIError(
            400,
            f"unknown field {param!r}: edgetp does not serve it; remove it",
            param=param,
            code="unknown_field",
        )
    if first["type"] == "missing":
        return APIError(400, f"{param} is required", param=param, code="missing_field")
    if any(e["type"] == "string_unicode" for e in errors):
        return APIError(
            400,
            f"{param} is not valid Unicode (a lone UTF-16 surrogate such as \\udfff?): send "
            f"valid UTF-8 text",
            param=param,
            code="invalid_value",
        )
    same = [e for e in errors if _field_path([str(x) for x in e["loc"]][1:]) == field_path]
    if len(same) > 1 and field_path[-1] in _EXPECTED:
        msg = f"{param} must be {_EXPECTED[field_path[-1]]}"
    else:
        msg = f"{param}: {first['msg']}"
    msg += f"; got {_show(first.get('input'))}"
    hint = _HINTS.get(param)
    if hint:
        msg += f" ({param}: {hint})"
    return APIError(400, msg, param=param, code="invalid_value")


_HINTS = {
    name: field.description
    for model in (ChatCompletionRequest, CompletionRequest)
    for name, field in model.model_fields.items()
    if field.description
}
_BRANCH_TAGS = {"str", "int", "float", "bool", "TextPart"}


def _field_path(loc: list[str]) -> list[str]:
    """The field names and list indexes in `loc` up to the first union branch tag.

    Pydantic names the branch a union error came from ('str', 'list[str]'); errors from the
    branches of one field then share this path.
    """
    out = []
    for part in loc:
        if part in _BRANCH_TAGS or "[" in part or "-" in part:  # e.g. 'constrained-str'
            break
        out.append(part)
    return out


def _show(value: Any, limit: int = 60) -> str:
    text = repr(value) if isinstance(value, bytes) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."
