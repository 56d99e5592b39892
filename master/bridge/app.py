"""The REST bridge: OpenAI's chat completions and completions (here), Responses (responses.py),
embeddings (embeddings.py), Anthropic's Messages (anthropic.py) and Ollama's /api (ollama.py),
each a thin router over one generation core (core.py) and the master's generation loop.

Handlers run on the event loop; the engine runs on the batcher's thread. Each request gets an
asyncio queue that the batcher feeds through `call_soon_threadsafe`. A client that goes away
(the connection closes) cancels its request: the batcher drops it before its next step.
Every body sent is one of schema.py's models, put together by answers.py; errors.py makes the
errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from edgetp.master.bridge import anthropic, embeddings, ollama, responses
from edgetp.master.bridge.answers import Answer, Choice, ChoiceEvent, sse, whole
from edgetp.master.bridge.core import (
    KEEPALIVE,
    Prepared,
    Served,
    disconnected,
    prepare_chat,
    prepare_text,
    queued,
    submit,
)
from edgetp.master.bridge.errors import APIError, documented, failure, install_handlers
from edgetp.master.bridge.metrics import add_metrics
from edgetp.master.bridge.models import Leases, ModelChoice, Models
from edgetp.master.bridge.request import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    warn_ignored,
)
from edgetp.master.bridge.schema import (
    ChatCompletion,
    ChatCompletionChunk,
    ClusterFigures,
    Completion,
    CompletionChunk,
    GenerationFigures,
    Health,
    ModelCard,
    ModelList,
    finish_openapi,
    stream_content,
)
from edgetp.master.cluster.figures import cluster_figures, generation_figures
from edgetp.master.generation.batcher import Delta, Failed, Ticket


def create_app(
    served: Served | Models, api_key: str | None = None, cors_origins: Sequence[str] = ()
) -> FastAPI:
    """The ASGI app over one model's Served, or several `Models` (one resident at a time);
    `api_key` (if given) is required as `Authorization: Bearer KEY` on /v1; browser pages from
    `cors_origins` may call it (CORS; none by default)."""
    models = served if isinstance(served, Models) else Models.single(served)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        unloading = asyncio.create_task(models.unload_idle())  # (none without unload_after)
        try:
            yield
        finally:
            unloading.cancel()

    app = FastAPI(
        title="edgetp REST bridge",
        version=_version(),
        description="OpenAI-, Anthropic- and Ollama-compatible APIs over an edgetp cluster.",
        lifespan=lifespan,
    )
    if cors_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["*"],
            allow_headers=["*"],
        )  # fmt: skip
    add_metrics(app, lambda: models.current.batcher if models.current else None)
    app.add_middleware(Leases, models=models)
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
        served = _resident(models)
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
        """The models this server answers for (one resident at a time)."""
        return ModelList(data=[_card(c) for c in models.choices])

    @app.get(
        "/v1/models/{model}",
        response_model=ModelCard,
        responses=documented(*auth_errors, 404),
        dependencies=guarded,
        tags=["openai"],
    )
    async def retrieve_model(model: str) -> ModelCard:
        return _card(models.choice(model))

    @app.get(
        "/v1/cluster",
        response_model=ClusterFigures,
        responses=documented(*auth_errors),
        dependencies=guarded,
        tags=["server"],
    )
    async def cluster() -> Any:
        """The nodes and their live figures, the allreduce latency, the generation counters."""
        served = _resident(models)
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
        served = await models.use(body.model)
        warn_ignored(body, "/v1/chat/completions")
        prepared = await prepare_chat(served, body)
        return await _generate(served, request, "chat", body, prepared)

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
        served = await models.use(body.model)
        warn_ignored(body, "/v1/completions")
        prepared = await prepare_text(served, body)
        return await _generate(served, request, "text", body, prepared)

    app.include_router(anthropic.router(models, api_key))
    app.include_router(responses.router(models, api_key))
    app.include_router(ollama.router(models, api_key))
    app.include_router(embeddings.router(models, api_key))

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        served = models.current
        if served is not None:  # the bounds of the resident model's (between two: none)
            vocab = min(served.tokenizer.vocab_size, served.batcher.config.vocab_size)
            finish_openapi(schema, served.batcher.max_context, vocab, served.batcher.config.hidden)
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


def _card(model: ModelChoice) -> ModelCard:
    return ModelCard(id=model.model_id, created=model.created, owned_by="edgetp")


def _resident(models: Models) -> Served:
    """The resident model's Served, or a 503 saying why there is none."""
    if models.current is None:
        why = models.failure or "no model is loaded (the next request loads the one it names)"
        raise APIError(503, why, type="server_error", code="model_unavailable")
    return models.current


