"""The generation loop behind the REST bridge: continuous batching and cancellation, in-process.

The real model on a real engine; requests are submitted from this thread as the bridge's
handlers would, and their events come back from the loop's thread.
"""

from __future__ import annotations

import copy
import gc
import queue
import threading
import weakref

import numpy as np
import openai
import pytest
from http_client import HTTP
from serving import served_app
from test_speculate import EDIT, SlowLinkSpeculator
from waiting import wait_until

from edgetp.master.bridge.app import create_app
from edgetp.master.bridge.core import Served
from edgetp.master.cluster.engine import Engine
from edgetp.master.cluster.hub import Hub
from edgetp.master.cluster.session import Session
from edgetp.master.cluster.transport import ClusterError
from edgetp.master.generation.batcher import Batcher, Delta, Event, Failed, Finished
from edgetp.master.generation.params import SamplingParams
from edgetp.master.generation.prompts import prompt_tokens
from edgetp.memory.budget import FILE_TYPES
from edgetp.models.errors import ModelError
from edgetp.models.rows_native import NativeBlocks

pytestmark = pytest.mark.slow

PROMPTS = ["Why is the sky blue?", "Write a haiku about the sea.", "What is 17 times 23?"]
TIMEOUT = 60.0


class Client:
    """One request's events, gathered as the bridge's handler would."""

    def __init__(self, batcher: Batcher, prompt: list[int], params: SamplingParams) -> None:
        self.events: queue.Queue[Event] = queue.Queue()
        self.text = ""
        self.steps_seen: list[int] = []  # the batcher's step count at each event
        self.batcher = batcher

        def on_event(e: Event) -> None:
            self.steps_seen.append(batcher.stats().steps)
            self.events.put(e)

        self.ticket = batcher.submit(prompt, params, on_event)

    def next(self) -> Event:
        e = self.events.get(timeout=TIMEOUT)
        if isinstance(e, Delta):
            self.text += e.text
        return e

    def finish(self) -> Finished:
        while True:
            e = self.next()
            if isinstance(e, Failed):
                raise e.error
            if isinstance(e, Finished):
                return e


@pytest.fixture(scope="module")
def batcher(smollm2, smollm2_tokenizer, shared_state):
    session = Session(smollm2, None, shared_state, context=256, slots=2, memory=FILE_TYPES)
    session.start()
    b = Batcher(session, smollm2_tokenizer, max_waiting=4).start()
    yield b
    b.close()
    session.close()


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    return [prompt_tokens(smollm2_tokenizer, p, raw=False) for p in PROMPTS]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def solo(batcher, prompts):
    """Each prompt's greedy text with nothing else running."""
    out = []
    for p in prompts:
        c = Client(batcher, p, greedy(24))
        done = c.finish()
        assert done.completion_tokens == 24 and done.finish_reason == "length"
        out.append(c.text)
    return out


def test_a_request_joins_the_running_batch_at_the_next_step(batcher, prompts, solo):
    long = Client(batcher, prompts[0], greedy(24))
    while not long.text:  # the long request is decoding
        long.next()
    steps_before = batcher.stats().steps
    short = Client(batcher, prompts[1], greedy(24))
    first = short.next()  # its prefill shares a step with the other's decode
    assert isinstance(first, Delta)
    joined_at = short.steps_seen[0]
    assert joined_at <= steps_before + 2, (steps_before, joined_at)  # no waiting for `long`
    short_done, long_done = short.finish(), long.finish()
    assert short_done.completion_tokens == long_done.completion_tokens == 24
    # The batching invariant: sharing steps changes nothing in either output.
    assert (long.text, short.text) == (solo[0], solo[1])
    assert batcher.stats().largest_batch == 2


