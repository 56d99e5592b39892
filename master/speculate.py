"""Speculative decoding by prompt lookup: drafts that cost the cluster nothing, checked in one step.

A decode step costs two allreduce sums per layer whatever it carries, so on links with latency a
step that checks k drafted tokens costs about what a step that makes one does. The drafts come
from the text itself: the tokens that followed the latest earlier occurrence of the sequence's
last few tokens (in the prompt or the answer so far), which is what an answer that repeats or
edits its prompt, or code, is made of. The step feeds the last token and the drafts; the logits
at each position say whether the draft there is what the sequence would have sampled
(`Sampler.verify`), so the output is exactly the non-speculative one: the same greedy tokens,
the same distribution when sampling. Rejected drafts' keys and values stay in the KV cache past
the sequence's position, where nothing reads them and the next step overwrites them.

How many tokens to draft (`Speculator.draft_length`) follows what was measured: the share of
drafted tokens accepted (per sequence) and what one more token costs a step against the step
itself (the cluster's hops make a step's fixed cost; compute makes the per-token one). A draft
that keeps missing backs off to none, and is tried again now and then.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass

DRAFT_MAX = 8  # tokens drafted at most in one step
NGRAMS = (3, 2)  # suffix lengths looked up, longest first
PROBE_EVERY = 16  # steps at least between tries of a draft that backed off
PROBE_DRAFTS = 2  # tokens a try drafts
PROBE_BUDGET = 0.01  # of the steps' time that tries may cost when they all miss
TOKEN_COST = 0.25  # what one more token costs a step, relative to it, until measured
EMA = 0.2  # weight of the newest measurement in the running figures


def lookup(tokens: Sequence[int], k: int, ngrams: Sequence[int] = NGRAMS) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the last n tokens of
    `tokens` (n from `ngrams`, longest first); none when no such occurrence is followed by any."""
    if k <= 0 or len(tokens) < 2:
        return []
    data = array.array("i", tokens).tobytes()  # a token is 4 bytes: find() works in C
    size = array.array("i").itemsize
    for n in ngrams:
        if len(tokens) <= n:
            continue
        suffix = data[-n * size :]
        end = len(data) - size  # a match must end before the last token: one must follow it
        while (at := data.rfind(suffix, 0, end)) != -1:
            if at % size == 0:  # on a token boundary, not inside one
                first = at // size + n
                return list(tokens[first : first + k])
            end = at + len(suffix) - 1
    return []


@dataclass
class DraftState:
    """One sequence's speculation figures: drafts kept and drafts tested (decayed counts,
    from a prior of one in two), and steps since a backed-off draft was last tried.

    A draft is tested up to its first rejection, the tokens after it never are: the chance that
    a draft is kept, given those before it were, is kept / tested (counting the rejected one),
    not kept / drafted, which would count untested tokens as misses."""

    kept: float = 1.0
    tested: float = 2.0
    since_probe: int = 0

    @property
    def accept_rate(self) -> float:
        return self.kept / self.tested

    @classmethod
    def at(cls, rate: float) -> DraftState:
        """A sequence whose drafts were kept at `rate`, as if over many of them."""
        return cls(kept=100 * rate, tested=100.0)


class Speculator:
    """Drafts for a batch's sequences and the figures that size them; one per engine loop."""

    def __init__(self, draft_max: int = DRAFT_MAX) -> None:
        self.draft_max = draft_max
        # Running time of a decode step by its width (tokens a sequence at most): not a line,
        # where a step of one token takes a path of its own (one node here: widths 1, 2, 3, 9
        # took 13, 22, 32, 44 ms).
        self.step_s: dict[int, float] = {}
        self.drafted = 0
        self.accepted = 0
        self.steps = 0  # decode steps, speculative or not
        self.tokens = 0  # tokens those steps made

    def cost(self, k: int) -> float:
        """A decode step with k drafts, in one-token steps: as measured, else read off the line
        between the nearest measured widths; beyond the widest, its slope from one token on
        (TOKEN_COST a token while only one-token steps are measured)."""
        one, w = self.step_s.get(1), k + 1
        if one is None:
            return 1 + k * TOKEN_COST
        if w in self.step_s:
            return self.step_s[w] / one
        lo = max(x for x in self.step_s if x < w)
        above = [x for x in self.step_s if x > w]
        if not above:
            widest = self.step_s[lo] / one
            slope = (widest - 1) / (lo - 1) if lo > 1 else TOKEN_COST
            return widest + (w - lo) * max(slope, 0.0)
        hi = min(above)
        between = self.step_s[lo] + (self.step_s[hi] - self.step_s[lo]) * (w - lo) / (hi - lo)
        return between / one

    def draft_length(self, state: DraftState) -> int:
        """The k in [0, draft_max] that makes the most tokens per second by the figures: a step
        of k drafts makes 1 + a + ... + a^k tokens (a the acceptance rate) and costs `cost(k)`
        one-token steps."""
        a = state.accept_rate
        best, best_rate, made = 0, 1.0, 1.0
        for k in range(1, self.draft_max + 1):
            made += a**k
            rate = made / self.cost(k)
            if rate > best_rate:
                best, best_rate = k, rate
        if best == 0:  # now and then, see whether the text turned repetitive: as often as
            state.since_probe += 1  # a try that misses costs no more than PROBE_BUDGET
            if state.since_probe >= max(PROBE_EVERY, (self.cost(PROBE_DRAFTS) - 1) / PROBE_BUDGET):
                state.since_probe = 0
                return PROBE_DRAFTS
        return best

    def draft(self, state: DraftState, tokens: Sequence[int], room: int) -> list[int]:
        """The drafts for a sequence whose tokens (prompt and output) are `tokens`, at most
        `room` of them (what its context and max_tokens leave)."""
        k = min(self.draft_length(state), room)
        return lookup(tokens, k) if k > 0 else []

    def record_step(self, seconds: float, width: int, decode: bool) -> None:
        """A step's time: `width` tokens a sequence at most; `decode`: no prompt in it."""
        if decode:
            last = self.step_s.get(width)
            self.step_s[width] = seconds if last is None else (1 - EMA) * last + EMA * seconds

    def record_draft(self, state: DraftState, drafted: int, accepted: int, made: int) -> None:
        """What one sequence's step did: `made` tokens, `accepted` of its `drafted` ones."""
        self.steps += 1
        self.tokens += made
        if drafted:
            self.drafted += drafted
            self.accepted += accepted
            tested = accepted + (accepted < drafted)  # up to the first rejection
            state.kept = (1 - EMA) * state.kept + accepted
            state.tested = (1 - EMA) * state.tested + tested

    def figures(self) -> dict[str, float]:
        """Acceptance and tokens a sequence makes per step, over the engine loop's life."""
        return {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance": round(self.accepted / self.drafted, 3) if self.drafted else 0.0,
            "tokens_per_step": round(self.tokens / self.steps, 3) if self.steps else 0.0,
        }
