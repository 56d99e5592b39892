"""Prompt reuse: a conversation's later turns prefill only what is new since the last answer.

A conversation runs through the generation loop turn after turn, each turn sending the whole
conversation as the chat app does, once with prompt reuse off and once on: the greedy answers are
the same, and on, each later turn's prefill step carries only the tokens past the earlier turns
(counted from the engine's step batches). The same on three local nodes, and for a conversation
that goes another way than the kept one half-way.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field, replace

import numpy as np
import pytest
import torch

from edgetp.master.cluster.engine import Engine
from edgetp.master.cluster.hub import Hub
from edgetp.master.cluster.local import local_session
from edgetp.master.cluster.session import Session
from edgetp.master.cluster.transport import ClusterError
from edgetp.master.generation.batcher import Batcher, Delta, Event, Failed, Finished
from edgetp.master.generation.params import SamplingParams
from edgetp.master.generation.prompts import chat_tokens
from edgetp.master.generation.reuse import SlotPool, Taken, common_prefix, reusable
from edgetp.memory.budget import FILE_TYPES
from edgetp.models.bundled import BUNDLED_MODELS
from edgetp.models.config import ModelConfig
from edgetp.models.layers import StepBatch
from edgetp.models.rows_native import NativeBlocks
from edgetp.models.source import open_model
from edgetp.node.kvcache import KEPT_TOKENS

pytestmark = pytest.mark.slow

SYSTEM = "You are a helpful assistant. Answer in one or two sentences."
QUESTIONS = [
    "What is the capital of France?",
    "And what river runs through it?",
    "Name one famous museum there.",
    "How old is that museum?",
]
OTHER_TURN = "What is the capital of Italy, then?"  # in place of QUESTIONS[1]
ANSWER_TOKENS = 24
TIMEOUT = 120.0


@dataclass
class Turn:
    prompt: int  # tokens
    reused: int  # as the figures say
    prefilled: int  # tokens of the request's first step, as the engine was given them
    start: int  # where that step started in its slot
    text: str


@dataclass
class Steps:
    """Every step the engine was given: (tokens, batch)."""

    seen: list[StepBatch] = field(default_factory=list)


@pytest.fixture
def steps(monkeypatch) -> Steps:
    record = Steps()
    forward = Engine.forward

    def recording(self, tokens, batch, all_logits=False):
        record.seen.append(batch)
        return forward(self, tokens, batch, all_logits)

    monkeypatch.setattr(Engine, "forward", recording)
    return record


def ask(batcher: Batcher, steps: Steps, tokens: list[int]) -> Turn:
    """One request, alone in the loop: its text and how its prompt was fed."""
    events: queue.Queue[Event] = queue.Queue()
    before = len(steps.seen)
    batcher.submit(tokens, SamplingParams(max_tokens=ANSWER_TOKENS), events.put)
    text = ""
    while True:
        e = events.get(timeout=TIMEOUT)
        if isinstance(e, Delta):
            text += e.text
        elif isinstance(e, Failed):
            raise e.error
        elif isinstance(e, Finished):
            break
    first = steps.seen[before]  # the request's prefill: the only sequence in the loop
    stats = batcher.stats()
    assert stats.last_reuse is not None and stats.last_reuse.prompt_tokens == len(tokens)
    reused = stats.last_reuse.reused_tokens
    return Turn(len(tokens), reused, first.lengths[0], first.starts[0], text)


def converse(
    session: Session, tokenizer, steps: Steps, reuse: bool, questions: list[str]
) -> list[Turn]:
    """The conversation turn by turn, the whole of it sent each turn, as the chat app does."""
    batcher = Batcher(session, tokenizer, prompt_reuse=reuse).start()
    try:
        messages = [{"role": "system", "content": SYSTEM}]
        turns = []
        for q in questions:
            messages.append({"role": "user", "content": q})
            turns.append(ask(batcher, steps, chat_tokens(tokenizer, messages)))
            messages.append({"role": "assistant", "content": turns[-1].text})
        return turns
    finally:
        batcher.close()


def check_reuse(off: list[Turn], on: list[Turn], tokenizer, questions: list[str]) -> None:
    assert [t.text for t in on] == [t.text for t in off]
    assert all(t.reused == 0 and t.prefilled == t.prompt and t.start == 0 for t in off)
    assert on[0].reused == 0 and on[0].prefilled == on[0].prompt
    for k in range(1, len(on)):
        t = on[k]
        assert t.start == t.reused and t.prefilled == t.prompt - t.reused, t
        # Everything before this turn's question is reused: the earlier prompt, the answer
        # (the template's end-of-turn token after it excepted, which the model did not feed),
        # so what is prefilled is that token, the question and the template's marks around it.
        new = len(tokenizer.encode(questions[k], add_bos=False))
        print(f"turn {k + 1}: {t.prompt} prompt tokens, {t.reused} reused, {t.prefilled} "
              f"prefilled for a question of {new}")  # fmt: skip
        assert t.reused >= on[k - 1].prompt
        assert new <= t.prefilled <= new + 12, (t, new)


def test_a_conversation_prefills_only_each_new_turn_and_answers_the_same(
    smollm2, smollm2_tokenizer, steps, shared_state
):
    """One process: with reuse each later turn prefills its question and the template's marks
    around it, and every answer is the one without reuse; a conversation that goes another way
    at its second turn reuses the first turn only, and answers as it does without reuse."""
    with Session(smollm2, None, shared_state, context=1024, slots=2, memory=FILE_TYPES) as session:
        session.start()
        off = converse(session, smollm2_tokenizer, steps, False, QUESTIONS)
        on = converse(session, smollm2_tokenizer, steps, True, QUESTIONS)
        check_reuse(off, on, smollm2_tokenizer, QUESTIONS)

        other = [QUESTIONS[0], OTHER_TURN]
        other_off = converse(session, smollm2_tokenizer, steps, False, other)
        batcher = Batcher(session, smollm2_tokenizer).start()
        try:  # the whole of `QUESTIONS` is kept, then the other conversation comes
            messages = [{"role": "system", "content": SYSTEM}]
            for q, t in zip(QUESTIONS, on, strict=True):
                messages.append({"role": "user", "content": q})
                ask(batcher, steps, chat_tokens(smollm2_tokenizer, messages))
                messages.append({"role": "assistant", "content": t.text})
            diverging = messages[:3] + [{"role": "user", "content": OTHER_TURN}]
            turn = ask(batcher, steps, chat_tokens(smollm2_tokenizer, diverging))
        finally:
            batcher.close()
        kept = chat_tokens(smollm2_tokenizer, messages[:4])  # up to the second question
        diverged = chat_tokens(smollm2_tokenizer, diverging)
        common = next(i for i, (a, b) in enumerate(zip(kept, diverged, strict=False)) if a != b)
        print(f"diverging: {turn.prompt} prompt tokens, {turn.reused} reused, common {common}")
        assert on[0].prompt <= turn.reused == common < turn.prompt
        assert turn.prefilled == turn.prompt - common
        assert turn.text == other_off[1].text


def test_three_local_nodes_prefill_only_each_new_turn(
    smollm2, smollm2_tokenizer, steps, shared_state
):
    """Three local nodes: the nodes keep every slot's KV, so the same holds."""
    with local_session(
        smollm2, 3, context=1024, slots=2, state_dir=shared_state, memory=FILE_TYPES
    ) as session:
        off = converse(session, smollm2_tokenizer, steps, False, QUESTIONS[:3])
        on = converse(session, smollm2_tokenizer, steps, True, QUESTIONS[:3])
    check_reuse(off, on, smollm2_tokenizer, QUESTIONS[:3])


