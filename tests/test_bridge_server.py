"""`edgetp serve` as people use it: a real server over a real two-process cluster.

The official `openai` client and curl talk to it over loopback HTTP. Greedy answers must equal
`edgetp run`'s for the same prompt; errors come in OpenAI's shape with the right status; a client
that disconnects mid-stream frees its slot before the next step; requests share steps. (Losing a
worker is tests/test_chat_app.py's last test: it needs a cluster of its own.)
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import openai
import pytest
from http_client import HTTP
from openai.types import completion_create_params as text_params
from openai.types.chat import completion_create_params as chat_params
from test_bridge_fields import CHAT_NO_OPS, REFUSED, TEXT_NO_OPS, TOOL
from waiting import wait_until

from edgetp.master.bridge.client import ServerProcess, start_server, stream_chat
from edgetp.master.cluster.engine import Engine
from edgetp.master.generation.embedding import embed_step
from edgetp.models.layers import Slice
from edgetp.node.kvcache import KVCache

pytestmark = pytest.mark.slow

KEY = "test-key-123"
CHAT_PROMPT = "Why is the sky blue?"
TEXT_PROMPT = "The capital of France is"
MAX_TOKENS = 24
EDGETP = Path(sys.executable).parent / "edgetp"


def edgetp_run(*args: str) -> subprocess.Popen[str]:
    cmd = [str(EDGETP)] if EDGETP.exists() else [sys.executable, "-m", "edgetp.tui.cli"]
    return subprocess.Popen(
        [*cmd, "run", "--max-tokens", str(MAX_TOKENS), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ,
    )


class Served:
    def __init__(self, server: ServerProcess, chat_reference: str, text_reference: str) -> None:
        self.server = server
        self.chat_reference = chat_reference
        self.text_reference = text_reference
        self.client = openai.OpenAI(
            base_url=f"{server.base}/v1", api_key=KEY, max_retries=0, timeout=60
        )

    def request(
        self,
        method: str,
        path: str,
        body: bytes | str | dict | None = None,
        key: str | None = KEY,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=60)
        try:
            payload = json.dumps(body) if isinstance(body, dict) else body
            h = {"Content-Type": "application/json", **(headers or {})}
            if key:
                h["Authorization"] = f"Bearer {key}"
            conn.request(method, path, payload, h)
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read())
        finally:
            conn.close()

    def generation(self) -> dict:
        status, body = self.request("GET", "/health")
        assert status == 200, body
        return body["generation"]


def words(line: str) -> str:
    """The answer's text an SSE line of a chat completion carries ("" for any other line)."""
    if not line.startswith("data: {"):
        return ""
    choices = json.loads(line[6:])["choices"]
    return (choices[0]["delta"].get("content") or "") if choices else ""


def cancelled_since(served: Served, before: dict) -> dict:
    """The generation figures once the server has cancelled a request since `before`."""
    return wait_until(
        lambda: (g := served.generation())["cancelled"] > before["cancelled"] and g,
        60,
        lambda: f"cancel at the server: {served.generation()}",
    )


@pytest.fixture(scope="module")
def served(shared_state):
    # The references run while the server loads: the machine has two cores to share.
    chat_ref = edgetp_run(CHAT_PROMPT)
    text_ref = edgetp_run("--raw", TEXT_PROMPT)
    args = ["--local-nodes", "2", "--state-dir", str(shared_state), "--api-key", KEY]
    server = start_server([*args, "--context", "512", "--max-batch", "4"], verbose=True)
    try:
        outs = [p.communicate(timeout=180) for p in (chat_ref, text_ref)]
        for p, (_, err) in zip((chat_ref, text_ref), outs, strict=True):
            assert p.returncode == 0, err
        yield Served(server, outs[0][0], outs[1][0])
    finally:
        for p in (chat_ref, text_ref):
            if p.poll() is None:
                p.kill()
        server.stop()


