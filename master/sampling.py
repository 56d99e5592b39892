"""Choosing the next token from logits: greedy, temperature, top-k, top-p, repetition penalty."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from master.params import GREEDY_BELOW, SamplingParams


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
            return int(torch.argmax(self._penalized(logits, history)))
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def verify(self, logits: torch.Tensor, history: Sequence[int], draft: int) -> int:
        """The next token, given a drafted one that proposes it: `draft` itself when accepted,
        else a token drawn from what is left. For a draft proposed with certainty (prompt
        lookup), accepting it with probability p(draft) and otherwise drawing from p without it
        gives every token exactly its probability p: speculation never changes what is sampled.
        Greedy accepts the draft when it is the argmax."""
        probs = self.distribution(logits, history)
        if probs is None:
            return int(torch.argmax(self._penalized(logits, history)))
        u = float(torch.rand((), generator=self.generator))
        if u < float(probs[draft]):
            return draft
        rest = probs.clone()
        rest[draft] = 0.0
        if float(rest.sum()) <= 0.0:  # p(draft) was 1 and u hit its rounding: nothing else
            return draft
        return int(torch.multinomial(rest, 1, generator=self.generator))

    def distribution(self, logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor | None:
        """What the next token is drawn from, (V,), after penalty, temperature, top-k and
        top-p; None when sampling is greedy."""
        p = self.params
        if p.temperature < GREEDY_BELOW:
            return None
        logits = self._penalized(logits, history) / p.temperature
        if p.top_k > 0 and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= p.top_p
            drop[0] = False  # a top_p that rounds to 0 in float32 must still leave one token
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
        return torch.softmax(logits, dim=-1)

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