def test_a_node_lost_forgets_what_the_slots_held(smollm2, smollm2_tokenizer, steps, shared_state):
    """A node lost mid-step: the re-planned engine's caches are empty, so a prompt that the old
    engine's slot held is prefilled again (past what the new engine's slots hold), and answers
    the same."""

    class LostNode:  # the seam: the other devices, lost in the first step after `fail` is set
        fail = False

        def begin_step(self, batch: object) -> None:
            pass

        def send(self, *args: object, **kwargs: object) -> None:
            if self.fail:
                self.fail = False
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

    # A real hub that no worker joined: the master alone re-plans for itself.
    with Session(
        smollm2, Hub("127.0.0.1", 0), shared_state, context=256, slots=2, memory=FILE_TYPES
    ) as session:
        lost = LostNode()
        session.start().remote = lost
        batcher = Batcher(session, smollm2_tokenizer).start()
        try:
            system = {"role": "system", "content": SYSTEM}
            tokens = chat_tokens(smollm2_tokenizer, [system, {"role": "user", "content": "Hi!"}])
            first = ask(batcher, steps, tokens)
            again = ask(batcher, steps, tokens)
            assert again.reused == len(tokens) - 1 and again.text == first.text
            lost.fail = True
            messages = [system, {"role": "user", "content": QUESTIONS[0]}]
            other_tokens = chat_tokens(smollm2_tokenizer, messages)
            ask(batcher, steps, other_tokens)  # a node is lost in its prefill: re-planned
            assert batcher.stats().recovered == 1
            after = ask(batcher, steps, tokens)
        finally:
            batcher.close()
    assert after.reused == common_prefix(other_tokens, tokens) < len(tokens) - 1
    assert after.text == first.text


