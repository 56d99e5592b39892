"""Each API's request translated into the bridge's one internal request (master/bridge/core.py),
without a server: Anthropic's blocks, Responses' items and Ollama's messages become the same
chat messages, calls and results, and their tool choices the same forced choices."""

from __future__ import annotations

import json

import pytest

from edgetp.master.bridge import anthropic, ollama, responses
from edgetp.master.bridge.core import chat_request
from edgetp.master.bridge.errors import APIError

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
]


def test_anthropic_blocks_become_the_chat_messages():
    body = anthropic.MessagesRequest.model_validate(
        {
            "max_tokens": 8,
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "call_1", "name": "get_weather",
                     "input": {"city": "Oslo"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "call_1", "content": "18 C"}]},
            ],
            "tools": [{"name": "get_weather", "input_schema": SCHEMA}],
            "tool_choice": {"type": "tool", "name": "get_weather",
                            "disable_parallel_tool_use": True},
            "stop_sequences": ["\n\n"],
        }
    )  # fmt: skip
    fields = anthropic.internal(body, None)
    assert fields["messages"] == CONVERSATION
    assert fields["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert fields["parallel_tool_calls"] is False and fields["stop"] == ["\n\n"]
    assert fields["tools"][0]["function"]["parameters"] == SCHEMA
    chat_request(fields, "messages")  # a valid internal request
    any_ = body.model_copy(update={"tool_choice": anthropic.ToolChoice(type="any")})
    assert anthropic.internal(any_, None)["tool_choice"] == "required"


def test_responses_items_become_the_chat_messages():
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
    ]  # fmt: skip
    body = responses.ResponsesRequest.model_validate(
        {"input": items, "instructions": "Be brief.", "tools": [
            {"type": "function", "name": "get_weather", "parameters": SCHEMA}],
         "tool_choice": {"type": "function", "name": "get_weather"},
         "text": {"format": {"type": "json_schema", "name": "w", "schema": SCHEMA}},
         "max_output_tokens": 9}
    )  # fmt: skip
    fields = responses.internal(body, [])
    assert fields["messages"] == CONVERSATION
    assert fields["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert fields["response_format"]["json_schema"]["schema"] == SCHEMA
    assert fields["max_tokens"] == 9
    chat_request(fields, "input")


@pytest.mark.parametrize(
    ("items", "param"),
    [
        ([{"type": "web_search_call"}], "input.0.type"),
        ([{"role": "robot", "content": "hi"}], "input.0.role"),
        ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input.0.call_id"),
        ([{"role": "user", "content": [{"type": "input_image"}]}], "input.0.content.0"),
    ],
)
def test_a_responses_item_edgetp_cannot_take_is_a_400_naming_it(items, param):
    with pytest.raises(APIError) as refused:
        responses.messages_of(items)
    assert refused.value.status == 400 and refused.value.body.error.param == param


def test_ollama_messages_and_options_become_the_internal_request():
    body = ollama.ChatRequest.model_validate(
        {"model": "m", "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "content": "18 C", "tool_name": "get_weather"}],
         "options": {"num_predict": 5, "temperature": 0, "top_k": 3, "seed": 1,
                     "stop": ["x"], "repeat_penalty": 1.1},
         "format": "json"}
    )  # fmt: skip
    fields = ollama.chat_fields(body, None)
    said = [(m["role"], m["content"]) for m in fields["messages"]]
    assert said == [(m["role"], m["content"]) for m in CONVERSATION]
    call = fields["messages"][2]["tool_calls"][0]
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    assert fields["messages"][3]["tool_call_id"] == call["id"]
    assert fields["max_tokens"] == 5 and fields["top_k"] == 3 and fields["stop"] == ["x"]
    assert fields["repetition_penalty"] == 1.1
    assert fields["response_format"] == {"type": "json_object"}
    chat_request(fields, "messages")
