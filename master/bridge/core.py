"""The bridge's protocol-neutral generation core: one internal request in, typed parts out.

Every API the bridge speaks is a thin router (openai_chat in app.py, anthropic.py,
responses.py, ollama.py) that translates its request into one internal request, hands it to
this core, and translates the parts that come back into its own events and errors, as vLLM's
`serving_*.py` modules share one engine client and llama.cpp's server turns Anthropic's
messages into its chat request. The core knows no API; the engine (the batcher) knows none
either.

The internal request is a `ChatCompletionRequest` (request.py) for a conversation, the
richest of the requests the bridge takes (messages, tools, a choice among them, a JSON schema,
sampling, stops, logprobs), or a `CompletionRequest` for a prompt taken as it is: a router
builds one from its own request and never reaches past `prepare_chat`/`prepare_text`. What
comes out is `Text`, `Reasoning`, `Call` parts and one `Finish`, whatever the model family
writes (output.py splits the text, tool_calls.py reads the calls).
"""

from __future__ import annotations

import asyncio
from asyncio import FIRST_COMPLETED
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from edgetp.master.bridge.errors import APIError, failure
from edgetp.master.bridge.output import Split
from edgetp.master.bridge.request import (
    ChatCompletionRequest,
    ChatTemplateKwargs,
    CompletionRequest,
    SamplingFields,
)
from edgetp.master.bridge.tool_calls import ToolCall
from edgetp.master.bridge.tools import Grammar, chat_prompt, constraints, tool_use
from edgetp.master.cluster.transport import ClusterError
from edgetp.master.generation.batcher import (
    Batcher,
    BusyError,
    Delta,
    Event,
    Failed,
    Finished,
    Ticket,
)
from edgetp.master.generation.grammar import GrammarError
from edgetp.master.generation.params import SamplingParams
from edgetp.models.chat_template import NoChatTemplate, NoThinkingSwitch
from edgetp.models.errors import ModelError
from edgetp.models.tokenizer import Tokenizer

# A streamed request that waits this long for its first token (a long prefill, a turn for a
# slot) is answered at once, and then sent an SSE comment every as many seconds until its first
# chunk: proxies and clients drop a connection silent for their read timeout (nginx's 60 s,
# many clients' 30 s or less). 5 s keeps well inside those for a few bytes, and a request
# answered within it starts as before, its errors still an HTTP status.
KEEPALIVE_S = 5.0
KEEPALIVE = ": keep-alive\n\n"  # the comment (an SSE line that begins with a colon)


@dataclass
class Served:
    """What the bridge serves: one model, its tokenizer, and the loop that owns the engine."""

    batcher: Batcher
    tokenizer: Tokenizer
    model_id: str
    aliases: tuple[str, ...] = ()  # other names a request may use for the model
    created: int = 0  # the model file's time, for /v1/models
    keepalive_s: float = KEEPALIVE_S  # a streamed request's silence before a comment


COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
ChoiceEvent = tuple[int, Event]


# -- the internal request, prepared -----------------------------------------------------------
@dataclass(frozen=True)
class Prepared:
    """A request made ready for the engine: its prompt, sampling (the grammar in it), and how
    its answer splits into reasoning, content and calls (None: text stays text)."""

    prompt: list[int]
    params: SamplingParams
    split: Split | None
    grammar: Grammar | None
    prompt_param: str  # the request field the prompt comes from, for a 400
    echo: str = ""  # the prompt's text (completions' echo)


async def prepare_chat(served: Served, body: ChatCompletionRequest) -> Prepared:
    """A conversation's prompt under the model's chat template, its tools and structured
    output as a grammar. Raises APIError (400) for what the model cannot do with it."""
    unserved = body.unserved(served.tokenizer.chat_template)
    if unserved:  # what the schema cannot say
        raise APIError(400, unserved[1], param=unserved[0], code="unsupported_value")
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
    params = sampling(body, len(prompt), limit, served.batcher.max_context, "messages")
    if grammar is not None:
        params = replace(params, grammar=grammar.text)
    return Prepared(prompt, params, split, grammar, "messages")


async def prepare_text(served: Served, body: CompletionRequest) -> Prepared:
    """A prompt taken as it is (text or token ids), without a chat template."""
    vocab = min(served.tokenizer.vocab_size, served.batcher.config.vocab_size)
    prompt, text = await run_in_threadpool(completion_prompt, served.tokenizer, body.prompt, vocab)
    unserved = body.unserved()
    if unserved:  # what the schema cannot say
        raise APIError(400, unserved[1], param=unserved[0], code="unsupported_value")
    limit = body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
    params = sampling(body, len(prompt), limit, served.batcher.max_context, "prompt")
    return Prepared(prompt, params, None, None, "prompt", text if body.echo else "")


