"""The REST bridge: OpenAI's chat and completions API over the master's generation loop.

Handlers run on the event loop; the engine runs on the batcher's thread. Each request gets an
asyncio queue that the batcher feeds through `call_soon_threadsafe`. A client that goes away
(the connection closes) cancels its request: the batcher drops it before its next step.
Every body sent is one of schema.py's models, put together by answers.py; errors.py makes the
errors.
"""

from __future__ import annotations

import asyncio
import hmac
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from edgetp.master.bridge.answers import Answer, Choice, ChoiceEvent, sse, whole
from edgetp.master.bridge.errors import APIError, documented, failure, install_handlers
from edgetp.master.bridge.metrics import add_metrics
from edgetp.master.bridge.output import Split
from edgetp.master.bridge.request import (
    ChatCompletionRequest,
    ChatTemplateKwargs,
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
from edgetp.master.bridge.tools import Grammar, chat_prompt, constraints, tool_use
from edgetp.master.cluster.figures import cluster_figures, generation_figures
from edgetp.master.cluster.transport import ClusterError
from edgetp.master.generation.batcher import Batcher, BusyError, Delta, Event, Failed, Ticket
from edgetp.master.generation.grammar import GrammarError
from edgetp.master.generation.params import SamplingParams
from edgetp.models.chat_template import NoChatTemplate, NoThinkingSwitch
from edgetp.models.errors import ModelError
from edgetp.models.tokenizer import Tokenizer

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# A streamed request that waits this long for its first token (a long prefill, a turn for a
# slot) is answered at once, and then sent an SSE comment every as many seconds until its first
# chunk: proxies and clients drop a connection silent for their read timeout (nginx's 60 s,
# many clients' 30 s or less). 5 s keeps well inside those for a few bytes, and a request
# answered within it starts as before, its errors still an HTTP status.
KEEPALIVE_S = 5.0
KEEPALIVE = ": keep-alive\n\n"


@dataclass
class Served:
    """What the bridge serves: one model, its tokenizer, and the loop that owns the engine."""

    batcher: Batcher
    tokenizer: Tokenizer
    model_id: str
    aliases: tuple[str, ...] = ()  # other names a request may use for the model
    created: int = 0  # the model file's time, for /v1/models
    keepalive_s: float = KEEPALIVE_S  # a streamed request's silence before a comment


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
        use = tool_use(body)
        try:
            switches = body.chat_template_kwargs or ChatTemplateKwargs()
            prompt = await run_in_threadpool(
                chat_prompt, served.tokenizer, body.messages, use, switches.enable_thinking
            )
        except NoChatTemplate as exc:
            message = f"{exc}: send the text to /v1/completions, which takes it as it is"
            raise APIError(400, message, param="messages") from exc
        except NoThinkingSwitch as exc:
            raise APIError(400, str(exc), param="chat_template_kwargs") from exc
        except ModelError as exc:  # the template's own verdict on the messages
            raise APIError(400, str(exc), param="messages") from exc
        grammar, split = await run_in_threadpool(constraints, served.tokenizer, body, use, prompt)
        limit = body.max_completion_tokens or body.max_tokens
        return await _generate(
            served, request, "chat", body, prompt, limit, "messages", "", grammar, split
        )

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
        unserved = body.unserved()
        if unserved:  # what the schema cannot say
            raise APIError(400, unserved[1], param=unserved[0], code="unsupported_value")
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
            min_p=body.min_p or 0.0,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            logprobs=_logprobs(body),
            seed=body.seed,
            max_tokens=limit or room,
            stop=stop,
            ignore_eos=bool(body.ignore_eos),
        )
    except ValueError as exc:  # the schema's ranges should have caught it first
        raise APIError(400, str(exc)) from exc


def _logprobs(body: SamplingFields) -> int | None:
    """Alternatives to report per token (None: no log probabilities at all)."""
    if isinstance(body, ChatCompletionRequest):
        return (body.top_logprobs or 0) if body.logprobs else None
    if isinstance(body, CompletionRequest):
        return body.logprobs
    return None


async def _generate(
    served: Served,
    request: Request,
    kind: str,
    body: SamplingFields,
    prompt: list[int],
    limit: int | None,
    prompt_param: str,
    echo: str,
    grammar: Grammar | None = None,
    split: Split | None = None,
) -> Response:
    """Submit the request's n choices to the batcher; answer with one JSON object or a stream
    of server-sent events."""
    context = served.batcher.max_context
    params = _params(body, len(prompt), limit, context, prompt_param)
    if grammar is not None:
        params = replace(params, grammar=grammar.text)
    n = body.n or 1
    if n > served.batcher.max_waiting:
        raise APIError(
            400,
            f"n: {n} choices would not fit the line of {served.batcher.max_waiting} waiting "
            f"sequences; ask for at most {served.batcher.max_waiting}",
            param="n",
            code="unsupported_value",
        )
    rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    logprobs = params.logprobs is not None
    answer = Answer(kind, rid, served.model_id, served.tokenizer, logprobs, echo, split)
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[ChoiceEvent] = asyncio.Queue()

    def on_event(index: int, event: Event) -> None:  # on the batcher's thread
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (index, event))
        except RuntimeError:  # the event loop has closed (shutdown): nobody is waiting
            pass

    # Choice i > 0 draws from the seed's i-th child stream: each is repeatable, none repeats.
    choices = [replace(params, stream=i) for i in range(n)]
    try:
        ticket = served.batcher.submit_choices(prompt, choices, on_event, rid)
    except ModelError as exc:
        raise APIError(400, str(exc), param=prompt_param, code="context_length_exceeded") from exc
    except BusyError as exc:
        raise APIError(429, str(exc), type="server_error", code="busy") from exc
    except GrammarError as exc:  # a grammar that passed the check yet does not compile
        field = grammar.field if grammar else "response_format"
        raise APIError(400, f"{field}: {exc}", param=field, code="invalid_value") from exc
    except ClusterError as exc:
        raise failure(Failed(exc)) from exc

    gone = asyncio.ensure_future(_disconnected(request))
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


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


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
