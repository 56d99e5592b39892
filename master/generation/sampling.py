"""Choosing the next token from logits: greedy, temperature, top-k, top-p, min-p, the
repetition, presence and frequency penalties, a grammar's mask; and the log probabilities
reported for it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from edgetp.master.generation.grammar import Constraint
from edgetp.master.generation.params import GREEDY_BELOW, SamplingParams
from edgetp.models.errors import ModelError
from edgetp.models.tokenizer import Tokenizer

# Top-k and top-p look among this many of the likeliest tokens (or top-k's k) first; top-p
# sorts the whole vocabulary only when they hold less than top_p: sorting SmolLM2's 49,152
# probabilities took 1.5 ms, finding the 256 largest 0.11 (Zen 3, one thread).
TOP_P_CANDIDATES = 256
# A draw inverts the cumulative sum of the weights a block at a time: a float64 cumulative sum
# over 49,152 weights took 225 us, their blocks' sums 38.
DRAW_BLOCK = 256
_BELOW_ONE = float(np.nextafter(1.0, 0.0))
# What OpenAI reports for a token the distribution cannot produce (a masked logit): JSON has
# no -Infinity.
LOGPROB_FLOOR = -9999.0
NOT_A_NUMBER = (
    "the model's output is not a number (NaN among its logits): its weights or this device's "
    "kernels are broken; check the model file against its source, and see `edgetp kernels`"
)


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log probability and its likeliest alternatives', likeliest first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    offset: int = 0  # where its text starts in the decoded output (the generation loop's)


class Sampler:
    """One sequence's sampler; its own generator makes a seeded run repeatable in any batch.

    NumPy throughout but for the softmax (torch's took 68 us over SmolLM2's vocabulary, NumPy's
    115): a sampled token is a few dozen small operations, each of which cost torch 5-40 us of
    dispatch where NumPy takes ~1.
    """

    def __init__(self, params: SamplingParams, constraint: Constraint | None = None) -> None:
        self.params = params
        self.constraint = constraint  # params.grammar's, compiled for the model's vocabulary
        # NumPy takes seeds >= 0: a negative one (the bridge takes any within +-2**53, as
        # torch did) is taken modulo 2**64, which keeps them all apart. No seed: fresh entropy.
        # Choice i > 0 of a request's n draws from the seed's i-th child stream, which no
        # plain seed gives (its spawn key is not empty).
        seed = None if params.seed is None else params.seed % 2**64
        if seed is not None and params.stream:
            self.generator = np.random.default_rng(
                np.random.SeedSequence(seed, spawn_key=(params.stream,))
            )
        else:
            self.generator = np.random.default_rng(seed)

    def __call__(
        self, logits: torch.Tensor, history: Sequence[int], output: Sequence[int] = ()
    ) -> int:
        """The next token for logits (V,) given the tokens so far (`history`: prompt and output;
        `output`: the generated ones alone, which the presence and frequency penalties count)."""
        support = self._support(logits, history, output)
        if support is None:
            return _argmax(self._penalized(logits, history, output))
        tokens, weights = support
        return _token(tokens, _inverse_cdf(weights, self.generator.random()))

    def verify(
        self,
        logits: torch.Tensor,
        history: Sequence[int],
        draft: int,
        output: Sequence[int] = (),
    ) -> int:
        """The next token, given a drafted one that proposes it: `draft` itself when accepted,
        else a token drawn from what is left. For a draft proposed with certainty (prompt
        lookup), accepting it with probability p(draft) and otherwise drawing from p without it
        gives every token exactly its probability p: speculation never changes what is sampled.
        Greedy accepts the draft when it is the argmax. The draft is checked against the
        penalized distribution, as the token sampled without it would have been."""
        support = self._support(logits, history, output)
        if support is None:
            return _argmax(self._penalized(logits, history, output))
        tokens, weights = support
        at = draft if tokens is None else _place(tokens, draft)
        u = self.generator.random()
        if at is not None:
            if u < weights[at]:
                return draft
            weights = weights.copy()
            weights[at] = 0.0
            if weights.sum() <= 0.0:  # p(draft) was 1 and u hit its rounding: nothing else
                return draft
        return _token(tokens, _inverse_cdf(weights, self.generator.random()))

    def distribution(
        self, logits: torch.Tensor, history: Sequence[int], output: Sequence[int] = ()
    ) -> np.ndarray | None:
        """What the next token is drawn from, (V,) float32, after the penalties, temperature,
        top-k, top-p and min-p; None when sampling is greedy."""
        support = self._support(logits, history, output)
        if support is None:
            return None
        tokens, weights = support
        if tokens is None:
            return weights
        out = np.zeros(len(logits), dtype=np.float32)
        out[tokens] = weights
        return out

    def logprob(
        self, logits: torch.Tensor, history: Sequence[int], token: int, output: Sequence[int] = ()
    ) -> TokenLogprob:
        """`token`'s log probability under logits (V,), and the `params.logprobs` likeliest
        tokens': the log-softmax of the logits after the penalties and the temperature (1 when
        greedy), before top-k, top-p and min-p cut it (docs/decisions.md says why)."""
        p = self.params
        scaled = self._penalized(logits, history, output)
        if p.temperature >= GREEDY_BELOW:
            scaled = scaled / np.float32(p.temperature)
        logp = torch.log_softmax(torch.from_numpy(scaled), dim=-1).numpy()
        top = _largest(logp, min(p.logprobs, len(logp))) if p.logprobs else ()
        # a token a grammar forbids is no alternative: it is left out of the top
        return TokenLogprob(
            token,
            _finite(logp[token]),
            tuple((int(i), _finite(logp[i])) for i in top if logp[i] > -np.inf),
        )

    def accept(self, token: int) -> None:
        """Take `token` as the sequence's next: a grammar moves past it."""
        if self.constraint is not None:
            self.constraint.accept(token)

    def allowed_drafts(self, drafts: list[int]) -> list[int]:
        """The first drafts the grammar allows: a draft it forbids is not proposed (nor any
        after it)."""
        if self.constraint is None or not drafts:
            return drafts
        return self.constraint.allowed_prefix(drafts)

    def _support(
        self, logits: torch.Tensor, history: Sequence[int], output: Sequence[int]
    ) -> tuple[np.ndarray | None, np.ndarray] | None:
        """The tokens that can be drawn (None: all of them) and their probabilities, summing to
        1; None when sampling is greedy."""
        p = self.params
        if p.temperature < GREEDY_BELOW:
            return None
        scaled = self._penalized(logits, history, output) / np.float32(p.temperature)
        probs = torch.softmax(torch.from_numpy(scaled), dim=-1).numpy()
        top_k = p.top_k if 0 < p.top_k < len(probs) else 0
        if not top_k and p.top_p >= 1.0 and p.min_p <= 0.0:
            return None, probs
        if top_k or p.top_p < 1.0:
            tokens = _kept(probs, top_k, p.top_p)
        else:
            tokens = np.arange(len(probs))
        if p.min_p > 0.0:  # a share of the likeliest token's probability, whatever cut before
            tokens = tokens[probs[tokens] >= np.float32(p.min_p) * probs.max()]
        kept = probs[tokens]
        return tokens, kept / kept.sum()

    def _penalized(
        self, logits: torch.Tensor, history: Sequence[int], output: Sequence[int]
    ) -> np.ndarray:
        p = self.params
        values = logits.float().numpy()
        # NaN has no order: the argmax would take the first one, a draw some token, and the
        # answer would go on as text of no meaning. 10 us over SmolLM2's 49,152 logits.
        if np.isnan(values).any():
            raise ModelError(NOT_A_NUMBER)
        if p.repetition_penalty != 1.0 and history:
            seen = np.fromiter(set(history), dtype=np.int64)
            picked = values[seen]
            values = values.copy()
            values[seen] = np.where(
                picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty
            )
        if (p.presence_penalty or p.frequency_penalty) and len(output):
            # OpenAI's: logits[t] -= presence * (count[t] > 0) + frequency * count[t], over
            # the tokens generated so far (not the prompt)
            seen, counts = np.unique(np.asarray(output, dtype=np.int64), return_counts=True)
            values = values.copy()
            values[seen] -= np.float32(p.presence_penalty) + np.float32(
                p.frequency_penalty
            ) * counts.astype(np.float32)
        if self.constraint is not None:
            # Every later step (temperature, top-k/p, min-p, logprobs, a draft's check) sees
            # only what the grammar allows: it always allows something (an end of sequence
            # once complete).
            values = np.where(self.constraint.allowed(len(values)), values, np.float32(-np.inf))
        return values


