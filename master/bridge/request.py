"""The requests the REST bridge takes: every field of OpenAI's chat completions and completions
requests (openai-python's `completion_create_params`), as OpenAI types them.

A field is honoured (temperature, max_tokens, stop, n, logprobs, the penalties, ...), or accepted
because its value changes nothing (`tools: []`, a caching hint), or it takes fewer values here
than at OpenAI: such a field is marked `NARROWED`, its schema admits only what edgetp serves, so
the OpenAPI document says it, and its description, which says what it takes and why, is the
400's message for any other value (errors.py). Types are strict: a string for a number is
refused, not coerced.

A field that neither OpenAI's API nor edgetp's own extensions (top_k, min_p, repetition_penalty,
ignore_eos, chat_template_kwargs) have is set aside by pydantic and ignored, with one warning
line per request that names it (`warn_ignored`), as vLLM does: clients written for other
servers send their own. edgetp's own `chat_template_kwargs` stays strict: a switch the chat
template does not know would change nothing, silently.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic.fields import FieldInfo

from master.bridge.schema import MAX_STOP_STRINGS, SEED_LIMIT, AnyText, Text
from master.params import (
    GREEDY_BELOW,
    PENALTY_LIMIT,
    REPETITION_PENALTY_MAX,
    REPETITION_PENALTY_MIN,
    TEMPERATURE_MAX,
    TOP_LOGPROBS_MAX,
)

log = logging.getLogger(__name__)

TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
NoBias = Annotated[dict[str, int], Field(max_length=0)]
NoToolCalls = Annotated[list[Any], Field(max_length=0)]
TextOnly = Annotated[list[Literal["text"]], Field(min_length=1)]
Empty = Annotated[str, Field(max_length=0)]
INT_FIELDS = (
    "max_tokens",
    "max_completion_tokens",
    "seed",
    "n",
    "top_k",
    "best_of",
    "top_logprobs",
    "logprobs",  # the completions' count (the chat's is a boolean, which this leaves alone)
)
# Choices in one request (OpenAI takes 128): each is a whole sequence, its prefill included
# (nothing is shared yet), so a request of 128 would take two lines' worth of waiting sequences.
N_MAX = 16
IGNORED_SHOWN = 10  # unknown fields named in the warning; the rest are counted
# Words in a chat template that mean the model reasons before it answers.
REASONING_MARKS = ("enable_thinking", "reasoning_effort", "<think>")


def _a_bool(value: Any) -> Any:
    """Refuses what equals False without being a boolean (0, 0.0), which Literal[False] takes."""
    if not isinstance(value, bool):
        raise ValueError("Input should be a valid boolean")
    return value


FalseOnly = Annotated[Literal[False], BeforeValidator(_a_bool)]


class Narrowed:
    """Marks a field (in `Annotated`) that edgetp takes at fewer values than OpenAI does."""


NARROWED = Narrowed()


def _integral(value: Any) -> Any:
    """51.0 is an integer to JSON Schema (and JavaScript); 51.5, "51" and true are not."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral(v) for v in value]
    return value


class _Request(BaseModel):
    """An object of OpenAI's request schema: what it does not declare lands in `model_extra`."""

    model_config = ConfigDict(extra="allow", strict=True)


class _Strict(BaseModel):
    """One of edgetp's own objects: an unknown key is a 400."""

    model_config = ConfigDict(extra="forbid", strict=True)


# -- parts ------------------------------------------------------------------------------------
class StreamOptions(_Request):
    include_usage: bool = Field(
        False, description="send a last chunk, with empty choices, that carries the usage counts"
    )
    include_obfuscation: bool | None = Field(
        None, description="accepted; edgetp pads no chunks (its text is the same either way)"
    )


class CacheBreakpoint(_Request):
    mode: Literal["explicit"]
    ttl: Literal["30m", "12h"] | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: AnyText
    prompt_cache_breakpoint: CacheBreakpoint | None = Field(
        None, description="a caching hint: accepted, changes nothing"
    )


