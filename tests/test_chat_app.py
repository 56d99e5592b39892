"""`edgetp chat` driven by Textual's Pilot against a real `edgetp serve` on a two-process cluster.

The bridge is started the way `edgetp chat` starts it (`start_server`), once for the module; the
app talks to it over loopback HTTP. Content is greedy (temperature 0) and compared with what the
same bridge answers to the same messages without the app. The last test starts a bridge of its
own, over three processes, and kills its two workers one after the other, each mid-answer: one
seen over the `openai` client, one in the app.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx2 as httpx
import openai
import pytest
from local_processes import local_workers
from rich.console import Console
from textual.pilot import Pilot
from textual.widgets import Static

from master.bridge.client import start_server
from master.plan import plan_slices
from master.splitter import split_model
from memory.shards import ShardStore
from models.source import default_dtype
from node.device import plan_shapes, prepare
from tui.chat.app import ChatApp
from tui.chat.client import BridgeClient, Sampling
from tui.chat.store import ConversationStore
from tui.chat.widgets import Answer, ConversationsScreen, Note, SettingsScreen

pytestmark = [pytest.mark.slow, pytest.mark.anyio]

SIZE = (110, 36)
SERVE = ["--local-nodes", "2", "--context", "512"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def bridge(shared_state):
    local = start_server([*SERVE, "--state-dir", str(shared_state)], timeout=240)
    yield local
    local.stop()


def make_app(base_url: str, folder: Path, sampling: Sampling, **kw) -> ChatApp:
    return ChatApp(BridgeClient(base_url), ConversationStore(folder), sampling=sampling, **kw)


def chat_once(base_url: str, messages: list[dict[str, str]], sampling: Sampling) -> str:
    """The bridge's answer to `messages`, asked directly (no app, no streaming)."""
    body = {"messages": messages, **sampling.to_dict()}
    resp = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]["content"]


def generation(base_url: str) -> dict:
    return httpx.get(f"{base_url}/health", timeout=10).json()["generation"]


async def until(pilot: Pilot, condition: Callable[[], object], timeout: float, what: str) -> float:
    """Seconds until `condition()` holds, pausing the app in small steps meanwhile."""
    t0 = time.monotonic()
    while not condition():
        assert time.monotonic() - t0 < timeout, f"no {what} within {timeout} s"
        await pilot.pause(0.02)
    return time.monotonic() - t0


async def ask(pilot: Pilot, prompt: str) -> None:
    """Type the prompt into the input, as a person would, and press Enter."""
    await pilot.press(*prompt)
    await pilot.press("enter")


async def answered(pilot: Pilot, app: ChatApp, timeout: float = 60) -> None:
    await until(pilot, lambda: app.answering is None, timeout, "finished answer")


def answer_text(app: ChatApp) -> str:
    """What the latest answer shows so far."""
    answers = app.query(Answer)
    return answers.last().source if answers else ""


def shown(app: ChatApp) -> list[tuple[str, str]]:
    """(role, text) of every message on the screen, top to bottom."""
    out = []
    for view in app.log_view.children:
        if isinstance(view, Answer):
            out.append(("assistant", view.source))
        elif isinstance(view, Note):
            out.append((view.has_class("error") and "error" or "user", str(view.content)))
    return out


async def test_a_prompt_streams_its_answer_token_by_token(bridge, tmp_path):
    prompt = "Why is the sky blue?"
    # Long enough to be seen streaming on a fast CPU beside the suite's other tests: there 48
    # tokens' pieces once spanned 0.4 s, and once the app drew them all at once.
    sampling = Sampling(temperature=0, top_p=1, max_tokens=128)
    app = make_app(bridge.base, tmp_path, sampling)
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, prompt)
        await until(pilot, lambda: app.query(Answer), 10, "answer view")
        view = app.query_one(Answer)
        seen: list[tuple[float, str]] = []  # what the view showed, and when
        t0 = time.monotonic()
        while app.answering is not None:
            assert time.monotonic() - t0 < 60
            if view.source and (not seen or seen[-1][1] != view.source):
                seen.append((time.monotonic() - t0, view.source))
            await pilot.pause(0.01)
        done = time.monotonic() - t0
        final = app.conversation.messages[-1]
        assert final.role == "assistant" and not final.stopped
        assert view.source == final.content
        # It arrived piece by piece, each a continuation of the last, over the answer's time
        # (most of it from the first piece on).
        assert len(seen) >= 10, seen
        assert all(b.startswith(a) for (_, a), (_, b) in zip(seen, seen[1:], strict=False))
        assert seen[-1][0] - seen[0][0] > 0.5, (seen, done)
        assert seen[-1][0] - seen[0][0] > 0.5 * (done - seen[0][0]), (seen, done)
        expected = await asyncio.to_thread(
            chat_once, bridge.base, [{"role": "user", "content": prompt}], sampling
        )
        assert final.content == expected
        assert f"{sampling.max_tokens} tokens" in str(app.query_one("#status").content)
        print(f"{len(seen)} updates over {seen[-1][0] - seen[0][0]:.2f} s: {final.content!r}")


