"""`edgetp serve`'s options: what it cannot do is refused with one clear line before any weights
load; what it takes reaches the server it starts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from http_client import HTTP
from test_cli import assert_clear_error, run

from edgetp.master.bridge.client import start_server


def test_a_taken_port_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = run("serve", "--port", str(port))
    assert_clear_error(result, f"cannot listen on 127.0.0.1:{port}", "pick another --port")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--max-batch", "0"], "--max-batch must be at least 1"),
        (["--api-key", " "], "--api-key is empty"),
        (["--port", "70000"], "--port must be in 0..65535"),
        (["--host", "no-such-host.invalid"], "does not resolve"),
    ],
)
def test_bad_options_are_clear_errors(args, needle):
    assert_clear_error(run("serve", *args), needle)


def test_option_errors_come_before_the_weights_code_is_imported():
    """The checks run before torch and the model code are imported (seconds on a small CPU),
    so a mistyped option or model path is answered at once."""
    code = (
        "import sys\n"
        "from edgetp.tui.cli import main\n"
        "assert main(['serve', '--port', '70000']) == 1\n"
        "assert main(['serve', '--api-key', ' ']) == 1\n"
        "assert main(['serve', '--model', '/nonexistent.gguf']) == 1\n"
        "assert main(['run', '--model', '/nonexistent.gguf', 'hi']) == 1\n"
        "assert main(['run', ' ']) == 1\n"
        "assert main(['run', '--top-p', '0', 'hi']) == 1\n"
        "import os; os.environ['EDGETP_API_KEY'] = ' '\n"
        "assert main(['serve']) == 1\n"
        "print(sorted({'torch', 'edgetp.master.cluster.session', 'uvicorn'} & set(sys.modules)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=os.environ
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result
    assert result.stderr.count("edgetp: error: ") == 7, result.stderr
    assert "the prompt is empty" in result.stderr and "top_p must be in" in result.stderr
    assert result.stderr.count("--api-key is empty") == 2, result.stderr
    assert result.stderr.count("model not found: /nonexistent.gguf") == 2, result.stderr


def reused_in_a_conversation(shared_state, *flags: str) -> tuple[int, int, str, int]:
    """A two-turn conversation, the second turn carrying the first and its answer, through a
    server of its own with `flags`: /v1/cluster's reused tokens, the second turn's prompt
    tokens, its greedy answer, and /v1/cluster's prefill chunk."""
    args = ["--local-nodes", "1", "--context", "256", "--state-dir", str(shared_state)]
    server = start_server([*args, *flags])
    try:
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="-", max_retries=0)
        messages = [{"role": "user", "content": "Name a color."}]
        first = client.chat.completions.create(
            messages=messages, model="smollm2-135m-instruct", temperature=0, max_tokens=8
        )
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content or ""},
            {"role": "user", "content": "And another one?"},
        ]
        second = client.chat.completions.create(
            messages=messages, model="smollm2-135m-instruct", temperature=0, max_tokens=8
        )
        figures = HTTP.get(f"{server.base}/v1/cluster", timeout=30).json()["generation"]
        assert second.usage is not None
        text = second.choices[0].message.content or ""
        return figures["reused_tokens"], second.usage.prompt_tokens, text, figures["prefill_chunk"]
    finally:
        server.stop()


@pytest.mark.slow
def test_no_prompt_reuse_prefills_every_turn_whole(shared_state):
    """With --no-prompt-reuse the second turn of a conversation reuses nothing of the first's
    KV cache; without it, the first turn's tokens; the answer is the same either way. With
    --prefill-chunk-ms 0 too, prompts prefill whole beside decoding ones: no chunk is sized."""
    off_flags = ("--no-prompt-reuse", "--prefill-chunk-ms", "0")
    with ThreadPoolExecutor(2) as pool:  # the two servers start side by side
        off = pool.submit(reused_in_a_conversation, shared_state, *off_flags)
        on = pool.submit(reused_in_a_conversation, shared_state)
        (reused_off, prompt, text_off, chunk_off), (reused_on, _, text_on, chunk_on) = (
            off.result(),
            on.result(),
        )
    print(f"second turn: {prompt} prompt tokens; reused {reused_on} with reuse, {reused_off} "
          f"without")  # fmt: skip
    assert reused_off == 0
    assert 10 < reused_on < prompt
    assert text_off == text_on
    assert chunk_off == 0 and chunk_on > 0
