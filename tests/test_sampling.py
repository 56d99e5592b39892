"""Sampling rules on known logits, and stop/length handling on the real model."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import numpy as np
import pytest
import torch

from edgetp.master.bridge.schema import SEED_LIMIT
from edgetp.master.cluster.engine import Engine
from edgetp.master.generation.generate import start, stream
from edgetp.master.generation.params import GREEDY_BELOW, TEMPERATURE_MAX, SamplingParams
from edgetp.master.generation.sampling import DRAW_BLOCK, LOGPROB_FLOOR, TOP_P_CANDIDATES, Sampler
from edgetp.master.generation.speculate import Speculator
from edgetp.models.errors import ModelError
from edgetp.models.layers import StepBatch

LOGITS = torch.tensor([1.0, 3.0, 2.5, -1.0, 0.5])


def draws(params: SamplingParams, n: int = 200, history=()) -> list[int]:
    sampler = Sampler(params)
    return [sampler(LOGITS, list(history)) for _ in range(n)]


def test_greedy_takes_the_argmax():
    assert set(draws(SamplingParams(), 5)) == {1}


def test_seed_makes_sampling_repeatable():
    p = SamplingParams(temperature=1.0, seed=7)
    assert draws(p) == draws(p)
    assert draws(p) != draws(SamplingParams(temperature=1.0, seed=8))
    # Any seed the bridge takes, negative too, and each its own.
    negative = SamplingParams(temperature=1.0, seed=-SEED_LIMIT)
    assert draws(negative) == draws(negative) != draws(SamplingParams(temperature=1.0, seed=-7))
    assert draws(SamplingParams(temperature=1.0, seed=-7)) != draws(p)


def test_top_k_keeps_only_the_k_best():
    assert set(draws(SamplingParams(temperature=2.0, top_k=2, seed=0))) == {1, 2}


def test_top_p_keeps_the_smallest_covering_prefix():
    probs = torch.softmax(LOGITS, -1)  # sorted: 1 (0.51), 2 (0.31), 0 (0.11) ...
    assert probs[1] < 0.6 < probs[1] + probs[2]
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.6, seed=0))) == {1, 2}
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.3, seed=0))) == {1}


def test_tiny_top_p_keeps_the_best_token():
    assert set(draws(SamplingParams(temperature=1.0, top_p=5e-324, seed=0), 20)) == {1}


# A 6-token vocabulary and a history, on which every token is likely enough to be counted.
SIX_LOGITS, SIX_HISTORY = torch.tensor([2.0, 1.5, 0.3, -0.5, 0.9, -2.0]), [1, 4]
# Chi-square's critical values at a 0.1% false alarm rate, by degrees of freedom.
CRITICAL = {5: 20.52, 4: 18.47, 3: 16.27, 2: 13.82, 1: 10.83}


def assert_distributed_as(draw: Callable[[], int], p: np.ndarray, n: int = 10_000) -> None:
    """`n` tokens from `draw` follow the distribution `p` (a chi-square test, false alarm rate
    0.1%), and none falls outside its support."""
    counts = np.bincount([draw() for _ in range(n)], minlength=len(p))
    support = p > 0
    assert counts[~support].sum() == 0, counts  # never a token it cannot sample
    expected = p[support].astype(np.float64) * n
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    critical = CRITICAL[int(support.sum()) - 1]
    print(f"chi2 {chi2:.2f} (0.1% critical value {critical})")
    assert chi2 < critical, (chi2, counts, p)


TEMPERATURE = SamplingParams(temperature=0.8, seed=5)
TOP_K_TOP_P_PENALTY = SamplingParams(
    temperature=1.2, top_k=4, top_p=0.9, repetition_penalty=1.3, seed=6
)
# Where the six tokens sit in a longer vocabulary, the rest impossible: over blocks of
# DRAW_BLOCK, the last one short (1000), and over blocks of blocks (past DRAW_BLOCK**2: Gemma 3
# has 262,144 tokens), where the blocks' sums are themselves inverted a block at a time.
BLOCKS_OF_BLOCKS = DRAW_BLOCK**2 + 1000
SPREAD = {
    6: list(range(6)),
    1000: [3, 255, 256, 511, 700, 999],
    BLOCKS_OF_BLOCKS: [0, 12_345, DRAW_BLOCK**2 - 1, DRAW_BLOCK**2, BLOCKS_OF_BLOCKS - 2, 40_000],
}


@pytest.mark.parametrize(
    ("params", "vocabulary"),
    [
        (TEMPERATURE, 6),
        (TOP_K_TOP_P_PENALTY, 6),
        (TEMPERATURE, 1000),
        (TOP_K_TOP_P_PENALTY, 1000),
        (TEMPERATURE, BLOCKS_OF_BLOCKS),  # top-k's few tokens would not take the blocks
    ],
    ids=["six-temperature", "six-top-k-top-p-penalty", "spread-over-1000-temperature",
         "spread-over-1000-top-k-top-p-penalty", "blocks-of-blocks-temperature"],
)  # fmt: skip
def test_draws_follow_the_distribution(params, vocabulary):
    """The sampled token is distributed as `distribution` says, and never outside it, also with
    the six tokens spread over a longer vocabulary (SPREAD)."""
    places = torch.tensor(SPREAD[vocabulary])
    assert vocabulary == 6 or (vocabulary > DRAW_BLOCK and vocabulary % DRAW_BLOCK)
    logits = torch.full((vocabulary,), -torch.inf)
    logits[places] = SIX_LOGITS
    history = places[SIX_HISTORY].tolist()
    sampler = Sampler(params)
    p = sampler.distribution(logits, history)
    assert np.count_nonzero(p) == 6 if params is TEMPERATURE else np.count_nonzero(p) >= 3
    assert_distributed_as(lambda: sampler(logits, history), p)


@pytest.mark.parametrize("top_k", [0, 40, 300])
@pytest.mark.parametrize("spread", [8.0, 0.5], ids=["peaked", "flat"])
@pytest.mark.parametrize("top_p", [0.5, 0.95, 1.0])
def test_top_k_and_top_p_over_a_large_vocabulary_equal_sorting_it_all(spread, top_p, top_k):
    """On a vocabulary of SmolLM2's size, with top-p's prefix among the likeliest
    TOP_P_CANDIDATES (peaked) or longer (flat), and top-k under or over them: the tokens kept
    and their probabilities are those of sorting all the probabilities, keeping the k likeliest
    (and ties), then the smallest prefix of what is left that reaches top_p."""
    logits = torch.randn(49152, generator=torch.Generator().manual_seed(2)) * spread
    params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)
    got = torch.from_numpy(Sampler(params).distribution(logits, []))
    probs = torch.softmax(logits.double(), dim=-1)
    values, order = torch.sort(probs, descending=True)
    if top_k:
        values, order = values[values >= values[top_k - 1]], order[values >= values[top_k - 1]]
    values = values / values.sum()
    before = values.cumsum(dim=0) - values
    kept = order[before < top_p]
    want = torch.zeros_like(probs)
    want[kept] = probs[kept] / probs[kept].sum()
    if not top_k and top_p < 1.0:  # both ways through top-p are taken
        assert (len(kept) <= TOP_P_CANDIDATES) == (spread > 1), len(kept)
    assert torch.equal(got > 0, want > 0)
    assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.2)],
    ids=["greedy", "sampled"],
)
def test_logits_that_are_not_numbers_are_an_error_not_a_token(params):
    logits = torch.tensor([0.5, float("nan"), 2.0, -1.0])
    sampler = Sampler(params)
    with pytest.raises(ModelError, match="not a number"):
        sampler(logits, [0])
    with pytest.raises(ModelError, match="not a number"):
        sampler.verify(logits, [0], draft=2)
    assert sampler(torch.tensor([0.5, -float("inf"), 2.0, -1.0]), [0]) in (0, 2, 3)  # a mask


def test_repetition_penalty_demotes_seen_tokens():
    # Token 1 leads 3.0 vs 2.5; penalised by 1.5 it drops to 2.0, below token 2.
    assert draws(SamplingParams(repetition_penalty=1.5), 1, history=[1]) == [2]
    assert draws(SamplingParams(repetition_penalty=1.5), 1, history=[3]) == [1]


def openai_penalized(logits, output, presence, frequency):
    """OpenAI's definition: logits[t] -= presence * (count[t] > 0) + frequency * count[t]."""
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=len(logits))
    return logits - presence * (counts > 0).float() - frequency * counts.float()


