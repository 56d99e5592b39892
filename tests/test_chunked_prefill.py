"""Chunked prefill: while other requests decode, a long prompt prefills a chunk at a time, with a
decode step of the others between two chunks, so their streams go on while it prefills.

A prompt fed in chunks leaves the cache a prompt fed whole leaves: every family's greedy tokens
are the same (SmolLM2 on 1 and 3 nodes, Gemma 3's local layers with chunks across the ring's
wrap, Qwen3.5's DeltaNet states); and in the generation loop a stream's answer and the long
prompt's answer are each what they are alone.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

import pytest
from test_families import _assert_close_logits
from test_qwen35 import qwen35  # noqa: F401 - a fixture

from edgetp.master.bench.long_prompt import prose_tokens
from edgetp.master.cluster.engine import Engine
from edgetp.master.cluster.figures import BatcherStats
from edgetp.master.cluster.local import local_session
from edgetp.master.cluster.session import Session
from edgetp.master.generation.batcher import (
    Batcher,
    Delta,
    Event,
    Failed,
    Finished,
)
from edgetp.master.generation.generate import start, step
from edgetp.master.generation.params import CHUNK_STEP_S, SamplingParams
from edgetp.master.generation.reuse import SlotPool
from edgetp.memory.budget import FILE_TYPES
from edgetp.models.bundled import BUNDLED_MODELS
from edgetp.models.layers import StepBatch
from edgetp.models.source import open_model
from edgetp.node.kvcache import KEPT_TOKENS

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
TIMEOUT = 120.0


def _greedy(engine: Engine, tokenizer, prompt: list[int], chunk: int | None) -> tuple[list, int]:
    """8 greedy tokens after `prompt`, prefilled whole (`chunk` None) or in chunks, and the
    steps its prefill took."""
    (g,) = start(engine, [prompt], [GREEDY], tokenizer)
    steps = 0
    while not g.tokens:
        step(engine, tokenizer, [g], prefill_chunk=chunk)
        steps += 1
    while not g.finished:
        step(engine, tokenizer, [g])
    return g.tokens, steps


@pytest.mark.parametrize(
    ("model", "nodes", "length", "chunk"),
    [("smollm2", 1, 300, 64), ("smollm2", 3, 300, 64), ("gemma3", 1, 700, 150)],
)
def test_a_prompt_in_chunks_answers_as_one_fed_whole(model, nodes, length, chunk, smollm2,
                                                     shared_state):  # fmt: skip
    """The chunks' last logits are those of the whole prompt (within float32 sums' order), and
    the 8 greedy tokens after them the same; so are a short last step's, run as rows. Gemma 3's
    local layers hold a ring of 512 positions: its 700-token prompt's chunks of 150 cross the
    ring's wrap."""
    source = smollm2 if model == "smollm2" else open_model(BUNDLED_MODELS["gemma3-270m"]())
    tokenizer = source.tokenizer()
    prompt = prose_tokens(tokenizer, length)
    with local_session(
        source, nodes, context=1024, slots=3, state_dir=shared_state, memory=FILE_TYPES
    ) as session:
        engine = session.engine
        assert engine is not None
        whole = engine.forward([prompt], StepBatch((0,), (0,), (length,)))
        for at in range(0, length, chunk):
            part = prompt[at : at + chunk]
            chunked = engine.forward([part], StepBatch((1,), (at,), (len(part),)))
        _assert_close_logits(chunked, whole, f"{model}, {nodes} node(s), chunks of {chunk}")
        want, one_step = _greedy(engine, tokenizer, prompt, None)
        got, steps = _greedy(engine, tokenizer, prompt, chunk)
        assert one_step == 1 and steps == -(-length // chunk)
        assert got == want
        # A step of one sequence's few tokens (a draft check, a prompt's last chunk) runs as a
        # decode step's rows in the native blocks, each row attending to those before it: its
        # logits are a prefill's. Gemma 3's 12 rows cross its local layers' ring wrap.
        end = min(length, 517)
        fed = engine.forward([prompt[:end]], StepBatch((0,), (0,), (end,)))
        engine.forward([prompt[: end - 12]], StepBatch((1,), (0,), (end - 12,)))
        rows = engine.forward([prompt[end - 12 : end]], StepBatch((1,), (end - 12,), (12,)))
        assert engine.executors[0].native_step
        _assert_close_logits(rows, fed, f"{model}, {nodes} node(s), 12 tokens as rows")
        # Beside another sequence's one token, in one step of 13 rows: each sequence's logits
        # are its own step's, and at every row (a draft check's) those of a torch step.
        x = int(fed[0].argmax())
        alone = engine.forward([[x]], StepBatch((0,), (end,), (1,)))
        both = StepBatch((0, 1), (end, end - 12), (1, 12))
        mixed = engine.forward([[x], prompt[end - 12 : end]], both)
        assert engine.executors[0].native_step
        every = engine.forward([[x], prompt[end - 12 : end]], both, all_logits=True)
        what = f"{model}, {nodes} node(s), 1 + 12 rows"
        _assert_close_logits(mixed[:1], alone, what)
        _assert_close_logits(mixed[1:], rows, what)
        _assert_close_logits(every[0, :1], alone, what)
        # A ring's positions are written in order once in a slot (or put back after drafts):
        # the torch step's sequence has one of its own.
        engine.forward([prompt[: end - 20]], StepBatch((2,), (0,), (end - 20,)))
        wide = engine.forward(
            [prompt[end - 20 : end]], StepBatch((2,), (end - 20,), (20,)), all_logits=True
        )
        _assert_close_logits(every[1], wide[0, 8:], what)


class _Ids:
    """What `step` reads of a tokenizer, for the random Qwen3.5, which has none: no end token,
    and each token's number as its text."""

    eos_ids: frozenset[int] = frozenset()

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


def test_a_linear_attention_prompt_in_chunks_is_reused_from_its_end(qwen35):  # noqa: F811
    """Qwen3.5's DeltaNet state is kept at the end of a prompt's last step when that step is
    wider than KEPT_TOKENS: a chunk that would leave that few is fed with the rest, so the
    state at the prompt's end is kept, and the conversation's next turn starts there."""
    _, folder, _ = qwen35
    source = open_model(folder)
    prompt = [(7 * i) % 300 + 3 for i in range(70)]
    chunk = 30  # 30, then the 40 left: 30, 30 and 10 would end on a step too short for a state
    assert 0 < len(prompt) % chunk <= KEPT_TOKENS
    engine = Engine.local(source, (1.0, 1.0), slots=2)
    pool = SlotPool(2)
    pool.bind(engine)
    (g,) = start(engine, [prompt], [GREEDY])
    g.slot = pool.take(prompt).slot
    fed = []
    while not g.finished:
        before = g.position
        step(engine, _Ids(), [g], prefill_chunk=chunk)  # type: ignore[arg-type]
        fed.append(g.position - before)
    assert fed == [30, 40] + [1] * 7
    pool.give_back(g.slot, g.cached())
    later = prompt + [(g.tokens[0] + 1) % 300] + list(range(40, 60))  # another answer, question
    again = pool.take(later)
    assert (again.slot, again.start) == (g.slot, len(prompt))
    rest = later[again.start :]
    got = engine.forward([rest], StepBatch((again.slot,), (again.start,), (len(rest),)))
    want = Engine.local(source).forward([later], StepBatch((0,), (0,), (len(later),)))
    _assert_close_logits(got, want, "carried on from a chunked prompt's end")


@dataclass
class Stream:
    """One request's text and events, and the engine step each of its deltas came after."""

    text: str = ""
    done: threading.Event = field(default_factory=threading.Event)
    events: queue.Queue[Event] = field(default_factory=queue.Queue)

    def on_event(self, e: Event) -> None:
        if isinstance(e, Delta):
            self.text += e.text
        self.events.put(e)
        if isinstance(e, Finished | Failed):
            self.done.set()


def _fed_beside(seen: list[StepBatch], stream_slot: int, prompt: int) -> list[int]:
    """The tokens of a `prompt`-token prompt each step fed beside the stream's."""
    return [
        n
        for b in seen
        if stream_slot in b.slots
        for slot, start, n in zip(b.slots, b.starts, b.lengths, strict=True)
        if slot != stream_slot and start < prompt
    ]


def test_a_long_prompt_prefills_between_a_running_streams_steps(
    smollm2, smollm2_tokenizer, shared_state, monkeypatch
):
    """A stream decodes; a 600-token prompt arrives. It prefills in chunks, each step of them
    its alone and each followed by a step of the stream, or, chunks small enough, beside the
    stream's token in one step of rows; both answers are the ones each gives alone. The loop
    reports the longest wait a stream saw and the chunk it sized."""
    seen: list[StepBatch] = []
    forward = Engine.forward

    def recording(self, tokens, batch, all_logits=False):
        seen.append(batch)
        return forward(self, tokens, batch, all_logits)

    monkeypatch.setattr(Engine, "forward", recording)
    chat = smollm2_tokenizer.encode("The three primary colours are")
    long = prose_tokens(smollm2_tokenizer, 600)
    stream_params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    long_params = SamplingParams(max_tokens=8, temperature=0.0)

    def beside(session: Session, chunk_step_s: float) -> tuple[list[str], BatcherStats]:
        """The stream's text and the long prompt's, the prompt sent once the stream decodes."""
        seen.clear()
        batcher = Batcher(
            session, smollm2_tokenizer, prompt_reuse=False, chunk_step_s=chunk_step_s
        ).start()
        try:
            running, late = Stream(), Stream()
            batcher.submit(chat, stream_params, running.on_event)
            for _ in range(4):  # it decodes now, its decode steps timed
                assert isinstance(running.events.get(timeout=TIMEOUT), Delta)
            batcher.submit(long, long_params, late.on_event)
            assert late.done.wait(TIMEOUT) and running.done.wait(TIMEOUT)
            return [running.text, late.text], batcher.stats()
        finally:
            batcher.close()

    with Session(smollm2, None, shared_state, context=1024, slots=2, memory=FILE_TYPES) as session:
        session.start()
        batcher = Batcher(session, smollm2_tokenizer).start()
        try:
            alone = []
            for prompt, params in ((chat, stream_params), (long, long_params)):
                s = Stream()
                batcher.submit(prompt, params, s.on_event)
                assert s.done.wait(TIMEOUT)
                alone.append(s.text)
        finally:
            batcher.close()
        texts, stats = beside(session, CHUNK_STEP_S)
        assert texts == alone
        stream_slot = seen[0].slots[0]  # the stream's prefill, then its steps, alone or not
        chunks = [i for i, b in enumerate(seen) if stream_slot not in b.slots]
        fed = [seen[i].lengths[0] for i in chunks]
        # The rest rode with the stream's steps: a first chunk sized from its 5-token prompt,
        # a last piece of at most MIXED_PREFILL_MAX tokens.
        along = _fed_beside(seen, stream_slot, len(long))
        assert len(chunks) > 2 and sum(fed) + sum(along) == len(long), (fed, along)
        for i in chunks[:-1]:  # each chunk alone is followed by a step of the stream
            assert stream_slot in seen[i + 1].slots
        assert stats.longest_gap_ms > 0 and stats.prefill_chunk > 0
        print(f"\nchunks fed {fed}; longest gap {stats.longest_gap_ms} ms")
        # Chunks aimed at 2 decode steps share a step of rows with the stream's token wherever
        # both fit one (`Engine.row_step_tokens`), and the answers are still each one's alone.
        # How many chunks fit depends on the steps' times (a loaded machine sizes them larger):
        # the rule is what holds, on any machine.
        texts, shared = beside(session, 0.001)
        assert session.engine is not None
        rows = session.engine.row_step_tokens
    assert texts == alone
    stream_slot = seen[0].slots[0]
    alongside = _fed_beside(seen, stream_slot, len(long))
    by_itself = [
        b.lengths[0] for b in seen if stream_slot not in b.slots and b.starts[0] < len(long)
    ]
    assert alongside and sum(alongside) + sum(by_itself) == len(long), (alongside, by_itself)
    assert all(n + 1 <= rows for n in alongside), (alongside, rows)
    # a chunk went by itself only where it did not fit (the prompt's last piece may be shorter)
    assert all(n + 1 > rows for n in by_itself[:-1]), (by_itself, rows)
    print(f"fed beside the stream {alongside}, by itself {by_itself}; longest gap "
          f"{shared.longest_gap_ms} ms")  # fmt: skip
