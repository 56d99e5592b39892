"""A node lost mid-stream through every API the bridge speaks: `edgetp serve --local-nodes 3`,
one worker SIGKILLed after the first deltas of a streamed greedy answer, through each API's own
client (the `openai` client's Responses and completions streams, the `anthropic` client's
Messages stream, the `ollama` client's chat stream), and an embeddings request of many inputs.
Chat completions has the same test in tests/test_chat_app.py (a worker killed mid-answer), and
the soak many of them.

The batcher's recovery (`_replan_running`) re-plans on the nodes left and replays each running
answer's prompt and tokens so far into the new plan's cache, then samples on as the
uninterrupted run would have. So, through each API: the stream ends with its API's own end
(the same as the healthy run's, no error event), its greedy text is that of the same request
on the healthy cluster, the master counts one answer recovered from the loss of that worker,
and the server answers the next request. The killed worker is started again and planned back
in before the next test, so each test starts from three nodes.

One server for the module, the APIs one after another on it: the suite's time is a budget.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import openai
import pytest
from local_processes import local_workers
from test_soak import cluster, planned_on_all_three

from edgetp.master.bridge.client import ServerProcess, start_server

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
PROMPT = "Write a long story about a dragon and a knight."
# Greedy SmolLM2 writes well past this: each answer ends by its limit, so the kill after
# KILL_AT deltas lands with most of the answer still to come (37 tokens sampled after the
# replay: what the check needs, and each test streams three answers on three nodes).
MAX_TOKENS = 40
KILL_AT = 3  # text deltas before the kill
STREAM_HUNG_S = 120  # s with no word from a stream: it has hung
BACK_S = 120  # s for a killed worker to be started again and planned back in


@pytest.fixture(scope="module")
def server(shared_state) -> Iterator[ServerProcess]:
    local = start_server(
        ["--local-nodes", "3", "--context", "512", "--state-dir", str(shared_state)],
        verbose=True,
        timeout=240,
    )
    try:
        yield local
    finally:
        local.stop()
        print("\n".join(line for line in local.log if "WARNING" in line or "ERROR" in line))


def planned_on_three(base: str) -> dict:
    """/v1/cluster once the master and both workers are planned, alive and ready."""
    return planned_on_all_three(base, BACK_S)


def restarts(figures: dict) -> dict[str, int]:
    return {n["name"]: n.get("restarts", 0) for n in figures["nodes"] if n["name"] != "master"}


def killed_mid_stream(
    server: ServerProcess, victim: str, stream: Callable[[Callable[[], None]], tuple[str, str]]
) -> tuple[str, str]:
    """`stream(on_delta)`'s (text, end) with `victim` SIGKILLed at its KILL_AT-th text delta;
    checks that the master recovered that one answer from that loss and that the worker came
    back (planned in again, restarted once more)."""
    before = planned_on_three(server.base)
    recovered = before["generation"]["recovered"]
    pid = local_workers(server.proc.pid)[victim]
    deltas = 0

    def on_delta() -> None:
        nonlocal deltas
        deltas += 1
        if deltas == KILL_AT:
            os.kill(pid, signal.SIGKILL)

    text, end = stream(on_delta)
    assert deltas >= KILL_AT, f"the answer ended after {deltas} deltas, before the kill"
    generation = cluster(server.base)["generation"]
    assert generation["recovered"] == recovered + 1, generation
    assert f"node {victim} " in generation["last_loss"], generation
    after = planned_on_three(server.base)
    assert restarts(after) == {**restarts(before), victim: restarts(before)[victim] + 1}
    return text, end


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=STREAM_HUNG_S
    )


def test_responses_stream_recovers_from_a_lost_node(server, oai):
    def stream(on_delta: Callable[[], None]) -> tuple[str, str]:
        text, kinds = "", []
        events = oai.responses.create(
            model=MODEL, input=PROMPT, max_output_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        for event in events:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
                on_delta()
        assert not {"error", "response.failed"} & set(kinds), kinds
        final = event.response  # the last event carries the whole response
        assert final.output_text == text
        return text, f"{kinds[-1]} {final.status} {final.incomplete_details}"

    healthy, end = stream(lambda: None)
    assert end.startswith("response.incomplete incomplete"), end  # its limit: max_output_tokens
    assert killed_mid_stream(server, "local-1", stream) == (healthy, end)
    assert stream(lambda: None) == (healthy, end)


def test_anthropic_messages_stream_recovers_from_a_lost_node(server):
    import anthropic  # a slow import, for this test only

    claude = anthropic.Anthropic(
        base_url=server.base, api_key="unused", max_retries=0, timeout=STREAM_HUNG_S
    )

    def stream(on_delta: Callable[[], None]) -> tuple[str, str]:
        text, kinds = "", []
        # The anthropic client has no temperature argument any more: greedy goes in the body.
        with claude.messages.stream(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=MAX_TOKENS,
            extra_body={"temperature": 0},
        ) as events:
            for event in events:
                kinds.append(event.type)
                if event.type == "content_block_delta" and event.delta.type == "text_delta":
                    text += event.delta.text
                    on_delta()
            final = events.get_final_message()
        assert "error" not in kinds, kinds
        assert "".join(b.text for b in final.content if b.type == "text") == text
        return text, f"{kinds[-1]} {final.stop_reason}"

    healthy, end = stream(lambda: None)
    assert end == "message_stop max_tokens", end
    assert killed_mid_stream(server, "local-2", stream) == (healthy, end)
    assert stream(lambda: None) == (healthy, end)


def test_ollama_chat_stream_recovers_from_a_lost_node(server):
    import ollama  # a slow import, for this test only

    client = ollama.Client(host=server.base, timeout=STREAM_HUNG_S)

    def stream(on_delta: Callable[[], None]) -> tuple[str, str]:
        text, last = "", None
        for last in client.chat(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPT}],
            options={"num_predict": MAX_TOKENS, "temperature": 0},
            stream=True,
        ):
            if last.message.content:
                text += last.message.content
                on_delta()
        assert last is not None
        return text, f"done={last.done} {last.done_reason}"

    healthy, end = stream(lambda: None)
    assert end == "done=True length", end
    assert killed_mid_stream(server, "local-1", stream) == (healthy, end)
    assert stream(lambda: None) == (healthy, end)


def test_completions_stream_recovers_from_a_lost_node(server, oai):
    def stream(on_delta: Callable[[], None]) -> tuple[str, str]:
        text, finish = "", None
        # A prompt without the chat template ends early: ignore_eos (edgetp's, as the soak's)
        # keeps it going to its limit, so the kill lands mid-answer.
        for chunk in oai.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            for choice in chunk.choices:
                if choice.text:
                    text += choice.text
                    on_delta()
                finish = choice.finish_reason or finish
        return text, f"finish_reason={finish}"

    healthy, end = stream(lambda: None)
    assert end == "finish_reason=length", end
    assert killed_mid_stream(server, "local-2", stream) == (healthy, end)
    assert stream(lambda: None) == (healthy, end)


def test_embeddings_recover_from_a_node_lost_mid_request(server, oai):
    """An embeddings request of many inputs runs as several steps (a step's inputs take the
    free slots): a worker killed while it runs costs it nothing. The inputs not yet computed
    run on the re-planned cluster, and every vector equals the healthy cluster's (to float
    rounding: two nodes sum the partials in another order than three)."""
    # 16 inputs of 46 tokens: two steps of the server's 8 slots.
    texts = [f"{PROMPT} Chapter {k}: the knight rides north through the rain." * 2
             for k in range(16)]  # fmt: skip

    def embed() -> tuple[np.ndarray, float]:
        started = time.perf_counter()
        data = oai.embeddings.create(model=MODEL, input=texts).data
        return np.array([d.embedding for d in data]), time.perf_counter() - started

    healthy, first_s = embed()
    again, healthy_s = embed()
    assert np.allclose(again, healthy, rtol=0, atol=1e-6)  # the same split: the same sums
    before = planned_on_three(server.base)
    pid = local_workers(server.proc.pid)["local-2"]
    killer = threading.Timer(min(first_s, healthy_s) / 4, os.kill, (pid, signal.SIGKILL))
    killer.start()
    try:
        after_loss, _ = embed()
    finally:
        killer.cancel()
    figures = cluster(server.base)["generation"]
    assert figures["last_loss"] != before["generation"]["last_loss"], figures
    assert "node local-2 " in figures["last_loss"], figures
    assert np.allclose(after_loss, healthy, rtol=0, atol=1e-5), abs(after_loss - healthy).max()
    back = planned_on_three(server.base)
    assert restarts(back) == {**restarts(before), "local-2": restarts(before)["local-2"] + 1}
    assert np.allclose(embed()[0], healthy, rtol=0, atol=1e-5)