def test_presence_and_frequency_penalties_are_openais_over_the_output_only():
    history, output = [0, 1, 2, 2, 4], [2, 2, 4]  # prompt [0, 1], then the answer
    p = SamplingParams(temperature=0.7, presence_penalty=0.6, frequency_penalty=0.5, seed=0)
    got = Sampler(p).distribution(SIX_LOGITS, history, output)
    want = torch.softmax(openai_penalized(SIX_LOGITS, output, 0.6, 0.5) / 0.7, -1)
    assert torch.allclose(torch.from_numpy(got), want, atol=1e-6)
    # The prompt's tokens are not penalized: with no output, nothing changes.
    plain = Sampler(SamplingParams(temperature=0.7)).distribution(SIX_LOGITS, history)
    assert np.allclose(Sampler(p).distribution(SIX_LOGITS, history, []), plain)
    # Negative penalties encourage repeating; greedy follows the penalized argmax.
    assert Sampler(SamplingParams(frequency_penalty=2.0))(LOGITS, [1, 1], [1]) == 2
    assert Sampler(SamplingParams(presence_penalty=-2.0))(LOGITS, [2], [2]) == 2
    assert Sampler(SamplingParams(presence_penalty=2.0))(LOGITS, [1], []) == 1  # prompt only


def test_a_draft_is_verified_against_the_penalized_distribution():
    output = [0, 0, 1]
    p = SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.7, seed=9)
    sampler = Sampler(p)
    want = sampler.distribution(SIX_LOGITS, SIX_HISTORY, output)
    assert not np.allclose(want, Sampler(p).distribution(SIX_LOGITS, SIX_HISTORY))
    for draft in (0, 3):
        assert_distributed_as(
            lambda d=draft: sampler.verify(SIX_LOGITS, SIX_HISTORY, d, output), want
        )
    greedy = Sampler(SamplingParams(frequency_penalty=2.0))
    assert greedy.verify(LOGITS, [1], 1, [1]) == 2  # the penalized argmax, not the draft
    assert greedy.verify(LOGITS, [1], 2, [1]) == 2