def completion_prompt(tokenizer: Tokenizer, prompt: Any, vocab: int) -> tuple[list[int], str]:
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


def sampling(
    body: SamplingFields, prompt_len: int, limit: int | None, context: int, prompt_param: str
) -> SamplingParams:
    """The engine's sampling parameters for a request; a prompt or a limit the context cannot
    hold is a 400."""
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


# -- to the engine and back -------------------------------------------------------------------
def submit(
    served: Served,
    prepared: Prepared,
    n: int,
    rid: str,
    on_event: Callable[[int, Event], None],
) -> Ticket:
    """Put the request's n choices in the batcher's line; its refusals as APIErrors."""
    if n > served.batcher.max_waiting:
        raise APIError(
            400,
            f"n: {n} choices would not fit the line of {served.batcher.max_waiting} waiting "
            f"sequences; ask for at most {served.batcher.max_waiting}",
            param="n",
            code="unsupported_value",
        )
    # Choice i > 0 draws from the seed's i-th child stream: each is repeatable, none repeats.
    choices = [replace(prepared.params, stream=i) for i in range(n)]
    try:
        return served.batcher.submit_choices(prepared.prompt, choices, on_event, rid)
    except ModelError as exc:
        param = prepared.prompt_param
        raise APIError(400, str(exc), param=param, code="context_length_exceeded") from exc
    except BusyError as exc:
        raise APIError(429, str(exc), type="server_error", code="busy") from exc
    except GrammarError as exc:  # a grammar that passed the check yet does not compile
        field = prepared.grammar.field if prepared.grammar else "response_format"
        raise APIError(400, f"{field}: {exc}", param=field, code="invalid_value") from exc
    except ClusterError as exc:
        raise failure(Failed(exc)) from exc


