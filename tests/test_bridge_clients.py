"""Structured output and tools through the clients people use, unmodified, against a real
`edgetp serve` on the bundled SmolLM2: the `openai` client (create, parse, stream), instructor,
LangChain's ChatOpenAI and LlamaIndex's OpenAILike. One node: what is tested is the bridge and
the master's grammar mask, which a split does not change.

SmolLM2's chat template shows no tools, so these run the Hermes system prompt and format
(master/bridge/tools.py); a forced call and a JSON schema are grammars, so even this 135M model
answers with JSON that parses and validates.
"""

from __future__ import annotations

import http.client
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import instructor
import jsonschema
import openai
import pytest
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from llama_index.core.llms import ChatMessage as LlamaMessage
from llama_index.core.tools import FunctionTool
from llama_index.llms.openai_like import OpenAILike
from pydantic import BaseModel

from edgetp.master.bridge.client import start_server

pytestmark = pytest.mark.slow

KEY = "test-key-clients"
MODEL = "smollm2-135m-instruct"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
}
GET_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather forecast for a city",
        "parameters": WEATHER,
    },
}
GET_TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CITIES = (
    "Paris Oslo Rome Lima Cairo Tokyo Delhi Quito Madrid Berlin Vienna Prague Dublin Lisbon "
    "Athens Warsaw Sofia Riga Tallinn Vilnius Helsinki Stockholm Copenhagen Amsterdam Brussels "
    "Bern Zagreb Belgrade Bucharest Budapest Ankara Tehran Baghdad Riyadh Doha Nairobi Lagos "
    "Accra Dakar Tunis Algiers Rabat Havana Bogota Caracas Santiago Montevideo Asuncion Ottawa "
    "Canberra"
).split()
CALL_TOKENS = 64  # a Hermes call of get_weather: ~50 of SmolLM2's tokens


class Person(BaseModel):
    name: str
    age: int
    role: Literal["engineer", "teacher", "doctor"]


ANN = [{"role": "user", "content": "Ann is a 31 year old engineer."}]


class Bridge:
    def __init__(self, base: str, port: int) -> None:
        self.base = base
        self.port = port
        self.client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120)

    def largest_batch(self) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request("GET", "/health")
            return int(json.loads(conn.getresponse().read())["generation"]["largest_batch"])
        finally:
            conn.close()


@pytest.fixture(scope="module")
def bridge(shared_state):
    args = ["--local-nodes", "1", "--state-dir", str(shared_state), "--api-key", KEY]
    server = start_server([*args, "--context", "1024", "--max-batch", "16"])
    try:
        yield Bridge(server.base, server.port)
    finally:
        server.stop()


def ask(bridge: Bridge, messages: list, **fields):
    return bridge.client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, **fields
    )


# -- structured output --------------------------------------------------------------------------
def test_json_mode_and_a_json_schema_give_json_that_validates(bridge):
    schema = Person.model_json_schema()
    json_schema = {"name": "person", "schema": schema, "strict": True}
    # JSON mode, asked for JSON as OpenAI's guide says to.
    asked = [{"role": "user", "content": f"{ANN[0]['content']} Give her name and age as JSON."}]
    mode = ask(bridge, asked, max_tokens=60, response_format={"type": "json_object"})
    assert json.loads(mode.choices[0].message.content) == {"name": "Ann", "age": 31}
    answer = ask(bridge, ANN, max_tokens=60,
                 response_format={"type": "json_schema", "json_schema": json_schema})  # fmt: skip
    assert answer.choices[0].finish_reason == "stop"
    assert json.loads(answer.choices[0].message.content) == {
        "name": "Ann", "age": 31, "role": "engineer"
    }  # fmt: skip
    # Sampled choices of one batch, and a stream, each under the mask.
    sampled = bridge.client.chat.completions.create(
        model=MODEL, messages=ANN, max_tokens=60, temperature=1.0, seed=3, n=3,
        response_format={"type": "json_schema", "json_schema": json_schema},
    )  # fmt: skip
    for choice in sampled.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), schema)
    stream = bridge.client.chat.completions.create(
        model=MODEL, messages=ANN, max_tokens=60, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": json_schema},
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == answer.choices[0].message.content


def test_the_openai_client_parses_into_a_pydantic_model(bridge):
    done = bridge.client.chat.completions.parse(
        model=MODEL, messages=ANN, response_format=Person, temperature=0, max_tokens=60
    )
    assert done.choices[0].message.parsed == Person(name="Ann", age=31, role="engineer")


@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA])
def test_instructor_gets_its_model(bridge, mode):
    """TOOLS forces a call of the model's function (tool_choice by name); JSON_SCHEMA asks for
    a response_format."""
    client = instructor.from_openai(bridge.client, mode=mode)
    person = client.chat.completions.create(
        model=MODEL, response_model=Person, messages=ANN, temperature=0, max_tokens=60,
        max_retries=0,
    )  # fmt: skip
    assert person.model_dump() == {"name": "Ann", "age": 31, "role": "engineer"}