class ChatMessage(_Request):
    role: Annotated[Literal["system", "developer", "user", "assistant"], NARROWED] = Field(
        description="system, developer (passed to the chat template as system), user or "
        "assistant: 'tool' and 'function' messages need tool calling, which edgetp has not yet"
    )
    content: AnyText | list[TextPart] = Field(description="text, or a list of text parts (joined)")
    name: AnyText | None = Field(
        None, description="passed to the chat template, which may use it or not"
    )
    # An assistant turn sent back as OpenAI's client returned it carries these, at null.
    refusal: Annotated[None, NARROWED] = Field(
        None, description="only null: send an assistant's text as content"
    )
    audio: Annotated[None, NARROWED] = Field(None, description="only null: edgetp makes text")
    function_call: Annotated[None, NARROWED] = Field(
        None, description="only null: edgetp cannot call tools yet"
    )
    tool_calls: Annotated[NoToolCalls | None, NARROWED] = Field(
        None, description="only empty or null: edgetp cannot call tools yet"
    )


class ChatTemplateKwargs(_Strict):
    enable_thinking: bool | None = Field(
        None,
        description=(
            "false: the chat template's thinking block off (Qwen3's switch); a model whose "
            "template has none refuses it (400)"
        ),
    )


class FunctionDefinition(_Request):
    name: Text
    description: AnyText | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema object")
    strict: bool | None = None


class FunctionTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class CustomToolDefinition(_Request):
    name: Text
    description: AnyText | None = None
    format: dict[str, Any] | None = None


class CustomTool(_Request):
    type: Literal["custom"]
    custom: CustomToolDefinition


class ResponseFormatText(_Request):
    type: Literal["text"]


class PredictionContent(_Request):
    type: Literal["content"]
    content: AnyText | list[TextPart]


class PromptCacheOptions(_Request):
    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m"] | None = None


# -- the requests -----------------------------------------------------------------------------
NO_TOOLS = "edgetp cannot call tools yet"
CHANGES_NOTHING = "accepted, changes nothing"


class SamplingFields(_Request):
    """Fields both generation endpoints take."""

    model: AnyText | None = Field(
        None, description="the served model's id (GET /v1/models); omitted: the served model"
    )
    temperature: float | None = Field(
        None,
        ge=0.0,
        le=TEMPERATURE_MAX,
        description=f"0 is greedy; default 1. Below {GREEDY_BELOW} counts as 0 (the same argmax).",
    )
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="nucleus mass; default 1")
    max_tokens: int | None = Field(
        None, ge=1, description="tokens to generate at most; prompt + max_tokens <= the context"
    )
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        None, description=f"up to {MAX_STOP_STRINGS} non-empty strings that end the output"
    )
    seed: int | None = Field(
        None, ge=-SEED_LIMIT, le=SEED_LIMIT, description="makes sampling repeatable"
    )
    n: Annotated[int | None, NARROWED] = Field(
        None,
        ge=1,
        le=N_MAX,
        description=f"1 to {N_MAX} choices, each a sequence of the batch in a slot of its own "
        f"(they wait for free slots as requests do, and nothing is shared yet); usage counts "
        f"the prompt once",
    )
    stream: bool | None = Field(False, description="send server-sent events as tokens come")
    stream_options: StreamOptions | None = Field(None, description="used with stream: true")
    presence_penalty: float | None = Field(
        None,
        ge=-PENALTY_LIMIT,
        le=PENALTY_LIMIT,
        description="subtracted from the logit of every token the answer already has",
    )
    frequency_penalty: float | None = Field(
        None,
        ge=-PENALTY_LIMIT,
        le=PENALTY_LIMIT,
        description="subtracted from a token's logit once per time the answer already has it",
    )
    logit_bias: Annotated[NoBias | None, NARROWED] = Field(
        None, description="only {} or null: edgetp biases no tokens yet"
    )
    user: AnyText | None = Field(None, description=f"an end user's id: {CHANGES_NOTHING}")
    # edgetp's own sampling knobs (the names other OpenAI-compatible servers use)
    top_k: int | None = Field(None, ge=0, description="edgetp: keep the k likeliest; 0 = all")
    min_p: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="edgetp: keep tokens at least min_p times as likely as the likeliest; 0 = all",
    )
    repetition_penalty: float | None = Field(
        None,
        ge=REPETITION_PENALTY_MIN,
        le=REPETITION_PENALTY_MAX,
        description="edgetp: >1 discourages repeating tokens",
    )
    ignore_eos: bool | None = Field(
        False, description="edgetp: keep going past end-of-sequence, up to max_tokens"
    )

    @model_validator(mode="before")
    @classmethod
    def _integral_numbers(cls, data: Any) -> Any:
        """Integer fields take integral floats (51.0), as JSON Schema's `integer` does."""
        if isinstance(data, dict):
            data = dict(data)
            for name in (*INT_FIELDS, "prompt"):
                if name in data:
                    data[name] = _integral(data[name])
        return data