def test_a_cancelled_request_is_dropped_before_the_next_step(batcher, prompts):
    before = batcher.stats()
    c = Client(batcher, prompts[2], greedy(200))
    while len(c.text) < 10:
        c.next()
    c.ticket.cancel()
    stats = wait_until(
        lambda: (now := batcher.stats()).cancelled > before.cancelled and now,
        TIMEOUT,
        "cancel in the generation loop",
    )
    record = stats.last_cancel
    assert record is not None and record.id == c.ticket.id
    assert record.late_steps == 0  # only the step already running when it came computed on
    assert record.tokens < 200
    assert stats.active == 0  # its slot is free again
    c.ticket.cancel()  # twice is harmless


def test_requests_wait_for_a_free_slot_and_then_join(batcher, prompts, solo):
    clients = [Client(batcher, prompts[i], greedy(24)) for i in (0, 1, 2)]  # 2 slots
    for c in clients:
        c.finish()
    assert [c.text for c in clients] == solo
    # The third started only once one of the first two had finished and freed its slot.
    assert clients[2].steps_seen[0] > min(clients[0].steps_seen[-1], clients[1].steps_seen[-1])


def test_embeddings_wait_for_a_free_slot_and_leave_the_answers_as_they_were(
    batcher, prompts, solo, smollm2_tokenizer
):
    texts = [smollm2_tokenizer.encode(p) for p in PROMPTS]
    alone = batcher.embed(texts).result(TIMEOUT)
    clients = [Client(batcher, prompts[i], greedy(24)) for i in (0, 1)]  # both slots
    for c in clients:
        while not c.text:
            c.next()
    assert batcher.stats().active == 2
    gone = batcher.embed(texts)
    gone.cancel()  # its client went away: the loop drops it and goes on to the next
    during = batcher.embed(texts)
    assert not during.done()  # no slot is free while both answers run
    for c in clients:
        c.finish()
    assert [c.text for c in clients] == solo[:2]  # their KV slots untouched
    for a, b in zip(alone, during.result(TIMEOUT), strict=True):
        assert np.allclose(a, b, rtol=0, atol=1e-6)
    with pytest.raises(ModelError, match="input 1 has 0 tokens"):
        batcher.embed([texts[0], []])
    with pytest.raises(ModelError, match="input 0 has 257 tokens"):
        batcher.embed([[1] * 257])  # the context is 256
    wait_until(lambda: batcher.stats().active == 0, TIMEOUT, "the slots freed")


def test_a_request_whose_logits_are_not_a_number_fails_alone(batcher, prompts, solo, monkeypatch):
    """NaN among one sequence's logits (its weights or this device's kernels broken) ends that
    request with what to check; the other in its step answers as it would have alone. The
    engine's output is where NaN would come from: it is set there, in one row of one step."""
    engine = batcher.engine
    forward = engine.forward
    poisoned: list[int] = []

    def nan_in_one_row(tokens, batch, all_logits=False):
        logits = forward(tokens, batch, all_logits)
        if not poisoned and len(batch.slots) == 2 and min(batch.starts) > 0:  # both decoding
            poisoned.append(batch.slots[1])
            logits = logits.clone()  # the engine's is an inference tensor
            logits[1] = float("nan")
        return logits

    monkeypatch.setattr(engine, "forward", nan_in_one_row)
    clients = [Client(batcher, prompts[i], greedy(24)) for i in (0, 1)]
    outcomes = []
    for c in clients:
        try:
            outcomes.append(c.finish())
        except Exception as exc:  # noqa: BLE001 - the failed one's error, checked below
            outcomes.append(exc)
    assert len(poisoned) == 1
    failed = [i for i, o in enumerate(outcomes) if not isinstance(o, Finished)]
    assert len(failed) == 1, outcomes
    assert "not a number (NaN among its logits)" in str(outcomes[failed[0]])
    (ok,) = {0, 1} - set(failed)
    assert outcomes[ok].completion_tokens == 24 and clients[ok].text == solo[ok]
    assert batcher.stats().active == 0  # the failed one's slot is free again


