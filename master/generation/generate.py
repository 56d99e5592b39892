"""The generation loop: sequences advance together, one engine step at a time.

A step carries every active sequence: a new one feeds its prompt (prefill; past the tokens whose
keys and values its slot already holds, master/generation/reuse.py), a running one its last token
(decode).
So a sequence can join a running batch at any step, and all of them share the same trip through
the layers.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch

from edgetp.master.cluster.engine import Engine
from edgetp.master.generation.params import SamplingParams
from edgetp.master.generation.sampling import Sampler, TokenLogprob, sampler_for
from edgetp.master.generation.speculate import DraftState, Speculator
from edgetp.models.errors import ModelError
from edgetp.models.layers import StepBatch
from edgetp.models.tokenizer import Tokenizer
from edgetp.node.kvcache import KEPT_TOKENS


@dataclass
class Generation:
    """One sequence being generated: its cache slot, tokens, text so far and why it ended."""

    slot: int
    prompt: list[int]
    params: SamplingParams
    sampler: Sampler
    tokens: list[int] = field(default_factory=list)
    text: str = ""  # decoded output, stop strings removed
    emitted: int = 0  # characters of `text` already handed out
    finish_reason: str | None = None  # "stop" | "length" | "error" (see `failure`)
    stop_string: str | None = None  # the one of params.stop that ended it, if one did
    failure: ModelError | None = None  # why it ended without its answer (NaN logits)
    position: int = 0  # tokens already in the KV cache
    drafts: DraftState = field(default_factory=DraftState)  # speculation's figures for it
    # With params.logprobs: one per token of `tokens`
    logprobs: list[TokenLogprob] = field(default_factory=list)
    decoded: int = 0  # characters of the output decoded up to the last whole character
    detok_text: str = ""  # those characters, stop strings not removed
    detok_window: tuple[int, int] = (0, 0)  # tokens decoded again, and the last of them kept
    logprobs_sent: int = 0  # of `logprobs`, handed out
    # prompt tokens whose KV its slot held when it started (master/generation/reuse.py)
    reused: int = 0
    # the slot whose positions [0, position) its next step copies first (-1: none), when those
    # of a running sequence begin as its prompt does (master/generation/reuse.py)
    source: int = -1
    sampled: int = 0  # tokens sampled so far (an end-of-sequence token included)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def decoding(self) -> bool:
        """Whether its next step feeds just its last sampled token (not a prompt)."""
        return bool(self.tokens) and self.position == len(self.prompt) + len(self.tokens) - 1

    def pending(self) -> list[int]:
        """Tokens to feed in the next step: those past what the KV cache holds. The prompt (past
        the reused part) for a new request; the prompt and every token so far for one replayed
        after a node was lost (position 0); else the last token."""
        if self.position >= len(self.prompt):
            return self.tokens[self.position - len(self.prompt) :]
        return self.prompt[self.position :] + self.tokens

    def cached(self) -> list[int]:
        """The tokens whose keys and values its slot holds: all it fed, the last sampled token
        and rejected drafts not included."""
        return (self.prompt + self.tokens)[: self.position]

    def take_text(self) -> str:
        """New text since the last call, holding back what a stop string might still claim."""
        hold = 0
        if not self.finished:
            for stop in self.params.stop:
                for n in range(min(len(stop) - 1, len(self.text)), 0, -1):
                    if self.text.endswith(stop[:n]):
                        hold = max(hold, n)
                        break
        ready = len(self.text) - hold
        if ready <= self.emitted:
            return ""
        out = self.text[self.emitted : ready]
        self.emitted = ready
        return out

    def take_logprobs(self) -> list[TokenLogprob]:
        """The log probabilities of the tokens whose text has begun to be handed out since the
        last call (`take_text` first), and once finished, all the rest."""
        end = len(self.logprobs)
        if not self.finished:
            while end > self.logprobs_sent and self.logprobs[end - 1].offset >= self.emitted:
                end -= 1
        out = self.logprobs[self.logprobs_sent : end]
        self.logprobs_sent = end
        return out


def check_prompt(prompt: Sequence[int], max_context: int) -> None:
    """A prompt must leave room in the context for at least one new token."""
    if not prompt:
        raise ModelError("the prompt is empty: give some text to complete")
    if len(prompt) >= max_context:
        raise ModelError(
            f"the prompt has {len(prompt)} tokens but the context holds {max_context}: "
            f"shorten it or raise --context"
        )


def step(
    engine: Engine,
    tokenizer: Tokenizer,
    seqs: Sequence[Generation],
    speculator: Speculator | None = None,
    prefill_chunk: int | None = None,
) -> None:
    """Advance every unfinished sequence by one token, or by several with a `speculator`:
    a decoding sequence feeds drafted tokens after its last one, and keeps those the logits
    confirm plus the one they choose next (master/generation/speculate.py). With a
    `prefill_chunk`, a prompt feeds about that many of its tokens (`_prompt_chunk`), and one
    that has more left samples nothing: its next step goes on from there (chunked prefill)."""
    active = [g for g in seqs if not g.finished]
    if not active:
        return
    whole = [g.pending() for g in active]
    decoding = [g.decoding for g in active]  # not a prompt (new, or replayed)
    states = bool(engine.config.linear_layers)
    feeds = [f if d else _prompt_chunk(f, prefill_chunk, states)
             for f, d in zip(whole, decoding, strict=True)]  # fmt: skip
    drafts: list[list[int]] = [[] for _ in active]
    drafting = [b for b in range(len(active)) if decoding[b]]
    if speculator is not None and drafting:
        proposed = speculator.drafts(
            [active[b].drafts for b in drafting],
            [active[b].prompt + active[b].tokens for b in drafting],
            [_room(active[b], engine.max_context) for b in drafting],
            [active[b].slot for b in drafting],
        )
        for b, d in zip(drafting, proposed, strict=True):
            drafts[b] = active[b].sampler.allowed_drafts(d)
    fed = [f + d for f, d in zip(feeds, drafts, strict=True)]
    sources = tuple(g.source for g in active)
    batch = StepBatch(
        tuple(g.slot for g in active),
        tuple(g.position for g in active),
        tuple(len(f) for f in fed),
        sources if any(s >= 0 for s in sources) else (),
    )
    started = time.perf_counter()
    logits = engine.forward(fed, batch, all_logits=any(drafts))  # (B, V), or (B, T, V)
    for g in active:
        g.source = -1  # copied: the slot holds those positions now
    if speculator is not None:
        seconds = time.perf_counter() - started
        speculator.record_step(seconds, batch.width, all(decoding))
    for b, g in enumerate(active):
        g.position += len(feeds[b])
        if len(feeds[b]) < len(whole[b]):
            continue  # a chunk of its prompt: the logits of a token inside it are not asked for
        try:
            made, accepted = _sample(
                g, logits[b], len(feeds[b]), drafts[b], tokenizer, engine.max_context
            )
        except ModelError as exc:  # NaN among this sequence's logits: the others' go on
            g.failure, g.finish_reason = exc, "error"
            continue
        g.sampled += made
        if speculator is not None and decoding[b]:
            speculator.record_draft(g.drafts, len(drafts[b]), accepted, made)


def _prompt_chunk(feed: list[int], chunk: int | None, states: bool) -> list[int]:
    """A prompt's feed for this step: its first `chunk` tokens, or all of it (no `chunk`).
    A model with linear-attention `states` feeds chunks wider than KEPT_TOKENS, and all of it
    rather than leave KEPT_TOKENS or fewer: a node then keeps the state at the end of the last
    chunk, the prompt's end, as it does after a prompt fed whole (node.kvcache.LinearStates;
    reuse.py counts on it)."""
    if chunk is None:
        return feed
    if not states:
        return feed[:chunk]
    size = max(chunk, KEPT_TOKENS + 1)
    return feed if len(feed) - size <= KEPT_TOKENS else feed[:size]


def _sample(
    g: Generation,
    logits: torch.Tensor,
    fed_tokens: int,
    drafts: list[int],
    tokenizer: Tokenizer,
    max_context: int,
) -> tuple[int, int]:
    """Take `g`'s next token from its `logits` (V,), or with drafts in the step (T, V), each
    draft the logits confirm after its `fed_tokens` and the one they choose next: (tokens
    taken, drafts accepted)."""
    if logits.dim() == 1:
        history = g.prompt + g.tokens
        _accept(g, logits, history, g.sampler(logits, history, g.tokens), tokenizer, max_context)
        return 1, 0
    made = accepted = 0
    rows = logits[fed_tokens - 1 : fed_tokens + len(drafts)]  # the next token's, at each place
    for row, draft in zip(rows, [*drafts, None], strict=True):
        history = g.prompt + g.tokens
        if draft is None:
            token = g.sampler(row, history, g.tokens)
        else:
            token = g.sampler.verify(row, history, draft, g.tokens)
        # a drafted token's log probability is the target's, from its row at that position
        _accept(g, row, history, token, tokenizer, max_context)
        made += 1
        if token != draft or g.finished:
            break
        accepted += 1
        g.position += 1  # the draft's keys and values, written by this step, now count
    return made, accepted


def _room(g: Generation, max_context: int) -> int:
    """Drafts a decoding sequence can take: the context must hold them and the token after,
    and no more than its max_tokens will keep."""
    return min(max_context - g.position - 2, g.params.max_tokens - len(g.tokens) - 1)


def _accept(
    g: Generation,
    logits: torch.Tensor,
    history: list[int],
    token: int,
    tokenizer: Tokenizer,
    max_context: int,
) -> None:
    """Take `token`, sampled from `logits` (V,) after `history`, into `g`."""
    g.sampler.accept(token)
    # A grammar allows an end only once complete, and nothing after it: it ends even with
    # ignore_eos.
    if token in tokenizer.eos_ids and (not g.params.ignore_eos or g.sampler.constraint):
        g.finish_reason = "stop"  # not text: no log probability is reported for it
        return
    if g.params.logprobs is not None:
        logprob = g.sampler.logprob(logits, history, token, g.tokens)
        g.logprobs.append(replace(logprob, offset=g.decoded))
    g.tokens.append(token)
    before = g.decoded
    text = _detokenize(g, tokenizer)
    for stop in g.params.stop:
        # earlier text held none: a stop can only end in what is new
        cut = text.find(stop, max(0, before - len(stop) + 1))
        if cut != -1:
            g.text = text[:cut]
            g.finish_reason, g.stop_string = "stop", stop
            return
    g.text = text
    if len(g.tokens) >= g.params.max_tokens or g.position + 1 >= max_context:
        g.finish_reason = "length"


def _detokenize(g: Generation, tokenizer: Tokenizer) -> str:
    """The text of `g`'s output up to its last whole character, decoding only the tokens since
    the last whole character's, and the run before them (a piece's text depends on what comes
    before it: sentencepiece drops the space of a run's first word). Decoding the whole answer
    again at every token cost O(answer) per token."""
    start, end = g.detok_window
    before = tokenizer.decode(g.tokens[start:end])
    now = tokenizer.decode(g.tokens[start:])
    if now.endswith("\ufffd") or len(now) <= len(before):  # an incomplete UTF-8 sequence
        return g.detok_text  # wait for its next byte
    g.detok_text += now[len(before) :]
    g.detok_window = (end, len(g.tokens))
    g.decoded = len(g.detok_text)
    return g.detok_text


def start(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    tokenizer: Tokenizer | None = None,
) -> list[Generation]:
    """One generation per prompt, in cache slots 0.., checked against the context; a
    `tokenizer` is needed for params with a grammar."""
    if len(prompts) > engine.slots:
        raise ModelError(f"{len(prompts)} prompts but the engine has {engine.slots} slots")
    seqs = []
    for slot, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        check_prompt(prompt, engine.max_context)
        if p.grammar is not None and tokenizer is None:
            raise ValueError("a grammar needs the model's tokenizer: pass it to start()")
        sampler = Sampler(p) if tokenizer is None else sampler_for(p, tokenizer)
        seqs.append(Generation(slot, list(prompt), p, sampler))
    return seqs


def stream(
    engine: Engine,
    tokenizer: Tokenizer,
    seqs: Sequence[Generation],
    speculator: Speculator | None = None,
) -> Iterator[tuple[int, str]]:
    """Step until every sequence is finished; yields (index in seqs, new text) as it comes."""
    while not all(g.finished for g in seqs):
        step(engine, tokenizer, seqs, speculator)
        for i, g in enumerate(seqs):
            text = g.take_text()
            if text:
                yield i, text
        failed = next((g.failure for g in seqs if g.failure is not None), None)
        if failed is not None:
            raise failed
