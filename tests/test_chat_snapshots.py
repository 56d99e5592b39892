"""Snapshots of `edgetp chat`: the main screen and the cluster panel; and a thinking model's
reasoning, shown folded above its answer.

The figures come through the app's own client from fixed JSON in the shape /v1/cluster serves
(an httpx mock transport stands in for the network), so the pictures do not move with the
machine's speed. An answer with reasoning comes the same way, as a recorded stream of
server-sent events (no bundled model thinks). Update with `pytest tests/test_chat_snapshots.py
--snapshot-update` and look at the pictures (tests/__snapshots__/test_chat_snapshots/*.svg)
before committing them.
"""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest
from textual.app import App, ComposeResult
from textual.pilot import Pilot
from waiting import until_shown

from edgetp.master.bridge.client import Reasoning, StreamEnd
from edgetp.tui.chat.app import ChatApp
from edgetp.tui.chat.client import BridgeClient, Sampling
from edgetp.tui.chat.store import Conversation, ConversationStore, Message
from edgetp.tui.chat.widgets import Answer, ClusterPanel, Thinking

BASE = "http://127.0.0.1:8000"
MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"

GENERATION: dict[str, Any] = {
    "slots": 8,
    "active": 0,
    "waiting": 0,
    "steps": 412,
    "submitted": 3,
    "completed": 3,
    "cancelled": 0,
    "failed": 0,
    "prompt_tokens": 120,
    "completion_tokens": 409,
    "largest_batch": 1,
    "step_ms_recent": [52.1, 53.4, 51.8, 60.2, 52.7],
    "batch_recent": [1, 1, 1, 1, 1],
    "tokens_per_s": 18.6,
    "last_cancel": None,
}

# What the bridge serves today for two local nodes, after an answer (from a real
# `edgetp serve --local-nodes 2`): every figure but the master's budget (none was given).
TODAY: dict[str, Any] = {
    "model": MODEL,
    "context": 2048,
    "layers": 30,
    "nodes": [
        {
            "name": "master",
            "role": "master",
            "alive": True,
            "ready": True,
            "slices": [{"q_heads": [0, 6], "kv_heads": [0, 2], "ffn": [0, 768]}],
            "rss_bytes": 1_324_965_888,
            "kv_cache_bytes": 503_316_480,
            "address": "127.0.0.1:46323",
            "share": 0.5556,
            "window": 30,
            "peak_rss_bytes": 1_324_965_888,
            "bytes_read_per_token": 0.0,
            "loader_wait_ms": 0.0,
            "load_ms": 0.0,
            "compute_ms": 31.667,
            "kernels": "f32: numpy-gemm, numpy-gemv",
            "activations": "exact",
        },
        {
            "name": "local-1",
            "role": "worker",
            "alive": True,
            "ready": True,
            "slices": [{"q_heads": [6, 9], "kv_heads": [2, 3], "ffn": [768, 1536]}],
            "memory_budget_bytes": 25_276_063_744,
            "cores": 1,
            "speed_gb_s": 46.74,
            "rss_bytes": 710_500_352,
            "heartbeat_silence_s": 0.065,
            "address": "127.0.0.1",
            "share": 0.4444,
            "window": 30,
            "peak_rss_bytes": 710_500_352,
            "bytes_read_per_token": 0.0,
            "loader_wait_ms": 0.0,
            "load_ms": 0.0,
            "compute_ms": 29.006,
            "kernels": "f32: numpy-gemm, numpy-gemv",
            "link_rtt_us": 447.9,
            "hop_us_median": 440.9,
            "hop_us_p99": 3302.8,
            "activations": "exact",
        },
    ],
    "allreduce": {"sums": 600, "median_us": 330.1, "p99_us": 1102.7},
    "generation": GENERATION,
    "down": None,
}


def _node(name: str, address: str, share: float, rss: int, window: int, wait: float) -> dict:
    return {
        "name": name,
        "role": "worker",
        "alive": True,
        "ready": True,
        "slices": [],
        "memory_budget_bytes": 512 * 2**20,
        "cores": 4,
        "speed_gb_s": 1.2,
        "rss_bytes": rss,
        "heartbeat_silence_s": 0.21,
        "address": address,
        "share": share,
        "window": window,
        "peak_rss_bytes": rss,
        "bytes_read_per_token": 2.1e6,
        "loader_wait_ms": wait,
        "load_ms": 9.5,
        "compute_ms": 11.25,
        "kernels": "q4_1: c-int8",
        "activations": "int8",
    }