def test_openai_client_chat_stream_completions_and_models(served):
    client = served.client
    model = client.models.list().data[0].id
    assert model.endswith(".gguf")
    assert client.models.retrieve(model).id == model

    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": CHAT_PROMPT}],
        temperature=0,
        max_tokens=MAX_TOKENS,
        seed=1,
        n=1,
    )
    text = chat.choices[0].message.content
    assert text + "\n" == served.chat_reference  # the same greedy answer as `edgetp run`
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage.completion_tokens <= MAX_TOKENS
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens

    pieces, usage, finish = [], None, None
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": CHAT_PROMPT}],
        temperature=0,
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert len([p for p in pieces if p]) > 5  # it came in pieces
    assert "".join(pieces) == text
    assert finish == chat.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens

    done = client.completions.create(
        model=model, prompt=TEXT_PROMPT, temperature=0, max_tokens=MAX_TOKENS, stop=["\n\n\n"]
    )
    assert done.choices[0].text + "\n" == served.text_reference  # as `edgetp run --raw`
    assert done.usage.prompt_tokens == 5

    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=model, prompt=TEXT_PROMPT, temperature=0, max_tokens=MAX_TOKENS, stream=True
        )
    )
    assert streamed == done.choices[0].text


def test_sampling_with_a_seed_is_repeatable(served):
    def sample() -> str:
        return (
            served.client.chat.completions.create(
                model="smollm2-135m-instruct",  # the bundled name works as an alias
                messages=[{"role": "user", "content": "Tell me a joke."}],
                temperature=0.9,
                top_p=0.9,
                seed=7,
                max_tokens=12,
            )
            .choices[0]
            .message.content
        )

    assert sample() == sample()


def test_curl_streams_line_by_line(served):
    body = {
        "messages": [{"role": "user", "content": "Count from one to twenty in words."}],
        "temperature": 0,
        "max_tokens": 120,
        "ignore_eos": True,
        "stream": True,
    }
    curl = subprocess.Popen(
        [
            "curl",
            "-sSN",
            "--max-time",
            "60",
            f"{served.server.base}/v1/chat/completions",
            "-H",
            f"Authorization: Bearer {KEY}",
            "-H",
            "Content-Type: application/json",
            "-d",
            json.dumps(body),
        ],  # fmt: skip
        stdout=subprocess.PIPE,
        text=True,
    )
    lines = []
    at_first_word = None  # the server's generation figures when curl printed the first word
    assert curl.stdout is not None
    for line in curl.stdout:  # as curl prints them
        lines.append(line.rstrip("\n"))
        if at_first_word is None and words(line):
            at_first_word = served.generation()
    assert curl.wait(timeout=10) == 0
    # a keep-alive comment may come first if the prefill is slow (a loaded machine)
    events = [line for line in lines if line and line != ": keep-alive"]
    assert all(line.startswith("data: ") for line in events), events
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    content = [line for line in events if words(line)]
    # Line by line: the first word reached curl while the server still had 100-odd tokens of
    # the answer to make (not in one burst once it was done), and the rest came as lines too.
    assert at_first_word is not None and at_first_word["active"] == 1, at_first_word
    assert len(content) > 100, events