class _Engine:  # what a slot pool reads of an engine, with a config of a local layer or none
    def __init__(self, ring: int | None, context: int = 4096) -> None:
        self.config = ModelConfig(
            architecture="LlamaForCausalLM", n_layers=2, hidden=64, n_heads=2, n_kv_heads=1,
            head_dim=32, ffn_hidden=64, vocab_size=100, context_length=context, norm_eps=1e-5,
            rope_theta=1e4, local_layers=(0,) if ring else (), sliding_window=ring,
        )  # fmt: skip
        self.max_context = context


def _engine(ring: int | None) -> _Engine:
    return _Engine(ring)


def test_a_slot_is_taken_by_its_longest_common_prefix_and_forgotten_with_its_engine():
    """The free slot that shares most is taken (else the least recently used); at least one
    prompt token is prefilled; another engine (a re-plan) holds nothing; off, nothing reused."""
    pool = SlotPool(3)
    engine = _engine(None)
    pool.bind(engine)  # type: ignore[arg-type]
    a, b = pool.take([1, 2, 3]), pool.take([1, 2, 3])
    assert (a.slot, a.start, b.slot, b.start) == (0, 0, 1, 0)
    pool.give_back(a.slot, [1, 2, 3, 4])
    pool.give_back(b.slot, [1, 2, 9])
    assert pool.take([1, 2, 3, 4, 5]) == type(a)(0, 4)
    pool.give_back(0, [1, 2, 3, 4, 5, 6])  # free: 1, 2, 0
    assert pool.take([1, 2, 3, 4, 5, 6]) == type(a)(0, 5)  # the last token's logits are needed
    pool.give_back(0, [1, 2, 3, 4, 5, 6])  # free: 1, 2, 0
    assert pool.take([1, 2, 3]) == type(a)(1, 2)  # as good as slot 0: the least recently used
    pool.give_back(1, [1, 2, 3])  # free: 2, 0, 1
    assert pool.take([7]).slot == 2  # nothing matches: the least recently used
    pool.give_back(2, None)
    pool.bind(_engine(None))  # type: ignore[arg-type]
    assert pool.take([1, 2, 3, 4, 5]).start == 0
    off = SlotPool(1, reuse=False)
    off.give_back(off.take([1, 2]).slot, [1, 2])
    assert off.take([1, 2, 3]).start == 0


def test_a_local_layer_ring_limits_reuse_to_carrying_on_from_its_end():
    """A ring of 4 positions: while a slot's tokens fit it any common prefix serves; past it,
    only a request that goes on from the kept tokens' end (the last one may differ)."""
    assert reusable([1, 2, 3], [1, 2, 5, 6], ring=4) == 2
    kept = list(range(10))
    assert reusable(kept, kept + [10, 11], ring=4) == 10
    assert reusable(kept, kept[:9] + [99, 11], ring=4) == 9
    assert reusable(kept, kept[:8] + [99, 11], ring=4) == 0
    assert reusable(kept, kept[:8] + [99, 11], ring=None) == 8
    pool = SlotPool(1)
    pool.bind(_engine(4))  # type: ignore[arg-type]
    pool.give_back(pool.take(kept).slot, kept)
    assert pool.take(kept[:5] + [42]).start == 0


