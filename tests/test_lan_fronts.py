"""The fronts on devices that join over the network: `edgetp serve` (and the chat on it) and
`edgetp master` as a service. Real `edgetp join` processes over loopback, the real model."""

from __future__ import annotations

import asyncio
import io
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import openai
import pytest
from http_client import HTTP
from rich.console import Console
from textual.widgets import Static
from waiting import until_shown, wait_until

from edgetp.master.bridge.client import start_server
from edgetp.tui.chat.app import ChatApp
from edgetp.tui.chat.client import BridgeClient, Sampling
from edgetp.tui.chat.store import ConversationStore

pytestmark = [pytest.mark.slow, pytest.mark.anyio]

EDGETP = Path(sys.executable).parent / "edgetp"
JOIN_LINE = re.compile(r"edgetp join THIS_HOST:(\d+) --token (\S+)")
QUESTION = "Name the largest planet of the solar system in one sentence."


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def edgetp(*args: str, **kw) -> subprocess.Popen:
    cmd = [str(EDGETP)] if EDGETP.exists() else [sys.executable, "-m", "edgetp.tui.cli"]
    return subprocess.Popen([*cmd, *args], env=os.environ, **kw)


def join(port: str, token: str, name: str, state: Path) -> subprocess.Popen:
    state.mkdir(parents=True, exist_ok=True)
    with open(state / "join.log", "wb") as log:
        return edgetp(
            "join", f"127.0.0.1:{port}", "--token", token, "--name", name, "--threads", "1",
            "--state-dir", str(state), stdout=subprocess.DEVNULL, stderr=log,
        )  # fmt: skip


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def greedy_answer(base_url: str, tokens: int = 24) -> str:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=tokens,
        temperature=0,
        timeout=300,  # a hang guard: 300 tokens on three processes sharing two busy cores
        extra_body={"ignore_eos": True},
    )
    return reply.choices[0].message.content or ""


def cluster_nodes(base_url: str) -> list[str]:
    figures = HTTP.get(f"{base_url}/v1/cluster", timeout=10).json()
    return [n["name"] for n in figures["nodes"]]


def panel_text(app: ChatApp) -> str:
    """The cluster panel's node blocks as the terminal shows them."""
    console = Console(width=60, file=io.StringIO(), record=True)
    console.print(app.cluster_panel.query_one("#cluster-nodes", Static).content)
    return console.export_text()