def queued(served: Served) -> tuple[asyncio.Queue[ChoiceEvent], Callable[[int, Event], None]]:
    """A queue on this event loop, and the callback that feeds it from the batcher's thread."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[ChoiceEvent] = asyncio.Queue()

    def on_event(index: int, event: Event) -> None:  # on the batcher's thread
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (index, event))
        except RuntimeError:  # the event loop has closed (shutdown): nobody is waiting
            pass

    return queue, on_event


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class Call:
    call: ToolCall
    index: int  # among the answer's calls


@dataclass(frozen=True)
class Finish:
    """The answer's end: "stop", "length" or "tool_calls" (it ended with calls), and usage;
    the stop string that ended it, if one did (Anthropic's API names it). Of the prompt's
    tokens, `reused_tokens` were not prefilled: a free slot's KV cache held them (prompt reuse,
    which every API reports in its own field); the seconds are the engine's (Ollama's
    durations)."""

    reason: str
    prompt_tokens: int
    completion_tokens: int
    stop_string: str | None = None
    reused_tokens: int = 0
    prefill_s: float = 0.0  # from its slot to its first token
    decode_s: float = 0.0  # from its first token to its last


Out = Text | Reasoning | Call | Finish


class Reader:
    """One answer's engine events read as typed parts: the one place where the model's text
    becomes text, reasoning and calls (through its Split), and where an answer that ended with
    calls finishes with "tool_calls". A Delta without a Split is one Text, empty or not (an
    API may stream an empty piece for its log probabilities)."""

    def __init__(self, split: Split | None) -> None:
        self._splitter = split.splitter() if split else None
        self.calls = 0  # the answer's calls so far

    def read(self, event: Delta | Finished) -> list[Out]:
        if isinstance(event, Delta):
            if self._splitter is None:
                return [Text(event.text)]
            pieces = self._splitter.feed(event.text)
        else:
            pieces = self._splitter.finish() if self._splitter else []
        out: list[Out] = []
        for part in pieces:
            if part.call is not None:
                out.append(Call(part.call, self.calls))
                self.calls += 1
            elif part.kind == "reasoning":
                out.append(Reasoning(part.text))
            else:
                out.append(Text(part.text))
        if isinstance(event, Finished):
            reason = "tool_calls" if self.calls and event.finish_reason == "stop" else None
            finish = Finish(
                reason or event.finish_reason,
                event.prompt_tokens,
                event.completion_tokens,
                event.stop_string,
                event.reused_tokens,
                event.prefill_s,
                event.decode_s,
            )
            out.append(finish)
        return out


async def generate(served: Served, prepared: Prepared, rid: str) -> AsyncGenerator[Out, None]:
    """One answer's parts as they come. The request is submitted at the first step of the
    iteration (its refusals raise APIError there), dropped from the batch when the iteration
    stops early; a generation that fails raises APIError (failure())."""
    queue, on_event = queued(served)
    ticket = submit(served, prepared, 1, rid, on_event)
    reader = Reader(prepared.split)
    try:
        while True:
            _, event = await queue.get()
            if isinstance(event, Failed):
                raise failure(event)
            for part in reader.read(event):
                if not (isinstance(part, Text) and not part.text):
                    yield part
            if isinstance(event, Finished):
                return
    finally:
        ticket.cancel()  # a no-op once finished; a client gone frees its slot here


@dataclass(frozen=True)
class Wait:
    """Not a part: the first part is late (a long prefill, a turn for a slot), and a streamed
    answer says something its client skips, so that nothing between drops a silent
    connection (an SSE comment, Anthropic's ping)."""


async def started(
    parts: AsyncGenerator[Out, None], request: Request, keepalive_s: float | None = None
) -> AsyncGenerator[Out | Wait, None] | None:
    """`parts` with its first part awaited here, so that a refusal or a failure before the
    first token is raised here, while the answer can still be an HTTP error; None if the client
    went away meanwhile (its request dropped). With `keepalive_s`, the wait here lasts that
    long at most: a later first part comes after a Wait every `keepalive_s`, and a failure then
    raises from the iteration, as one mid-answer does."""
    first = asyncio.ensure_future(parts.__anext__())
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({first, gone}, timeout=keepalive_s, return_when=FIRST_COMPLETED)
    except asyncio.CancelledError:
        first.cancel()
        raise
    finally:
        left = gone.done() and not gone.cancelled()
        gone.cancel()  # from here a stream's response watches the connection itself
    if first.done():
        first.result()  # its refusal or failure, raised here
    elif left:
        first.cancel()  # the generation's finally drops the request from the batch
        return None
    return _from(first, parts, keepalive_s)


async def _from(
    first: asyncio.Future[Out], parts: AsyncGenerator[Out, None], keepalive_s: float | None
) -> AsyncGenerator[Out | Wait, None]:
    try:
        while not first.done():
            done, _ = await asyncio.wait({first}, timeout=keepalive_s)
            if not done:
                yield Wait()
        yield first.result()
        async for part in parts:
            yield part
    finally:
        if not first.done():  # the client went away while the first part was late
            first.cancel()  # the generation's finally drops the request from the batch
            await asyncio.wait({first})
        await parts.aclose()


async def disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def whole(
    parts: AsyncIterator[Out | Wait], request: Request
) -> tuple[list[Out], Finish] | None:
    """`collect`, or None once the client has gone (its request is dropped then)."""
    task = asyncio.ensure_future(collect(parts))
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()  # the generation's finally drops it from the batch
        return None
    finally:
        gone.cancel()


async def collect(parts: AsyncIterator[Out | Wait]) -> tuple[list[Out], Finish]:
    """A whole answer: its parts (text pieces joined, in order) and its finish."""
    out: list[Out] = []
    finish = Finish("stop", 0, 0)
    async for part in parts:
        if isinstance(part, Wait):
            continue
        if isinstance(part, Finish):
            finish = part
        elif isinstance(part, Text) and out and isinstance(out[-1], Text):
            out[-1] = Text(out[-1].text + part.text)
        elif isinstance(part, Reasoning) and out and isinstance(out[-1], Reasoning):
            out[-1] = Reasoning(out[-1].text + part.text)
        else:
            out.append(part)
    return out, finish


def chat_request(fields: dict[str, Any], where: str) -> ChatCompletionRequest:
    """The internal request from a router's translation of its own; a translation that does
    not validate is the router's request's fault, named by `where` (its field)."""
    from pydantic import ValidationError

    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        error = exc.errors()[0]
        path = ".".join(str(x) for x in error["loc"])
        raise APIError(400, f"{where}: {path}: {error['msg']}", param=where) from exc


def tool_definitions(
    tools: Sequence[tuple[str, str | None, dict[str, Any] | None]],
) -> list[dict[str, Any]]:
    """(name, description, parameters) as the internal request's function tools."""
    return [
        {
            "type": "function",
            "function": {
                "name": name,
                **({"description": d} if d else {}),
                **({"parameters": p} if p is not None else {}),
            },
        }
        for name, d, p in tools
    ]