async def test_esc_stops_a_running_answer(bridge, tmp_path):
    sampling = Sampling(temperature=0, top_p=1, max_tokens=300)
    app = make_app(bridge.base, tmp_path, sampling)
    async with app.run_test(size=SIZE) as pilot:
        before = await asyncio.to_thread(generation, bridge.base)
        await ask(pilot, "Write a long story about a dragon and a knight.")
        await until(pilot, lambda: len(answer_text(app)) > 20, 30, "first words")
        assert app.answering is not None
        await pilot.press("escape")
        await until(pilot, lambda: app.answering is None, 2, "stop")
        view = app.query_one(Answer)
        at_stop = view.source
        await pilot.pause(1.0)
        assert view.source == at_stop  # nothing more arrives
        last = app.conversation.messages[-1]
        assert last.role == "assistant" and last.stopped and last.content == at_stop
        assert view.border_subtitle == "stopped"
        # The bridge dropped the request: the closed stream cancelled it.
        deadline = time.monotonic() + 5
        while (g := await asyncio.to_thread(generation, bridge.base))["cancelled"] == before[
            "cancelled"
        ]:
            assert time.monotonic() < deadline, g
            await pilot.pause(0.05)
        assert g["active"] == 0 and g["last_cancel"]["tokens"] < 300
        print("stopped after:", repr(at_stop), "bridge:", g["last_cancel"])


async def test_a_second_turn_uses_the_first_as_context(bridge, tmp_path):
    sampling = Sampling(temperature=0, top_p=1, max_tokens=32)
    first, second = "I have a dog called Rex.", "What is my dog called?"
    app = make_app(bridge.base, tmp_path, sampling)
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, first)
        await answered(pilot, app)
        await ask(pilot, second)
        await answered(pilot, app)
        turns = [(m.role, m.content) for m in app.conversation.messages]
        assert [r for r, _ in turns] == ["user", "assistant", "user", "assistant"]
        assert shown(app) == turns
        answer = turns[3][1]
    history = [{"role": r, "content": c} for r, c in turns[:3]]
    assert answer == await asyncio.to_thread(chat_once, bridge.base, history, sampling)
    alone = await asyncio.to_thread(
        chat_once, bridge.base, [{"role": "user", "content": second}], sampling
    )
    print("with the first turn:", repr(answer), "\nalone:", repr(alone))
    assert "Rex" in answer and "Rex" not in alone  # only the first turn says the name


async def test_a_saved_conversation_reopens_with_its_messages(bridge, tmp_path):
    sampling = Sampling(temperature=0, top_p=1, max_tokens=16)
    app = make_app(bridge.base, tmp_path, sampling, system="Answer briefly.")
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, "Name three colors.")
        await answered(pilot, app)
        saved = app.conversation
        turns = shown(app)
        # Saved after the turn: the whole conversation, nothing else in the folder.
        assert [p.name for p in tmp_path.iterdir()] == [f"{saved.id}.json"]
        on_disk = json.loads((tmp_path / f"{saved.id}.json").read_text())
        assert [(m["role"], m["content"]) for m in on_disk["messages"]] == turns
        assert on_disk["system"] == "Answer briefly." and on_disk["sampling"]["max_tokens"] == 16
        await pilot.press("ctrl+n")  # a new conversation with one key
        await pilot.pause()
        assert shown(app) == [] and app.conversation.id != saved.id

    # A new app (a later start) lists it and opens it from disk.
    app = make_app(bridge.base, tmp_path, Sampling())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("ctrl+o")
        await until(pilot, lambda: isinstance(app.screen, ConversationsScreen), 5, "list")
        await pilot.press("enter")
        await until(pilot, lambda: app.conversation.id == saved.id, 5, "reopened conversation")
        await pilot.pause()
        assert shown(app) == turns
        assert app.conversation.system == "Answer briefly."
        assert app.conversation.sampling == sampling
        assert app.log_view.border_title == "Name three colors."


async def test_a_poll_that_lands_as_the_app_closes_is_dropped(bridge, tmp_path):
    """The cluster's figures arrive after the main screen's widgets are gone: nothing to show,
    and no crash (seen when a poll's timer fired during shutdown)."""
    app = make_app(bridge.base, tmp_path, Sampling(), poll_s=3600)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: not app._polling, 30, "first poll")
        await app.screen_stack[0].query_one("#cluster").remove()
        app.poll_cluster()
        await until(pilot, lambda: not app._polling, 30, "poll after the panel went")
        assert app.is_running