async def _generate(
    served: Served, request: Request, kind: str, body: SamplingFields, prepared: Prepared
) -> Response:
    """Submit the request's n choices to the batcher; answer with one JSON object or a stream
    of server-sent events."""
    n = body.n or 1
    rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    logprobs = prepared.params.logprobs is not None
    answer = Answer(
        kind, rid, served.model_id, served.tokenizer, logprobs, prepared.echo, prepared.split
    )
    queue, on_event = queued(served)
    ticket = submit(served, prepared, n, rid, on_event)

    gone = asyncio.ensure_future(disconnected(request))
    try:
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def events(first: ChoiceEvent) -> AsyncIterator[str]:
                return sse(answer, n, first, queue, ticket, include_usage)

            try:
                first = await _next(queue, gone, served.keepalive_s)
            except TimeoutError:
                chunks = _keep_alive(queue, served.keepalive_s, ticket, events)
            else:
                if first is None:
                    ticket.cancel()
                    return Response(status_code=499)
                if isinstance(first[1], Failed):
                    ticket.cancel()  # the other choices, if any
                    raise failure(first[1])
                chunks = events(first)
            gone.cancel()  # from here the streaming response watches the connection itself
            return StreamingResponse(
                chunks,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        gathered = [Choice() for _ in range(n)]
        while any(c.done is None for c in gathered):
            item = await _next(queue, gone)
            if item is None:
                ticket.cancel()
                return Response(status_code=499)
            index, event = item
            if isinstance(event, Delta):
                gathered[index].take(event)
            elif isinstance(event, Failed):
                ticket.cancel()  # the other choices, if any
                raise failure(event)
            else:
                gathered[index].done = event
        return Response(whole(answer, gathered).model_dump_json(), media_type="application/json")
    except asyncio.CancelledError:
        ticket.cancel()
        raise
    finally:
        gone.cancel()


async def _next(
    queue: asyncio.Queue[ChoiceEvent], gone: asyncio.Future[None], timeout: float | None = None
) -> ChoiceEvent | None:
    """The request's next event, or None once the client has gone; TimeoutError after
    `timeout` s of neither."""
    if not queue.empty():
        return queue.get_nowait()
    get = asyncio.ensure_future(queue.get())
    either: set[asyncio.Future[Any]] = {get, gone}
    await asyncio.wait(either, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    if get.done():
        return get.result()
    get.cancel()  # the queue keeps an event that comes after this
    if not gone.done():
        raise TimeoutError
    return None


async def _keep_alive(
    queue: asyncio.Queue[ChoiceEvent],
    seconds: float,
    ticket: Ticket,
    events: Callable[[ChoiceEvent], AsyncIterator[str]],
) -> AsyncIterator[str]:
    """A stream whose first token is late: an SSE comment (which clients skip) every `seconds`
    until the request's first event, then `events` from it. The status line is sent by then,
    so a failure travels as an event, as one mid-answer does. A client that goes away is
    noticed at the next comment, and its request dropped."""
    try:
        while True:
            try:
                first = await asyncio.wait_for(queue.get(), seconds)
            except TimeoutError:
                yield KEEPALIVE
            else:
                break
        async for chunk in events(first):
            yield chunk
    finally:
        ticket.cancel()  # a no-op once finished