def test_a_running_slot_gives_its_positions_to_a_free_one_unless_its_ring_went_round():
    """A prompt that begins as a running sequence's takes the least recently used free slot and
    copies those positions (`source`), when they are more than a free slot holds; a running
    ring gives them only while its tokens (and a step's drafts past them) fit it."""
    pool = SlotPool(4)
    pool.bind(_engine(None))  # type: ignore[arg-type]
    for tokens in ([1, 2, 3], [1, 2, 3, 4, 5, 6]):
        pool.take(tokens)  # slots 0 and 1 run; 2 and 3 are free
    pool.give_back(pool.take([1, 9]).slot, [1, 9])  # slot 2 holds [1, 9]: free 3, 2
    running = {0: [1, 2, 3], 1: [1, 2, 3, 4, 5, 6]}
    assert pool.reusable([1, 2, 3, 4, 7], running) == Taken(3, 4, source=1)
    assert pool.take([1, 2, 3, 4, 7], running) == Taken(3, 4, source=1)
    assert pool.take([1, 9, 9], {0: [1, 2, 3]}) == Taken(2, 2)  # its own slot holds more
    ring = SlotPool(2)
    ring.bind(_engine(32))  # type: ignore[arg-type]
    kept = list(range(32 - KEPT_TOKENS))
    assert ring.take(kept + [99], {1: kept}) == Taken(0, len(kept), source=1)
    ring.give_back(0, None)
    assert ring.take(kept + [99], {1: kept + [7]}).start == 0  # its drafts may go round
    off = SlotPool(2, reuse=False)
    assert off.take([1, 2, 3], {1: [1, 2, 3, 4]}) == Taken(0, 0)


COPY_PROMPT = "The history of the city of Paris begins with a small settlement on an island"


@pytest.mark.parametrize(
    ("model", "nodes", "kv_cache"),
    [("smollm2", 1, "f32"), ("smollm2", 3, "f32"), ("smollm2", 1, "q8_0"), ("gemma3", 1, "f32")],
)
def test_positions_copied_from_another_slot_answer_as_the_slot_that_holds_them(
    model, nodes, kv_cache, smollm2, shared_state
):
    """On every node the copy (`StepBatch.sources`) gives the keys and values of the slot it
    copies: the prompt's rest after them has the logits, to the bit, and the greedy tokens
    that the slot holding them gives when it carries on itself (prompt reuse), and in a float32
    cache those of the whole prompt prefilled in a slot of its own. Gemma 3 copies its local
    layers' rings; a q8_0 cache its codes and scales."""
    source = smollm2 if model == "smollm2" else open_model(BUNDLED_MODELS["gemma3-270m"]())
    tokenizer = source.tokenizer()
    first = tokenizer.encode(COPY_PROMPT + " in the river Seine.")
    other = tokenizer.encode(COPY_PROMPT + " that the Romans called Lutetia, and")
    shared = common_prefix(first, other)
    assert 10 < shared < len(other) - 4
    rest = other[shared:]
    memory = replace(FILE_TYPES, kv_cache=kv_cache)
    with local_session(
        source, nodes, context=128, slots=3, state_dir=shared_state, memory=memory
    ) as session:
        engine = session.engine
        assert engine is not None
        engine.forward([first], StepBatch((0,), (0,), (len(first),)))
        copied = engine.forward([rest], StepBatch((1,), (shared,), (len(rest),), (0,)))
        kept = engine.forward([rest], StepBatch((0,), (shared,), (len(rest),)))  # carries on
        whole = engine.forward([other], StepBatch((2,), (0,), (len(other),)))
        assert torch.equal(copied, kept)
        largest = (copied - whole).abs().max().item()
        print(f"\n{model}, {nodes} node(s), {kv_cache} KV: {largest:.2e} from a whole prefill")
        slots = (1, 0, 2) if kv_cache == "f32" else (1, 0)  # q8_0: a prefill reads fresh floats
        if kv_cache == "f32":
            assert largest < 1e-3
        tokens = [int(copied[0].argmax()), int(kept[0].argmax()), int(whole[0].argmax())]
        greedy: list[list[int]] = [[] for _ in slots]
        for k in range(8):  # all in one step, each reading its own slot
            for seq, t in zip(greedy, tokens, strict=False):
                seq.append(t)
            at = len(other) + k
            step = StepBatch(slots, (at,) * len(slots), (1,) * len(slots))
            logits = engine.forward([[t] for t in tokens[: len(slots)]], step)
            tokens = [int(row.argmax()) for row in logits]
        assert all(seq == greedy[0] for seq in greedy), greedy