# Every figure a node can report, on three devices.
FULL: dict[str, Any] = {
    **TODAY,
    "nodes": [
        {
            **TODAY["nodes"][0],
            "address": "192.168.1.10:7470",
            "share": 0.4,
            "window": 30,
            "memory_budget_bytes": 2 * 2**30,
            "compute_ms": 14.5,
            "loader_wait_ms": 0.0,
        },
        _node("pi-kitchen", "192.168.1.21", 0.35, 301 * 2**20, 4, 1.75),
        _node("pi-garage", "192.168.1.22", 0.25, 187 * 2**20, 2, 6.5),
    ],
    "attention": {"on": "master", "why": "master: --attention master"},
}


def _down() -> dict[str, Any]:
    figures = copy.deepcopy(TODAY)
    figures["nodes"][1].update(alive=False, heartbeat_silence_s=None)
    figures["nodes"][0]["alive"] = False
    figures["down"] = (
        "the cluster is down: node local-1 stopped answering; restart edgetp serve to re-plan"
    )
    return figures


REASONING = ["The user asks for ", "17 times 23.\n\n", "17 × 20 = 340, ", "17 × 3 = 51; ", "391."]
CONTENT = ["17 × 23 = ", "**391**."]


def _chunk(delta: dict[str, Any], finish: str | None = None, usage: bool = False) -> bytes:
    chunk: dict[str, Any] = {
        "id": "chatcmpl-0",
        "object": "chat.completion.chunk",
        "created": 1_740_820_500,
        "model": MODEL,
        "choices": [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    if usage:
        chunk["usage"] = {"prompt_tokens": 20, "completion_tokens": 30, "total_tokens": 50}
    return f"data: {json.dumps(chunk)}\n\n".encode()


# A thinking model's streamed answer as the bridge sends it (vLLM's and DeepSeek's shape): the
# reasoning in `reasoning_content` deltas, then the answer in `content` deltas; a keep-alive
# comment while it prefilled.
THINKING_SSE = b"".join(
    [
        b": keep-alive\n\n",
        _chunk({"role": "assistant", "content": ""}),
        *(_chunk({"reasoning_content": r, "content": None}) for r in REASONING),
        *(_chunk({"content": c}) for c in CONTENT),
        _chunk({}, finish="stop"),
        _chunk({}, usage=True),
        b"data: [DONE]\n\n",
    ]
)


def bridge(figures: dict[str, Any], sent: list[dict] | None = None) -> BridgeClient:
    """The app's real client, over a transport that answers with fixed JSON, and a chat
    completion with THINKING_SSE (its request bodies kept in `sent`)."""

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/chat/completions" and sent is not None:
            sent.append(json.loads(request.content))
            headers = {"content-type": "text/event-stream"}
            return httpx.Response(200, content=THINKING_SSE, headers=headers)
        if request.url.path == "/v1/cluster":
            return httpx.Response(200, json=figures)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": MODEL}]})
        return httpx.Response(404, json={"error": {"message": "not here", "code": None}})

    return BridgeClient(BASE, transport=httpx.MockTransport(answer))


async def _settled(pilot: Pilot) -> None:
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()


def conversation(folder: Path) -> Conversation:
    """A saved conversation, read back through the store as the app reads one."""
    store = ConversationStore(folder)
    saved = Conversation(
        id="20250301-101500-abc123",
        created=1_740_820_500.0,
        updated=1_740_820_560.0,
        system="",
        sampling=Sampling(temperature=0.0, top_p=1.0, max_tokens=256),
        messages=[
            Message("user", "Write a Python function that adds two numbers."),
            Message(
                "assistant",
                "Here it is:\n\n```python\ndef add(a: int, b: int) -> int:\n"
                "    return a + b\n```\n\nCall it as `add(2, 3)`, which gives **5**.",
            ),
            Message("user", "Now tell me a long story."),
            Message("assistant", "Once upon a time, in a valley of", stopped=True),
            Message("error", "the cluster is down: node local-1 stopped answering"),
        ],
    )
    store.save(saved)
    return store.load(saved.id)


def test_main_screen(snap_compare, tmp_path):
    """The main screen with a reopened conversation and today's figures of two local nodes.

    Left, bordered and titled with the first prompt: the prompt ("you", indented), an answer
    ("assistant") whose code block is highlighted Python and whose `add(2, 3)` and **5** are
    rendered as markdown, a second prompt, a cut-short answer with "stopped" on its lower
    border, and a red "error" message. Under it the status line (temperature 0 · top-p 1 ·
    max 256 tokens) and the empty prompt input. Right, the "cluster" panel: the model, 30
    layers, context 2048, 18.6 tokens/s, 52.7 ms/token, allreduce 330 µs · p99 1.10 ms, then
    master at 127.0.0.1:46323 (55.6% share, 1.2 GiB "· no budget", window 30 layers, 31.67 ms
    compute, 0.00 ms loader wait) and local-1 at 127.0.0.1 (44.4%, 677.6 MiB / 23.5 GiB,
    window 30 layers, 29.01 ms compute, heartbeat 0.07 s ago), each with "kernels f32:
    numpy-gemm, numpy-gemv"; no dashes. The header shows the
    model and the URL; the footer the keys: Quit, Stop (dimmed: nothing to stop), New chat,
    Open, Settings, Cluster.
    """
    app = ChatApp(bridge(TODAY), ConversationStore(tmp_path), conversation(tmp_path))
    assert snap_compare(app, terminal_size=(120, 44), run_before=_settled)


class PanelApp(App[None]):
    """The cluster panel alone, fed once through the app's client."""

    CSS_PATH = str(Path(__file__).parents[1] / "tui" / "chat" / "chat.tcss")

    def __init__(self, client: BridgeClient) -> None:
        super().__init__()
        self.client = client

    def compose(self) -> ComposeResult:
        yield ClusterPanel()

    async def on_mount(self) -> None:
        panel = self.query_one(ClusterPanel)
        panel.border_title = "cluster"
        panel.show(await self.client.cluster())


def test_cluster_panel_with_every_figure(snap_compare):
    """The panel for three devices that report every figure.

    At the top the cluster: model, 30 layers · context 2048, 18.6 tokens/s, 52.7 ms/token,
    allreduce 330 µs · p99 1.10 ms, attention master · one sum a layer, 0 active · 0 waiting
    / 8. Then one block per node, each
    with a green "● up": master at 192.168.1.10:7470 with a 40.0% share, 1.3 GiB of a 2.0 GiB
    budget, a window of 30 layers, 14.50 ms compute and 0.00 ms loader wait; pi-kitchen
    (192.168.1.21, 35.0%, 301.0 MiB / 512.0 MiB, window 4 layers, 1.75 ms loader wait) and
    pi-garage (192.168.1.22, 25.0%, 187.0 MiB / 512.0 MiB, window 2 layers, 6.50 ms loader
    wait), both 11.25 ms compute, "kernels int8: dequant-f32" and a heartbeat 0.21 s ago. No
    dashes.
    """
    assert snap_compare(PanelApp(bridge(FULL)), terminal_size=(44, 44), run_before=_settled)


def test_cluster_panel_when_the_cluster_is_down(snap_compare):
    """The panel after a worker died: a red border, "DOWN: the cluster is down: node local-1
    stopped answering; restart edgetp serve to re-plan" in bold red above the figures, and a
    red "✕ down" beside both master and local-1 instead of the green "● up"; local-1 shows no
    heartbeat line."""
    assert snap_compare(PanelApp(bridge(_down())), terminal_size=(44, 38), run_before=_settled)


def test_the_figures_served_today_parse(tmp_path):
    """The fixtures above are what the bridge's schema accepts (a drifted fixture fails)."""
    from edgetp.master.bridge.schema import ClusterFigures

    for figures in (TODAY, FULL, _down()):
        ClusterFigures.model_validate(json.loads(json.dumps(figures)))


def test_a_node_s_block_shows_how_its_kv_cache_is_stored():
    """A node that reports its KV cache's format (--kv-cache) shows it beside the cache's size."""
    import io

    from rich.console import Console

    from edgetp.master.bridge.schema import NodeFigures
    from edgetp.tui.chat.widgets import node_block

    node = NodeFigures.model_validate(TODAY["nodes"][0] | {"kv_cache": "q8_0"})
    console = Console(width=60, record=True, file=io.StringIO())
    console.print(node_block(node))
    rows = [line.split() for line in console.export_text().splitlines()]
    assert ["KV", "cache", "480.0", "MiB", "·", "q8_0"] in rows


def test_a_stream_gives_reasoning_apart_from_the_answer():
    """read_chat_stream, through the app's client: the reasoning deltas as Reasoning pieces,
    the content as text, in the order they came, then the end."""

    async def read() -> list[Any]:
        client = bridge(TODAY, sent=[])
        try:
            return [e async for e in client.stream_chat([{"role": "user", "content": "Hi"}],
                                                        Sampling())]  # fmt: skip
        finally:
            await client.aclose()

    events = asyncio.run(read())
    assert events == [*(Reasoning(r) for r in REASONING), *CONTENT, StreamEnd("stop", 30)]


def test_a_client_used_on_two_event_loops_closes_without_touching_the_ended_one():
    """A keep-alive connection belongs to the loop that opened it: once that loop has ended,
    the client asks on a new connection of the next loop, and closing it there does not reach
    back into the ended loop (which raised 'Event loop is closed' as an app closed)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from threading import Thread

    class Models(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the pool keeps the connection

        def do_GET(self) -> None:
            body = json.dumps({"data": [{"id": "m"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Models)
    Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = BridgeClient(f"http://127.0.0.1:{server.server_port}")
        assert asyncio.run(client.model()) == "m"  # this loop ends with a connection pooled
        assert asyncio.run(client.model()) == "m"
        asyncio.run(client.aclose())
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_a_thinking_answer_shows_its_reasoning_folded(tmp_path):
    """The reasoning streams into a folded "Thinking" above the answer, which shows only the
    answer's text; the title opens it. It is saved with the answer, and not sent back."""
    sent: list[dict] = []
    app = ChatApp(bridge(TODAY, sent), ConversationStore(tmp_path), sampling=Sampling())
    async with app.run_test(size=(110, 36)) as pilot:
        await pilot.press(*"What is 17 times 23?", "enter")
        await until_shown(pilot, lambda: app.answering is None, 30, "finished answer")
        *_, thinking, answer = app.log_view.children
        assert isinstance(thinking, Thinking) and isinstance(answer, Answer)
        assert thinking.collapsed and thinking.body.region.height == 0  # folded: not shown
        assert thinking.body.source == "".join(REASONING)
        assert answer.source == "".join(CONTENT)
        await pilot.click(Thinking)
        await until_shown(pilot, lambda: not thinking.collapsed, 5, "opened reasoning")
        await pilot.pause()
        assert thinking.body.region.height > 0  # shown now
        last = app.conversation.messages[-1]
        assert (last.content, last.reasoning) == ("".join(CONTENT), "".join(REASONING))
        saved = json.loads((tmp_path / f"{app.conversation.id}.json").read_text())
        assert saved["messages"][-1]["reasoning"] == "".join(REASONING)
        await pilot.click("#prompt")  # the focus went to the title
        await pilot.press(*"And 18 times 23?", "enter")
        await until_shown(pilot, lambda: len(sent) == 2 and not app.answering, 30, "2nd answer")
    assert sent[1]["messages"][1] == {"role": "assistant", "content": "".join(CONTENT)}


def test_a_thinking_answer(snap_compare, tmp_path):
    """A reopened conversation whose answer came from a thinking model: under the prompt
    ("you", indented), one line "▶ Thinking" (folded; its reasoning hidden), then the answer
    "17 × 23 = 391" (391 in bold) in its "assistant" box. The status line and the cluster
    panel as on the main screen."""
    store = ConversationStore(tmp_path)
    saved = Conversation.new(sampling=Sampling(temperature=0.0, top_p=1.0, max_tokens=256))
    saved.id = "20250301-101500-def456"
    saved.messages = [
        Message("user", "What is 17 times 23?"),
        Message("assistant", "".join(CONTENT), reasoning="".join(REASONING)),
    ]
    store.save(saved)
    app = ChatApp(bridge(TODAY), store, store.load(saved.id))
    assert snap_compare(app, terminal_size=(120, 24), run_before=_settled)
