"""The REST bridge's wire shapes: OpenAI's chat and completions API, as far as edgetp serves it.

Requests are strict: a field of the wrong type (a string for a number, 51.5 for an integer) or
a field edgetp does not serve is refused with a 400 that names it, rather than coerced or
silently dropped. Ranges live here, so the OpenAPI document says exactly what is accepted; the
bounds that depend on the model (the context, the vocabulary) are added to the served schema,
and what depends on the prompt's length is checked by the handlers.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.json_schema import models_json_schema

from master.params import (
    GREEDY_BELOW,
    REPETITION_PENALTY_MAX,
    REPETITION_PENALTY_MIN,
    TEMPERATURE_MAX,
)

SEED_LIMIT = 2**53 - 1  # the largest integer a JSON number (a double) holds exactly
MAX_STOP_STRINGS = 4
MAX_TEXT = 1_000_000  # characters in one string: far beyond any context

# Constrained strings are checked to be valid Unicode: a lone surrogate ("\udfff", which JSON
# can carry) is refused here instead of failing in the tokenizer.
AnyText = Annotated[str, Field(max_length=MAX_TEXT)]
Text = Annotated[str, Field(min_length=1, max_length=MAX_TEXT)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
INT_FIELDS = ("max_tokens", "max_completion_tokens", "seed", "n", "top_k", "best_of")


def _integral(value: Any) -> Any:
    """51.0 is an integer to JSON Schema (and JavaScript); 51.5, "51" and true are not."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral(v) for v in value]
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# -- errors -----------------------------------------------------------------------------------
class ErrorBody(BaseModel):
    message: str = Field(description="what went wrong and what to change")
    type: str = Field(description="invalid_request_error, authentication_error, ...")
    param: str | None = Field(None, description="the request field at fault, if one is")
    code: str | None = Field(None, description="a stable identifier for the error")


class ErrorResponse(BaseModel):
    error: ErrorBody


# -- requests ---------------------------------------------------------------------------------
class StreamOptions(_Strict):
    include_usage: bool = Field(
        False, description="send a last chunk, with empty choices, that carries the usage counts"
    )


class TextPart(_Strict):
    type: Literal["text"]
    text: AnyText


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"] = Field(
        description="'developer' is passed to the chat template as 'system'"
    )
    content: AnyText | list[TextPart] = Field(description="text, or a list of text parts (joined)")


class SamplingFields(_Strict):
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
    n: int | None = Field(None, ge=1, le=1, description="choices per request: only 1")
    stream: bool | None = Field(False, description="send server-sent events as tokens come")
    stream_options: StreamOptions | None = Field(None, description="used with stream: true")
    presence_penalty: float | None = Field(
        None, ge=0.0, le=0.0, description="only 0: edgetp has none; use repetition_penalty"
    )
    frequency_penalty: float | None = Field(
        None, ge=0.0, le=0.0, description="only 0: edgetp has none; use repetition_penalty"
    )
    user: AnyText | None = Field(None, description="accepted for compatibility; not used")
    # edgetp's own sampling knobs (the names other OpenAI-compatible servers use)
    top_k: int | None = Field(None, ge=0, description="edgetp: keep the k likeliest; 0 = all")
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


class ChatTemplateKwargs(_Strict):
    enable_thinking: bool | None = Field(
        None,
        description=(
            "false: the chat template's thinking block off (Qwen3's switch); a model whose "
            "template has none refuses it (400)"
        ),
    )


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    chat_template_kwargs: ChatTemplateKwargs | None = Field(
        None, description="switches passed to the model's chat template"
    )
    max_completion_tokens: int | None = Field(
        None, ge=1, description="the newer name of max_tokens; wins if both are given"
    )


class CompletionRequest(SamplingFields):
    prompt: (
        Text
        | Annotated[list[Text], Field(min_length=1, max_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=1)]
    ) = Field(description="one prompt: text, or token ids (a list of one of either is accepted)")
    echo: bool | None = Field(False, description="put the prompt before the completion")
    best_of: int | None = Field(None, ge=1, le=1, description="only 1")


# -- responses --------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Literal["stop", "length"]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: FinishReason


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


def _none(value: Any) -> bool:
    return value is None


class ChatDelta(BaseModel):
    # Left out rather than null, as OpenAI sends them: the last chunk's delta is {}.
    role: Literal["assistant"] | None = Field(
        None, exclude_if=_none, description="in the first chunk only"
    )
    content: str | None = Field(None, exclude_if=_none, description="the next piece of text")


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: None = None
    finish_reason: FinishReason | None = Field(description="set in the last chunk with choices")


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice] = Field(description="empty in the usage chunk")
    usage: Usage | None = Field(
        None, exclude_if=_none, description="only in the last chunk, if asked for"
    )


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None


