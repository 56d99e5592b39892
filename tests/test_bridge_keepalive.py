"""SSE keep-alive comments while a streamed request waits for its first token.

The real bridge app on uvicorn over the real model, in-process so that its keep-alive interval
can be set short (`Served.keepalive_s`) and a request can be made to wait as long as the test
needs: the session has one slot, and a request submitted straight to the batcher holds it until
the test cancels it. Read with httpx, which sees the comments, and with the `openai` client,
which must skip them.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator

import httpx2 as httpx
import openai
import pytest
from http_client import HTTP
from serving import served_app
from waiting import wait_until

from edgetp.master.bridge.app import KEEPALIVE, create_app
from edgetp.master.bridge.core import Served
from edgetp.master.cluster.session import Session
from edgetp.master.generation.batcher import Batcher, Delta, Event
from edgetp.master.generation.params import SamplingParams
from edgetp.master.generation.prompts import prompt_tokens
from edgetp.memory.budget import FILE_TYPES

pytestmark = pytest.mark.slow

MODEL = "smollm2"
KEEPALIVE_S = 0.05  # short, so that a wait of a fraction of a second sees several comments
TIMEOUT = 60.0
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Why is the sky blue?"}]}
TEXT = {"model": MODEL, "prompt": "The capital of France is"}
GREEDY = {"temperature": 0, "max_tokens": 6}


@pytest.fixture(scope="module")
def bridge(smollm2, smollm2_tokenizer, shared_state) -> Iterator[tuple[str, Batcher]]:
    """The bridge's base URL (no /v1) over a one-slot session, and its batcher."""
    session = Session(smollm2, None, shared_state, context=256, slots=1, memory=FILE_TYPES)
    session.start()
    batcher = Batcher(session, smollm2_tokenizer).start()
    served = Served(batcher, smollm2_tokenizer, model_id=MODEL, keepalive_s=KEEPALIVE_S)
    try:
        with served_app(create_app(served), TIMEOUT) as url:
            yield url, batcher
    finally:
        batcher.close()
        session.close()


class SlotHolder:
    """A long request that has taken the one slot (its first token is out): every other
    request waits for its first token until this one is cancelled."""

    def __init__(self, batcher: Batcher, tokenizer) -> None:
        started, self.ended = threading.Event(), threading.Event()

        def on_event(event: Event) -> None:
            (started if isinstance(event, Delta) else self.ended).set()

        prompt = prompt_tokens(tokenizer, "Tell me a long story.", raw=False)
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        self.ticket = batcher.submit(prompt, params, on_event)
        assert started.wait(TIMEOUT), "the slot's holder never started"

    def release(self) -> None:
        assert not self.ended.is_set(), "the slot's holder ended by itself: give it more tokens"
        self.ticket.cancel()


def text_of(path: str, chunk: dict) -> str:
    if not chunk["choices"]:
        return ""  # the usage chunk
    choice = chunk["choices"][0]
    return (choice["delta"].get("content") or "") if path.endswith("chat/completions") else (
        choice["text"]
    )  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body"), [("/v1/chat/completions", CHAT), ("/v1/completions", TEXT)]
)
def test_a_stream_waiting_for_its_first_token_gets_comments_until_it_comes(
    bridge, smollm2_tokenizer, path, body
):
    """Answered at once with comments every KEEPALIVE_S while it waits for the slot; once the
    slot frees, the chunks of the same answer as when nothing waits, and no comment after."""
    base, batcher = bridge
    alone = HTTP.post(f"{base}{path}", json={**body, **GREEDY}, timeout=TIMEOUT)
    assert alone.status_code == 200, alone.text
    expected = alone.json()["choices"][0]
    holder = SlotHolder(batcher, smollm2_tokenizer)
    lines: list[str] = []
    try:
        request = {**body, **GREEDY, "stream": True}
        with HTTP.stream("POST", f"{base}{path}", json=request, timeout=TIMEOUT) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            for line in resp.iter_lines():
                lines.append(line)
                if lines.count(KEEPALIVE.strip()) == 3:
                    holder.release()  # the slot frees: the waiting request starts
    finally:
        holder.ticket.cancel()
    shown = [line for line in lines if line]
    first_data = next(i for i, line in enumerate(shown) if line.startswith("data: "))
    print(f"{first_data} comments before the first chunk of {path}")
    assert first_data >= 3 and set(shown[:first_data]) == {KEEPALIVE.strip()}
    assert all(line.startswith("data: ") for line in shown[first_data:])
    assert shown[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in shown[first_data:-1]]
    text = "".join(text_of(path, c) for c in chunks)
    assert text == (expected["message"]["content"] if "message" in expected else expected["text"])
    assert chunks[-1]["choices"][0]["finish_reason"] == expected["finish_reason"]