def sampler_for(params: SamplingParams, tokenizer: Tokenizer) -> Sampler:
    """A sequence's sampler, with its grammar (if any) compiled for `tokenizer`'s vocabulary.
    Raises master.generation.grammar.GrammarError for a grammar that cannot be compiled."""
    if params.grammar is None:
        return Sampler(params)
    return Sampler(params, Constraint(tokenizer, params.grammar))


def _finite(logprob: np.floating) -> float:
    return max(float(logprob), LOGPROB_FLOOR)


def _argmax(logits: np.ndarray) -> int:
    """The first of the largest logits (V,): NumPy's argmax took 14 us over SmolLM2's 49,152
    logits where torch's took 135 (one thread, Zen 3), at every greedy token."""
    return int(np.argmax(logits))


def _token(tokens: np.ndarray | None, index: int) -> int:
    return index if tokens is None else int(tokens[index])


def _place(tokens: np.ndarray, token: int) -> int | None:
    """Where `token` is among `tokens`, or None."""
    found = np.flatnonzero(tokens == token)
    return int(found[0]) if len(found) else None


def _largest(probs: np.ndarray, n: int) -> np.ndarray:
    """The indices of the n largest of probs, largest first (ties by index)."""
    if n < len(probs):
        some = np.argpartition(probs, len(probs) - n)[len(probs) - n :]
        return some[np.argsort(-probs[some], kind="stable")]
    return np.argsort(-probs, kind="stable")


