"""Choosing the next token from logits: greedy, temperature, top-k, top-p, repetition penalty."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from master.params import GREEDY_BELOW, SamplingParams

# Top-k and top-p look among this many of the likeliest tokens (or top-k's k) first; top-p
# sorts the whole vocabulary only when they hold less than top_p: sorting SmolLM2's 49,152
# logits took 4.5 ms a token, the 256 largest 0.15 ms (Zen 3, one thread).
TOP_P_CANDIDATES = 256


class Sampler:
    """One sequence's sampler; its own generator makes a seeded run repeatable in any batch."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, history: Sequence[int]) -> int:
        """The next token for logits (V,) given the tokens so far (prompt and output)."""
        probs = self.distribution(logits, history)
        if probs is None:
            return _argmax(self._penalized(logits, history))
        return self._draw(probs)

    def verify(self, logits: torch.Tensor, history: Sequence[int], draft: int) -> int:
        """The next token, given a drafted one that proposes it: `draft` itself when accepted,
        else a token drawn from what is left. For a draft proposed with certainty (prompt
        lookup), accepting it with probability p(draft) and otherwise drawing from p without it
        gives every token exactly its probability p: speculation never changes what is sampled.
        Greedy accepts the draft when it is the argmax."""
        probs = self.distribution(logits, history)
        if probs is None:
            return _argmax(self._penalized(logits, history))
        u = float(torch.rand((), generator=self.generator))
        if u < float(probs[draft]):
            return draft
        rest = probs.clone()
        rest[draft] = 0.0
        if float(rest.sum()) <= 0.0:  # p(draft) was 1 and u hit its rounding: nothing else
            return draft
        return self._draw(rest)

    def distribution(self, logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor | None:
        """What the next token is drawn from, (V,), after penalty, temperature, top-k and
        top-p; None when sampling is greedy."""
        p = self.params
        if p.temperature < GREEDY_BELOW:
            return None
        probs = torch.softmax(self._penalized(logits, history) / p.temperature, dim=-1)
        top_k = p.top_k if 0 < p.top_k < len(probs) else 0
        if not top_k and p.top_p >= 1.0:
            return probs
        kept = _kept(probs, top_k, p.top_p)
        out = torch.zeros_like(probs)
        out[kept] = probs[kept] / probs[kept].sum()
        return out

    def _draw(self, weights: torch.Tensor) -> int:
        """A token drawn with probability proportional to `weights` (V,), by inverting their
        cumulative sum at a uniform number: torch.multinomial took 1.45 ms a token over SmolLM2's
        vocabulary, this 0.1 ms. A token of weight 0 is never drawn."""
        cumulative = weights.double().cumsum(dim=0)
        u = torch.rand((), generator=self.generator, dtype=torch.float64) * cumulative[-1]
        token = int(torch.searchsorted(cumulative, u, right=True))
        if token >= len(weights):  # u rounded up to the total: the last token that can be drawn
            token = int(weights.nonzero()[-1])
        return token

    def _penalized(self, logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        p = self.params
        logits = logits.float()
        if p.repetition_penalty != 1.0 and history:
            seen = torch.tensor(sorted(set(history)), dtype=torch.long)
            picked = logits[seen]
            logits = logits.clone()
            logits[seen] = torch.where(
                picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty
            )
        return logits


def _argmax(logits: torch.Tensor) -> int:
    """The first of the largest logits (V,): NumPy's argmax, which took 14 us over SmolLM2's
    49,152 logits where torch's took 135 (one thread, Zen 3), at every greedy token."""
    return int(np.argmax(logits.numpy()))


def _kept(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The tokens top-k (0: none) and then top-p keep. Top-k keeps the k likeliest and any tied
    with the k-th; top-p, of what is left, the smallest prefix, likeliest first, whose mass
    reaches `top_p` (always at least one). Both look among the max(k, TOP_P_CANDIDATES)
    likeliest; top-p alone sorts the whole vocabulary when those hold less than `top_p`."""
    values, order = torch.topk(probs, min(max(top_k, TOP_P_CANDIDATES), len(probs)))
    if top_k:
        tied = values >= values[top_k - 1]
        values, order = values[tied], order[tied]
        values = values / values.sum()  # what top-p cuts is top-k's distribution
    if top_p >= 1.0:
        return order
    cumulative = values.cumsum(dim=0)
    if not top_k and float(cumulative[-1]) < top_p:
        values, order = torch.sort(probs, descending=True)
        cumulative = values.cumsum(dim=0)
    # A token is kept while the mass before it is under top_p; a top_p that rounds to 0 in
    # float32 still keeps the first.
    keep = cumulative - values < top_p
    keep[0] = True
    return order[keep]