@pytest.mark.parametrize(
    ("body", "status", "needle", "param"),
    [
        (b"{not json", 400, "not valid JSON", None),
        (b"[1, 2]", 400, "must be a JSON object", None),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400,
         "temperature: Input should be a valid number", "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": 3}, 400,
         "less than or equal to 2", "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400,
         "greater than 0", "top_p"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, 400, "n:", "n"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400,
         "max_tokens", "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, 400,
         "tool_choice: \"required\" is not supported", "tool_choice"),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": 5}, 400,
         "stop must be a string or a list of strings", "stop"),
        ({"messages": [{"role": "user", "content": "hi"}]}, 400, None, None),  # fine: 200 below
        ({"messages": [{"role": "user", "content": "hi"}],
          "chat_template_kwargs": {"enable_thinking": False}}, 400,
         "never reads enable_thinking", "chat_template_kwargs"),
        ({"messages": [{"role": "user", "content": "hi"}],
          "chat_template_kwargs": {"thinking": False}}, 400,
         "unknown field 'chat_template_kwargs.thinking'", "chat_template_kwargs.thinking"),
        ({"messages": [{"role": "user", "content": "word " * 600}]}, 400,
         "context holds 512", "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 600}, 400,
         "ask for at most", "max_tokens"),
        ({"messages": []}, 400, "messages", "messages"),
        ({"messages": [{"role": "user", "content": "\udfff"}]}, 400, "not valid Unicode",
         "messages.0.content"),
        ({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 404,
         "is not served here", "model"),
    ],
)  # fmt: skip
def test_errors_say_what_to_change(served, body, status, needle, param):
    if needle is None:
        body = {**body, "max_tokens": 2}
        code, answer = served.request("POST", "/v1/chat/completions", body)
        assert code == 200, answer
        return
    code, answer = served.request("POST", "/v1/chat/completions", body)
    assert code == status, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert needle in error["message"], error
    assert error["param"] == param


MODEL = "smollm2-135m-instruct"  # the bundled name works as an alias
CONVERSATION = [
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello! How can I help you today?"},
    {"role": "user", "content": CHAT_PROMPT},
]


def counts(usage) -> tuple[int, int, int]:
    """Usage's token counts (what was cached is each request's own)."""
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def test_openai_fields_at_their_defaults_change_nothing(served):
    client, logged = served.client, len(served.server.log)
    plain = client.chat.completions.create(
        model=MODEL, messages=CONVERSATION, temperature=0, max_tokens=MAX_TOKENS
    )
    # The assistant turn as OpenAI's client returns it, the last turn as a text part.
    turns = [
        CONVERSATION[0],
        {**CONVERSATION[1], "refusal": None, "audio": None, "function_call": None,
         "tool_calls": []},
        {"role": "user", "content": [{"type": "text", "text": CHAT_PROMPT,
                                      "prompt_cache_breakpoint": {"mode": "explicit"}}]},
    ]  # fmt: skip
    every = client.chat.completions.create(
        model=MODEL, messages=turns, temperature=0, max_tokens=MAX_TOKENS, **CHAT_NO_OPS
    )
    assert every.choices[0].message.content == plain.choices[0].message.content
    # The same prompt, token for token: the second prefills only its last token.
    assert counts(every.usage) == counts(plain.usage)
    assert every.usage.prompt_tokens_details.cached_tokens == every.usage.prompt_tokens - 1
    # Tools the model may not call are not shown to it: the answer is the one without them.
    unshown = client.chat.completions.create(
        model=MODEL, messages=CONVERSATION, temperature=0, max_tokens=MAX_TOKENS,
        tools=[TOOL], tool_choice="none", parallel_tool_calls=False,
    )  # fmt: skip
    assert unshown.choices[0].message.content == plain.choices[0].message.content

    args = {"model": MODEL, "prompt": TEXT_PROMPT, "temperature": 0, "max_tokens": MAX_TOKENS}
    text = client.completions.create(**args)
    every_text = client.completions.create(**args, **TEXT_NO_OPS)
    assert every_text.choices[0].text == text.choices[0].text
    assert counts(every_text.usage) == counts(text.usage)
    assert every_text.usage.prompt_tokens_details.cached_tokens == text.usage.prompt_tokens - 1
    assert not [line for line in list(served.server.log)[logged:] if "ignored" in line]


@pytest.mark.parametrize(("endpoint", "fields", "param"), REFUSED)
def test_values_edgetp_cannot_honour_are_refused_by_name(served, endpoint, fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        if endpoint == "chat":
            body = {"messages": [{"role": "user", "content": "hi"}], **fields}
            served.client.chat.completions.create(model=MODEL, max_tokens=2, **body)
        else:
            served.client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **fields)
    error = caught.value
    assert error.status_code == 400 and error.code == "unsupported_value", error.body
    assert error.param == param
    assert error.body["message"].startswith(param), error.body