def test_the_waiting_line_is_bounded(batcher, prompts):
    from edgetp.master.generation.batcher import BusyError

    clients, refused = [], None
    for _ in range(8):  # 2 slots + 4 waiting
        try:
            clients.append(Client(batcher, prompts[0], greedy(8)))
        except BusyError as exc:
            refused = exc
            break
    assert refused is not None and "--max-batch" in str(refused)
    for c in clients:
        c.finish()


def test_submit_is_thread_safe(batcher, prompts, solo):
    results: dict[int, str] = {}

    def run(i: int) -> None:
        c = Client(batcher, prompts[i], greedy(24))
        c.finish()
        results[i] = c.text

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert [results[0], results[1]] == solo[:2]


def test_a_node_lost_mid_answer_loses_no_answer_and_frees_the_old_engine_first(
    smollm2, smollm2_tokenizer, shared_state, prompts, solo
):
    """A step that fails for a lost node, eight tokens into two answers: the master re-plans
    and both answers go on from where they were, token for token what they are uninterrupted;
    the old engine's weights and KV cache were gone before the new engine loaded (a device
    cannot hold both)."""

    class LostNode:  # the seam: the other devices, one of which dies during step 9
        steps = 0

        def begin_step(self, batch: object) -> None:
            self.steps += 1

        def send(self, *args: object, **kwargs: object) -> None:
            if self.steps == 9:
                raise ClusterError("node local-1 is unreachable")

        def gather(self, *args: object, **kwargs: object) -> None:
            return None

        def decode_layers(
            self,
            blocks: NativeBlocks,
            h: np.ndarray,
            post_norms: np.ndarray | None,
            eps: float,
            attention_alone: bool,
        ) -> tuple[np.ndarray, float]:
            self.send()  # no other devices: the master's own blocks are the whole layer
            for i in range(blocks.config.n_layers):
                h = h + blocks.attention(i, h)
                h = h + blocks.ffn(i, h)
            return h, 0.0

    old_caches: list[weakref.ref] = []
    alive_during_replan: list[bool] = []

    class Watched(Session):
        def _plan(self) -> Engine:
            gc.collect()
            alive_during_replan.extend(ref() is not None for ref in old_caches)
            return super()._plan()

    # A real hub that no worker joined: the master alone re-plans for itself.
    session = Watched(
        smollm2, Hub("127.0.0.1", 0), shared_state, context=256, slots=2, memory=FILE_TYPES
    )
    old = session.start()
    old.remote = LostNode()
    old_caches.append(weakref.ref(old.executors[0].cache))
    del old
    b = Batcher(session, smollm2_tokenizer, max_waiting=4).start()
    try:
        clients = [Client(b, p, greedy(24)) for p in prompts[:2]]
        done = [c.finish() for c in clients]
        assert [c.text for c in clients] == solo[:2]
        assert [d.completion_tokens for d in done] == [24, 24]
        stats = b.stats()
        assert stats.recovered == 2 and stats.failed == 0, stats
        assert "local-1" in (stats.last_loss or "") and "2 answer(s) went on" in stats.last_loss
    finally:
        b.close()
        session.close()
    assert alive_during_replan == [False]
    assert b.engine is None and session.engine is None  # closed with the session


@pytest.fixture(scope="module")
def drafting(smollm2, smollm2_tokenizer, shared_state):
    """A batcher with drafts (`--draft lookup`) on a session of its own."""
    session = Session(smollm2, None, shared_state, context=256, slots=2, memory=FILE_TYPES)
    session.start()
    b = Batcher(session, smollm2_tokenizer, speculator=SlowLinkSpeculator()).start()
    yield b
    b.close()
    session.close()


