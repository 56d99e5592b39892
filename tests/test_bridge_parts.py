"""A chat answer split into reasoning, content and tool calls (master/bridge/output.py), each
family's call format read, written and forced by its grammar (tool_calls.py), and the prompt
that shows the model its tools (tools.py), without a server.

Streams are fed as the batcher sends them: the text of one SmolLM2 token at a time, and one
character at a time; each must split as the whole answer does.
"""

from __future__ import annotations

import asyncio
import copy
import json

import pytest

from edgetp.master.bridge.answers import Answer, Choice, sse, whole
from edgetp.master.bridge.output import Part, Split, Splitter
from edgetp.master.bridge.request import ChatCompletionRequest
from edgetp.master.bridge.tool_calls import (
    FORMATS,
    BareJsonCall,
    BracketedCalls,
    Function,
    TaggedCalls,
    format_for,
)
from edgetp.master.bridge.tools import (
    TOOLS_PROMPT,
    answer_grammar,
    call_format,
    chat_prompt,
    closed,
    opens_thinking,
    renders_tools,
    tool_use,
)
from edgetp.master.generation.batcher import Delta, Finished, Ticket
from edgetp.master.generation.grammar import Constraint
from edgetp.master.generation.prompts import chat_tokens

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}


def streamed(splitter: Splitter, pieces: list[str]) -> list[Part]:
    parts = [p for piece in pieces for p in splitter.feed(piece)]
    return parts + splitter.finish()


def by_token(tokenizer, text: str) -> list[str]:
    """`text` as the batcher streams it: each token's text as it completes."""
    tokens = tokenizer.encode(text, add_bos=False)
    said = [tokenizer.decode(tokens[: i + 1]) for i in range(len(tokens))]
    return [b[len(a) :] for a, b in zip(["", *said], said, strict=False)]


def joined(parts: list[Part]) -> dict[str, object]:
    """The parts as an answer carries them: text of each kind joined, calls listed."""
    return {
        "content": "".join(p.text for p in parts if p.kind == "content"),
        "reasoning": "".join(p.text for p in parts if p.kind == "reasoning"),
        "calls": [(p.call.name, json.loads(p.call.arguments)) for p in parts if p.call],
    }


def split_every_way(tokenizer, text: str, **options) -> dict[str, object]:
    """The parts of `text` whole, by token and by character: the same each way."""
    whole = joined(streamed(Splitter(**options), [text]))
    assert joined(streamed(Splitter(**options), by_token(tokenizer, text))) == whole
    assert joined(streamed(Splitter(**options), list(text))) == whole
    return whole


@pytest.mark.parametrize(
    ("text", "thinking", "reasoning", "content"),
    [
        ("<think>\nTwo and two.\n</think>\n\nIt is 4.", False, "\nTwo and two.\n", "It is 4."),
        ("Two and two.</think>It is 4.", True, "Two and two.", "It is 4."),  # opened by the prompt
        ("<think>Still weighing it", False, "Still weighing it", ""),  # cut by max_tokens
        ("It is 4. <think> is a tag.", False, "", "It is 4. <think> is a tag."),  # after content
        ("a < b </thin", False, "", "a < b </thin"),  # a mark's beginning, never finished
    ],
)
def test_reasoning_is_split_from_content(smollm2_tokenizer, text, thinking, reasoning, content):
    parts = split_every_way(smollm2_tokenizer, text, reasoning=True, thinking=thinking)
    assert parts == {"content": content, "reasoning": reasoning, "calls": []}


THINKING = [Delta("<thi"), Delta("nk>Two and"), Delta(" two.</th"), Delta("ink>\n\nFour"),
            Delta("."), Finished("stop", 5, 7)]  # fmt: skip


