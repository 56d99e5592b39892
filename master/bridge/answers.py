"""The REST bridge's answers: a request's choices, gathered from the batcher's events into one
JSON object or a stream of server-sent events in OpenAI's shapes, log probabilities included.

A request of n choices is n sequences of the batch; each event comes with its choice's index.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypedDict, cast

from pydantic import BaseModel

from master.batcher import Delta, Event, Finished, Ticket
from master.bridge.errors import failure
from master.bridge.schema import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionLogprobs,
    ContentLogprob,
    FinishReason,
    TopLogprob,
    Usage,
)
from master.sampling import TokenLogprob
from models.tokenizer import Tokenizer

ChoiceEvent = tuple[int, Event]


@dataclass
class Choice:
    """One choice's answer so far."""

    pieces: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    done: Finished | None = None

    def take(self, event: Delta) -> None:
        self.pieces.append(event.text)
        self.logprobs.extend(event.logprobs)


@dataclass(frozen=True)
class Answer:
    """What every response object of one request shares."""

    kind: str  # "chat" | "text"
    rid: str
    model: str
    tokenizer: Tokenizer
    logprobs: bool  # asked for
    echo: str = ""  # the prompt's text, put before a completion
    created: int = field(default_factory=lambda: int(time.time()))

    def head(self) -> _Head:
        return {"id": self.rid, "created": self.created, "model": self.model}


class _Head(TypedDict):
    id: str
    created: int
    model: str


def usage(done: Sequence[Finished]) -> Usage:
    """The prompt once (the choices share it), and every choice's tokens."""
    prompt = done[0].prompt_tokens if done else 0
    completion = sum(d.completion_tokens for d in done)
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


def _finish_reason(done: Finished) -> FinishReason:
    # The batcher's reason is a plain str that is always "stop" or "length"; the response
    # models validate it all the same.
    return cast(FinishReason, done.finish_reason)


def token_text(tokenizer: Tokenizer, token: int) -> tuple[str, list[int]]:
    """A token's text and UTF-8 bytes; a token that holds part of a character has no text of
    its own, and its bytes are the tokenizer's."""
    return _token_text(tokenizer, token)


@functools.lru_cache(maxsize=65536)
def _token_text(tokenizer: Tokenizer, token: int) -> tuple[str, list[int]]:
    text = tokenizer.decode([token])
    if "\ufffd" not in text:
        return text, list(text.encode())
    return text, list(tokenizer.token_bytes()[token])


def chat_logprobs(answer: Answer, entries: Sequence[TokenLogprob]) -> ChatLogprobs | None:
    if not answer.logprobs:
        return None

    def top(token: int, logprob: float) -> TopLogprob:
        text, raw = token_text(answer.tokenizer, token)
        return TopLogprob(token=text, logprob=logprob, bytes=raw)

    content = [
        ContentLogprob(
            **top(e.token, e.logprob).model_dump(),
            top_logprobs=[top(t, lp) for t, lp in e.top],
        )
        for e in entries
    ]
    return ChatLogprobs(content=content)


def text_logprobs(answer: Answer, entries: Sequence[TokenLogprob]) -> CompletionLogprobs | None:
    if not answer.logprobs:
        return None
    text = functools.partial(token_text, answer.tokenizer)
    return CompletionLogprobs(
        tokens=[text(e.token)[0] for e in entries],
        token_logprobs=[e.logprob for e in entries],
        top_logprobs=[{text(t)[0]: lp for t, lp in e.top} for e in entries],
        text_offset=[len(answer.echo) + e.offset for e in entries],
    )


def whole(answer: Answer, choices: Sequence[Choice]) -> ChatCompletion | Completion:
    """The non-streamed response, once every choice has finished."""
    done = [c.done for c in choices if c.done is not None]
    assert len(done) == len(choices)
    if answer.kind == "chat":
        return ChatCompletion(
            **answer.head(),
            choices=[
                ChatChoice(
                    index=i,
                    message=AssistantMessage(content="".join(c.pieces)),
                    logprobs=chat_logprobs(answer, c.logprobs),
                    finish_reason=_finish_reason(d),
                )
                for i, (c, d) in enumerate(zip(choices, done, strict=True))
            ],
            usage=usage(done),
        )
    return Completion(
        **answer.head(),
        choices=[
            CompletionChoice(
                index=i,
                text=answer.echo + "".join(c.pieces),
                logprobs=text_logprobs(answer, c.logprobs),
                finish_reason=_finish_reason(d),
            )
            for i, (c, d) in enumerate(zip(choices, done, strict=True))
        ],
        usage=usage(done),
    )


async def sse(
    answer: Answer,
    n: int,
    first: ChoiceEvent,
    queue: asyncio.Queue[ChoiceEvent],
    ticket: Ticket,
    include_usage: bool,
) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk shapes, each choice's under its index; cancels the
    request if the stream stops."""
    head = answer.head()

    def chunk(
        index: int,
        text: str | None,
        finish: FinishReason | None = None,
        role: Literal["assistant"] | None = None,
        entries: Sequence[TokenLogprob] = (),
    ) -> str:
        if answer.kind == "chat":
            delta = ChatDelta(role=role, content=text)
            logprobs = chat_logprobs(answer, entries) if entries else None
            choice = ChatChunkChoice(
                index=index, delta=delta, logprobs=logprobs, finish_reason=finish
            )
            return event(ChatCompletionChunk(**head, choices=[choice]))
        text_choice = CompletionChunkChoice(
            index=index,
            text=text or "",
            logprobs=text_logprobs(answer, entries) if entries else None,
            finish_reason=finish,
        )
        return event(CompletionChunk(**head, choices=[text_choice]))

    finished: list[Finished] = []
    try:
        for i in range(n):
            if answer.kind == "chat":
                yield chunk(i, "", role="assistant")
            elif answer.echo:
                yield chunk(i, answer.echo)
        index, item = first
        while True:
            if isinstance(item, Delta):
                yield chunk(index, item.text, entries=item.logprobs)
            elif isinstance(item, Finished):
                yield chunk(index, None, _finish_reason(item))
                finished.append(item)
                if len(finished) == n:
                    break
            else:  # the status line is long gone: the error travels as an event
                yield event(failure(item).body)
                return
            index, item = await queue.get()
        if include_usage:
            last = ChatCompletionChunk if answer.kind == "chat" else CompletionChunk
            yield event(last(**head, choices=[], usage=usage(finished)))
        yield "data: [DONE]\n\n"
    finally:
        ticket.cancel()  # a no-op once finished; a client that went away frees its slots here


def event(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"
