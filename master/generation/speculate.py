"""Speculative decoding: drafts that cost the cluster nothing, checked in one step.

A decode step costs two allreduce sums per layer whatever it carries, so on links with latency a
step that checks k drafted tokens costs about what a step that makes one does. The drafts come
from the master alone, one of two ways:
- prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last
  few tokens (in the prompt or the answer so far), which is what an answer that repeats or edits
  its prompt, or code, is made of;
- a draft model: a smaller model of the same vocabulary (or the target at a cheaper dtype) run
  whole on the master, proposing its greedy tokens one after another (`DraftModel`).
The step feeds the last token and the drafts; the logits at each position say whether the draft
there is what the sequence would have sampled (`Sampler.verify`), so the output is exactly the
non-speculative one: the same greedy tokens, the same distribution when sampling. Rejected
drafts' keys and values stay in the KV cache past the sequence's position, where nothing reads
them and the next step overwrites them (in the draft model's cache too). A linear-attention
layer's state cannot leave them behind: each node keeps its state from before a step of a few
tokens and the step's inputs, and the next step, starting after the accepted drafts, steps that
state forward over them again (node.kvcache.LinearStates).

How many tokens to draft (`Speculator.draft_length`) follows what was measured: the share of
drafted tokens accepted (per sequence), what one more token costs a step against the step itself
(the cluster's hops make a step's fixed cost; compute makes the per-token one) and what drafting
a token costs the master. A draft that keeps missing, or costs more than it saves, backs off to
none, and is tried again now and then.
"""

from __future__ import annotations

import array
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from edgetp.master.cluster.engine import Engine
from edgetp.master.cluster.session import Session
from edgetp.master.generation.reuse import common_prefix
from edgetp.memory.budget import MemoryOptions
from edgetp.models.errors import ModelError
from edgetp.models.layers import StepBatch
from edgetp.models.source import ModelSource, open_model
from edgetp.models.tokenizer import Tokenizer

DRAFT_MAX = 8  # tokens drafted at most in one step
NGRAMS = (3, 2)  # suffix lengths looked up, longest first
PROBE_EVERY = 16  # steps at least between tries of a draft that backed off
PROBE_DRAFTS = 2  # tokens a try drafts
PROBE_BUDGET = 0.01  # of the steps' time that tries may cost when they all miss
CATCH_UP = 32  # tokens of the forward a draft model's catching up is timed with, at load
TOKEN_COST = 0.25  # what one more token costs a step, relative to it, until measured
EMA = 0.2  # weight of the newest measurement in the running figures