async def test_system_prompt_and_sampling_are_set_in_the_app(bridge, tmp_path):
    app = make_app(bridge.base, tmp_path, Sampling())
    system = "You are a pirate. Answer like a pirate."
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("ctrl+s")
        await until(pilot, lambda: isinstance(app.screen, SettingsScreen), 5, "settings")
        await pilot.press(*system)  # the system prompt box has the focus
        for field, value in (("temperature", "0"), ("top_p", "1"), ("max_tokens", "12")):
            await pilot.click(f"#{field}")
            await pilot.press("end", *["backspace"] * 8, *value)
        await pilot.press("ctrl+s")
        await until(pilot, lambda: not isinstance(app.screen, SettingsScreen), 5, "saved")
        assert app.conversation.system == system
        assert app.conversation.sampling == Sampling(temperature=0, top_p=1, max_tokens=12)
        assert "max 12 tokens" in str(app.query_one("#status").content)
        await ask(pilot, "Who are you?")
        await answered(pilot, app)
        answer = app.conversation.messages[-1].content
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Who are you?"}]
    expected = await asyncio.to_thread(
        chat_once, bridge.base, messages, Sampling(temperature=0, top_p=1, max_tokens=12)
    )
    assert answer == expected


def ask_greedy(client: openai.OpenAI, max_tokens: int = 16) -> str:
    reply = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": "Why is the sky blue?"}],
        temperature=0,
        max_tokens=max_tokens,
    )
    return reply.choices[0].message.content or ""


def stream_greedy(client: openai.OpenAI, max_tokens: int, on_chunk: Callable[[int], None]):
    """The same request streamed: its text, and the longest wait between two chunks (s)."""
    stream = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": "Why is the sky blue?"}],
        temperature=0,
        max_tokens=max_tokens,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text, longest, last = "", 0.0, time.monotonic()
    for n, chunk in enumerate(stream):
        now = time.monotonic()
        longest, last = max(longest, now - last), now
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        on_chunk(n)
    return text, longest


def back_to_three(base: str, restarts: dict[str, int], timeout: float = 90) -> dict:
    """/v1/cluster once the master and both workers are planned and ready, with these restart
    counts (the workers are started again after a loss); fails after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        cluster = httpx.get(f"{base}/v1/cluster", timeout=10).json()
        nodes = {n["name"]: n for n in cluster["nodes"]}
        if sorted(nodes) == ["local-1", "local-2", "master"] and all(
            n["ready"] and n["alive"] and n["slices"] for n in nodes.values()
        ):
            assert {k: nodes[k]["restarts"] for k in restarts} == restarts, cluster["nodes"]
            return cluster
        assert time.monotonic() < deadline, cluster["nodes"]
        time.sleep(0.5)


def hold_until_back(base: str, name: str, paused_pid: int, timeout: float = 60) -> None:
    """Hold the running answers, by pausing the worker `paused_pid` 0.3 s at a time (less than
    the 2 s that mark a node dead), until the restarted worker `name` has joined: so that it
    joins while they run, however fast this machine decodes; fails after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        nodes = httpx.get(f"{base}/v1/cluster", timeout=10).json()["nodes"]
        if any(n["name"] == name and n["alive"] and n["restarts"] == 1 for n in nodes):
            return
        assert time.monotonic() < deadline, nodes
        os.kill(paused_pid, signal.SIGSTOP)
        try:
            time.sleep(0.3)
        finally:
            os.kill(paused_pid, signal.SIGCONT)
        time.sleep(0.1)


def split_for_two_nodes(smollm2, state_dir: Path) -> None:
    """The plan a loss of one of three nodes re-plans to, split and its kernels checked
    beforehand: a pause then measures noticing, re-planning and replaying, not a first split,
    which other tests (in any order) may or may not have done already."""
    slices = plan_slices(smollm2.config, [1.0, 1.0])
    dtype = default_dtype()  # what the server runs the bundled model at
    split_model(smollm2, slices, ShardStore(state_dir / "shards"), dtype=dtype)
    prepare(plan_shapes(smollm2, slices, dtype), install=False)


