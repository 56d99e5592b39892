"""Speculative decoding by prompt lookup: more tokens a step, never other tokens."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from cluster_threads import master_threads
from test_sampling import SIX_HISTORY, SIX_LOGITS, assert_distributed_as

from edgetp.master.cluster.local import local_session
from edgetp.master.cluster.session import Session
from edgetp.master.generation.generate import start, stream
from edgetp.master.generation.params import SamplingParams
from edgetp.master.generation.prompts import prompt_tokens
from edgetp.master.generation.sampling import Sampler
from edgetp.master.generation.speculate import (
    DRAFT_MAX,
    DraftModel,
    DraftState,
    Speculator,
    draft_source,
    lookup,
    open_speculator,
)
from edgetp.memory.budget import FILE_TYPES
from edgetp.models.config import DEFAULT_MODEL
from edgetp.models.errors import ModelError

PARAGRAPH = (
    "The committee met on Tuesday to discuss the budget for the coming year. After a long "
    "debate, the members agreed to increase funding for the library and the public parks, while "
    "reducing spending on administrative travel. The chair thanked everyone for their patience."
)
EDIT = f"Repeat this paragraph word for word, but write Friday instead of Tuesday:\n\n{PARAGRAPH}"


class SlowLinkSpeculator(Speculator):
    """Step costs as on links with 2 ms round trips (a step 100 ms, each token 2 ms more),
    and a draft model's forwards as free, whatever this machine measures: these tests check
    what drafts do to the output, not when they pay (the benchmarks measure that)."""

    def __init__(self, model: DraftModel | None = None) -> None:
        super().__init__(model=model)
        self.step_s = {w: 0.100 + 0.002 * (w - 1) for w in range(1, DRAFT_MAX + 2)}

    def record_step(self, seconds: float, width: int, decode: bool) -> None:
        pass

    def cost(self, k: int) -> float:
        return self.step_cost(k)


def poor_draft_model(session: Session, tokenizer) -> DraftModel:
    """The target's own weights rounded again to q4_0 (teacher-forced top-1 agreement with the
    target 0.70, tests/test_window.py): drafts that are often rejected, so every test with it
    takes rejected drafts back out of the draft model's cache as well as the target's."""
    speculator = open_speculator(DEFAULT_MODEL, "q4_0", session, tokenizer)
    assert speculator is not None and speculator.model is not None
    return speculator.model


def test_lookup_drafts_what_followed_the_latest_earlier_match():
    assert lookup([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2) == [7, 5]  # the latest, not the first
    assert lookup([1, 2, 3, 9, 1, 2, 3], 8) == [9, 1, 2, 3]  # as far as the text goes
    assert lookup([5, 6, 7, 8], 3) == []  # nothing repeats
    assert lookup([1, 2, 3, 1, 2, 3], 0) == []
    # The last two tokens' bytes (01 00 00 00 00 00 00 00) also stand across the boundary of
    # 256 (00 01 00 00) and the zeros after it, later than their one true match: no match.
    assert lookup([1, 0, 7, 0, 256, 0, 0, 1, 0], 2) == [7, 0]


def test_the_draft_length_backs_off_when_drafts_miss_and_grows_when_tokens_are_cheap():
    s = Speculator()
    state = DraftState()
    s.record_draft(state, drafted=8, accepted=6, made=7)  # the 7th rejected, the 8th untested
    assert (state.kept, state.tested) == (0.8 * 1 + 6, 0.8 * 2 + 7)
    s.record_draft(state, drafted=4, accepted=4, made=5)  # all kept: none rejected
    assert (state.kept, state.tested) == (0.8 * 6.8 + 4, 0.8 * 8.6 + 4)
    s.step_s = {w: 0.100 + 0.002 * (w - 1) for w in range(1, 10)}  # hops make the step
    assert s.draft_length(DraftState.at(0.9)) == DRAFT_MAX
    missing = DraftState.at(0.0)
    lengths = [s.draft_length(missing) for _ in range(32)]
    assert [i for i, k in enumerate(lengths) if k] == [15, 31]  # a try costs 4%: every 16 steps
    assert set(lengths) == {0, 2}
    s.step_s = {1: 0.013, 2: 0.022, 3: 0.032, 5: 0.044, 9: 0.044}  # one node, as measured
    assert s.draft_length(DraftState.at(0.9)) == 8
    assert s.draft_length(DraftState.at(0.3)) == 0
    missing = DraftState.at(0.05)
    lengths = [s.draft_length(missing) for _ in range(600)]
    # Tried again now and then, as rarely as keeps the tries under 1% of the time: a try of 2
    # costs 1.46 steps more than a step, so one every 147 steps.
    assert [i for i, k in enumerate(lengths) if k] == [146, 293, 440, 587], lengths
    assert set(lengths) == {0, 2}
    # A new sequence, whose prior (one in two) would not draft here, tries at once: nothing is
    # known of how its drafts fare.
    new = DraftState()
    assert [s.draft_length(new) for _ in range(3)] == [2, 0, 0]
    # A draft model whose forward costs what a one-token step does: on one node its drafts
    # could not pay even if all were kept, so it never tries, not even at first.
    slow = Speculator(model=SimpleNamespace(forward_s=0.013, catch_up_s=0.005))
    slow.step_s = dict(s.step_s)
    assert {slow.draft_length(DraftState.at(1.0)) for _ in range(400)} == {0}
    assert {slow.draft_length(DraftState()) for _ in range(400)} == {0}
    # One half as slow would pay when all are kept, but a new sequence's first try would
    # also catch the draft model up on its prompt: 36 tokens at 5 ms are 14 steps' time.
    half = Speculator(model=SimpleNamespace(forward_s=0.007, catch_up_s=0.005))
    half.step_s = {1: 0.013}  # only one-token steps measured yet
    assert half.draft_length(DraftState()) == 2
    assert half.draft_length(DraftState(), behind=36) == 0


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, seed=3),
        SamplingParams(temperature=1.2, top_k=4, top_p=0.9, repetition_penalty=1.3, seed=4),
    ],
    ids=["temperature", "top-k-top-p-penalty"],
)
def test_a_verified_draft_leaves_the_distribution_as_it_was(params):
    """Whatever token is drafted (likely, unlikely, or cut off by top-k/top-p), the token that
    `verify` returns is distributed as the sampler's own distribution. A chi-square test over
    10,000 draws on a 6-token vocabulary, seeded: its false alarm rate is 0.1% per draft."""
    sampler = Sampler(params)
    p = sampler.distribution(SIX_LOGITS, SIX_HISTORY)
    for draft in range(6):
        print(f"draft {draft}:", end=" ")
        assert_distributed_as(lambda d=draft: sampler.verify(SIX_LOGITS, SIX_HISTORY, d), p)


def _generate(engine, tokenizer, prompts, speculator, max_tokens=64):
    seqs = start(engine, prompts, [SamplingParams(max_tokens=max_tokens)] * len(prompts))
    for _ in stream(engine, tokenizer, seqs, speculator):
        pass
    return [g.tokens for g in seqs]


@pytest.fixture(scope="module")
def one_node(smollm2, shared_state):
    """One process of two slots for the one-node tests, on the file's blocks as `edgetp` runs
    them: drafts are held to the same engine's plain run (mechanics, not parity)."""
    with Session(smollm2, None, shared_state, context=512, slots=2, memory=FILE_TYPES) as session:
        session.start()
        yield session