def test_fields_outside_openais_api_are_answered_and_logged_once(served):
    said = [{"role": "user", "content": "Say hi."}]
    plain = served.client.chat.completions.create(
        model=MODEL, messages=said, temperature=0, max_tokens=6
    )
    answer = served.client.chat.completions.create(
        model=MODEL,
        messages=[{**said[0], "edgetp_note": "x"}],
        temperature=0,
        max_tokens=6,
        extra_body={"typical_p": 0.5, "edgetp_unknown": {"nested": True}},
    )
    assert answer.choices[0].message.content == plain.choices[0].message.content
    text = served.client.completions.create(
        model=MODEL, prompt=TEXT_PROMPT, max_tokens=2, extra_body={"edgetp_unknown_2": 1}
    )
    assert text.choices[0].text

    def lines(name: str) -> list[str]:
        return [line for line in served.server.log if repr(name) in line]

    deadline = time.monotonic() + 10
    while not lines("edgetp_unknown_2"):  # the later request's line: stderr is read on a thread
        assert time.monotonic() < deadline
        time.sleep(0.01)
    [chat_line] = lines("edgetp_unknown")
    assert chat_line.startswith("WARNING") and "/v1/chat/completions" in chat_line
    assert "'typical_p'" in chat_line and "'messages.0.edgetp_note'" in chat_line
    [text_line] = lines("edgetp_unknown_2")
    assert "/v1/completions" in text_line


def test_embeddings_of_two_nodes_equal_one_engine_s(served, smollm2, smollm2_tokenizer):
    """The route's vectors at two nodes (each layer a sum across the wire) are one in-process
    engine's (tests/test_embeddings.py holds that engine to transformers)."""
    texts = ["The quick brown fox.", "Paris", "Tensor parallelism sums partials across nodes."]
    model = served.client.models.list().data[0].id
    made = served.client.embeddings.create(model=model, input=texts, encoding_format="float")
    engine = Engine.local(smollm2, max_context=64, slots=len(texts))
    try:
        ids = [smollm2_tokenizer.encode(t) for t in texts]
        ref = embed_step(engine, ids, range(len(ids)))
    finally:
        engine.close()
    assert made.usage.prompt_tokens == sum(map(len, ids))
    for got, want in zip(made.data, ref, strict=True):
        assert np.allclose(got.embedding, want, rtol=0, atol=1e-5)


def test_a_wrong_or_missing_api_key_is_401(served):
    for key in ("wrong", None):
        code, answer = served.request("GET", "/v1/models", key=key)
        assert code == 401
        assert answer["error"]["code"] == "invalid_api_key"
        assert "Authorization: Bearer" in answer["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=f"{served.server.base}/v1", api_key="wrong", max_retries=0
        ).models.list()
    assert served.request("GET", "/health", key=None)[0] == 200  # liveness needs no key


def test_a_connection_idle_past_the_clients_keep_alive_still_answers(served):
    """httpx, under the openai and anthropic clients, keeps an idle connection 5 s: one idle a
    little longer than that is still open at the server, so a client whose pool held it that
    long does not send its request into a connection the server is closing."""
    conn = http.client.HTTPConnection("127.0.0.1", served.server.port, timeout=30)
    try:
        for pause in (0.0, 5.5):
            time.sleep(pause)
            conn.request("GET", "/health")
            assert conn.getresponse().read() and conn.sock is not None  # the same connection
    finally:
        conn.close()