def running_mean(last: float | None, new: float) -> float:
    """A measured time's running figure: the newest measurement weighs EMA."""
    return new if last is None else (1 - EMA) * last + EMA * new


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
    from a prior of one in two), and steps since a backed-off draft was last tried (none
    yet: a sequence that would not draft by the prior tries once at its first decode step,
    since nothing is known of how its drafts fare).

    A draft is tested up to its first rejection, the tokens after it never are: the chance that
    a draft is kept, given those before it were, is kept / tested (counting the rejected one),
    not kept / drafted, which would count untested tokens as misses."""

    kept: float = 1.0
    tested: float = 2.0
    since_probe: float = float("inf")
    fed: list[int] = field(default_factory=list)  # tokens in a draft model's cache for it

    @property
    def accept_rate(self) -> float:
        return self.kept / self.tested

    @classmethod
    def at(cls, rate: float) -> DraftState:
        """A sequence whose drafts were kept at `rate`, as if over many of them."""
        return cls(kept=100 * rate, tested=100.0, since_probe=0)


class DraftModel:
    """A model of the target's vocabulary run whole on the master (its own session, one node):
    for each sequence, its greedy tokens after the text so far.

    Its KV cache keeps, per sequence, the tokens last fed to it (`DraftState.fed`); a step
    feeds only what differs from the text now (the tokens the target chose after a rejection,
    or the last draft and the target's own token after a full acceptance)."""

    def __init__(self, session: Session, name: str) -> None:
        self.session = session
        self.name = name
        self.forward_s: float | None = None  # a one-token forward, measured (a running mean)
        self.catch_up_s = 0.0  # a token of a many-token forward (catching up), timed at load
        self.seconds = 0.0  # spent drafting, over its life

    @property
    def engine(self) -> Engine:
        assert self.session.engine is not None
        return self.session.engine

    @torch.inference_mode()
    def measure(self) -> None:
        """Time a one-token forward and a catch-up of CATCH_UP tokens (each the second of two:
        the first warms up), so that the first drafts are sized, or left out, by what drafting
        costs on this device. Nothing is kept of them: a sequence's first draft feeds its
        cache from position 0."""
        n = min(CATCH_UP, self.engine.max_context)
        for _ in range(2):
            started = time.perf_counter()
            self.engine.forward([[0] * n], StepBatch((0,), (0,), (n,)))
            self.catch_up_s = (time.perf_counter() - started) / n
        for _ in range(2):
            started = time.perf_counter()
            self.engine.forward([[0]], StepBatch((0,), (0,), (1,)))
            self.forward_s = time.perf_counter() - started

    @staticmethod
    def behind(state: DraftState, history: Sequence[int]) -> int:
        """Tokens of `history` its cache lacks for a sequence (more than the usual one or two
        after a pause in drafting)."""
        return len(history) - common_prefix(state.fed, history)

    def room(self, tokens: Sequence[int]) -> int:
        """Drafts its context holds after `tokens` (its context may be the smaller one)."""
        return self.engine.max_context - len(tokens)

    @torch.inference_mode()
    def propose(
        self,
        states: Sequence[DraftState],
        histories: Sequence[Sequence[int]],
        slots: Sequence[int],
        lengths: Sequence[int],
    ) -> list[list[int]]:
        """Up to lengths[i] greedy tokens after histories[i], for every sequence at once: the
        first forward catches each sequence's cache up, each next one feeds the last draft."""
        began = time.perf_counter()
        drafts: list[list[int]] = [[] for _ in states]
        feeds: list[list[int]] = [[] for _ in states]
        live = [b for b, n in enumerate(lengths) if n > 0]
        for b in live:
            state, history = states[b], histories[b]
            same = common_prefix(state.fed, history)
            same = min(same, len(history) - 1)  # the last token is fed: its logits draft
            feeds[b] = list(history[same:])
            state.fed = list(history)
        while live:
            batch = StepBatch(
                tuple(slots[b] for b in live),
                tuple(len(states[b].fed) - len(feeds[b]) for b in live),
                tuple(len(feeds[b]) for b in live),
            )
            started = time.perf_counter()
            logits = self.engine.forward([feeds[b] for b in live], batch)
            if batch.width <= 2:  # not a catch-up after a pause: what a draft token costs
                self.forward_s = running_mean(self.forward_s, time.perf_counter() - started)
            for row, b in zip(torch.argmax(logits, dim=-1).tolist(), live, strict=True):
                drafts[b].append(int(row))
                feeds[b] = [int(row)]
            live = [b for b in live if len(drafts[b]) < lengths[b]]
            for b in live:  # its cache now holds the draft it feeds next
                states[b].fed.append(feeds[b][0])
        self.seconds += time.perf_counter() - began
        return drafts

    def close(self) -> None:
        self.session.close()


class Speculator:
    """Drafts for a batch's sequences and the figures that size them; one per engine loop.
    Without a `model`, drafts come from prompt lookup."""

    def __init__(self, draft_max: int = DRAFT_MAX, model: DraftModel | None = None) -> None:
        self.draft_max = draft_max
        self.model = model
        # Running time of a decode step by its width (tokens a sequence at most): not a line,
        # where a step of one token takes a path of its own (one node here: widths 1, 2, 3, 9
        # took 13, 22, 32, 44 ms).
        self.step_s: dict[int, float] = {}
        self.drafted = 0
        self.accepted = 0
        self.steps = 0  # decode steps, speculative or not
        self.tokens = 0  # tokens those steps made

    @property
    def name(self) -> str:
        return self.model.name if self.model else "lookup"

    def cost(self, k: int) -> float:
        """A decode step with k drafts, in one-token steps: its own (`step_cost`) and, with a
        draft model, k of its forwards (TOKEN_COST of a step each until measured)."""
        one = self.step_s.get(1)
        if self.model is None or k == 0:
            drafting = 0.0
        elif self.model.forward_s is None or one is None:
            drafting = k * TOKEN_COST
        else:
            drafting = k * self.model.forward_s / one
        return self.step_cost(k) + drafting

    def step_cost(self, k: int) -> float:
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

    def draft_length(self, state: DraftState, behind: int = 0) -> int:
        """The k in [0, draft_max] that makes the most tokens per second by the figures: a step
        of k drafts makes 1 + a + ... + a^k tokens (a the acceptance rate) and costs `cost(k)`
        one-token steps. `behind`: tokens a draft model must catch up on before it drafts
        (after a pause), which a try that misses costs too."""
        a = state.accept_rate
        best, best_rate, made = 0, 1.0, 1.0
        for k in range(1, self.draft_max + 1):
            made += a**k
            rate = made / self.cost(k)
            if rate > best_rate:
                best, best_rate = k, rate
        # Now and then, see whether the text turned repetitive: as often as a try that misses
        # costs no more than PROBE_BUDGET, and only where drafts could pay if all were kept
        # (by a measured step: once one is).
        try_cost = self.cost(PROBE_DRAFTS) + self.catch_up_cost(behind)
        if best == 0 and 1 in self.step_s and try_cost < PROBE_DRAFTS + 1:
            state.since_probe += 1
            if state.since_probe >= max(PROBE_EVERY, (try_cost - 1) / PROBE_BUDGET):
                state.since_probe = 0
                return PROBE_DRAFTS
        return best

    def catch_up_cost(self, tokens: int) -> float:
        """A draft model's catching up on `tokens`, in one-token steps (0 before one is
        measured)."""
        one = self.step_s.get(1)
        if self.model is None or not tokens or one is None:
            return 0.0
        return tokens * self.model.catch_up_s / one

    def drafts(
        self,
        states: Sequence[DraftState],
        histories: Sequence[Sequence[int]],
        rooms: Sequence[int],
        slots: Sequence[int],
    ) -> list[list[int]]:
        """The drafts for decoding sequences whose tokens (prompt and output) are `histories`,
        each at most its room (what its context and max_tokens leave), in cache `slots`."""
        if self.model is None:
            lengths = [min(self.draft_length(s), r) for s, r in zip(states, rooms, strict=True)]
            return [lookup(h, k) if k > 0 else [] for h, k in zip(histories, lengths, strict=True)]
        lengths = [
            min(self.draft_length(s, self.model.behind(s, h)), r, self.model.room(h))
            for s, h, r in zip(states, histories, rooms, strict=True)
        ]
        if not any(k > 0 for k in lengths):
            return [[] for _ in states]
        return self.model.propose(states, histories, slots, lengths)

    def record_step(self, seconds: float, width: int, decode: bool) -> None:
        """A step's time: `width` tokens a sequence at most; `decode`: no prompt in it."""
        if decode:
            self.step_s[width] = running_mean(self.step_s.get(width), seconds)

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

    def figures(self) -> dict[str, float | str]:
        """Acceptance and tokens a sequence makes per step, over the engine loop's life."""
        figures: dict[str, float | str] = {
            "draft": self.name,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance": round(self.accepted / self.drafted, 3) if self.drafted else 0.0,
            "tokens_per_step": round(self.tokens / self.steps, 3) if self.steps else 0.0,
        }
        if self.model is not None and self.model.forward_s is not None:
            figures["draft_ms"] = round(self.model.forward_s * 1000, 2)
            figures["drafting_s"] = round(self.model.seconds, 3)
        return figures

    def close(self) -> None:
        """Let go of the draft model, if any."""
        if self.model is not None:
            self.model.close()


def draft_source(draft: str, tokenizer: Tokenizer) -> ModelSource | None:
    """The draft model `--draft` names (None for "lookup" and "off"), checked against the
    target's `tokenizer`: cheap, so a front calls it before any weights load."""
    if draft in ("off", "lookup"):
        return None
    source = open_model(draft)
    mismatch = _vocabulary_mismatch(tokenizer, source.tokenizer())
    if mismatch:
        raise ModelError(
            f"the draft model {source.name} cannot draft for this model: {mismatch}; a draft "
            f"model must use the same tokenizer (or use --draft lookup)"
        )
    if source.config.linear_layers:  # it would go back past its last step's tokens
        raise ModelError(
            f"the draft model {source.name} has linear-attention layers, whose state cannot "
            f"take back its own rejected drafts: pick another draft model, or --draft lookup"
        )
    return source


def open_speculator(
    draft: str, dtype: str, session: Session, tokenizer: Tokenizer
) -> Speculator | None:
    """The speculator `--draft` asks for on a started session: none ("off"), prompt lookup
    ("lookup"), or a draft model (a model as `--model` takes it, its shards at `dtype`),
    loaded now on this process with the session's context and slots."""
    if draft == "off":
        return None
    source = draft_source(draft, tokenizer)
    if source is None:
        return Speculator()
    draft_session = Session(
        source,
        None,
        session.state_dir,
        session.max_context,
        session.slots,
        MemoryOptions(dtype=dtype),
    )
    try:
        draft_session.start()
    except BaseException:
        draft_session.close()
        raise
    model = DraftModel(draft_session, f"{source.name} ({dtype})")
    model.measure()
    return Speculator(model=model)


def _vocabulary_mismatch(target: Tokenizer, draft: Tokenizer) -> str | None:
    """How the draft's vocabulary differs from the target's, or None when it is the same."""
    if draft.vocab_size != target.vocab_size:
        return f"its vocabulary has {draft.vocab_size} tokens, the target's {target.vocab_size}"
    for i in range(target.vocab_size):
        if draft.id_to_token(i) != target.id_to_token(i):
            return (
                f"token {i} is {draft.id_to_token(i)!r} in it but "
                f"{target.id_to_token(i)!r} in the target"
            )
    return None
