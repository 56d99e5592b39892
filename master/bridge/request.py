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

import json
import logging
from collections.abc import Sequence
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, Field, model_validator
from pydantic.fields import FieldInfo

from edgetp.master.bridge.request_parts import (
    NARROWED,
    AllowedToolChoice,
    ChatMessage,
    ChatTemplateKwargs,
    CustomTool,
    FalseOnly,
    FunctionDefinition,
    FunctionName,
    FunctionTool,
    NamedCustomToolChoice,
    NamedToolChoice,
    PredictionContent,
    PromptCacheOptions,
    ResponseFormat,
    StreamOptions,
    Tool,
    ToolChoice,
    _Request,
)
from edgetp.master.bridge.schema import MAX_STOP_STRINGS, SEED_LIMIT, AnyText, Text
from edgetp.master.generation.params import (
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


def _integral(value: Any) -> Any:
    """51.0 is an integer to JSON Schema (and JavaScript); 51.5, "51" and true are not."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral(v) for v in value]
    return value


# -- the requests -----------------------------------------------------------------------------
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
    response_format: ResponseFormat | None = Field(
        None,
        description="{'type': 'json_object'}: the answer is a JSON object; {'type': "
        "'json_schema', 'json_schema': {'name', 'schema'}}: JSON valid against the schema "
        "(strict or not: decoding is constrained by a grammar either way)",
    )
    tools: list[Tool] | None = Field(
        None,
        description="function tools the model may call: shown to it through its chat template "
        "(or, when the template shows none, a system prompt in the Hermes format)",
    )
    tool_choice: ToolChoice | None = Field(
        None,
        description="'auto' (the default with tools): the model chooses; 'none': it answers in "
        "text, without seeing the tools; 'required', a function by name or allowed_tools "
        "'required': a call is forced by the grammar, its arguments valid against the schema",
    )
    parallel_tool_calls: bool | None = Field(
        None,
        description="false: an answer keeps its first call only; true: a forced call may be "
        "several; left out: the model may write several, a forced call is one (as llama.cpp's "
        "server does: a small model repeats a forced call until max_tokens)",
    )
    functions: list[FunctionDefinition] | None = Field(
        None, description="tools' older form; the answer's call comes as function_call"
    )
    function_call: Literal["none", "auto"] | FunctionName | None = Field(
        None, description="tool_choice's older form: 'none', 'auto' or {'name': ...}"
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
        tools = self.tool_problem()
        if tools:
            return tools
        if self.reasoning_effort is not None and reasons(chat_template):
            return "reasoning_effort", (
                f"reasoning_effort: {self.reasoning_effort!r} is not supported: this model "
                f"reasons, and edgetp cannot set how much yet; leave it out (with a Qwen3-style "
                f"template, chat_template_kwargs enable_thinking false turns thinking off)"
            )
        return None

    def tool_problem(self) -> tuple[str, str] | None:
        """(field, message) for tools and a choice among them that do not go together."""
        if self.tools and self.functions:
            return "functions", "functions: give tools or functions (their older form), not both"
        custom = [i for i, t in enumerate(self.tools or ()) if isinstance(t, CustomTool)]
        if custom or isinstance(self.tool_choice, NamedCustomToolChoice):
            field = f"tools.{custom[0]}" if custom else "tool_choice"
            return field, f"{field}: edgetp calls function tools only, not custom tools"
        tools = [t.function.name for t in self.tools or () if isinstance(t, FunctionTool)]
        functions = [f.name for f in self.functions or ()]
        for field, choice, names in (
            ("tool_choice", self.tool_choice, tools),
            ("function_call", self.function_call, functions),
        ):
            if choice in (None, "none", "auto"):
                continue
            if not names:
                given = "tools" if field == "tool_choice" else "functions"
                return field, (
                    f"{field}: {_shown(choice)} is not supported without {given}: give the "
                    f"{given} the model is to call"
                )
            unknown = [n for n in called_names(choice) if n not in names]
            if unknown:
                return field, (
                    f"{field} names {unknown[0]!r}, which is not among the tools: "
                    f"{', '.join(map(repr, names))}"
                )
        return None

    def function_definitions(self) -> list[FunctionDefinition]:
        """The functions of tools (or of functions, their older form)."""
        if self.functions is not None:
            return list(self.functions)
        return [t.function for t in self.tools or () if isinstance(t, FunctionTool)]


def called_names(choice: Any) -> list[str]:
    """The functions a tool choice (or function_call) names; [] for one that names none."""
    if isinstance(choice, NamedToolChoice):
        return [choice.function.name]
    if isinstance(choice, FunctionName):
        return [choice.name]
    if isinstance(choice, AllowedToolChoice):
        return [str((t.get("function") or {}).get("name")) for t in choice.allowed_tools.tools]
    return []


def _shown(choice: Any) -> str:
    return json.dumps(choice) if isinstance(choice, str) else choice.model_dump_json()


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