QUESTION = [{"role": "user", "content": "Why is the sky blue?"}]
# The other streaming APIs: a request, its keep-alive line (None: it sends nothing before its
# first token), and the answer's text in one line of its stream and in its whole answer.
OTHERS = {
    "/v1/responses": (
        {"model": MODEL, "input": QUESTION, "temperature": 0, "max_output_tokens": 6},
        KEEPALIVE.strip(),
        lambda e: e["delta"] if e.get("type") == "response.output_text.delta" else "",
        lambda r: "".join(c["text"] for o in r["output"] if o["type"] == "message"
                          for c in o["content"]),
    ),
    "/v1/messages": (  # Anthropic's ping: its stream's documented keep-alive
        {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 6},
        "event: ping",
        lambda e: e["delta"].get("text", "") if e.get("type") == "content_block_delta" else "",
        lambda r: r["content"][0]["text"],
    ),
    "/api/chat": (  # NDJSON has no comment, and Ollama sends nothing before its first token
        {"model": MODEL, "messages": QUESTION, "options": {"temperature": 0, "num_predict": 6}},
        None,
        lambda e: e["message"]["content"],
        lambda r: r["message"]["content"],
    ),
}  # fmt: skip


def parsed(line: str) -> dict:
    return json.loads(line.removeprefix("data: "))


@pytest.mark.parametrize("path", list(OTHERS))
def test_the_other_apis_keep_a_waiting_stream_alive_in_their_own_way(
    bridge, smollm2_tokenizer, path
):
    """While the stream waits for the slot: Responses' comments, Messages' pings, after their
    opening events and before the first piece of text; Ollama's nothing at all. Once the slot
    frees, the same answer as when nothing waits."""
    base, batcher = bridge
    body, keep_alive, piece, answer = OTHERS[path]
    alone = HTTP.post(f"{base}{path}", json={**body, "stream": False}, timeout=TIMEOUT)
    assert alone.status_code == 200, alone.text
    expected = answer(alone.json())
    holder = SlotHolder(batcher, smollm2_tokenizer)
    lines: list[str] = []
    if keep_alive is None:  # nothing comes until the slot frees: free it from aside

        def release() -> None:
            wait_until(lambda: batcher.stats().waiting == 1, TIMEOUT, "the request waiting")
            time.sleep(10 * KEEPALIVE_S)  # as long as SSE's streams see several keep-alives
            holder.release()

        threading.Thread(target=release, daemon=True).start()
    try:
        request = {**body, "stream": True}
        with HTTP.stream("POST", f"{base}{path}", json=request, timeout=TIMEOUT) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                lines.append(line)
                if keep_alive is not None and lines.count(keep_alive) == 3 + (
                    path == "/v1/messages"  # the ping its stream always sends after its start
                ):
                    holder.release()  # the slot frees: the waiting request starts
    finally:
        holder.ticket.cancel()
    # The data and the keep-alives (an SSE event's name line goes with its data).
    shown = [line for line in lines
             if line and (line == keep_alive or not line.startswith("event: "))]  # fmt: skip
    pieces = [i for i, line in enumerate(shown)
              if line != keep_alive and piece(parsed(line))]  # fmt: skip
    print(f"{shown[: pieces[0]].count(keep_alive)} keep-alives before the first piece of {path}")
    if keep_alive is None:
        assert pieces[0] == 0  # its first line is its first piece
    else:
        assert shown[: pieces[0]].count(keep_alive) >= 3
        assert keep_alive not in shown[pieces[0] :]
    text = "".join(piece(parsed(line)) for line in shown if line != keep_alive)
    assert text == expected