def test_drafted_requests_in_one_batch_give_each_its_own_greedy_text(
    smollm2_tokenizer, batcher, drafting, prompts
):
    """With drafts (`--draft lookup`), a request that repeats its prompt and one that does not
    share the steps: each text equals the one the batcher without drafts gives; the figures say
    how many drafts were taken, and tokens/s counts every token a step made."""
    mixed = [prompt_tokens(smollm2_tokenizer, EDIT, raw=False), prompts[0]]
    plain = [Client(batcher, p, greedy(48)) for p in mixed]
    for c in plain:
        c.finish()
    clients = [Client(drafting, p, greedy(48)) for p in mixed]
    assert [c.finish().completion_tokens for c in clients] == [48, 48]
    stats = drafting.stats()
    edit_steps = clients[0].steps_seen[-1] - clients[0].steps_seen[0] + 1
    print(f"\n{stats.speculation}; the repeating request took {edit_steps} steps for 48 tokens")
    assert [c.text for c in clients] == [c.text for c in plain]
    assert stats.speculation["accepted"] > 10 and edit_steps < 40
    busy = sum(stats.step_ms_recent) / 1000  # every step of both is among the recent ones
    assert len(stats.step_ms_recent) == stats.steps
    assert abs(stats.tokens_per_s * busy - 96) < 1  # tokens made, not sequences stepped


def test_drafts_leave_one_greedy_answer_as_it_was_through_every_api(
    smollm2_tokenizer, batcher, drafting
):
    """Speculation is the engine's, below every API: a greedy request that drafts well (it
    repeats its prompt) gives, through chat completions, Responses, Messages and Ollama's chat,
    the text the batcher gives without drafts, and drafts were taken for each."""
    question = [{"role": "user", "content": EDIT}]
    tokens = 16
    alone = Client(batcher, prompt_tokens(smollm2_tokenizer, EDIT, raw=False),
                   SamplingParams(max_tokens=tokens))  # fmt: skip
    alone.finish()
    greedy_fields = {"model": "smollm2", "temperature": 0}
    asks = {
        "/v1/chat/completions": ({"messages": question, "max_tokens": tokens},
                                 lambda r: r["choices"][0]["message"]["content"]),
        "/v1/responses": ({"input": question, "max_output_tokens": tokens},
                          lambda r: r["output"][0]["content"][0]["text"]),
        "/v1/messages": ({"messages": question, "max_tokens": tokens},
                         lambda r: r["content"][0]["text"]),
        "/api/chat": ({"messages": question, "stream": False, "options": {"num_predict": tokens,
                       "temperature": 0}}, lambda r: r["message"]["content"]),
    }  # fmt: skip
    with served_app(create_app(Served(drafting, smollm2_tokenizer, "smollm2")), TIMEOUT) as url:
        for path, (body, text) in asks.items():
            accepted = drafting.stats().speculation["accepted"]
            reply = HTTP.post(f"{url}{path}", json={**greedy_fields, **body}, timeout=TIMEOUT)
            assert reply.status_code == 200, reply.text
            assert text(reply.json()) == alone.text, path
            assert drafting.stats().speculation["accepted"] > accepted, path


def test_a_model_without_a_chat_template_is_told_to_use_completions(batcher, smollm2_tokenizer):
    """The bridge over a model that brings no chat template: a chat request is refused with the
    endpoint that takes text as it is, and that endpoint answers (uvicorn on a real port)."""
    no_template = copy.copy(smollm2_tokenizer)
    no_template.chat_template = None
    app = create_app(Served(batcher, no_template, model_id="smollm2"))
    with served_app(app, TIMEOUT) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", timeout=TIMEOUT)
        message = {"role": "user", "content": "Why is the sky blue?"}
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="smollm2", messages=[message])
        error = refused.value.body
        assert isinstance(error, dict) and error["param"] == "messages", error
        assert "no chat template" in error["message"] and "/v1/completions" in error["message"]
        text = client.completions.create(
            model="smollm2",
            prompt="The sky is",
            max_tokens=4,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert text.usage is not None and text.usage.completion_tokens == 4
