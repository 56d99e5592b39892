"""A chat answer split into its parts as its text streams in: a thinking model's reasoning
(`<think>...</think>`, which goes to `reasoning_content`), the content, and tool calls in the
model family's format (tool_calls.py).

The same `Splitter` reads a streamed answer piece by piece and a whole one at once, so both
give the same parts. Text that may be the start of a mark (`<thi`, `<tool_`) is held back until
the next text tells; a call is given out once its text is complete (at its closing mark, or at
the end of the answer for a family that has none); text that looked like a call but does not
parse is given out as content, as the model wrote it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from edgetp.master.bridge.tool_calls import BareJsonCall, CallFormat, ToolCall

THINK, END_THINK = "<think>", "</think>"
Mode = Literal["content", "reasoning", "calls"]


@dataclass(frozen=True)
class Part:
    """A piece of the answer: text of the content or of the reasoning, or a whole call."""

    kind: Literal["content", "reasoning", "call"]
    text: str = ""
    call: ToolCall | None = None


class Splitter:
    """One answer's text in, its parts out.

    `calls`: the format the model writes calls in (None: no tools, text stays text);
    `max_calls`: calls kept (1 when parallel_tool_calls is false); `reasoning`: the model thinks
    (its template has `<think>`); `thinking`: its prompt ends inside a think block, so the
    answer begins with reasoning (DeepSeek-R1's and some Qwen3 templates open it themselves).
    """

    def __init__(
        self,
        calls: CallFormat | None = None,
        max_calls: int | None = None,
        reasoning: bool = False,
        thinking: bool = False,
    ) -> None:
        self._format = calls
        self._max_calls = max_calls
        self._reasoning = reasoning
        self._mode: Mode = "reasoning" if thinking else "content"
        self._held = ""  # text not given out yet: it may begin a mark
        self._calls_text = ""  # in calls mode: the calls' text so far
        self._said = False  # content has begun: a <think> is text now, and so is Llama's {
        self._trim = False  # drop the whitespace that follows a think block or a call
        self.calls = 0

    def feed(self, text: str) -> list[Part]:
        self._held += text
        parts: list[Part] = []
        while self._held:
            if self._mode == "calls":
                self._calls_text += self._held
                self._held = ""
                parts += self._closed_calls()
                continue
            if self._trim:
                stripped = self._held.lstrip()
                if not stripped:
                    break
                self._held, self._trim = stripped, False
            marks = self._marks()
            found = [
                (i, mark)
                for mark, opening in marks
                if (i := self._held.find(mark)) >= 0 and not (opening and self._held[:i].strip())
            ]
            if found:
                i, mark = min(found)
                parts += self._say(self._held[:i])
                self._held = self._held[i + len(mark) :]
                self._switch(mark)
                continue
            keep = _partial_mark(self._held, marks)
            parts += self._say(self._held[: len(self._held) - keep])
            self._held = self._held[len(self._held) - keep :]
            break
        return [p for p in parts if p.text or p.call]

    def finish(self) -> list[Part]:
        """The parts still held once the answer has ended."""
        parts: list[Part] = []
        if self._mode == "calls":
            parts += self._read(self._calls_text)
            self._calls_text = ""
        elif not self._trim:
            parts += self._say(self._held)
        self._held = ""
        return [p for p in parts if p.text or p.call]

    # -- inside ---------------------------------------------------------------------------------
    def _marks(self) -> list[tuple[str, bool]]:
        """The marks that change the mode from here, each with whether it opens the content
        only (nothing but whitespace before it): a thinking block, and Llama's calls, which
        are the whole answer (a { inside text is text)."""
        if self._mode == "reasoning":
            return [(END_THINK, False)]
        marks = [(THINK, True)] if self._reasoning and not self._said else []
        fmt = self._format
        if isinstance(fmt, BareJsonCall):
            marks += [(fmt.start, True), (fmt.PYTHON_TAG, True)] if not self._said else []
        elif fmt is not None:
            marks.append((fmt.start, False))
        return marks

    def _switch(self, mark: str) -> None:
        if mark == THINK:
            self._mode = "reasoning"
        elif mark == END_THINK:
            self._mode, self._trim = "content", True
        else:  # a call begins: its mark is part of its text
            self._mode, self._calls_text = "calls", mark

    def _say(self, text: str) -> list[Part]:
        if not text:
            return []
        if self._mode == "content" and text.strip():
            self._said = True
        return [Part("reasoning" if self._mode == "reasoning" else "content", text)]

    def _closed_calls(self) -> list[Part]:
        """The calls whose closing mark has come; after one, back to content."""
        closed = self._format.closed if self._format else None
        if not closed or closed not in self._calls_text:
            return []
        text, _, rest = self._calls_text.partition(closed)
        self._mode, self._calls_text, self._held = "content", "", rest
        parts = self._read(text + closed)
        self._trim = any(p.call for p in parts)  # the whitespace between calls is no text
        return parts

    def _read(self, text: str) -> list[Part]:
        calls = self._format.read(text) if self._format else None
        if calls is None:  # not a call after all: the model's text, as it wrote it
            self._mode = "content"
            return self._say(text)
        kept = calls
        if self._max_calls is not None:
            kept = calls[: max(0, self._max_calls - self.calls)]
        self.calls += len(kept)
        return [Part("call", call=c) for c in kept]


@dataclass(frozen=True)
class Split:
    """How a request's answers split: each choice gets a Splitter of these settings."""

    calls: CallFormat | None = None  # with tools: the format the model writes calls in
    max_calls: int | None = None  # 1 when parallel_tool_calls is false
    reasoning: bool = False  # a thinking model
    thinking: bool = False  # its prompt opens a think block
    legacy: bool = False  # asked as functions: the call comes as function_call

    def splitter(self) -> Splitter:
        return Splitter(self.calls, self.max_calls, self.reasoning, self.thinking)


def _partial_mark(text: str, marks: list[tuple[str, bool]]) -> int:
    """The length of the longest end of `text` that may begin one of `marks` (one that opens
    the content only where nothing but whitespace comes before)."""
    longest = 0
    for mark, opening in marks:
        for n in range(min(len(mark) - 1, len(text)), longest, -1):
            if text.endswith(mark[:n]) and not (opening and text[: len(text) - n].strip()):
                longest = n
                break
    return longest