class CompletionChunk(BaseModel):
    """One server-sent event of a streamed completion."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChunkChoice] = Field(description="empty in the usage chunk")
    usage: Usage | None = Field(
        None, exclude_if=_none, description="only in the last chunk, if asked for"
    )


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CancelFigures(BaseModel):
    id: str
    tokens: int = Field(description="tokens generated before the request was dropped")
    requested_during_step: int = Field(description="steps started when the cancel came")
    dropped_before_step: int = Field(description="the first step without the request")
    late_steps: int = Field(description="steps started after the cancel that still carried it")


class GenerationFigures(BaseModel):
    """The generation loop's counters and recent figures."""

    slots: int = Field(description="KV-cache slots: requests generated at once")
    active: int = Field(description="requests in the running batch")
    waiting: int = Field(description="requests waiting for a slot")
    steps: int = Field(description="engine steps started since the server started")
    submitted: int
    completed: int
    cancelled: int = Field(description="requests whose client went away")
    failed: int
    prompt_tokens: int
    completion_tokens: int
    largest_batch: int = Field(description="most sequences one step has carried")
    step_ms_recent: list[float] = Field(description="duration of the latest steps, oldest first")
    batch_recent: list[int] = Field(description="sequences in each of those steps")
    tokens_per_s: float = Field(description="tokens per second of those steps' time")
    last_cancel: CancelFigures | None = None
    recovered: int = Field(0, description="requests that went on after a node was lost")
    last_loss: str | None = Field(
        None, description="when the last node was lost, which, and what the cluster did"
    )
    replans_mid_answer: int = Field(
        0, description="times nodes were planned in or out between two steps of running answers"
    )
    speculation: dict[str, float | str] | None = Field(
        None,
        description="with --draft: the draft ('lookup' or the draft model), tokens drafted and "
        "accepted, the acceptance rate, tokens a sequence makes per step, and with a draft "
        "model its ms per forward (draft_ms)",
    )


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    model: str
    generation: GenerationFigures


class SliceFigures(BaseModel):
    q_heads: list[int] = Field(description="half-open range of query heads")
    kv_heads: list[int]
    ffn: list[int] = Field(description="half-open range of FFN columns")


class NodeFigures(BaseModel):
    name: str
    role: Literal["master", "worker"]
    alive: bool
    ready: bool
    standby: bool = Field(
        False, description="joined, but left out of the plan: its link would slow every token"
    )
    slices: list[SliceFigures] = Field(description="the node's share of every layer, if known")
    memory_budget_bytes: int | None = None
    cores: int | None = None
    speed_gb_s: float | None = Field(None, description="measured weight-streaming throughput")
    rss_bytes: int | None = Field(None, description="resident memory of the process")
    kv_cache_bytes: int | None = None
    heartbeat_silence_s: float | None = Field(None, description="seconds since its last beat")
    address: str | None = Field(
        None, description="the master: where nodes join it; a worker: where it connects from"
    )
    share: float | None = Field(None, description="the node's fraction of every layer's weights")
    window: int | None = Field(None, description="layers of its slice held in memory at once")
    peak_rss_bytes: int | None = Field(None, description="highest resident memory so far")
    bytes_read_per_token: float | None = Field(None, description="shard bytes read, last token")
    loader_wait_ms: float | None = Field(None, description="compute waiting for the loader")
    load_ms: float | None = Field(None, description="time spent reading shards, last token")
    compute_ms: float | None = Field(None, description="time computing its partials, last step")
    kernels: str | None = Field(
        None, description="the kernels this device admitted and chose, per weight dtype"
    )
    restarts: int = Field(0, description="times this machine restarted the node's process")


class AllreduceFigures(BaseModel):
    sums: int = Field(description="sums measured (the latest are summarized)")
    median_us: float
    p99_us: float


class ClusterFigures(BaseModel):
    model: str
    context: int
    layers: int
    nodes: list[NodeFigures]
    allreduce: AllreduceFigures | None = Field(None, description="None on a single node")
    generation: GenerationFigures
    down: str | None = Field(None, description="why the cluster is down, if it is")


# -- the OpenAPI document ---------------------------------------------------------------------
def stream_content(chunk: type[BaseModel]) -> dict[str, Any]:
    """A 200 response's text/event-stream content: the schema of each event."""
    payload = {"contentMediaType": "application/json"}
    data = {
        "type": "string",
        "description": f"a JSON {chunk.__name__}, or ErrorResponse if generation failed "
        f"mid-stream; the last event is the literal [DONE]",
        "anyOf": [
            {"const": "[DONE]"},
            {**payload, "contentSchema": {"$ref": f"#/components/schemas/{chunk.__name__}"}},
            {**payload, "contentSchema": {"$ref": "#/components/schemas/ErrorResponse"}},
        ],
    }
    return {
        "text/event-stream": {
            "schema": {
                "type": "object",
                "description": "with stream: true, one event per piece of text",
                "properties": {"event": {"type": "string"}, "data": data},
                "required": ["data"],
            }
        }
    }


def finish_openapi(document: dict[str, Any], context: int, vocab: int) -> None:
    """Make FastAPI's OpenAPI document say what the bridge does, for a model with this context
    and vocabulary size."""
    # Validation errors are OpenAI-style 400s here, not FastAPI's 422s.
    for path in document.get("paths", {}).values():
        for op in path.values():
            op.get("responses", {}).pop("422", None)
    schemas = document.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    # The streamed chunks, which no route returns as its JSON model.
    _, defs = models_json_schema(
        [(ChatCompletionChunk, "serialization"), (CompletionChunk, "serialization")],
        ref_template="#/components/schemas/{model}",
    )
    for name, definition in defs.get("$defs", {}).items():
        schemas.setdefault(name, definition)
    # Bounds that depend on the model served.
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        props = schemas.get(name, {}).get("properties", {})
        for field in ("max_tokens", "max_completion_tokens"):
            _set_maximum(props.get(field), context - 1)
        _set_maximum(props.get("prompt"), vocab - 1)


def _set_maximum(schema: Any, maximum: int) -> None:
    """Give every integer in a JSON schema (and its anyOf/items) an upper bound."""
    if isinstance(schema, dict):
        if schema.get("type") == "integer":
            schema["maximum"] = maximum
        for key in ("anyOf", "items"):
            sub = schema.get(key)
            for s in sub if isinstance(sub, list) else [sub]:
                _set_maximum(s, maximum)
