"""Rendering a model's chat template: the jinja2 program that turns messages into prompt text.

Templates come from the model file (GGUF `tokenizer.chat_template`, tokenizer_config.json) and are
written for transformers' `apply_chat_template`, so they are rendered the way it renders them:
the same jinja2 settings, globals and `tojson` filter. They are untrusted code, hence the sandbox.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from edgetp.models.errors import ModelError


class NoChatTemplate(ModelError):
    """The model brings no chat template: its prompts can only be given as text."""


class NoThinkingSwitch(ModelError):
    """A thinking switch was given for a template that never reads one."""


def render_chat(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    bos_token: str | None,
    eos_token: str | None,
    add_generation_prompt: bool = True,
    enable_thinking: bool | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The prompt text for `messages` ({"role": ..., "content": ...}, and as transformers passes
    them, an assistant's "tool_calls" and a tool result's "tool_call_id") under the model's
    template.

    With `add_generation_prompt` the text ends where the assistant's reply begins.
    `enable_thinking` (Qwen3's switch for its thinking block) reaches the template only when
    given, as transformers passes it: templates test whether it is defined. `tools` are
    OpenAI's tool objects ({"type": "function", "function": {...}}), as transformers passes
    them; a template may show them or not.
    """
    if not template:
        # What to do instead depends on the front (a flag, an endpoint): each adds its own way.
        raise NoChatTemplate(
            "this model has no chat template (no tokenizer.chat_template in the GGUF, none in "
            "tokenizer_config.json)"
        )
    if enable_thinking is not None and "enable_thinking" not in template:
        raise NoThinkingSwitch(
            "this model's chat template has no thinking block to turn on or off "
            "(it never reads enable_thinking)"
        )
    compiled = _compile(template)
    switches = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    # As transformers hands them over: a key whose value is None is left out (an assistant's
    # `content: null` beside its tool calls), which templates test for ("content" in message).
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    try:
        return compiled.render(
            messages=messages,
            bos_token=bos_token,
            eos_token=eos_token,
            add_generation_prompt=add_generation_prompt,
            # transformers always passes these; templates test them.
            tools=None if tools is None else [dict(t) for t in tools],
            documents=None,
            **switches,
        )
    except jinja2.TemplateError as exc:
        # Includes raise_exception() calls: the template's own verdict on the conversation.
        raise ModelError(f"the model's chat template failed on this conversation: {exc}") from exc
    except Exception as exc:  # template code is arbitrary: a TypeError is as much its fault
        raise ModelError(
            f"the model's chat template failed on this conversation: {type(exc).__name__}: {exc}"
        ) from exc


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson escapes <, >, & and ' for HTML, which would change the prompt text.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    # trim_blocks/lstrip_blocks and loop controls as transformers sets them: templates are
    # written against those, and their whitespace is part of the prompt.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ModelError(
            f"the model's chat template is not valid jinja2 (line {exc.lineno}: {exc.message})"
        ) from exc