Tool = Annotated[FunctionTool | CustomTool, Field(discriminator="type")]
Hint = AnyText | None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    chat_template_kwargs: ChatTemplateKwargs | None = Field(
        None, description="edgetp: switches passed to the model's chat template"
    )
    max_completion_tokens: int | None = Field(
        None, ge=1, description="the newer name of max_tokens; wins if both are given"
    )
    logprobs: bool | None = Field(
        None,
        description="each token's log probability: of the model's logits after the penalties "
        "and the temperature (1 when greedy), before top-k, top-p and min-p",
    )
    top_logprobs: int | None = Field(
        None,
        ge=0,
        le=TOP_LOGPROBS_MAX,
        description="with logprobs true: the likeliest tokens' too, at each position",
    )
    response_format: Annotated[ResponseFormatText | None, NARROWED] = Field(
        None,
        description="only {'type': 'text'}: json_object and json_schema need constrained "
        "decoding, which edgetp has not yet",
    )
    tools: list[Tool] | None = Field(
        None,
        description=f"only with tool_choice 'none', when the model answers in text and is not "
        f"shown them: {NO_TOOLS}",
    )
    tool_choice: Annotated[Literal["none", "auto"] | None, NARROWED] = Field(
        None, description=f"only 'none', or 'auto' without tools: {NO_TOOLS}"
    )
    parallel_tool_calls: bool | None = Field(None, description=f"no tools run: {CHANGES_NOTHING}")
    functions: list[FunctionDefinition] | None = Field(
        None, description=f"tools' older form: only with function_call 'none'; {NO_TOOLS}"
    )
    function_call: Annotated[Literal["none", "auto"] | None, NARROWED] = Field(
        None,
        description=f"tool_choice's older form: only 'none', or 'auto' without functions; "
        f"{NO_TOOLS}",
    )
    audio: Annotated[None, NARROWED] = Field(None, description="only null: edgetp makes text")
    modalities: Annotated[TextOnly | None, NARROWED] = Field(
        None, description="only ['text']: edgetp makes text"
    )
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = (
        Field(
            None,
            description="accepted for a model that does not reason (it changes nothing); a "
            "model that reasons refuses it: edgetp cannot set the effort yet",
        )
    )
    verbosity: Annotated[Literal["medium"] | None, NARROWED] = Field(
        None, description="only 'medium' (the default): the model has no verbosity switch"
    )
    prediction: PredictionContent | None = Field(
        None,
        description="accepted, unused: a prediction makes an answer sooner, never different",
    )
    service_tier: Annotated[Literal["auto", "default"] | None, NARROWED] = Field(
        None, description="only 'auto' or 'default': edgetp has one tier"
    )
    store: Annotated[FalseOnly | None, NARROWED] = Field(
        None, description="only false or null: edgetp stores no completions"
    )
    metadata: dict[str, AnyText] | None = Field(
        None, description=f"tags for stored completions: {CHANGES_NOTHING}"
    )
    prompt_cache_key: Hint = Field(None, description=f"a caching hint: {CHANGES_NOTHING}")
    prompt_cache_retention: Literal["in_memory", "24h"] | None = Field(
        None, description=f"a caching hint: {CHANGES_NOTHING}"
    )
    prompt_cache_options: PromptCacheOptions | None = Field(
        None, description=f"a caching hint: {CHANGES_NOTHING}"
    )
    safety_identifier: Hint = Field(None, description=f"an end user's id: {CHANGES_NOTHING}")
    moderation: Annotated[None, NARROWED] = Field(
        None, description="only null: edgetp runs no moderation model"
    )
    web_search_options: Annotated[None, NARROWED] = Field(
        None, description="only null: edgetp does not search the web"
    )

    def unserved(self, chat_template: str | None) -> tuple[str, str] | None:
        """(field, message) for what the schema cannot refuse: fields served alone but not
        together, and a reasoning effort for a model that reasons."""
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", (
                f"top_logprobs: {self.top_logprobs} needs logprobs: true (as at OpenAI)"
            )
        for tools, choice, name in (
            (self.tools, self.tool_choice, "tool_choice"),
            (self.functions, self.function_call, "function_call"),
        ):
            if tools and choice != "none":
                field = "tools" if name == "tool_choice" else "functions"
                given = "left out (then 'auto')" if choice is None else repr(choice)
                return field, (
                    f"{field} are served only with {name} 'none', when the model answers in "
                    f"text without seeing them: {NO_TOOLS}; {name} was {given}"
                )
        if self.reasoning_effort is not None and reasons(chat_template):
            return "reasoning_effort", (
                f"reasoning_effort: {self.reasoning_effort!r} is not supported: this model "
                f"reasons, and edgetp cannot set how much yet; leave it out (with a Qwen3-style "
                f"template, chat_template_kwargs enable_thinking false turns thinking off)"
            )
        return None