@pytest.mark.parametrize("top_k", [0, 3])
def test_min_p_keeps_tokens_within_a_share_of_the_likeliest(top_k):
    probs = torch.softmax(SIX_LOGITS / 0.9, -1)
    p = SamplingParams(temperature=0.9, min_p=0.3, top_k=top_k, seed=1)
    got = torch.from_numpy(Sampler(p).distribution(SIX_LOGITS, []))
    kept = probs >= 0.3 * probs.max()
    if top_k:
        kept &= probs >= torch.topk(probs, top_k).values[-1]
    want = torch.where(kept, probs, 0.0)
    assert torch.allclose(got, want / want.sum(), atol=1e-6)
    assert 1 < int(kept.sum()) < 6
    sampler = Sampler(p)
    assert_distributed_as(lambda: sampler(SIX_LOGITS, []), got.numpy(), n=2000)
    assert Sampler(SamplingParams(temperature=1.0, min_p=1.0, seed=0))(SIX_LOGITS, []) == 0


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(logprobs=3),
        SamplingParams(temperature=0.6, top_k=2, logprobs=5, seed=0),
        SamplingParams(temperature=1.3, presence_penalty=1.0, frequency_penalty=0.5, logprobs=2),
    ],
    ids=["greedy", "temperature-top-k", "penalties"],
)
def test_logprobs_are_the_log_softmax_after_penalties_and_temperature(params):
    logits, history, output = torch.randn(1000, generator=torch.Generator().manual_seed(4)), [
        5, 7, 7], [7, 7]  # fmt: skip
    scaled = openai_penalized(logits, output, params.presence_penalty, params.frequency_penalty)
    scaled = scaled / (params.temperature or 1.0)  # greedy reports the model's own
    want = torch.log_softmax(scaled, -1)
    sampler = Sampler(params)
    token = sampler(logits, history, output)
    got = sampler.logprob(logits, history, token, output)
    assert got.token == token
    assert got.logprob == pytest.approx(float(want[token]), abs=1e-5)
    assert [t for t, _ in got.top] == torch.topk(want, params.logprobs).indices.tolist()
    assert [v for _, v in got.top] == pytest.approx(torch.topk(want, params.logprobs).values)
    if params.temperature == 0:  # greedy's token is the likeliest
        assert got.logprob == got.top[0][1]
    assert Sampler(SamplingParams()).logprob(logits, [], 0).top == ()  # logprobs None: none


def test_a_masked_token_reports_openais_floor_not_minus_infinity():
    """A masked token's own log probability is OpenAI's floor; as an alternative it is left
    out: it cannot be drawn (a grammar's mask, master/generation/grammar.py)."""
    logits = torch.tensor([1.0, -torch.inf, 0.0])
    got = Sampler(SamplingParams(logprobs=3)).logprob(logits, [], 1)
    assert got.logprob == LOGPROB_FLOOR
    assert [token for token, _ in got.top] == [0, 2]


def test_each_choice_has_its_own_repeatable_stream():
    def drawn(stream: int, seed: int = 7) -> list[int]:
        return draws(SamplingParams(temperature=1.0, seed=seed, stream=stream))

    assert drawn(0) == draws(SamplingParams(temperature=1.0, seed=7))  # choice 0: the seed's
    assert drawn(1) == drawn(1) != drawn(0)
    assert drawn(2) != drawn(1) and drawn(1) != drawn(0, seed=8)


def test_temperature_spreads_choices():
    assert len(set(draws(SamplingParams(temperature=2.0, seed=3), 400))) == 5


