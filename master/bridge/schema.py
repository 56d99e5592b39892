"""The REST bridge's wire shapes: the limits its requests share, its errors and responses in
OpenAI's shapes, and the OpenAPI document.

The requests themselves are request.py's. Ranges live in the models, so the OpenAPI document
says exactly what is accepted; the bounds that depend on the model (the context, the
vocabulary) are added to the served schema, and what depends on the prompt's length is checked
by the handlers.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema

SEED_LIMIT = 2**53 - 1  # the largest integer a JSON number (a double) holds exactly
MAX_STOP_STRINGS = 4
MAX_TEXT = 1_000_000  # characters in one string: far beyond any context

# Constrained strings are checked to be valid Unicode: a lone surrogate ("\udfff", which JSON
# can carry) is refused here instead of failing in the tokenizer.
AnyText = Annotated[str, Field(max_length=MAX_TEXT)]
Text = Annotated[str, Field(min_length=1, max_length=MAX_TEXT)]


# -- errors -----------------------------------------------------------------------------------
class ErrorBody(BaseModel):
    message: str = Field(description="what went wrong and what to change")
    type: str = Field(description="invalid_request_error, authentication_error, ...")
    param: str | None = Field(None, description="the request field at fault, if one is")
    code: str | None = Field(None, description="a stable identifier for the error")


class ErrorResponse(BaseModel):
    error: ErrorBody


# -- responses --------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(
        description="of the prompt's tokens, those not prefilled: a free KV-cache slot held "
        "them from an earlier request that began alike (prompt reuse)"
    )


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


# "tool_calls" (or "function_call", asked as `functions`): the answer ended with its calls.
FinishReason = Literal["stop", "length", "tool_calls", "function_call"]


class TopLogprob(BaseModel):
    token: str = Field(description="the token's text")
    logprob: float = Field(
        description="of the model's logits after the penalties and the temperature (1 when "
        "greedy), before top-k, top-p and min-p cut them"
    )
    bytes: list[int] | None = Field(description="the token's UTF-8 bytes")


class ContentLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(description="the likeliest tokens, likeliest first")


class ChatLogprobs(BaseModel):
    content: list[ContentLogprob] | None
    refusal: None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int] = Field(description="where each token's text starts in the choice's")


def _none(value: Any) -> bool:
    return value is None


class CalledFunction(BaseModel):
    name: str
    arguments: str = Field(description="the arguments, a JSON object as text")


class ToolCall(BaseModel):
    id: str = Field(description="call_...: a tool message answers it by this id")
    type: Literal["function"] = "function"
    function: CalledFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = Field(description="the answer's text; null when it is only calls")
    reasoning_content: str | None = Field(
        None, exclude_if=_none, description="a thinking model's reasoning, before its answer"
    )
    tool_calls: list[ToolCall] | None = Field(
        None, exclude_if=_none, description="the calls the model made (with tools)"
    )
    function_call: CalledFunction | None = Field(
        None, exclude_if=_none, description="the call the model made (with functions)"
    )


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
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
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class DeltaFunction(BaseModel):
    name: str | None = Field(None, exclude_if=_none, description="in a call's first chunk")
    arguments: str | None = Field(None, exclude_if=_none, description="the next piece of them")


class DeltaToolCall(BaseModel):
    index: int = Field(description="which call of the answer: pieces of one share it")
    id: str | None = Field(None, exclude_if=_none, description="in a call's first chunk")
    type: Literal["function"] | None = Field(None, exclude_if=_none)
    function: DeltaFunction


class ChatDelta(BaseModel):
    # Left out rather than null, as OpenAI sends them: the last chunk's delta is {}.
    role: Literal["assistant"] | None = Field(
        None, exclude_if=_none, description="in the first chunk only"
    )
    content: str | None = Field(None, exclude_if=_none, description="the next piece of text")
    reasoning_content: str | None = Field(
        None, exclude_if=_none, description="the next piece of a thinking model's reasoning"
    )
    tool_calls: list[DeltaToolCall] | None = Field(None, exclude_if=_none)
    function_call: DeltaFunction | None = Field(
        None, exclude_if=_none, description="with functions: the call, in pieces"
    )


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
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
    logprobs: CompletionLogprobs | None = None
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


class ReuseFigures(BaseModel):
    id: str
    prompt_tokens: int
    reused_tokens: int = Field(
        description="prompt tokens not prefilled: a finished request's KV cache held them"
    )


class GenerationFigures(BaseModel):
    """The generation loop's counters and recent figures."""

    slots: int = Field(description="KV-cache slots: requests generated at once")
    active: int = Field(description="requests in the running batch")
    waiting: int = Field(description="requests waiting for a slot (embeddings' too)")
    steps: int = Field(description="engine steps started since the server started")
    submitted: int = Field(description="requests taken, answers and embeddings alike")
    completed: int
    cancelled: int = Field(description="requests whose client went away")
    failed: int
    prompt_tokens: int
    completion_tokens: int
    largest_batch: int = Field(description="most sequences one step has carried")
    reused_tokens: int = Field(
        0,
        description="prompt tokens not prefilled, since a finished request's KV cache, kept in "
        "its slot, held them (a conversation's earlier turns)",
    )
    last_reuse: ReuseFigures | None = Field(
        None, description="the last request admitted: its prompt tokens and how many were reused"
    )
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
    longest_gap_ms: float = Field(
        0.0,
        description="the longest a decoding stream has waited between two of its tokens, since "
        "the server started (a long prompt prefills in chunks between their steps)",
    )
    prefill_chunk: int = Field(
        0,
        description="prompt tokens a step of a long prompt feeds while other requests decode, "
        "as last sized (0: --prefill-chunk-ms 0, a prompt prefills whole)",
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
    kv_cache_bytes: int | None = Field(None, description="its KV cache's keys and values")
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
    state_bytes_per_sequence: int | None = Field(
        None,
        description="a sequence's memory on this node whatever its length: a gated DeltaNet's "
        "state and the local layers' KV rings",
    )
    kv_bytes_per_token: int | None = Field(
        None, description="a sequence's KV cache on this node per token of its context"
    )
    kv_cache: Literal["f32", "f16", "q8_0"] | None = Field(
        None, description="how its KV cache stores keys and values (--kv-cache)"
    )
    slots: int | None = Field(None, description="sequences this node's cache holds at once")
    context: int | None = Field(None, description="tokens of context each of them may hold")
    expert_hit_rate: float | None = Field(
        None,
        description="a mixture's experts a node streams: the share of the last step's chosen "
        "experts its expert cache held (the rest were read from its shards)",
    )
    expert_read_hidden_ms: float | None = Field(
        None,
        description="a mixture's experts a node streams: the time its reads of the last step's "
        "experts took while the experts it held computed (time it did not wait for them)",
    )
    kernels: str | None = Field(
        None, description="the kernels this device admitted and chose, per weight dtype"
    )
    link_rtt_us: float | None = Field(
        None, description="a worker: the round trip of a sum-sized message, as its link was timed"
    )
    hop_us_median: float | None = Field(
        None,
        description="a worker: its partials' return after the step went, less its compute, "
        "over recent sums (median): the hop's cost beside link_rtt_us",
    )
    hop_us_p99: float | None = None
    activations: Literal["exact", "int8"] | None = Field(
        None,
        description="how its block-format products take their input: exact float32, or int8 "
        "a block of 32 (llama.cpp's Q8_0 rounding; the K-quants' Q8_K, a block of 256), where "
        "the device has an integer kernel",
    )
    restarts: int = Field(0, description="times this machine restarted the node's process")


class AllreduceFigures(BaseModel):
    sums: int = Field(
        description="sums since the start (the latest are summarized); a step pays one a "
        "block whatever its batch, so concurrent sequences share them"
    )
    median_us: float
    p99_us: float
    wire: Literal["float32", "float16"] = Field(
        "float32",
        description="what a sum's messages carry: float32, or float16 at half the bytes (a "
        "message with a value past its range goes as float32): `--wire`",
    )


class AttentionFigures(BaseModel):
    on: Literal["split", "master"] = Field(
        description="split across the nodes as the FFN is (two sums a layer), or every head on "
        "the master (one sum a layer, the workers waiting while it computes): `--attention`"
    )
    why: str = Field(description="what chose it: the flag, or the estimate from the measured "
                     "links and speeds")  # fmt: skip


class ClusterFigures(BaseModel):
    model: str
    context: int
    layers: int
    nodes: list[NodeFigures]
    allreduce: AllreduceFigures | None = Field(None, description="None on a single node")
    attention: AttentionFigures | None = Field(None, description="where the plan put attention")
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


# Ids 0 to 100255 are OpenAI's cl100k_base tokens of text (/v1/embeddings' token arrays);
# the special ones after them are not text.
CL100K_TOKENS = 100256


def finish_openapi(
    document: dict[str, Any], context: int, vocab: int, hidden: int | None = None
) -> None:
    """Make FastAPI's OpenAPI document say what the bridge does, for a model with this context,
    vocabulary size and (for its embeddings) hidden size."""
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
    embedding = schemas.get("EmbeddingRequest", {}).get("properties", {})
    _set_maximum(embedding.get("input"), CL100K_TOKENS - 1)  # OpenAI's ids, not the model's
    if hidden is not None:  # the one size of its vectors
        _set_maximum(embedding.get("dimensions"), hidden)
        _set_minimum(embedding.get("dimensions"), hidden)


def _set_maximum(schema: Any, maximum: int) -> None:
    """Give every integer in a JSON schema (and its anyOf/items) an upper bound."""
    if isinstance(schema, dict):
        if schema.get("type") == "integer":
            schema["maximum"] = maximum
        for key in ("anyOf", "items"):
            sub = schema.get(key)
            for s in sub if isinstance(sub, list) else [sub]:
                _set_maximum(s, maximum)


def _set_minimum(schema: Any, minimum: int) -> None:
    """Give the integers in a JSON schema (and its anyOf) a lower bound."""
    if isinstance(schema, dict):
        if schema.get("type") == "integer":
            schema["minimum"] = minimum
        for sub in schema.get("anyOf", []):
            _set_minimum(sub, minimum)
