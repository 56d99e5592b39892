"""A chat request's tools and structured output, made into the prompt and the grammar.

The tools go to the model's own chat template as transformers passes them (`tools=`), and the
conversation's calls and results as its messages. A template that shows no tools (SmolLM2's
does not) gets them as a system prompt in the Hermes format, as llama.cpp's server does for
models without a tool format of their own, and the calls and results of earlier turns written
in that format (docs/decisions.md). The model's calls are then read in the format its template
shows, Hermes for the fallback (tool_calls.py).

A call that is required (`tool_choice` 'required', a named function) and a `response_format`
other than text are grammars (llguidance's Lark, with `%json` for the schemas), which the
master's sampler enforces token by token: even a small model writes a call that parses.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from edgetp.master.bridge.errors import APIError
from edgetp.master.bridge.output import Split
from edgetp.master.bridge.request import ChatCompletionRequest, called_names, reasons
from edgetp.master.bridge.request_parts import (
    AllowedToolChoice,
    ChatMessage,
    FunctionDefinition,
    ResponseFormatJSONObject,
    ResponseFormatJSONSchema,
)
from edgetp.master.bridge.tool_calls import TAGGED, CallFormat, Function, format_for
from edgetp.master.generation.grammar import GrammarError, grammar_error, json_schema_grammar
from edgetp.master.generation.prompts import chat_tokens
from edgetp.models.chat_template import render_chat
from edgetp.models.tokenizer import Tokenizer

# The system prompt that describes tools to a model whose template does not (Qwen2.5's words,
# which Hermes-trained models know).
TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
_PROBE = {"type": "function", "function": {"name": "edgetp_probe_tool", "parameters": {}}}


@dataclass(frozen=True)
class ToolUse:
    """The tools of one request: those shown to the model, those it may call, and how."""

    shown: tuple[dict[str, Any], ...]  # as transformers passes them to a chat template
    functions: tuple[Function, ...]  # those it may call
    required: bool  # the answer is a call, by grammar
    parallel: bool  # a forced answer may hold several calls (parallel_tool_calls: true)
    one_call: bool  # an answer keeps its first call only (parallel_tool_calls: false)
    legacy: bool  # asked as `functions`: the answer's call comes as `function_call`


def tool_use(body: ChatCompletionRequest) -> ToolUse | None:
    """What the request's tools ask for; None with no tools, or with tool_choice 'none'
    (the model answers in text without seeing them)."""
    definitions = body.function_definitions()
    legacy = body.functions is not None
    choice = body.function_call if legacy else body.tool_choice
    if not definitions or choice == "none":
        return None
    named = called_names(choice)
    allowed = isinstance(choice, AllowedToolChoice)
    shown = [d for d in definitions if not allowed or d.name in named]
    if isinstance(choice, AllowedToolChoice):
        required = choice.allowed_tools.mode == "required"
    else:
        required = choice == "required" or bool(named)
    return ToolUse(
        shown=tuple(_shown(d) for d in shown),
        functions=tuple(_function(d) for d in shown if allowed or not named or d.name in named),
        required=required,
        parallel=body.parallel_tool_calls is True and not legacy,
        one_call=body.parallel_tool_calls is False or legacy,
        legacy=legacy,
    )


def call_format(chat_template: str | None) -> CallFormat:
    """The format the model writes calls in: its template's, or Hermes if it shows none."""
    return format_for(chat_template) if renders_tools(chat_template) else TAGGED


@functools.lru_cache(maxsize=8)
def renders_tools(chat_template: str | None) -> bool:
    """Whether the template shows the model the tools it is given."""
    if not chat_template:
        return False
    try:
        probe = [{"role": "user", "content": "hi"}]
        text = render_chat(chat_template, probe, bos_token="", eos_token="", tools=[_PROBE])
    except Exception:  # a template that fails on tools does not show them
        return False
    return "edgetp_probe_tool" in text


def chat_prompt(
    tokenizer: Tokenizer,
    messages: Sequence[ChatMessage],
    use: ToolUse | None,
    enable_thinking: bool | None,
) -> list[int]:
    """The prompt's tokens: the conversation and the tools under the model's chat template,
    ending where the reply begins. Raises ModelError (NoChatTemplate, NoThinkingSwitch, the
    template's own verdict) as models.chat_template.render_chat does."""
    template = tokenizer.chat_template
    native = renders_tools(template)
    fmt = call_format(template)
    turns: list[dict[str, Any]] = []
    after_result = False
    for message in messages:
        turn = _turn(message, fmt, native)
        result = not native and message.role in ("tool", "function")
        if result and after_result:  # results in a row are one turn: templates alternate
            turns[-1] = {**turns[-1], "content": f"{turns[-1]['content']}\n{turn['content']}"}
        else:
            turns.append(turn)
        after_result = result
    tools = list(use.shown) if use else None
    if not native:
        if tools:
            block = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
            if turns and turns[0]["role"] == "system":
                turns[0] = {**turns[0], "content": f"{turns[0]['content']}\n\n{block}"}
            else:
                turns.insert(0, {"role": "system", "content": block})
        tools = None
    return chat_tokens(tokenizer, turns, enable_thinking, tools)


@dataclass(frozen=True)
class Grammar:
    """A grammar the answer must match, and the request field it comes from (for a 400)."""

    text: str
    field: str