def test_a_tiny_temperature_is_greedy():
    assert set(draws(SamplingParams(temperature=GREEDY_BELOW / 2, seed=0), 20)) == {1}
    assert set(draws(SamplingParams(temperature=1e-300, seed=0), 5)) == {1}  # no overflow


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": -1},
        {"temperature": TEMPERATURE_MAX + 0.01},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"max_tokens": 0},
        {"repetition_penalty": 0},
        {"repetition_penalty": 101},
        {"stop": ("",)},
        {"min_p": 1.5},
        {"presence_penalty": 2.5},
        {"frequency_penalty": -3},
        {"logprobs": 21},
        {"stream": -1},
    ],
)
def test_out_of_range_params_are_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_the_limits_load_without_torch():
    """The chat app checks its settings against them and must not load torch."""
    code = (
        "import sys, edgetp.master.generation.params, edgetp.master.bridge.schema\n"
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.fixture(scope="module")
def engine(smollm2):
    return Engine.local(smollm2, slots=2)


def _generate(engine, tokenizer, prompt, params):
    (g,) = start(engine, [tokenizer.encode(prompt)], [params])
    pieces = [text for _, text in stream(engine, tokenizer, [g])]
    return g, pieces


@pytest.mark.slow
def test_stop_string_cuts_the_answer(engine, smollm2_tokenizer):
    prompt = "The three primary colors are"
    full, _ = _generate(engine, smollm2_tokenizer, prompt, SamplingParams(max_tokens=30))
    assert full.finish_reason == "length" and len(full.tokens) == 30
    stop = full.text[12:16]
    assert stop.strip(), full.text
    cut, pieces = _generate(
        engine, smollm2_tokenizer, prompt, SamplingParams(max_tokens=30, stop=(stop,))
    )
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    assert "".join(pieces) == cut.text  # streaming never leaks part of the stop string


@pytest.mark.slow
def test_end_of_sequence_finishes_with_stop(engine, smollm2_tokenizer):
    from edgetp.master.generation.prompts import prompt_tokens

    ids = prompt_tokens(smollm2_tokenizer, "Say only the word yes.", raw=False)
    (g,) = start(engine, [ids], [SamplingParams(max_tokens=64)])
    text = "".join(t for _, t in stream(engine, smollm2_tokenizer, [g]))
    assert g.finish_reason == "stop" and len(g.tokens) < 64
    assert text == g.text == smollm2_tokenizer.decode(g.tokens)


@pytest.mark.slow
def test_seeded_sampling_is_repeatable_in_a_batch(engine, smollm2_tokenizer):
    """A seeded sequence gets the same text alone and batched next to another."""
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=20, ignore_eos=True)
    alone, _ = _generate(engine, smollm2_tokenizer, "Once upon a time", p)
    prompts = [smollm2_tokenizer.encode("Once upon a time"), smollm2_tokenizer.encode("Hi")]
    seqs = start(engine, prompts, [p, SamplingParams(max_tokens=20, temperature=1.0, seed=1)])
    for _ in stream(engine, smollm2_tokenizer, seqs):
        pass
    assert seqs[0].tokens == alone.tokens


@pytest.mark.slow
def test_greedy_is_the_argmax_and_drafted_tokens_get_the_targets_logprobs(
    engine, smollm2_tokenizer
):
    """Greedy without the new fields is the argmax of the engine's logits, token for token; asking
    for log probabilities changes no token; under speculation (prompt lookup) each accepted
    draft reports what the target's logits at its position say, as a step without drafts does."""
    ids = smollm2_tokenizer.encode("1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1,")
    want, fed, position = [], list(ids), 0
    for _ in range(12):  # an independent greedy loop over the engine itself
        logits = engine.forward([fed], StepBatch((0,), (position,), (len(fed),)))
        position += len(fed)
        fed = [int(torch.argmax(logits[0]))]
        want.append(fed[0])

    def run(params: SamplingParams, speculator: Speculator | None = None):
        (g,) = start(engine, [ids], [params])
        for _ in stream(engine, smollm2_tokenizer, [g], speculator):
            pass
        return g

    assert run(SamplingParams(max_tokens=12, ignore_eos=True)).tokens == want
    asked = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3)
    plain = run(asked)
    assert plain.tokens == want and [lp.token for lp in plain.logprobs] == want
    assert all(lp.top[0] == (lp.token, lp.logprob) for lp in plain.logprobs)
    speculator = Speculator()
    drafted = run(asked, speculator)
    assert drafted.tokens == want and speculator.accepted > 0, speculator.figures()
    for a, b in zip(drafted.logprobs, plain.logprobs, strict=True):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=2e-2)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