AGENT_SYSTEM = (
    "You are a careful assistant for a travel agency. You answer questions about cities, "
    "their weather, their museums and how to travel between them. Keep every answer short, "
    "name the city you are asked about, and never invent opening hours or prices: say that "
    "you do not know them instead. When a question is about the weather, say which season "
    "the answer is for. When it is about travel, give the usual way and the time it takes."
)
CITY_QUESTIONS = [f"What should I see first in {c}?" for c in ("Paris", "Rome", "Oslo", "Lima")]


def test_requests_that_arrive_together_prefill_what_they_share_once(
    smollm2, smollm2_tokenizer, steps, shared_state
):
    """Requests with one long system prompt, submitted together: the first prefills it, the
    others wait a step and copy its positions into their own slots (reuse.py), so they prefill
    their questions only; every answer is the one without reuse."""

    def answers(batcher: Batcher) -> list[tuple[str, int]]:
        done: list[queue.Queue[Event]] = [queue.Queue() for _ in CITY_QUESTIONS]
        for q, events in zip(CITY_QUESTIONS, done, strict=True):
            messages = [{"role": "system", "content": AGENT_SYSTEM}, {"role": "user", "content": q}]
            tokens = chat_tokens(smollm2_tokenizer, messages)
            batcher.submit(tokens, SamplingParams(max_tokens=ANSWER_TOKENS), events.put)
        out = []
        for events in done:
            text = ""
            while not isinstance(e := events.get(timeout=TIMEOUT), Finished):
                assert not isinstance(e, Failed), e.error
                text += e.text if isinstance(e, Delta) else ""
            out.append((text, e.reused_tokens))
        return out

    with Session(smollm2, None, shared_state, context=512, slots=4, memory=FILE_TYPES) as session:
        session.start()
        runs = {}
        for reuse in (False, True):
            batcher = Batcher(session, smollm2_tokenizer, prompt_reuse=reuse).start()
            try:
                before = len(steps.seen)
                runs[reuse] = (answers(batcher), steps.seen[before:])
            finally:
                batcher.close()
    prompts = [
        chat_tokens(smollm2_tokenizer, [{"role": "system", "content": AGENT_SYSTEM},
                                        {"role": "user", "content": q}])
        for q in CITY_QUESTIONS
    ]  # fmt: skip
    shared = min(common_prefix(prompts[0], p) for p in prompts[1:])
    assert shared > 80
    (off, off_steps), (on, on_steps) = runs[False], runs[True]
    assert [text for text, _ in on] == [text for text, _ in off]
    assert all(reused == 0 for _, reused in off)
    reused = sorted(r for _, r in on)
    assert reused[0] == 0 and all(r >= shared for r in reused[1:]), reused

    def prefilled(seen: list[StepBatch]) -> int:
        return sum(n for batch in seen for n in batch.lengths if n > 1)

    copies = [c for batch in on_steps for c in batch.copies()]
    print(f"\nprefilled {prefilled(off_steps)} prompt tokens without reuse, {prefilled(on_steps)} "
          f"with; {len(copies)} copies of {shared}+ positions")  # fmt: skip
    assert len(copies) == len(CITY_QUESTIONS) - 1
    assert prefilled(on_steps) <= prefilled(off_steps) - (len(CITY_QUESTIONS) - 1) * shared