async def test_workers_lost_mid_answer_lose_no_answer_and_come_back(
    tmp_path, shared_state, smollm2
):
    """A bridge of its own over three processes. A worker paused for 1 s mid-answer (less than
    the 2 s that mark a node dead) costs a pause and nothing else: no re-plan. A worker killed
    in the middle of a streamed 120-token answer: the stream pauses, the master re-plans on the
    two nodes left, replays the answer so far, and the stream completes with the uninterrupted
    run's text; the worker is started again and planned back in at a step boundary of that
    same answer (held by short pauses of the other worker until it has joined), not after it.
    The other killed mid-answer in the app: the answer completes, the cluster panel says a node
    was lost, the next prompt is answered, and that worker comes back too."""
    await asyncio.to_thread(split_for_two_nodes, smollm2, shared_state)
    local = await asyncio.to_thread(
        start_server,
        ["--local-nodes", "3", "--context", "512", "--state-dir", str(shared_state)],
        timeout=240,
    )
    try:
        client = openai.OpenAI(base_url=f"{local.base}/v1", api_key="unused", max_retries=0)
        workers = local_workers(local.proc.pid)
        assert sorted(workers) == ["local-1", "local-2"], workers

        def pause_at_chunk_30(n: int) -> None:
            if n == 30:
                os.kill(workers["local-2"], signal.SIGSTOP)
                time.sleep(1.0)
                os.kill(workers["local-2"], signal.SIGCONT)

        before, paused = await asyncio.to_thread(stream_greedy, client, 120, pause_at_chunk_30)
        generation = httpx.get(f"{local.base}/v1/cluster", timeout=10).json()["generation"]
        print(f"a 1 s pause of a worker held the stream {paused:.2f} s")
        assert generation["recovered"] == 0 and generation["replans_mid_answer"] == 0, generation
        assert generation["last_loss"] is None

        def kill_at_the_60th_chunk(n: int) -> None:
            if n == 60:
                os.kill(workers["local-1"], signal.SIGKILL)
            if n == 61:  # the answer goes on: it is still running when local-1 joins again
                hold_until_back(local.base, "local-1", workers["local-2"])

        after, pause = await asyncio.to_thread(stream_greedy, client, 120, kill_at_the_60th_chunk)
        print(f"the stream paused {pause:.2f} s for the loss and the re-plan")
        assert after == before and len(before) > 400
        # A guard against a hang, not a speed bar: the pause is printed, and measured as a
        # benchmark (the soak, docs/decisions.md); with the suite's other tests on the same two
        # cores it took 10.6 and 11.2 s, alone 3-8 s (2 s to notice, the re-plan, the replay).
        assert pause < 30
        cluster = httpx.get(f"{local.base}/v1/cluster", timeout=10).json()
        assert cluster["generation"]["recovered"] == 1, cluster["generation"]
        assert "node local-1 " in cluster["generation"]["last_loss"], cluster["generation"]
        assert cluster["generation"]["failed"] == 0
        # The restarted worker joined while that answer ran, and was planned back in at one of
        # its step boundaries: the answer replayed on three nodes and came out the same.
        assert cluster["generation"]["replans_mid_answer"] == 1, cluster["generation"]
        cluster = await asyncio.to_thread(back_to_three, local.base, {"local-1": 1, "local-2": 0})
        again, _ = await asyncio.to_thread(stream_greedy, client, 200, lambda n: None)
        assert again.startswith(before) and len(again) > len(before)

        app = make_app(
            local.base,
            tmp_path / "conversations",
            Sampling(temperature=0, top_p=1, max_tokens=120),
            down_hint="(restart the cluster)",
        )
        async with app.run_test(size=SIZE) as pilot:
            await ask(pilot, "Write a long story about a dragon and a knight.")
            await until(pilot, lambda: answer_text(app), 30, "first words")
            os.kill(workers["local-2"], signal.SIGKILL)
            summary = app.query_one("#cluster-summary", Static)

            def loss_shown() -> bool:
                console = Console(width=200, file=io.StringIO(), record=True)
                console.print(summary.content)
                text = console.export_text()
                return "node lost at" in text and "local-2" in text

            seconds = await until(pilot, loss_shown, 15, "the loss in the cluster panel")
            print(f"the panel showed the loss {seconds:.2f} s after the kill")
            await answered(pilot, app, timeout=120)
            assert [r for r, _ in shown(app)] == ["user", "assistant"], shown(app)
            assert len(shown(app)[-1][1]) > 200  # the whole answer, not its first words

            # The next prompt is answered (by the nodes left, or all three again).
            await ask(pilot, "Are you there?")
            await answered(pilot, app, timeout=120)
            role, text = shown(app)[-1]
            assert role == "assistant" and text.strip(), shown(app)[-1]
            assert not app.query_one("#cluster").has_class("down")
            saved = json.loads(
                (tmp_path / "conversations" / f"{app.conversation.id}.json").read_text()
            )
            assert [m["role"] for m in saved["messages"]] == [
                "user", "assistant", "user", "assistant"
            ]  # fmt: skip
        cluster = await asyncio.to_thread(back_to_three, local.base, {"local-1": 1, "local-2": 1})
        assert cluster["down"] is None
        assert cluster["generation"]["recovered"] == 2 and cluster["generation"]["failed"] == 0
    finally:
        local.stop()