class Tee(httpx.BaseTransport):
    """The openai client's transport, which also tells when a keep-alive comment came."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.comment = threading.Event()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=_Watched(response.stream, self.comment),
            extensions=response.extensions,
        )

    def close(self) -> None:
        self.inner.close()


class _Watched(httpx.SyncByteStream):
    def __init__(self, stream: httpx.SyncByteStream, comment: threading.Event) -> None:
        self.stream = stream
        self.comment = comment

    def __iter__(self) -> Iterator[bytes]:
        for part in self.stream:
            if KEEPALIVE.encode() in part:
                self.comment.set()
            yield part

    def close(self) -> None:
        self.stream.close()


def test_the_openai_client_reads_a_stream_with_comments(bridge, smollm2_tokenizer):
    base, batcher = bridge
    tee = Tee()
    client = openai.OpenAI(
        base_url=f"{base}/v1",
        api_key="-",
        max_retries=0,
        timeout=TIMEOUT,
        http_client=httpx.Client(transport=tee),
    )
    expected = client.chat.completions.create(**CHAT, **GREEDY).choices[0].message.content
    holder = SlotHolder(batcher, smollm2_tokenizer)
    pieces: list[str] = []
    try:
        stream = client.chat.completions.create(**CHAT, **GREEDY, stream=True)
        reader = threading.Thread(
            target=lambda: pieces.extend(c.choices[0].delta.content or "" for c in stream)
        )
        reader.start()
        assert tee.comment.wait(TIMEOUT), "no keep-alive comment while the request waited"
        assert not pieces  # the first chunk waits for the slot
        holder.release()
    finally:
        holder.ticket.cancel()
    reader.join(TIMEOUT)
    assert not reader.is_alive()
    assert "".join(pieces) == expected


def left_the_line(batcher, cancelled_before: int) -> None:
    """Waits until the waiting request was cancelled and left the line, while the slot's
    holder runs on."""
    wait_until(
        lambda: batcher.stats().waiting == 0 and batcher.stats().cancelled > cancelled_before,
        TIMEOUT,
        lambda: f"the waiting request dropped: {batcher.stats()}",
    )
    assert batcher.stats().active == 1  # the slot's holder runs on


def test_a_client_gone_during_the_comments_frees_its_request(bridge, smollm2_tokenizer):
    base, batcher = bridge
    holder = SlotHolder(batcher, smollm2_tokenizer)
    try:
        before = batcher.stats().cancelled
        request = {**CHAT, **GREEDY, "stream": True}
        with HTTP.stream("POST", f"{base}/v1/chat/completions", json=request) as resp:
            assert next(resp.iter_lines()) == KEEPALIVE.strip()
            assert batcher.stats().waiting == 1
        # Closed: noticed at the next comment, and the request leaves the line.
        left_the_line(batcher, before)
        holder.release()
    finally:
        holder.ticket.cancel()


@pytest.mark.parametrize("path", list(OTHERS))
def test_a_client_gone_while_its_stream_waits_frees_its_request_through_the_other_apis(
    bridge, smollm2_tokenizer, path
):
    """Gone before its first token: noticed at the next keep-alive, or by Ollama's route,
    which sends nothing meanwhile, as its connection closes; the request leaves the line."""
    base, batcher = bridge
    body = OTHERS[path][0]
    holder = SlotHolder(batcher, smollm2_tokenizer)
    try:
        before = batcher.stats().cancelled
        conn = http.client.HTTPConnection(base.removeprefix("http://"), timeout=TIMEOUT)
        conn.request("POST", path, json.dumps({**body, "stream": True}),
                     {"Content-Type": "application/json"})  # fmt: skip
        wait_until(lambda: batcher.stats().waiting == 1, TIMEOUT, "the request waiting")
        conn.sock.close()  # the client goes away without a byte of the answer read
        conn.close()
        left_the_line(batcher, before)
        holder.release()
    finally:
        holder.ticket.cancel()