def streamed_chunks(answer: Answer, events: list) -> list[dict]:
    """The chunks `sse` sends for one choice's events, as JSON."""

    async def run() -> list[str]:
        queue: asyncio.Queue = asyncio.Queue()
        for event in events[1:]:
            queue.put_nowait((0, event))
        ticket = Ticket(None, [], answer.rid)  # type: ignore[arg-type]  # no jobs to cancel
        return [text async for text in sse(answer, 1, (0, events[0]), queue, ticket, False)]

    lines = "".join(asyncio.run(run())).split("\n\n")
    return [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: {")]


def test_a_thinking_models_reasoning_is_reasoning_content(smollm2_tokenizer):
    """The field the chat app and clients read, streamed and whole, named as vLLM and
    DeepSeek name it."""
    answer = Answer(
        "chat", "chatcmpl-1", "m", smollm2_tokenizer, False, split=Split(reasoning=True)
    )
    deltas = [c["choices"][0]["delta"] for c in streamed_chunks(answer, THINKING)]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Two and two."
    assert "".join(d.get("content", "") for d in deltas) == "Four."
    done = Choice(pieces=[e.text for e in THINKING[:-1]], done=THINKING[-1])
    message = json.loads(whole(answer, [done]).model_dump_json())["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Four.", "reasoning_content": "Two and two."}
    plain = Answer("chat", "chatcmpl-2", "m", smollm2_tokenizer, False)  # no split: as before
    message = json.loads(whole(plain, [done]).model_dump_json())["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "".join(done.pieces)}


def test_without_reasoning_or_tools_text_stays_text(smollm2_tokenizer):
    text = "<think>x</think> <tool_call>{}</tool_call>"
    assert split_every_way(smollm2_tokenizer, text)["content"] == text


ARGS = {"city": "Oslo", "days": 2}
WEATHER_CALL = {"name": "get_weather", "arguments": ARGS}
TIME_CALL = {"name": "get_time", "arguments": {}}
HERMES_CALLS = (
    f"Let me look.\n<tool_call>\n{json.dumps(WEATHER_CALL)}\n</tool_call>\n"
    f"<tool_call>{json.dumps(TIME_CALL)}</tool_call>"
)
LLAMA_CALLS = (
    f"<|python_tag|>{json.dumps({'name': 'get_weather', 'parameters': ARGS})}; "
    f"{json.dumps({'name': 'get_time', 'parameters': {}})}"
)


@pytest.mark.parametrize(
    ("fmt", "text", "content"),
    [
        (TaggedCalls(), HERMES_CALLS, "Let me look.\n"),
        (TaggedCalls(), f"<tool_call>\n{json.dumps(WEATHER_CALL)}\n</tool_", ""),
        (BareJsonCall(), LLAMA_CALLS, ""),
        (BracketedCalls(), f"[TOOL_CALLS]{json.dumps([WEATHER_CALL, TIME_CALL])}", ""),
        (BracketedCalls(), f"[TOOL_CALLS]get_weather[ARGS]{json.dumps(ARGS)}"
                    "[TOOL_CALLS]get_time[ARGS]{}", ""),
    ],
    ids=["hermes", "hermes-cut-in-its-closing-mark", "llama3", "mistral", "mistral-v11"],
)  # fmt: skip
def test_each_family_calls_are_read_as_they_stream(smollm2_tokenizer, fmt, text, content):
    parts = split_every_way(smollm2_tokenizer, text, calls=fmt)
    calls = [("get_weather", ARGS), ("get_time", {})][: 1 if text.endswith("</tool_") else 2]
    assert parts == {"content": content, "reasoning": "", "calls": calls}
    one = split_every_way(smollm2_tokenizer, text, calls=fmt, max_calls=1)  # not parallel
    assert one["calls"] == calls[:1]


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        (TaggedCalls(), "<tool_call>\nnot json\n</tool_call> and more"),
        (BareJsonCall(), '{"a json answer": "not a call"}'),
        (BareJsonCall(), '{"name": "Ann", "age": 31}'),
        (BracketedCalls(), "[TOOL_CALLS] never mind"),
    ],
)
def test_what_looks_like_a_call_but_does_not_parse_stays_text(smollm2_tokenizer, fmt, text):
    assert split_every_way(smollm2_tokenizer, text, calls=fmt)["content"] == text


def test_a_call_written_while_reasoning_is_reasoning(smollm2_tokenizer):
    call = json.dumps({"name": "get_weather", "arguments": ARGS})
    text = f"<think>Maybe <tool_call>{call}</tool_call>?</think>\n<tool_call>{call}</tool_call>"
    parts = split_every_way(smollm2_tokenizer, text, calls=TaggedCalls(), reasoning=True)
    assert parts == {
        "content": "",
        "reasoning": f"Maybe <tool_call>{call}</tool_call>?",
        "calls": [("get_weather", ARGS)],
    }
    assert BareJsonCall().read(' {"name": "f", "parameters": {}} x') is None  # text after a call


def test_a_prompt_that_opens_a_think_block_starts_the_answer_in_it(smollm2_tokenizer):
    said = smollm2_tokenizer.encode("<|im_start|>assistant\n<think>\n", add_bos=False)
    assert opens_thinking(smollm2_tokenizer, said)
    done = smollm2_tokenizer.encode("<think>\n\n</think>\n\n", add_bos=False)
    assert not opens_thinking(smollm2_tokenizer, done)


@pytest.mark.parametrize(
    ("template", "family"),
    [
        ("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}", BracketedCalls),
        ("{% if tools %}<tool_call>{% endif %}", TaggedCalls),
        ('<|start_header_id|>ipython{{ "parameters" }}<|python_tag|>', BareJsonCall),
        ("{{ messages }}", TaggedCalls),  # shows no format: the one edgetp describes
    ],
)
def test_the_family_is_the_templates(template, family):
    assert isinstance(format_for(template), family)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("parallel", [False, True])
def test_a_forced_call_is_one_the_family_writes_and_reads(smollm2_tokenizer, fmt, parallel):
    """Each grammar takes the family's own call, and its reader reads it back; it refuses a
    call of another function, or arguments its schema does not allow."""
    functions = [Function("get_weather", closed(WEATHER)), Function("get_time", closed({}))]
    grammar = f"start: calls\n{fmt.grammar(functions, parallel, smollm2_tokenizer)}"

    def takes(text: str) -> bool:
        tokens = smollm2_tokenizer.encode(text, add_bos=False)
        constraint = Constraint(smollm2_tokenizer, grammar)
        if constraint.allowed_prefix(tokens) != tokens:
            return False
        for token in tokens:
            constraint.accept(token)
        allowed = constraint.allowed(smollm2_tokenizer.vocab_size)
        return any(allowed[t] for t in smollm2_tokenizer.eos_ids)  # complete: it may end

    calls = [("get_weather", ARGS), ("get_time", {})]
    written = fmt.write(calls[:1])
    assert takes(written)
    read = fmt.read(written)
    assert read is not None and [(c.name, json.loads(c.arguments)) for c in read] == calls[:1]
    assert takes(fmt.write(calls)) == parallel
    assert not takes(fmt.write([("get_news", {})]))
    assert not takes(fmt.write([("get_weather", {"town": "Oslo"})]))  # closed: no other keys


def test_closing_a_schema_keeps_its_meaning_elsewhere():
    schema = {
        "type": "object",
        "properties": {"properties": {"type": "object", "properties": {"a": {}}}},
        "$defs": {"x": {"properties": {}}},
        "allOf": [{"properties": {"b": {}}}],
        "additionalProperties": True,
    }
    done = closed(schema)
    assert done["additionalProperties"] is True  # said: kept
    assert done["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in done["properties"]  # a name, not a schema
    assert done["$defs"]["x"]["additionalProperties"] is False
    assert done["allOf"] == schema["allOf"]


def request(**fields) -> ChatCompletionRequest:
    messages = fields.pop("messages", [{"role": "user", "content": "Weather in Oslo?"}])
    return ChatCompletionRequest.model_validate({"messages": messages, **fields})


def test_a_request_without_tools_has_the_prompt_it_had(smollm2_tokenizer):
    """Token for token what master.generation.prompts.chat_tokens renders, as before tools."""
    turns = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                     {"type": "text", "text": "!"}]},
        {"role": "assistant", "content": "Hello.", "name": "bot"},
        {"role": "user", "content": "Why is the sky blue?"},
    ]  # fmt: skip
    body = request(messages=turns, tools=[TOOL], tool_choice="none")
    assert tool_use(body) is None
    as_before = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi !"},
        {"role": "assistant", "content": "Hello.", "name": "bot"},
        {"role": "user", "content": "Why is the sky blue?"},
    ]
    ours = chat_prompt(smollm2_tokenizer, body.messages, None, None)
    assert ours == chat_tokens(smollm2_tokenizer, as_before)
    assert answer_grammar(body, None, TaggedCalls(), smollm2_tokenizer) == (None, "response_format")