async def test_devices_join_the_chat_s_cluster_and_the_answer_stays_the_same(tmp_path):
    """`edgetp chat` without --local-nodes starts a cluster devices can join: two `edgetp join`
    processes join it while it answers (they are told they are in at once, and planned in once
    the answer is done), the panel shows them with their addresses once re-planned, and the
    greedy answer over the openai client equals the master's alone.
    (One thread a process: the three share this machine's two cores. `--every-device`: on a
    busy host the probes time loopback's round trips long enough that the plan would leave the
    devices on standby, a choice test_emulate checks, not this test.)"""
    bridge = await asyncio.to_thread(
        start_server,
        ["--cluster-port", "0", "--no-announce", "--context", "512", "--threads", "1",
         "--every-device", "--state-dir", str(tmp_path / "master")],
        timeout=240,
    )  # fmt: skip
    devices: list[subprocess.Popen] = []
    try:
        alone = await asyncio.to_thread(greedy_answer, bridge.base)
        found = [m for line in bridge.log if (m := JOIN_LINE.search(line))]
        assert found, "\n".join(bridge.log)
        port, token = found[0].groups()
        answers: list[str] = []
        long_answer = threading.Thread(
            target=lambda: answers.append(greedy_answer(bridge.base, 300))
        )
        long_answer.start()
        devices = [join(port, token, f"dev-{k}", tmp_path / f"dev-{k}") for k in (1, 2)]
        await asyncio.to_thread(  # HELLOs answered mid-answer
            wait_until,
            lambda: len(cluster_nodes(bridge.base)) >= 3,
            120,
            lambda: f"three nodes: {cluster_nodes(bridge.base)}",
        )
        assert long_answer.is_alive(), "the answer ended before the devices were let in"
        await asyncio.to_thread(long_answer.join)
        assert len(answers) == 1 and answers[0].strip()  # it went on, undisturbed
        store = ConversationStore(tmp_path / "conversations")
        app = ChatApp(BridgeClient(bridge.base), store, sampling=Sampling(), poll_s=0.5)
        async with app.run_test(size=(110, 36)) as pilot:

            def both_up() -> bool:
                assert all(d.poll() is None for d in devices), "a device exited"
                text = panel_text(app)
                return text.count("● up") == 3 and "dev-1" in text and "dev-2" in text

            def state() -> str:
                logs = [(tmp_path / f"dev-{k}" / "join.log").read_text()[-2000:] for k in (1, 2)]
                return (
                    f"devices up in the panel:\n{panel_text(app)}\nthe master's log:\n"
                    + "\n".join(list(bridge.log)[-40:])
                    + "\nthe devices' logs:\n"
                    + "\n".join(logs)
                )

            await until_shown(pilot, both_up, 180, state)
            text = panel_text(app)
        assert text.count("127.0.0.1") >= 2, text  # each device's address
        figures = HTTP.get(f"{bridge.base}/v1/cluster", timeout=10).json()
        assert sorted(n["name"] for n in figures["nodes"]) == ["dev-1", "dev-2", "master"]
        states = [(n["name"], n["ready"], n["share"]) for n in figures["nodes"]]
        # Every node ready, both devices planned in, the layers all placed. The master may take
        # few of them: its speed is measured as the devices', and three processes on two busy
        # cores measure unevenly (seen, when its lm_head was counted against it: master 0.0,
        # dev-2 0.5694, dev-1 0.4306).
        assert all(ready for _, ready, _ in states), states
        shares = {name: share or 0 for name, _, share in states}
        assert shares["dev-1"] > 0 and shares["dev-2"] > 0, states
        assert abs(sum(shares.values()) - 1) < 1e-3, states
        together = await asyncio.to_thread(greedy_answer, bridge.base)
        print(f"alone: {alone!r}\n3 nodes: {together!r}")
        assert together == alone and alone.strip()
        # each device's link as the plan timed it, and what its partials' hops took
        figures = HTTP.get(f"{bridge.base}/v1/cluster", timeout=10).json()
        workers = [n for n in figures["nodes"] if n["role"] == "worker"]
        assert all(n["link_rtt_us"] > 0 and n["hop_us_median"] > 0 for n in workers), workers
        print([(n["name"], n["link_rtt_us"], n["hop_us_median"], n["hop_us_p99"]) for n in workers])
        bridge.stop()
        # told BYE, they leave cleanly (a moment after the master has gone)
        assert [d.wait(30) for d in devices] == [0, 0]
    finally:
        bridge.stop()
        stop(devices)


def test_a_master_without_a_terminal_serves_until_sigterm(tmp_path):
    """Run as a service (stdin at end-of-file), `edgetp master` keeps its worker after the
    first plan, and SIGTERM stops both cleanly."""
    master_err = open(tmp_path / "master.log", "w+")
    master = edgetp(
        "master", "--port", "0", "--no-announce", "--workers", "1", "--context", "128",
        "--threads", "1",
        "--state-dir", str(tmp_path / "master"),
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=master_err, text=True,
    )  # fmt: skip
    devices: list[subprocess.Popen] = []
    try:

        def said(pattern: re.Pattern[str]) -> re.Match[str] | None:
            """The master's line that matches, once it has written it; fails if it exits."""
            text = Path(master_err.name).read_text()
            assert master.poll() is None, text
            return pattern.search(text)

        def log() -> str:
            return f"line in the master's log:\n{Path(master_err.name).read_text()}"

        found = wait_until(lambda: said(JOIN_LINE), 120, log)
        devices = [join(*found.groups(), "dev-1", tmp_path / "dev-1")]
        wait_until(lambda: said(re.compile("ready; stdin is not a terminal")), 180, log)
        # Past end-of-file on stdin both still run: a master that took it for the end would
        # exit at once (its prompt loop reads every 0.5 s); these 3 s are the span of the check.
        with pytest.raises(subprocess.TimeoutExpired):
            master.wait(3)
        assert devices[0].poll() is None
        master.send_signal(signal.SIGTERM)
        assert master.wait(30) == 0, Path(master_err.name).read_text()
        assert devices[0].wait(30) == 0  # the master said BYE
    finally:
        stop([master, *devices])
        master_err.close()