@pytest.mark.slow
def test_greedy_tokens_are_the_same_with_and_without_drafts_on_one_node(
    one_node, smollm2_tokenizer
):
    """A batch of two: a prompt to repeat with an edit (drafts hit) and an open question (they
    mostly miss): each sequence's tokens equal its non-speculative run's, and the first makes
    several tokens a step."""
    engine = one_node.engine
    prompts = [
        prompt_tokens(smollm2_tokenizer, EDIT, raw=False),
        prompt_tokens(smollm2_tokenizer, "Why is the sky blue?", raw=False),
    ]
    plain = _generate(engine, smollm2_tokenizer, prompts, None)
    speculator = SlowLinkSpeculator()
    drafted = _generate(engine, smollm2_tokenizer, prompts, speculator)
    figures = speculator.figures()
    print(f"\n{figures}")
    assert drafted == plain
    assert figures["accepted"] > 20 and figures["tokens_per_step"] > 1.3, figures


@pytest.mark.slow
def test_greedy_tokens_are_the_same_with_a_draft_model(one_node, smollm2_tokenizer):
    """A batch of two open prompts, drafted by a poor draft model: each sequence's tokens
    equal its non-speculative run's although many drafts are rejected."""
    prompts = [
        prompt_tokens(smollm2_tokenizer, "Why is the sky blue?", raw=False),
        prompt_tokens(smollm2_tokenizer, "Write a haiku about the sea.", raw=False),
    ]
    assert one_node.engine is not None
    plain = _generate(one_node.engine, smollm2_tokenizer, prompts, None)
    speculator = SlowLinkSpeculator(poor_draft_model(one_node, smollm2_tokenizer))
    try:
        drafted = _generate(one_node.engine, smollm2_tokenizer, prompts, speculator)
    finally:
        speculator.close()
    figures = speculator.figures()
    print(f"\n{figures}")
    assert drafted == plain
    assert figures["accepted"] > 20 and figures["tokens_per_step"] > 1.3, figures
    assert figures["accepted"] < figures["drafted"], figures  # rejections were taken back


@pytest.mark.slow
@master_threads(3)
def test_greedy_tokens_are_the_same_with_and_without_drafts_on_three_nodes(
    smollm2, smollm2_tokenizer, shared_state
):
    """Prompt lookup and a draft model on the master of three nodes."""
    prompts = [prompt_tokens(smollm2_tokenizer, EDIT, raw=False)]
    with local_session(
        smollm2, 3, state_dir=shared_state, context=512, memory=FILE_TYPES
    ) as session:
        assert session.engine is not None
        plain = _generate(session.engine, smollm2_tokenizer, prompts, None)
        lookups = SlowLinkSpeculator()
        by_lookup = _generate(session.engine, smollm2_tokenizer, prompts, lookups)
        by_model = SlowLinkSpeculator(poor_draft_model(session, smollm2_tokenizer))
        try:
            by_draft_model = _generate(session.engine, smollm2_tokenizer, prompts, by_model)
        finally:
            by_model.close()
    print(f"\n{lookups.figures()}\n{by_model.figures()}")
    assert by_lookup == plain and by_draft_model == plain
    assert lookups.figures()["tokens_per_step"] > 1.5
    assert by_model.figures()["tokens_per_step"] > 1.5


def test_a_draft_model_of_another_vocabulary_is_refused(smollm2_tokenizer):
    with pytest.raises(ModelError, match="vocabulary has 262144 tokens, the target's 49152"):
        draft_source("gemma3-270m", smollm2_tokenizer)
