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

from edgetp.master.bridge.core import Call, ChoiceEvent, Finish, Out, Reader, Reasoning, Text
from edgetp.master.bridge.errors import failure
from edgetp.master.bridge.output import Split
from edgetp.master.bridge.schema import (
    AssistantMessage,
    CalledFunction,
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
    DeltaFunction,
    DeltaToolCall,
    FinishReason,
    PromptTokensDetails,
    ToolCall,
    TopLogprob,
    Usage,
)
from edgetp.master.bridge.tool_calls import ToolCall as Called
from edgetp.master.generation.batcher import Delta, Finished, Ticket
from edgetp.master.generation.sampling import TokenLogprob
from edgetp.models.tokenizer import Tokenizer


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
    split: Split | None = None  # a chat answer read for reasoning and calls (None: text)
    created: int = field(default_factory=lambda: int(time.time()))

    def head(self) -> _Head:
        return {"id": self.rid, "created": self.created, "model": self.model}

    @property
    def legacy(self) -> bool:
        """Calls are the legacy functions API's `function_call`."""
        return bool(self.split and self.split.legacy)


class _Head(TypedDict):
    id: str
    created: int
    model: str


def usage(done: Sequence[Finish]) -> Usage:
    """The prompt once (the choices share it) with what the first choice's slot reused of
    it, and every choice's tokens."""
    prompt = done[0].prompt_tokens if done else 0
    cached = done[0].reused_tokens if done else 0
    completion = sum(d.completion_tokens for d in done)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def _finish_reason(finish: Finish, legacy: bool = False) -> FinishReason:
    """The core's reason ("stop", "length" or "tool_calls"; the response models validate it
    all the same), the calls' named as the legacy functions API names them."""
    if legacy and finish.reason == "tool_calls":
        return "function_call"
    return cast(FinishReason, finish.reason)


def message(parts: Sequence[Out], legacy: bool) -> AssistantMessage:
    """A whole chat answer's message from its parts."""
    content = "".join(p.text for p in parts if isinstance(p, Text))
    reasoning = "".join(p.text for p in parts if isinstance(p, Reasoning))
    calls = [p.call for p in parts if isinstance(p, Call)]
    function_call = None
    if legacy and calls:
        function_call, calls = _called(calls[0]), []
    tool_calls = [ToolCall(id=c.id, function=_called(c)) for c in calls] or None
    said = content if content.strip() or not (calls or function_call or reasoning) else None
    return AssistantMessage(
        content=said,
        reasoning_content=reasoning or None,
        tool_calls=tool_calls,
        function_call=function_call,
    )


def _called(call: Called) -> CalledFunction:
    return CalledFunction(name=call.name, arguments=call.arguments)


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
    assert all(c.done is not None for c in choices)
    read = [_parts(answer.split, c) for c in choices]
    done = [next(p for p in parts if isinstance(p, Finish)) for parts in read]
    legacy = answer.legacy
    if answer.kind == "chat":
        chat_choices = [
            ChatChoice(
                index=i,
                message=message(parts, legacy),
                logprobs=chat_logprobs(answer, c.logprobs),
                finish_reason=_finish_reason(d, legacy),
            )
            for i, (c, parts, d) in enumerate(zip(choices, read, done, strict=True))
        ]
        return ChatCompletion(**answer.head(), choices=chat_choices, usage=usage(done))
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


def _parts(split: Split | None, choice: Choice) -> list[Out]:
    """A whole choice's parts, read by the core as a stream's are (the Splitter splits a
    whole text as it splits its pieces)."""
    assert choice.done is not None
    reader = Reader(split)
    return reader.read(Delta("".join(choice.pieces))) + reader.read(choice.done)


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
        delta: ChatDelta | None = None,
    ) -> str:
        if answer.kind == "chat":
            delta = delta or ChatDelta(role=role, content=text)
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

    readers = [Reader(answer.split) for _ in range(n)]
    legacy = answer.legacy

    def parts_chunks(index: int, parts: Sequence[Out], entries: Sequence[TokenLogprob]) -> str:
        """A chunk for each part of the text; its tokens' logprobs go with the first."""
        sent = []
        for part in parts:
            if isinstance(part, Finish):
                continue
            if answer.kind == "text":
                assert isinstance(part, Text)  # a completion's text is not split
                sent.append(chunk(index, part.text, entries=entries))
                entries = ()
                continue
            for delta in _deltas(part, legacy):
                sent.append(chunk(index, None, entries=entries, delta=delta))
                entries = ()
        if entries:
            sent.append(chunk(index, None, entries=entries, delta=ChatDelta()))
        return "".join(sent)

    finished: list[Finish] = []
    try:
        for i in range(n):
            if answer.kind == "chat":
                yield chunk(i, "", role="assistant")
            elif answer.echo:
                yield chunk(i, answer.echo)
        index, item = first
        while True:
            if isinstance(item, Delta):
                yield parts_chunks(index, readers[index].read(item), item.logprobs)
            elif isinstance(item, Finished):
                parts = readers[index].read(item)
                said = parts_chunks(index, parts, ())
                if said:
                    yield said
                finish = parts[-1]
                assert isinstance(finish, Finish)
                yield chunk(index, None, _finish_reason(finish, legacy))
                finished.append(finish)
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


def _deltas(part: Text | Reasoning | Call, legacy: bool) -> list[ChatDelta]:
    """A part as OpenAI streams it; a call as two chunks: its id and name, then its
    arguments."""
    if isinstance(part, Text):
        return [ChatDelta(content=part.text)]
    if isinstance(part, Reasoning):
        return [ChatDelta(reasoning_content=part.text)]
    named = DeltaFunction(name=part.call.name, arguments="")
    arguments = DeltaFunction(arguments=part.call.arguments)
    if legacy:
        return [ChatDelta(function_call=named), ChatDelta(function_call=arguments)]
    return [
        ChatDelta(tool_calls=[DeltaToolCall(index=part.index, id=part.call.id, type="function",
                                            function=named)]),
        ChatDelta(tool_calls=[DeltaToolCall(index=part.index, function=arguments)]),
    ]  # fmt: skip


def event(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"
