"""The fields the REST bridge takes, held to OpenAI's own request types (openai-python's
`completion_create_params`), without a server.

Every field OpenAI's chat completions and completions requests have is declared; each is
honoured, or exercised at a value that changes nothing (CHAT_NO_OPS, TEXT_NO_OPS), and every
field edgetp takes at fewer values than OpenAI is refused at one (REFUSED).
tests/test_bridge_server.py sends these tables to a real server with the `openai` client.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from openai.types import completion_create_params as text_params
from openai.types.chat import (
    chat_completion_assistant_message_param,
    chat_completion_content_part_text_param,
    chat_completion_developer_message_param,
    chat_completion_function_message_param,
    chat_completion_stream_options_param,
    chat_completion_system_message_param,
    chat_completion_tool_message_param,
    chat_completion_user_message_param,
)
from openai.types.chat import completion_create_params as chat_params
from pydantic import BaseModel

from edgetp.master.bridge.request import (
    ChatCompletionRequest,
    CompletionRequest,
    narrowed,
    warn_ignored,
)
from edgetp.master.bridge.request_parts import ChatMessage, StreamOptions, TextPart

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
# Every field of OpenAI's requests that edgetp does not honour, at a value that asks for nothing
# more than leaving it out.
CHAT_NO_OPS: dict[str, Any] = {
    "n": 1, "logprobs": False, "top_logprobs": 0, "presence_penalty": 0, "frequency_penalty": 0,
    "response_format": {"type": "text"}, "parallel_tool_calls": True, "user": "user-1",
    "store": False, "metadata": {"team": "edge"}, "service_tier": "auto", "logit_bias": {},
    "stream_options": {"include_usage": True, "include_obfuscation": True}, "seed": 3,
    "tool_choice": "none", "tools": [], "modalities": ["text"], "reasoning_effort": "low",
    "prediction": {"type": "content", "content": "The sky is blue"}, "audio": None,
    "function_call": "none", "functions": [], "moderation": None, "verbosity": "medium",
    "web_search_options": None, "prompt_cache_key": "k1", "prompt_cache_retention": "24h",
    "prompt_cache_options": {"mode": "implicit", "ttl": "30m"}, "safety_identifier": "s1",
}  # fmt: skip
TEXT_NO_OPS: dict[str, Any] = {
    "n": 1, "best_of": 1, "echo": False, "logprobs": None, "suffix": "", "logit_bias": None,
    "presence_penalty": 0, "frequency_penalty": 0, "user": "user-1", "seed": 3,
    "stream_options": {"include_usage": False},
}  # fmt: skip
# What edgetp does with them; `model` names the served model, `messages` and `prompt` are it.
HONOURED = {"model", "temperature", "top_p", "max_tokens", "max_completion_tokens", "stop"}
HONOURED |= {"stream", "stream_options", "seed", "echo", "messages", "prompt", "n", "logprobs"}
HONOURED |= {"top_logprobs", "presence_penalty", "frequency_penalty", "response_format"}
HONOURED |= {"tools", "tool_choice", "parallel_tool_calls", "functions", "function_call"}
# (endpoint, fields, the param the 400 names): values edgetp cannot honour yet.
REFUSED = [
    ("chat", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true, as at OpenAI
    ("chat", {"n": 17}, "n"),
    ("chat", {"logit_bias": {"42": 5}}, "logit_bias"),
    ("chat", {"tools": [{"type": "custom", "custom": {"name": "sql"}}]}, "tools.0"),
    ("chat", {"tools": [TOOL], "tool_choice": {"type": "custom", "custom": {"name": "sql"}}},
     "tool_choice"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),  # no tools to call
    ("chat", {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     "tool_choice"),
    ("chat", {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice"),
    ("chat", {"tools": [TOOL], "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "required", "tools": [{"type": "function", "function": {"name": "x"}}]}}},
     "tool_choice"),
    ("chat", {"tools": [TOOL], "functions": [TOOL["function"]]}, "functions"),
    ("chat", {"function_call": {"name": "get_weather"}}, "function_call"),
    ("chat", {"audio": {"format": "wav", "voice": "alloy"}}, "audio"),
    ("chat", {"modalities": ["text", "audio"]}, "modalities"),
    ("chat", {"service_tier": "flex"}, "service_tier"),
    ("chat", {"store": True}, "store"),
    ("chat", {"verbosity": "low"}, "verbosity"),
    ("chat", {"web_search_options": {}}, "web_search_options"),
    ("chat", {"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
    ("chat", {"messages": [{"role": "assistant", "content": "", "refusal": "No."}]},
     "messages.0.refusal"),
    ("chat", {"messages": [{"role": "assistant", "content": "", "audio": {"id": "a1"}}]},
     "messages.0.audio"),
    ("text", {"best_of": 2}, "best_of"),
    ("text", {"n": 100}, "n"),
    ("text", {"echo": True, "logprobs": 1}, "echo"),
    ("text", {"suffix": "The end."}, "suffix"),
    ("text", {"logit_bias": {"42": -100}}, "logit_bias"),
]  # fmt: skip
REQUESTS = {"chat": ChatCompletionRequest, "text": CompletionRequest}
BASE: dict[str, dict[str, Any]] = {
    "chat": {"messages": [{"role": "user", "content": "hi"}]},
    "text": {"prompt": "hi"},
}


def keys(typed_dict: Any) -> set[str]:
    return set(typed_dict.__required_keys__ | typed_dict.__optional_keys__)


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (ChatCompletionRequest, [chat_params.CompletionCreateParamsNonStreaming]),
        (CompletionRequest, [text_params.CompletionCreateParamsNonStreaming]),
        (StreamOptions, [chat_completion_stream_options_param.ChatCompletionStreamOptionsParam]),
        (TextPart, [chat_completion_content_part_text_param.ChatCompletionContentPartTextParam]),
        (
            ChatMessage,
            [
                chat_completion_system_message_param.ChatCompletionSystemMessageParam,
                chat_completion_developer_message_param.ChatCompletionDeveloperMessageParam,
                chat_completion_user_message_param.ChatCompletionUserMessageParam,
                chat_completion_assistant_message_param.ChatCompletionAssistantMessageParam,
                chat_completion_tool_message_param.ChatCompletionToolMessageParam,
                chat_completion_function_message_param.ChatCompletionFunctionMessageParam,
            ],
        ),
    ],
)
def test_every_openai_field_is_declared(ours: type[BaseModel], theirs: list[Any]) -> None:
    missing = set().union(*map(keys, theirs)) - set(ours.model_fields)
    assert not missing, f"{ours.__name__} lacks OpenAI's {sorted(missing)}"


@pytest.mark.parametrize(
    ("endpoint", "theirs", "no_ops"),
    [
        ("chat", chat_params.CompletionCreateParamsNonStreaming, CHAT_NO_OPS),
        ("text", text_params.CompletionCreateParamsNonStreaming, TEXT_NO_OPS),
    ],
)
def test_every_field_is_honoured_or_exercised(endpoint: str, theirs: Any, no_ops: dict) -> None:
    """A field is honoured or sent at a no-op value, and one edgetp narrows is refused."""
    assert keys(theirs) - HONOURED <= set(no_ops)
    REQUESTS[endpoint].model_validate(BASE[endpoint] | no_ops)
    narrow = {name for name, info in REQUESTS[endpoint].model_fields.items() if narrowed(info)}
    if endpoint == "chat":
        narrow |= {f"messages.0.{n}" for n, i in ChatMessage.model_fields.items() if narrowed(i)}
    assert narrow <= {param for e, _, param in REFUSED if e == endpoint}


@pytest.mark.parametrize(("endpoint", "fields", "param"), REFUSED)
def test_refused_by_the_schema_or_the_combination(endpoint: str, fields: dict, param: str) -> None:
    try:
        request = REQUESTS[endpoint].model_validate(BASE[endpoint] | fields)
    except ValueError as exc:
        assert param.split(".")[0] in str(exc)
        return
    assert isinstance(request, ChatCompletionRequest | CompletionRequest), "the schema took it"
    assert (request.unserved(None) or ("",))[0] == param


def test_a_reasoning_effort_is_refused_only_for_a_model_that_reasons() -> None:
    request = ChatCompletionRequest.model_validate(BASE["chat"] | {"reasoning_effort": "high"})
    assert request.unserved("{{ messages[0].content }}") is None
    for template in ("{% if enable_thinking %}", "<think>\n\n</think>", "{{ reasoning_effort }}"):
        param, message = request.unserved(template) or ("", "")
        assert param == "reasoning_effort" and "'high' is not supported" in message


def test_unknown_fields_make_one_warning_line_a_request(caplog: pytest.LogCaptureFixture) -> None:
    body = {"messages": [{"role": "user", "content": "hi", "mood": 1}], "typical_p": 0.1}
    many = ChatCompletionRequest.model_validate(body | {f"x{i}": i for i in range(11)})
    nested = ChatCompletionRequest.model_validate({"messages": body["messages"]})
    with caplog.at_level(logging.WARNING):
        warn_ignored(many, "/v1/chat/completions")
        warn_ignored(nested, "/v1/chat/completions")
        warn_ignored(ChatCompletionRequest.model_validate(BASE["chat"]), "/v1/chat/completions")
    first, second = (r.getMessage() for r in caplog.records)
    assert "'typical_p'" in first and "'x8'" in first and "'x9'" not in first and "3 more" in first
    assert "'messages.0.mood'" in second


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_the_sampling_fields_served_are_held_to_openais_ranges(fields: dict, param: str) -> None:
    with pytest.raises(ValueError, match=param):
        ChatCompletionRequest.model_validate(BASE["chat"] | fields)
    with pytest.raises(ValueError, match="logprobs"):
        CompletionRequest.model_validate(BASE["text"] | {"logprobs": 21})


@pytest.mark.parametrize("field", ["logprobs", "store"])
@pytest.mark.parametrize("value", [0, 0.0])
def test_only_false_is_false(field: str, value: float) -> None:
    """Literal[False] alone takes 0 and 0.0, which equal False: a JSON number is not false."""
    with pytest.raises(ValueError, match=field):
        ChatCompletionRequest.model_validate(BASE["chat"] | {field: value})