class CompletionRequest(SamplingFields):
    prompt: (
        Text
        | Annotated[list[Text], Field(min_length=1, max_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=1)]
    ) = Field(description="one prompt: text, or token ids (a list of one of either is accepted)")
    echo: bool | None = Field(False, description="put the prompt before the completion")
    best_of: Annotated[int | None, NARROWED] = Field(
        None, ge=1, le=1, description="only 1: edgetp does not rank choices (n makes several)"
    )
    logprobs: int | None = Field(
        None,
        ge=0,
        le=TOP_LOGPROBS_MAX,
        description="each token's log probability and those of the `logprobs` likeliest "
        "tokens, of the model's logits after the penalties and the temperature (1 when greedy)",
    )
    suffix: Annotated[Empty | None, NARROWED] = Field(
        None, description="only null or '': edgetp has no fill-in-the-middle yet"
    )

    def unserved(self, chat_template: str | None = None) -> tuple[str, str] | None:
        """(field, message) for fields served alone but not together."""
        if self.echo and self.logprobs is not None:
            return "echo", (
                "echo: true with logprobs would report the prompt's tokens' log probabilities, "
                "which edgetp does not compute yet; ask for one or the other"
            )
        return None


REQUESTS: dict[str, type[SamplingFields]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}


# -- what the handlers and errors.py ask of them ----------------------------------------------
def reasons(chat_template: str | None) -> bool:
    """Whether the model thinks before it answers, as far as its chat template tells."""
    return any(mark in (chat_template or "") for mark in REASONING_MARKS)


def declared(model: type[BaseModel], path: Sequence[str]) -> FieldInfo | None:
    """The declaration of the field at `path` (field names and list indexes) in `model`."""
    info: FieldInfo | None = None
    models = [model]
    for part in path:
        if part.isdigit():
            continue
        info = next((m.model_fields[part] for m in models if part in m.model_fields), None)
        if info is None:
            return None
        models = _models(info.annotation)
    return info


def narrowed(info: FieldInfo | None) -> bool:
    return info is not None and NARROWED in info.metadata


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The models an annotation holds, through unions, lists and Annotated."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models(arg)]


def ignored(value: Any, path: str = "") -> list[str]:
    """The dotted paths of the fields in a validated request that no model here declares."""
    if isinstance(value, list):
        return [f for i, v in enumerate(value) for f in ignored(v, f"{path}{i}.")]
    if not isinstance(value, BaseModel):
        return []
    found = [f"{path}{name}" for name in value.model_extra or {}]
    for name in type(value).model_fields:
        found += ignored(getattr(value, name), f"{path}{name}.")
    return found


def warn_ignored(body: BaseModel, route: str) -> None:
    """One warning line naming the fields of `body` that edgetp ignores, if it has any."""
    names = ignored(body)
    if not names:
        return
    shown = ", ".join(repr(n[:80]) for n in names[:IGNORED_SHOWN])
    more = f" and {len(names) - IGNORED_SHOWN} more" if len(names) > IGNORED_SHOWN else ""
    log.warning("%s: ignored %s%s: no such field in OpenAI's API", route, shown, more)