STORY = [{"role": "user", "content": "Write a long story about a dragon."}]
# Each API's long greedy stream, and what marks a line that carries a piece of the answer.
STREAMS = {
    "/v1/chat/completions": (
        {"messages": STORY, "temperature": 0, "max_tokens": 400, "ignore_eos": True},
        b"data: {",
    ),
    "/v1/responses": (
        {"input": STORY, "temperature": 0, "max_output_tokens": 400},
        b'"type": "response.output_text.delta"',
    ),
    "/v1/messages": (
        {"messages": STORY, "temperature": 0, "max_tokens": 400},
        b'"type": "content_block_delta"',
    ),
    "/api/chat": (
        {"model": MODEL, "messages": STORY, "options": {"temperature": 0, "num_predict": 400}},
        b'"done": false',
    ),
}


@pytest.mark.parametrize("path", list(STREAMS))
def test_a_client_that_disconnects_mid_stream_stops_its_generation(served, path):
    before = served.generation()
    conn = http.client.HTTPConnection("127.0.0.1", served.server.port, timeout=60)
    body, piece = STREAMS[path]
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    conn.request("POST", path, json.dumps({**body, "stream": True}), headers)
    resp = conn.getresponse()
    assert resp.status == 200
    pieces = 0
    while pieces < 10:  # a few tokens in
        line = resp.readline()
        assert line, f"the stream of {path} ended before 10 pieces"
        pieces += piece in line
    conn.sock.close()  # the client goes away
    conn.close()
    g = cancelled_since(served, before)
    cancel = g["last_cancel"]
    print("cancel:", cancel)
    assert cancel["late_steps"] == 0  # dropped before the step after the cancel
    assert cancel["dropped_before_step"] == cancel["requested_during_step"] + 1
    assert cancel["tokens"] < 400
    assert g["active"] == 0
    # Nothing runs for it any more: a two-token request after it runs alone, in its own two
    # steps (one that still ran would share them, and add steps of its own).
    code, _ = served.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert code == 200
    after = served.generation()
    steps = after["steps"] - g["steps"]
    assert steps <= 2 and after["batch_recent"][-steps:] == [1] * steps, (g, after)
    logged = [line for line in served.server.log if f"request {cancel['id']} cancelled" in line]
    assert logged and f"dropped before step {cancel['dropped_before_step']}" in logged[0]


def test_a_client_that_gives_up_on_a_whole_answer_stops_it_too(served):
    before = served.generation()
    conn = http.client.HTTPConnection("127.0.0.1", served.server.port, timeout=60)
    body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    conn.request("POST", "/v1/completions", json.dumps(body), headers)
    wait_until(lambda: served.generation()["active"], 60, "request running at the server")
    conn.close()  # without reading the answer
    g = cancelled_since(served, before)
    assert g["last_cancel"]["late_steps"] == 0 and g["last_cancel"]["tokens"] < 400
    assert g["active"] == 0


def test_a_new_request_joins_a_running_stream(served):
    results: dict[str, object] = {}

    def long_stream() -> None:
        results["long"] = stream_chat(
            served.server.base,
            "Write a long story about a lighthouse.",
            120,
            api_key=KEY,
            extra={"ignore_eos": True},
        )
        results["long_done"] = time.perf_counter()

    t = threading.Thread(target=long_stream)
    t.start()
    wait_until(lambda: served.generation()["active"], 60, "long stream running at the server")
    short = served.client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": "Say hi."}],
        temperature=0,
        max_tokens=4,
    )
    short_done = time.perf_counter()
    t.join(60)
    assert short.choices[0].message.content
    # It did not wait for the 120-token stream: it finished while that one was still going.
    assert short_done < results["long_done"]  # type: ignore[operator]
    assert results["long"].completion_tokens == 120  # type: ignore[union-attr]
    status, cluster = served.request("GET", "/v1/cluster")
    assert status == 200
    assert cluster["generation"]["largest_batch"] >= 2


