"""The parts of the REST bridge's requests (request.py): messages, tools and the choice among
them, response formats, and the small options objects, as OpenAI types them.

`_Request` objects keep what OpenAI's schema has and edgetp does not know in `model_extra`
(ignored with a warning); `_Strict` ones are edgetp's own, where an unknown key is a 400.
A field marked `NARROWED` takes fewer values here than at OpenAI; its description says which.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from edgetp.master.bridge.schema import AnyText, Text


def _a_bool(value: Any) -> Any:
    """Refuses what equals False without being a boolean (0, 0.0), which Literal[False] takes."""
    if not isinstance(value, bool):
        raise ValueError("Input should be a valid boolean")
    return value


FalseOnly = Annotated[Literal[False], BeforeValidator(_a_bool)]


class Narrowed:
    """Marks a field (in `Annotated`) that edgetp takes at fewer values than OpenAI does."""


NARROWED = Narrowed()


class _Request(BaseModel):
    """An object of OpenAI's request schema: what it does not declare lands in `model_extra`."""

    model_config = ConfigDict(extra="allow", strict=True)


class _Strict(BaseModel):
    """One of edgetp's own objects: an unknown key is a 400."""

    model_config = ConfigDict(extra="forbid", strict=True)


# -- options ----------------------------------------------------------------------------------
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


class ChatTemplateKwargs(_Strict):
    enable_thinking: bool | None = Field(
        None,
        description=(
            "false: the chat template's thinking block off (Qwen3's switch); a model whose "
            "template has none refuses it (400)"
        ),
    )


class PromptCacheOptions(_Request):
    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m"] | None = None


# -- messages ---------------------------------------------------------------------------------
class TextPart(_Request):
    type: Literal["text"]
    text: AnyText
    prompt_cache_breakpoint: CacheBreakpoint | None = Field(
        None, description="a caching hint: accepted, changes nothing"
    )


class PredictionContent(_Request):
    type: Literal["content"]
    content: AnyText | list[TextPart]


class CalledFunction(_Request):
    name: Text
    arguments: AnyText = Field(description="the arguments as JSON text, as the answer gave them")


class MessageToolCall(_Request):
    id: AnyText
    type: Literal["function"] = Field(description="edgetp calls function tools only")
    function: CalledFunction


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"] = Field(
        description="system, developer (passed to the chat template as system), user, "
        "assistant, tool (a call's result) or function (tool's older form)"
    )
    content: AnyText | list[TextPart] | None = Field(
        None,
        description="text, or a list of text parts (joined); null (an assistant's that only "
        "calls tools) is empty text",
    )
    name: AnyText | None = Field(
        None, description="passed to the chat template, which may use it or not"
    )
    tool_calls: list[MessageToolCall] | None = Field(
        None, description="an assistant's calls, as the answer gave them"
    )
    tool_call_id: AnyText | None = Field(None, description="a tool message: the call it answers")
    function_call: CalledFunction | None = Field(
        None, description="an assistant's call in tools' older form"
    )
    # An assistant turn sent back as OpenAI's client returned it carries these, at null.
    refusal: Annotated[None, NARROWED] = Field(
        None, description="only null: send an assistant's text as content"
    )
    audio: Annotated[None, NARROWED] = Field(None, description="only null: edgetp makes text")

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text for p in self.content)


# -- tools ------------------------------------------------------------------------------------
class FunctionDefinition(_Request):
    name: Text
    description: AnyText | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="a JSON Schema object; left out: the function takes no arguments"
    )
    strict: bool | None = Field(
        None, description="accepted: a call edgetp forces always follows the schema"
    )


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


Tool = Annotated[FunctionTool | CustomTool, Field(discriminator="type")]


class FunctionName(_Request):
    name: Text


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


class NamedCustomToolChoice(_Request):
    type: Literal["custom"]
    custom: FunctionName


class AllowedTools(_Request):
    mode: Literal["auto", "required"]
    tools: list[dict[str, Any]] = Field(
        description="the tools the model may call, e.g. {'type': 'function', 'function': "
        "{'name': ...}}"
    )


class AllowedToolChoice(_Request):
    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


ToolChoice = (
    Literal["none", "auto", "required"]
    | Annotated[
        NamedToolChoice | NamedCustomToolChoice | AllowedToolChoice, Field(discriminator="type")
    ]
)


# -- response formats -------------------------------------------------------------------------
class ResponseFormatText(_Request):
    type: Literal["text"]


class ResponseFormatJSONObject(_Request):
    type: Literal["json_object"]


class JSONSchemaFormat(_Request):
    name: Text
    description: AnyText | None = None
    # `schema` would shadow a BaseModel method: the field takes it as its alias.
    schema_: dict[str, Any] | None = Field(
        None, alias="schema", description="a JSON Schema; left out: any JSON value"
    )
    strict: bool | None = Field(None, description="accepted: the answer always follows the schema")


class ResponseFormatJSONSchema(_Request):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJSONObject | ResponseFormatJSONSchema,
    Field(discriminator="type"),
]