@pytest.mark.parametrize(
    ("fields", "param", "said"),
    [
        ({"response_format": {"type": "json_schema",
                               "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
         "response_format", "Invalid type: strin"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": 5}}}}}], "tool_choice": "required"},
         "tools", "the grammar cannot be used"),
    ],
)  # fmt: skip
def test_a_schema_llguidance_cannot_use_is_a_400_that_says_why(bridge, fields, param, said):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(bridge, ANN, max_tokens=4, **fields)
    assert caught.value.param == param
    assert caught.value.body["message"].startswith(param) and said in caught.value.body["message"]


# -- tools --------------------------------------------------------------------------------------
def weather_call(message) -> dict:
    """The one call in `message`, checked: get_weather's, arguments valid against its schema."""
    [call] = message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER)
    return arguments


def test_a_required_call_parses_and_validates_for_50_prompts_of_one_batch(bridge):
    prompts = [f"Will I need an umbrella in {c} in {i % 7 + 1} days?" for i, c in enumerate(CITIES)]
    assert len(set(prompts)) == 50

    def call(prompt: str):
        return ask(bridge, [{"role": "user", "content": prompt}], max_tokens=CALL_TOKENS,
                   tools=[GET_WEATHER], tool_choice="required")  # fmt: skip

    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(call, prompts))
    cities = []
    for answer in answers:
        [choice] = answer.choices
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        cities.append(weather_call(choice.message)["city"])
    assert len(set(cities)) > 40  # each prompt's own city, mostly: the calls read the prompt
    assert bridge.largest_batch() > 8  # submitted together, batched together


def test_a_call_its_result_and_the_answer_round_trip(bridge):
    asked = [{"role": "user", "content": "What is the weather in Oslo?"}]
    called = ask(bridge, asked, max_tokens=CALL_TOKENS, tools=[GET_WEATHER, GET_TIME],
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})  # fmt: skip
    message = called.choices[0].message
    assert weather_call(message)["city"] == "Oslo"
    conversation = [
        *asked,
        message.model_dump(exclude_none=True),  # content null, as the client returned it
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "18 C and sunny"},
    ]
    answer = ask(bridge, conversation, max_tokens=24, tools=[GET_WEATHER, GET_TIME])
    [choice] = answer.choices
    assert choice.finish_reason in ("stop", "length") and choice.message.tool_calls is None
    assert choice.message.content
    assert answer.usage.prompt_tokens > called.usage.prompt_tokens + 20  # the call and result


def test_auto_lets_the_model_answer_in_text(bridge):
    answer = ask(bridge, [{"role": "user", "content": "Say hello."}], max_tokens=12,
                 tools=[GET_WEATHER], tool_choice="auto")  # fmt: skip
    [choice] = answer.choices
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")


def test_tool_calls_stream_as_openai_streams_them(bridge):
    fields = {"max_tokens": CALL_TOKENS, "tools": [GET_WEATHER], "tool_choice": "required"}
    asked = [{"role": "user", "content": "Weather in Lima for 3 days?"}]
    whole = ask(bridge, asked, **fields).choices[0].message.tool_calls[0]
    chunks = [c.choices[0] for c in ask(bridge, asked, stream=True, **fields) if c.choices]
    calls = [c.delta.tool_calls[0] for c in chunks if c.delta.tool_calls]
    first, *rest = calls
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather" and first.function.arguments == ""
    assert all(c.index == 0 and c.id is None and c.function.name is None for c in rest)
    assert "".join(c.function.arguments for c in rest) == whole.function.arguments
    assert chunks[-1].finish_reason == "tool_calls"
    assert not any(c.delta.content for c in chunks)
    # The client's own accumulation of the stream.
    with bridge.client.chat.completions.stream(
        model=MODEL, messages=asked, temperature=0, **fields
    ) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.arguments == whole.function.arguments