def test_four_streams_at_once_share_their_sums(served):
    """A step pays one sum a block whatever its batch: four streams at once pay about a quarter
    of one stream's sums a token (each prompt's prefill may be a step of its own)."""

    def sums() -> int:
        allreduce = served.request("GET", "/v1/cluster")[1]["allreduce"]
        return allreduce["sums"] if allreduce else 0  # none yet: no step has run

    def sums_a_token(streams: int) -> float:
        before = sums()
        start = threading.Barrier(streams)

        def one() -> int:
            start.wait()
            reply = served.client.chat.completions.create(
                model="smollm2-135m-instruct",
                messages=[{"role": "user", "content": "Write a story about a lighthouse."}],
                temperature=0,
                max_tokens=32,
                extra_body={"ignore_eos": True},
            )
            return reply.usage.completion_tokens

        threads = [threading.Thread(target=lambda: tokens.append(one())) for _ in range(streams)]
        tokens: list[int] = []
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert tokens == [32] * streams
        return (sums() - before) / sum(tokens)

    alone, together = sums_a_token(1), sums_a_token(4)
    print(f"sums a token: one stream {alone:.1f}, four at once {together:.1f}")
    scraped = HTTP.get(f"{served.server.base}/metrics", timeout=30).text
    assert f"edgetp_allreduce_sums_total {float(sums())}" in scraped.splitlines()
    assert alone == 2 * 30  # SmolLM2's 30 layers, two sums each, a step a token
    assert alone / together > 3


def test_cluster_figures_and_openapi(served, smollm2):
    # An answer of its own first, so the allreduce figures exist whichever tests ran before.
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert served.request("POST", "/v1/chat/completions", body)[0] == 200
    status, cluster = served.request("GET", "/v1/cluster")
    assert status == 200, cluster
    assert [n["role"] for n in cluster["nodes"]] == ["master", "worker"]
    master, worker = cluster["nodes"]
    assert worker["alive"] and worker["ready"] and worker["name"] == "local-1"
    assert worker["address"] == "127.0.0.1"  # where it connected from, as the master saw it
    # its partials' hop (local nodes split equally: no probe timed its link; test_lan_fronts')
    assert 0 < worker["hop_us_median"] <= worker["hop_us_p99"] and worker["link_rtt_us"] is None
    host, port = master["address"].split(":")
    assert host == "127.0.0.1" and int(port) > 0
    assert cluster["allreduce"]["sums"] > 0 and cluster["allreduce"]["median_us"] > 0
    assert cluster["context"] == 512 and cluster["generation"]["slots"] == 4
    # auto, with equal shares for processes of one machine: no link was timed to weigh
    assert cluster["attention"]["on"] == "split" and "not measured" in cluster["attention"]["why"]
    for node in cluster["nodes"]:  # what a sequence costs each node: its slice's KV a token
        s = Slice.from_dict(node["slices"][0])
        assert node["kv_bytes_per_token"] == KVCache.bytes_per_token(smollm2.config, s) > 0
        assert node["kv_cache"] == "f32"  # the default, told every worker by the plan
        assert node["kv_cache_bytes"] == 4 * 512 * node["kv_bytes_per_token"]
        assert node["state_bytes_per_sequence"] == 0  # no DeltaNet state, no local layers
        assert (node["slots"], node["context"]) == (4, 512), node
    assert served.request("GET", "/v1/cluster", key=None)[0] == 401

    status, schema = served.request("GET", "/openapi.json", key=None)
    assert status == 200
    chat = schema["paths"]["/v1/chat/completions"]["post"]
    assert set(chat["responses"]) == {"200", "400", "401", "404", "429", "503"}
    assert "text/event-stream" in chat["responses"]["200"]["content"]
    assert "422" not in json.dumps(schema["paths"])
    assert "HTTPBearer" in schema["components"]["securitySchemes"]
    for name, openai_params in (
        ("ChatCompletionRequest", chat_params.CompletionCreateParamsNonStreaming),
        ("CompletionRequest", text_params.CompletionCreateParamsNonStreaming),
    ):
        request = schema["components"]["schemas"][name]
        described = set(request["properties"])
        assert openai_params.__required_keys__ | openai_params.__optional_keys__ <= described
        assert request["additionalProperties"] is True  # ignored, with a warning
