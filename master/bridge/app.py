"""The REST bridge: OpenAI's chat and completions API over the master's generation loop.

Handlers run on the event loop; the engine runs on the batcher's thread. Each request gets an
asyncio queue that the batcher feeds through `call_soon_threadsafe`. A client that goes away
(the connection closes) cancels its request: the batcher drops it before its next step.
Every body sent is one of schema.py's models; errors.py makes the errors.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypedDict, cast

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from master.batcher import Batcher, BusyError, Delta, Event, Failed, Finished, Ticket
from master.bridge.errors import APIError, documented, failure, install_handlers
from master.bridge.metrics import add_metrics
from master.bridge.request import (
    ChatCompletionRequest,
    ChatTemplateKwargs,
    CompletionRequest,
    SamplingFields,
    warn_ignored,
)
from master.bridge.schema import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ClusterFigures,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    FinishReason,
    GenerationFigures,
    Health,
    ModelCard,
    ModelList,
    Usage,
    finish_openapi,
    stream_content,
)
from master.figures import cluster_figures, generation_figures
from master.params import SamplingParams
from master.prompts import chat_tokens
from master.transport import ClusterError
from models.chat_template import NoChatTemplate, NoThinkingSwitch
from models.errors import ModelError
from models.tokenizer import Tokenizer

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class Served:
    """What the bridge serves: one model, its tokenizer, and the loop that owns the engine."""

    batcher: Batcher
    tokenizer: Tokenizer
    model_id: str
    aliases: tuple[str, ...] = ()  # other names a request may use for the model
    created: int = 0  # the model file's time, for /v1/models


def create_app(
    served: Served, api_key: str | None = None, cors_origins: Sequence[str] = ()
) -> FastAPI:
    """The ASGI app; `api_key` (if given) is required as `Authorization: Bearer KEY` on /v1;
    browser pages from `cors_origins` may call it (CORS; none by default)."""
    app = FastAPI(
        title="edgetp REST bridge",
        version=_version(),
        description="OpenAI-compatible chat and completions over an edgetp cluster.",
    )
    if cors_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["*"],
            allow_headers=["*"],
        )  # fmt: skip
    add_metrics(app, served.batcher, served.model_id)
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

    install_handlers(app)

    @app.get("/health", response_model=Health, responses=documented(503), tags=["server"])
    async def health() -> Health:
        """Liveness and the generation counters; 503 when the cluster is down."""
        stats = served.batcher.stats()
        if stats.down:
            raise APIError(503, stats.down, type="server_error", code="cluster_down")
        generation = GenerationFigures.model_validate(generation_figures(stats))
        return Health(model=served.model_id, generation=generation)

    @app.get(
        "/v1/models",
        response_model=ModelList,
        responses=documented(*auth_errors),
        dependencies=guarded,
        tags=["openai"],
    )
    async def list_models() -> ModelList:
        """The one model this server runs."""
        return ModelList(data=[_card(served)])

    @app.get(
        "/v1/models/{model}",
        response_model=ModelCard,
        responses=documented(*auth_errors, 404),
        dependencies=guarded,
        tags=["openai"],
    )
    async def retrieve_model(model: str) -> ModelCard:
        _check_model(served, model)
        return _card(served)

    @app.get(
        "/v1/cluster",
        response_model=ClusterFigures,
        responses=documented(*auth_errors),
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
            200: {"content": stream_content(ChatCompletionChunk)},
            **documented(400, *auth_errors, 404, 429, 503),
        },
        dependencies=guarded,
        tags=["openai"],
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        """A reply to a conversation, rendered with the model's own chat template."""
        _check_model(served, body.model)
        unserved = body.unserved(served.tokenizer.chat_template)
        if unserved:  # what the schema cannot say
            raise APIError(400, unserved[1], param=unserved[0], code="unsupported_value")
        warn_ignored(body, "/v1/chat/completions")
        messages = [
            {
                "role": "system" if m.role == "developer" else m.role,
                "content": m.content
                if isinstance(m.content, str)
                else "".join(p.text for p in m.content),
                **({} if m.name is None else {"name": m.name}),
            }
            for m in body.messages
        ]
        try:
            switches = body.chat_template_kwargs or ChatTemplateKwargs()
            prompt = await run_in_threadpool(
                chat_tokens, served.tokenizer, messages, switches.enable_thinking
            )
        except NoChatTemplate as exc:
            message = f"{exc}: send the text to /v1/completions, which takes it as it is"
            raise APIError(400, message, param="messages") from exc
        except NoThinkingSwitch as exc:
            raise APIError(400, str(exc), param="chat_template_kwargs") from exc
        except ModelError as exc:  # the template's own verdict on the messages
            raise APIError(400, str(exc), param="messages") from exc
        limit = body.max_completion_tokens or body.max_tokens
        return await _generate(served, request, "chat", body, prompt, limit, "messages", "")

    @app.post(
        "/v1/completions",
        response_model=Completion,
        responses={
            200: {"content": stream_content(CompletionChunk)},
            **documented(400, *auth_errors, 404, 429, 503),
        },
        dependencies=guarded,
        tags=["openai"],
    )
    async def completions(body: CompletionRequest, request: Request) -> Any:
        """The continuation of a text (or of token ids), without a chat template."""
        _check_model(served, body.model)
        warn_ignored(body, "/v1/completions")
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
        vocab = min(served.tokenizer.vocab_size, served.batcher.config.vocab_size)
        finish_openapi(schema, served.batcher.max_context, vocab)
        app.openapi_schema = schema
        return schema

    # FastAPI's documented way to change its OpenAPI document is to replace this method,
    # which mypy refuses for any method.
    app.openapi = openapi  # type: ignore[method-assign]
    return app


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("edgetp")
    except PackageNotFoundError:
        return "0"