def test_functions_the_older_form_call_by_function_call(bridge):
    asked = [{"role": "user", "content": "Weather in Rome?"}]
    answer = bridge.client.chat.completions.create(
        model=MODEL, messages=asked, temperature=0, max_tokens=CALL_TOKENS,
        functions=[GET_WEATHER["function"]], function_call={"name": "get_weather"},
    )  # fmt: skip
    [choice] = answer.choices
    assert choice.finish_reason == "function_call" and choice.message.tool_calls is None
    assert choice.message.function_call.name == "get_weather"
    jsonschema.validate(json.loads(choice.message.function_call.arguments), WEATHER)


# -- LangChain ----------------------------------------------------------------------------------
@tool
def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
    """Get the weather forecast for a city."""
    return "18 C"


@pytest.fixture(scope="module")
def chat_model(bridge) -> ChatOpenAI:
    # The bridge's address: nothing leaves this machine.
    return ChatOpenAI(
        base_url=f"{bridge.base}/v1", api_key=KEY, model=MODEL, temperature=0,
        max_tokens=CALL_TOKENS, max_retries=0, timeout=120,
    )  # fmt: skip


def test_langchain_binds_tools_and_gets_a_call(chat_model):
    said = chat_model.bind_tools([get_weather], tool_choice="required").invoke(
        "What is the weather in Oslo?"
    )
    [call] = said.tool_calls
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    assert call["args"]["city"] == "Oslo" and call["args"]["unit"] in ("celsius", "fahrenheit")
    assert said.response_metadata["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(chat_model, method):
    structured = chat_model.with_structured_output(Person, method=method)
    assert structured.invoke(ANN[0]["content"]) == Person(name="Ann", age=31, role="engineer")


@pytest.fixture(scope="module")
def llama_index_llm(bridge) -> OpenAILike:
    # LlamaIndex's class for a server that speaks OpenAI's API; the bridge's address.
    return OpenAILike(
        model=MODEL, api_base=f"{bridge.base}/v1", api_key=KEY, is_chat_model=True,
        is_function_calling_model=True, temperature=0, max_tokens=CALL_TOKENS, max_retries=0,
        timeout=120,
    )  # fmt: skip


def test_llama_index_chats_streams_and_completes(llama_index_llm, bridge):
    """LlamaIndex's chat, streamed chat and completion give what the openai client gets."""
    messages = [LlamaMessage(role="user", content="Name a colour.")]
    said = llama_index_llm.chat(messages).message.content
    expected = ask(bridge, [{"role": "user", "content": "Name a colour."}], max_tokens=CALL_TOKENS)
    assert said and said == expected.choices[0].message.content
    assert "".join(c.delta or "" for c in llama_index_llm.stream_chat(messages)) == said
    assert llama_index_llm.complete("The capital of France is").text


def weather_in(city: str) -> str:  # LlamaIndex reads the annotations: plain ones
    """Get the weather forecast for a city."""
    return "18 C"


def test_llama_index_calls_a_required_tool_and_fills_a_model(llama_index_llm):
    tool = FunctionTool.from_defaults(fn=weather_in, name="get_weather")
    said = llama_index_llm.chat_with_tools(
        [tool], user_msg="What is the weather in Oslo?", tool_required=True
    )
    [call] = llama_index_llm.get_tool_calls_from_response(said)
    assert call.tool_name == "get_weather" and call.tool_kwargs["city"] == "Oslo"
    structured = llama_index_llm.as_structured_llm(Person)
    answer = structured.chat([LlamaMessage(role="user", content=ANN[0]["content"])])
    assert answer.raw == Person(name="Ann", age=31, role="engineer")
