"""What a person typed, as the model's prompt tokens: a one-turn prompt or a conversation under
the model's chat template, or the text as it is."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from edgetp.models.chat_template import NoChatTemplate, render_chat
from edgetp.models.errors import ModelError
from edgetp.models.source import ModelSource, open_model
from edgetp.models.tokenizer import Tokenizer


def open_with_tokenizer(model: str | None) -> tuple[ModelSource, Tokenizer]:
    """The model's source and tokenizer, without loading weights: cheap checks come first."""
    source = open_model(model)
    return source, source.tokenizer()


def prompt_tokens(
    tokenizer: Tokenizer,
    text: str,
    raw: bool,
    system: str | None = None,
    enable_thinking: bool | None = None,
) -> list[int]:
    """Tokens for a one-turn prompt: chat-templated, or the text as is when `raw`."""
    if not text.strip():
        raise ModelError("the prompt is empty: give some text")
    if raw:
        return tokenizer.encode(text)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}
    ]
    try:
        return chat_tokens(tokenizer, messages, enable_thinking)
    except NoChatTemplate as exc:
        raise NoChatTemplate(f"{exc}: use --raw to give the prompt as it is") from exc


def chat_tokens(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    enable_thinking: bool | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Tokens for a conversation under the model's chat template, ending where the reply
    begins; `enable_thinking` and `tools` as `models.chat_template.render_chat` takes them."""
    rendered = render_chat(
        tokenizer.chat_template,
        messages,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
        enable_thinking=enable_thinking,
        tools=tools,
    )
    # The template writes any BOS itself; adding another would change the model's input.
    return tokenizer.encode(rendered, add_bos=False)