def constraints(
    tokenizer: Tokenizer, body: ChatCompletionRequest, use: ToolUse | None, prompt: list[int]
) -> tuple[Grammar | None, Split | None]:
    """The grammar a chat answer must match (structured output, a forced call), checked
    against the model's vocabulary, and how its text splits into reasoning, content and calls
    (None: kept whole, as before tools). A grammar that cannot be used is a 400 (APIError)
    naming the field it comes from, with llguidance's reason."""
    template = tokenizer.chat_template
    fmt = call_format(template)
    try:
        grammar, field = answer_grammar(body, use, fmt, tokenizer)
    except GrammarError as exc:
        raise APIError(400, f"response_format: {exc}", param="response_format") from exc
    problem = grammar_error(tokenizer, grammar) if grammar is not None else None
    if problem:
        raise APIError(
            400, f"{field}: the grammar cannot be used: {problem}", param=field,
            code="invalid_value",
        )  # fmt: skip
    checked = None if grammar is None else Grammar(grammar, field)
    thinks = reasons(template)
    if use is None and not thinks:
        return checked, None
    split = Split(
        calls=fmt if use else None,
        max_calls=1 if use and use.one_call else None,
        reasoning=thinks,
        thinking=thinks and opens_thinking(tokenizer, prompt),
        legacy=bool(use and use.legacy),
    )
    return checked, split


def answer_grammar(
    body: ChatCompletionRequest, use: ToolUse | None, fmt: CallFormat, tokenizer: Tokenizer
) -> tuple[str | None, str]:
    """(the grammar the answer must match or None, the request field it comes from). Raises
    master.generation.grammar.GrammarError for a JSON schema llguidance cannot use."""
    form = body.response_format
    schema: dict[str, Any] | None = None
    if isinstance(form, ResponseFormatJSONSchema):
        given = form.json_schema.schema_
        schema = closed(given) if given is not None else {}
    elif isinstance(form, ResponseFormatJSONObject):
        schema = {"type": "object"}
    if use is None or (not use.required and schema is None):
        return (None if schema is None else json_schema_grammar(schema)), "response_format"
    calls = fmt.grammar(use.functions, use.parallel, tokenizer)
    if use.required or schema is None:
        return f"start: calls\n{calls}", "tools"
    json_schema_grammar(schema)  # a schema llguidance refuses is the response_format's fault
    return f"start: answer | calls\nanswer: %json {json.dumps(schema)}\n{calls}", "tools"


def opens_thinking(tokenizer: Tokenizer, prompt: Sequence[int]) -> bool:
    """Whether the prompt ends inside a think block, so the answer begins with reasoning."""
    tail = tokenizer.decode(list(prompt[-16:]))
    return tail.rfind("<think>") > tail.rfind("</think>")


# -- inside -----------------------------------------------------------------------------------
def _shown(definition: FunctionDefinition) -> dict[str, Any]:
    return {"type": "function", "function": definition.model_dump(exclude_none=True)}


def _function(definition: FunctionDefinition) -> Function:
    return Function(definition.name, closed(definition.parameters or NO_ARGUMENTS))


def closed(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` wherever an object lists its properties and
    says nothing of others, as llama.cpp's grammars do: a small model given room for more keys
    fills it (a call's arguments grew a "properties" key until max_tokens). What matches the
    result matches `schema`. Members of allOf are left open: closing them could admit nothing."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    for key in _ONE_SCHEMA:
        if key in out:
            out[key] = closed(out[key])
    for key in _NAMED_SCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(s) for name, s in out[key].items()}
    for key in _LISTED_SCHEMAS:
        if isinstance(out.get(key), list):
            out[key] = [closed(s) for s in out[key]]
    return out


_ONE_SCHEMA = ("items", "additionalProperties", "not", "contains", "if", "then", "else")
_NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LISTED_SCHEMAS = ("anyOf", "oneOf", "prefixItems")


def _turn(message: ChatMessage, fmt: CallFormat, native: bool) -> dict[str, Any]:
    """A message as the chat template takes it: as before tools for a plain one; calls and
    results as transformers passes them, or in Hermes' text for a template without tools."""
    role = "system" if message.role == "developer" else message.role
    turn: dict[str, Any] = {"role": role, "content": message.text()}
    if message.name is not None:
        turn["name"] = message.name
    calls = [(c.function.name, c.function.arguments, c.id) for c in message.tool_calls or ()]
    if message.function_call is not None:
        calls.append((message.function_call.name, message.function_call.arguments, "call_0"))
    if role == "function":
        turn["role"] = "tool"
    if not native:
        if turn["role"] == "tool":
            result = f"<tool_response>\n{turn['content']}\n</tool_response>"
            return {"role": "user", "content": result}
        if calls:
            written = fmt.write([(name, _value(arguments)) for name, arguments, _ in calls])
            turn["content"] = f"{turn['content']}\n{written}" if turn["content"] else written
        return turn
    if message.tool_call_id is not None:
        turn["tool_call_id"] = message.tool_call_id
    if calls:
        turn["tool_calls"] = [
            {"id": i, "type": "function", "function": {"name": n, "arguments": _value(a)}}
            for n, a, i in calls
        ]
    return turn


def _value(arguments: str) -> Any:
    """A call's arguments as templates take them: the JSON value (its text if it is none)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