def _kept(probs: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """The tokens top-k (0: none) and then top-p keep, likeliest first. Top-k keeps the k
    likeliest and any tied with the k-th; top-p, of what is left, the smallest prefix whose mass
    reaches `top_p` (always at least one). Both look among the max(k, TOP_P_CANDIDATES)
    likeliest; top-p alone sorts the whole vocabulary when those hold less than `top_p`."""
    order = _largest(probs, min(max(top_k, TOP_P_CANDIDATES), len(probs)))
    values = probs[order]
    if top_k:
        tied = int(np.count_nonzero(values >= values[top_k - 1]))  # sorted: a prefix
        order, values = order[:tied], values[:tied]
        values = values / values.sum()  # what top-p cuts is top-k's distribution
    if top_p >= 1.0:
        return order
    cumulative = np.cumsum(values, dtype=np.float64)
    if not top_k and cumulative[-1] < top_p:
        order = _largest(probs, len(probs))
        values = probs[order]
        cumulative = np.cumsum(values, dtype=np.float64)
    # A token is kept while the mass before it is under top_p; a top_p that rounds to 0 in
    # float32 still keeps the first.
    reached = np.flatnonzero(cumulative - values >= top_p)
    return order[: max(1, int(reached[0]))] if len(reached) else order


def _inverse_cdf(weights: np.ndarray, u: float) -> int:
    """The index at which the cumulative sum of `weights` first exceeds u (in [0, 1)) times
    their total: index i with probability weights[i] / total, never one of weight 0. A long
    vector is inverted a block at a time: the blocks' sums first, then within the block."""
    if len(weights) <= DRAW_BLOCK:
        cumulative = np.cumsum(weights, dtype=np.float64)
        i = int(np.searchsorted(cumulative, u * cumulative[-1], side="right"))
        # u * total rounded up to the total: the last index that can be drawn
        return i if i < len(weights) else int(np.flatnonzero(weights)[-1])
    sums = np.add.reduceat(weights, np.arange(0, len(weights), DRAW_BLOCK), dtype=np.float64)
    block = _inverse_cdf(sums, u)
    cumulative = np.cumsum(sums)
    before = float(cumulative[block - 1]) if block else 0.0
    within = (u * float(cumulative[-1]) - before) / float(sums[block])
    start = block * DRAW_BLOCK
    return start + _inverse_cdf(
        weights[start : start + DRAW_BLOCK], min(max(within, 0.0), _BELOW_ONE)
    )
