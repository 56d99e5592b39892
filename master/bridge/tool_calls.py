"""Tool calls as models write them: how to read them out of the model's text, how to write them
back into a conversation, and the grammar that makes the model write one.

One class per shape of call behind one interface (`CallFormat`), named by what the model writes,
not by who writes it, and chosen by what the model's chat template contains (`format_for`):
- TaggedCalls: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block a
  call (Hermes-trained models, Qwen); also the format edgetp describes to a model whose template
  does not render tools (master/bridge/tools.py);
- BareJsonCall: the whole answer is `{"name": ..., "parameters": {...}}` (after an optional
  `<|python_tag|>`), several separated by `;` (Llama 3.x);
- BracketedCalls: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer
  `[TOOL_CALLS]name[ARGS]{...}` a call (Mistral's models).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from edgetp.models.tokenizer import Tokenizer


@dataclass(frozen=True)
class ToolCall:
    """A call the model wrote: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class Function:
    """A function the model may call: its name and the JSON schema of its arguments."""

    name: str
    parameters: dict[str, Any]


class CallFormat:
    """How one family writes tool calls. Text from `start` on is calls (`read` parses it);
    `closed` (if any) ends one call, so a stream can send it at once."""

    name = ""
    start = ""
    closed: str | None = None
    arguments_key = "arguments"

    def read(self, text: str) -> list[ToolCall] | None:
        """The calls in `text` (which begins with `start`), or None if it does not parse."""
        raise NotImplementedError

    def write(self, calls: Sequence[tuple[str, Any]]) -> str:
        """(name, arguments as a value) calls as the model writes them."""
        raise NotImplementedError

    def grammar(self, functions: Sequence[Function], parallel: bool, tokenizer: Tokenizer) -> str:
        """Lark rules (llguidance's dialect) whose `calls` rule is one call (several if
        `parallel`) of one of `functions`, its arguments valid against its schema."""
        raise NotImplementedError

    def _call_schema(self, functions: Sequence[Function]) -> dict[str, Any]:
        """The JSON schema of one call object: the name first, then its arguments."""
        one = [
            {
                "type": "object",
                "properties": {"name": {"const": f.name}, self.arguments_key: f.parameters},
                "required": ["name", self.arguments_key],
                "additionalProperties": False,
            }
            for f in functions
        ]
        return one[0] if len(one) == 1 else {"anyOf": one}

    def _call(self, value: Any) -> ToolCall | None:
        """A call object as parsed JSON, if it is one: a name and arguments (a JSON answer
        with a "name" key is no call)."""
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get(self.arguments_key, value.get("arguments"))
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


class TaggedCalls(CallFormat):
    name = "tagged"
    start = "<tool_call>"
    closed = "</tool_call>"

    def read(self, text: str) -> list[ToolCall] | None:
        closed = self.closed or ""
        calls = []
        rest = text.strip()
        while rest:
            if not rest.startswith(self.start):
                return None
            value, rest = _first_json(rest[len(self.start) :])
            call = self._call(value)
            if call is None:
                return None
            calls.append(call)
            if rest.startswith(closed):
                rest = rest[len(closed) :].strip()
            elif closed.startswith(rest):  # the answer ended inside the closing mark
                rest = ""
        return calls

    def write(self, calls: Sequence[tuple[str, Any]]) -> str:
        return "\n".join(
            f"{self.start}\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}\n"
            f"{self.closed}"
            for n, a in calls
        )

    def grammar(self, functions: Sequence[Function], parallel: bool, tokenizer: Tokenizer) -> str:
        more = f" ({_lit(chr(10))} call)*" if parallel else ""
        return (
            f"calls: call{more}\n"
            f"call: {_lit(self.start + chr(10))} call_body {_lit(chr(10) + (self.closed or ''))}\n"
            f"call_body: %json {json.dumps(self._call_schema(functions))}\n"
        )


class BareJsonCall(CallFormat):
    name = "bare_json"
    start = "{"
    arguments_key = "parameters"
    PYTHON_TAG = "<|python_tag|>"

    def read(self, text: str) -> list[ToolCall] | None:
        text = text.strip().removeprefix(self.PYTHON_TAG).strip()
        calls = []
        decoder = json.JSONDecoder()
        while text:
            try:
                value, end = decoder.raw_decode(text)
            except ValueError:
                return None
            call = self._call(value)
            if call is None:
                return None
            calls.append(call)
            text = text[end:].strip().removeprefix(";").strip()
        return calls or None

    def write(self, calls: Sequence[tuple[str, Any]]) -> str:
        return "; ".join(
            json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls
        )

    def grammar(self, functions: Sequence[Function], parallel: bool, tokenizer: Tokenizer) -> str:
        more = ' ("; " call)*' if parallel else ""
        return f"calls: call{more}\ncall: %json {json.dumps(self._call_schema(functions))}\n"


class BracketedCalls(CallFormat):
    name = "bracketed"
    start = "[TOOL_CALLS]"
    ARGS = "[ARGS]"

    def read(self, text: str) -> list[ToolCall] | None:
        calls: list[ToolCall] = []
        for block in text.split(self.start)[1:]:
            block = block.strip()
            if block.startswith("["):  # [{"name": ..., "arguments": ...}, ...]
                value = _json(block)
                if not isinstance(value, list):
                    return None
                found = [self._call(v) for v in value]
            else:  # name[ARGS]{...}
                name, _, arguments = block.partition(self.ARGS)
                found = [self._call({"name": name.strip(), "arguments": _json(arguments)})]
            if not found or any(c is None for c in found):
                return None
            calls += [c for c in found if c is not None]
        return calls or None

    def write(self, calls: Sequence[tuple[str, Any]]) -> str:
        value = [{"name": n, "arguments": a} for n, a in calls]
        return self.start + json.dumps(value, ensure_ascii=False)

    def grammar(self, functions: Sequence[Function], parallel: bool, tokenizer: Tokenizer) -> str:
        schema = {"type": "array", "items": self._call_schema(functions), "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
        token = tokenizer.token_to_id(self.start)
        marker = f"<[{token}]>" if token is not None else _lit(self.start)
        return f"calls: {marker} call_list\ncall_list: %json {json.dumps(schema)}\n"


BRACKETED, TAGGED, BARE_JSON = BracketedCalls(), TaggedCalls(), BareJsonCall()
FORMATS: tuple[CallFormat, ...] = (BRACKETED, TAGGED, BARE_JSON)


def format_for(chat_template: str | None) -> CallFormat:
    """The family whose calls the template's model writes: its own marks tell (a template that
    shows none gets the Hermes format described to it)."""
    template = chat_template or ""
    if BracketedCalls.start in template:
        return BRACKETED
    if TaggedCalls.start in template:
        return TAGGED
    if BareJsonCall.PYTHON_TAG in template or (
        "<|start_header_id|>" in template and '"parameters"' in template
    ):
        return BARE_JSON
    return TAGGED


def _first_json(text: str) -> tuple[Any, str]:
    """The JSON value `text` begins with (None if none), and the text after it, stripped."""
    text = text.lstrip()
    try:
        value, end = json.JSONDecoder().raw_decode(text)
    except ValueError:
        return None, text
    return value, text[end:].strip()


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _lit(text: str) -> str:
    """A Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text)