ROUND_TRIP = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "windy"},
]  # fmt: skip


def test_a_template_without_tools_gets_them_in_hermes_words(smollm2_tokenizer):
    assert not renders_tools(smollm2_tokenizer.chat_template)
    body = request(messages=ROUND_TRIP, tools=[TOOL], tool_choice="required")
    use = tool_use(body)
    assert use is not None and use.required and not use.parallel
    text = smollm2_tokenizer.decode(chat_prompt(smollm2_tokenizer, body.messages, use, None))
    block = TOOLS_PROMPT.format(tools=json.dumps(TOOL))
    assert text.startswith(f"<|im_start|>system\n{block}<|im_end|>\n<|im_start|>user\nWeather")
    call = json.dumps({"name": "get_weather", "arguments": ARGS})
    assert f"<|im_start|>assistant\n<tool_call>\n{call}\n</tool_call><|im_end|>" in text
    results = "<tool_response>\n18 C\n</tool_response>\n<tool_response>\nwindy\n</tool_response>"
    assert text.endswith(f"<|im_start|>user\n{results}<|im_end|>\n<|im_start|>assistant\n")


# A template of Qwen2.5's kind that shows tools, calls and results itself.
TOOLS_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools><|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant' }}
{%- for call in message.tool_calls %}
{{- '\\n<tool_call>\\n'
    + ({'name': call.function.name, 'arguments': call.function.arguments} | tojson)
    + '\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content
    + '\\n</tool_response><|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""


@pytest.mark.slow
def test_a_template_with_tools_renders_them_as_transformers_does(smollm2_tokenizer):
    chat_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    tokenizer = copy.copy(smollm2_tokenizer)
    tokenizer.chat_template = TOOLS_TEMPLATE
    assert renders_tools(TOOLS_TEMPLATE) and isinstance(call_format(TOOLS_TEMPLATE), TaggedCalls)
    body = request(messages=ROUND_TRIP, tools=[TOOL])
    ours = tokenizer.decode(chat_prompt(tokenizer, body.messages, tool_use(body), None))
    theirs = copy.deepcopy(ROUND_TRIP)
    theirs[1]["content"] = ""
    theirs[1]["tool_calls"][0]["function"]["arguments"] = ARGS  # a template takes the value
    rendered, _ = chat_utils.render_jinja_template(
        conversations=[theirs], tools=[TOOL], chat_template=TOOLS_TEMPLATE,
        add_generation_prompt=True,
    )  # fmt: skip
    assert ours == rendered[0]
    assert '"name": "get_weather", "arguments": {"city": "Oslo"' in ours


def test_auto_with_a_response_format_takes_the_json_or_a_call(smollm2_tokenizer):
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}}
    form = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    body = request(tools=[TOOL], response_format=form)
    use = tool_use(body)
    grammar, field = answer_grammar(body, use, TaggedCalls(), smollm2_tokenizer)
    assert field == "tools" and grammar is not None

    def takes(text: str) -> bool:
        tokens = smollm2_tokenizer.encode(text, add_bos=False)
        return Constraint(smollm2_tokenizer, grammar).allowed_prefix(tokens) == tokens

    assert takes('{"answer": "18 C"}') and takes(TaggedCalls().write([("get_weather", ARGS)]))
    assert not takes('{"answer": "18 C", "more": 1}')  # closed, as the schema lists its keys
    assert not takes("It is 18 C.")
    required = request(tools=[TOOL], response_format=form, tool_choice="required")
    forced, _ = answer_grammar(required, tool_use(required), TaggedCalls(), smollm2_tokenizer)
    assert forced is not None and forced.startswith("start: calls\n")