def _card(served: Served) -> ModelCard:
    return ModelCard(id=served.model_id, created=served.created, owned_by="edgetp")


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
    try:
        return SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_k=body.top_k or 0,
            top_p=1.0 if body.top_p is None else body.top_p,
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
        raise failure(Failed(exc)) from exc

    gone = asyncio.ensure_future(_disconnected(request))
    try:
        if body.stream:
            first = await _next(queue, gone)
            if first is None:
                ticket.cancel()
                return Response(status_code=499)
            if isinstance(first, Failed):
                raise failure(first)
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
                raise failure(event)
            else:
                whole = _whole(served, kind, rid, "".join(text), event)
                return Response(whole.model_dump_json(), media_type="application/json")
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
    either: set[asyncio.Future[Any]] = {get, gone}
    await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    if get.done():
        return get.result()
    get.cancel()
    return None


def _usage(done: Finished) -> Usage:
    total = done.prompt_tokens + done.completion_tokens
    return Usage(
        prompt_tokens=done.prompt_tokens,
        completion_tokens=done.completion_tokens,
        total_tokens=total,
    )


class _Head(TypedDict):
    """The fields every response object of one request starts with."""

    id: str
    created: int
    model: str


def _head(served: Served, rid: str) -> _Head:
    return {"id": rid, "created": int(time.time()), "model": served.model_id}


def _finish_reason(done: Finished) -> FinishReason:
    # The batcher's reason is a plain str that is always "stop" or "length"; the response
    # models validate it all the same.
    return cast(FinishReason, done.finish_reason)


def _whole(
    served: Served, kind: str, rid: str, text: str, done: Finished
) -> ChatCompletion | Completion:
    head = _head(served, rid)
    if kind == "chat":
        message = AssistantMessage(content=text)
        choice = ChatChoice(index=0, message=message, finish_reason=_finish_reason(done))
        return ChatCompletion(**head, choices=[choice], usage=_usage(done))
    text_choice = CompletionChoice(index=0, text=text, finish_reason=_finish_reason(done))
    return Completion(**head, choices=[text_choice], usage=_usage(done))


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
    head = _head(served, rid)

    def chunk(
        text: str | None,
        finish: FinishReason | None = None,
        role: Literal["assistant"] | None = None,
    ) -> str:
        if kind == "chat":
            delta = ChatDelta(role=role, content=text)
            choice = ChatChunkChoice(index=0, delta=delta, finish_reason=finish)
            return _event(ChatCompletionChunk(**head, choices=[choice]))
        text_choice = CompletionChunkChoice(index=0, text=text or "", finish_reason=finish)
        return _event(CompletionChunk(**head, choices=[text_choice]))

    try:
        if kind == "chat":
            yield chunk("", role="assistant")
        elif echo:
            yield chunk(echo)
        event: Event = first
        while True:
            if isinstance(event, Delta):
                yield chunk(event.text)
            elif isinstance(event, Finished):
                yield chunk(None, _finish_reason(event))
                if include_usage:
                    last = ChatCompletionChunk if kind == "chat" else CompletionChunk
                    yield _event(last(**head, choices=[], usage=_usage(event)))
                yield "data: [DONE]\n\n"
                return
            else:  # the status line is long gone: the error travels as an event
                yield _event(failure(event).body)
                return
            event = await queue.get()
    finally:
        ticket.cancel()  # a no-op once finished; a client that went away frees its slot here


def _event(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"
