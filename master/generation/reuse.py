"""Prompt reuse: a finished sequence's KV cache stays in its slot, for a prompt that begins alike.

Nothing on the nodes changes: a slot is not cleared when its sequence ends, and a new sequence
that starts at position p in it writes its keys and values from p on (`StepBatch.starts`), while
attention reads only positions below the step's end. So what the master must know is, per free
slot, which tokens its cache holds: the prompt and the tokens fed through the model after it
(not the last one sampled, whose keys are not written yet; not a rejected draft's, which lie past
the sequence's position). A new request takes the free slot whose tokens share the longest
prefix with its own, and prefills only the rest.

A local layer's ring (Gemma 3) holds only the last `ring` positions a slot wrote: once a slot's
sequence outgrew its ring, the positions before its last `ring` are gone, and only a request
that carries on from its end (at most its last token different) can start past 0.

A linear-attention layer (Qwen3.5's gated DeltaNet) keeps no keys and values but a state a
slot, known at two positions only (node.kvcache.LinearStates): after the last token the slot
took in, and at the end of its last prompt, when that prompt's prefill was wider than
KEPT_TOKENS (the node keeps the state there). A request reuses the longer of those that its
tokens carry on from: a conversation's next turn holds the last prompt, if not always the
answer's tokens as they were sampled. Any other prefills from 0, which zeroes the state.

A running sequence's slot gives its positions too: a request whose prompt begins as a running
one's takes a free slot, and its first step copies those positions into it on every node
(`StepBatch.sources`), so requests that share a long system prompt and tool list (an agent's
parallel calls) prefill it once. Requests that arrive together wait one step for the first of
them to prefill what they share (master/generation/batcher.py). A ring gives its positions only
while its sequence has not gone round it (the copy takes the ring's first positions as they
are); a linear-attention state gives none (it is known at the slot's own position only).

A re-plan builds a new engine with empty caches: what the pool knew belongs to the engine it was
told of (`bind`), and is forgotten when another one runs.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from edgetp.master.cluster.engine import Engine
from edgetp.node.kvcache import KEPT_TOKENS, positions


@dataclass(frozen=True)
class Taken:
    """A slot handed to a request, and where its prefill starts: tokens before it are reused,
    from the slot itself or copied from running slot `source` (-1: none)."""

    slot: int
    start: int
    source: int = -1


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def reusable(
    kept: Sequence[int], tokens: Sequence[int], ring: int | None, known: Sequence[int] | None = None
) -> int:
    """Tokens of `tokens` whose keys and values a slot holding `kept` can give: their common
    prefix, less the last token of `tokens` (its logits are the first token's), and none when a
    ring of `ring` positions has lost positions that the first new token would read. `known`:
    the only positions the slot's state is known at (a linear-attention layer's), of which the
    furthest within that prefix, or none."""
    n = min(common_prefix(kept, tokens), len(tokens) - 1)
    if known is not None:
        return max((p for p in known if 0 < p <= n), default=0)
    if ring is not None and len(kept) > ring and n < len(kept) - 1:
        return 0  # the new tokens would read positions before the kept ones' last `ring`
    return max(n, 0)


class SlotPool:
    """The KV-cache slots: the free ones in the order they were freed (least recently used
    first) with the tokens each holds, and those in use."""

    def __init__(self, slots: int, reuse: bool = True) -> None:
        self.reuse = reuse
        self._free: list[int] = list(range(slots))  # least recently used first
        self._kept: dict[int, list[int]] = {}  # free slot -> tokens its cache holds
        self._engine: weakref.ref[Engine] | None = None
        self._ring: int | None = None
        self._states = False  # the slots hold a state, known at a few positions only
        self._prompt_end: dict[int, int] = {}  # slot -> its last prompt's end, with a state

    def __len__(self) -> int:
        """Free slots."""
        return len(self._free)

    def bind(self, engine: Engine) -> None:
        """The caches are `engine`'s: a different engine (a re-plan) holds none of the kept
        tokens."""
        if self._engine is not None and self._engine() is engine:
            return
        self.forget()
        self._engine = weakref.ref(engine)
        config = engine.config
        self._ring = None
        self._states = bool(config.linear_layers)
        if config.local_layers and config.sliding_window:
            self._ring = positions(config, config.local_layers[0], engine.max_context)

    def forget(self) -> None:
        """The caches are gone (a node was lost, a re-plan): no slot holds anything now."""
        self._kept.clear()
        self._prompt_end.clear()

    def reusable(self, tokens: Sequence[int], running: Mapping[int, Sequence[int]]) -> Taken:
        """Where a sequence of `tokens` would start (`take`), nothing taken."""
        best, start, source = self._free[0], 0, -1
        if not self.reuse:
            return Taken(best, start)
        for slot in self._free:
            n = reusable(self._kept.get(slot, ()), tokens, self._ring, self._known(slot))
            if n > start:
                best, start = slot, n
        for slot, kept in running.items():
            n = 0 if self._states else reusable(kept, tokens, self._ring)
            if self._ring is not None and len(kept) + KEPT_TOKENS > self._ring:
                n = 0  # its ring may have gone round (drafts written past `kept` included)
            if n > start:
                best, start, source = self._free[0], n, slot
        return Taken(best, start, source)

    def take(
        self, tokens: Sequence[int], running: Mapping[int, Sequence[int]] | None = None
    ) -> Taken:
        """A free slot for a sequence of `tokens`: the one sharing the longest prefix, else the
        least recently used; its prefill starts after the tokens it reuses. `running`: the
        slots in use and the tokens each holds, whose positions a free slot may copy."""
        return self.claim(tokens, self.reusable(tokens, running or {}))

    def claim(self, tokens: Sequence[int], taken: Taken) -> Taken:
        """Hand out `taken`, what `reusable` offered a sequence of `tokens` (nothing changed in
        between)."""
        best, start = taken.slot, taken.start
        self._free.remove(best)
        self._kept.pop(best, None)  # in use: what it holds now changes with every step
        if len(tokens) - start > KEPT_TOKENS:  # a node keeps the state at the prompt's end
            self._prompt_end[best] = len(tokens)
        elif start == 0:
            self._prompt_end.pop(best, None)
        return taken

    def borrow(self) -> int:
        """The least recently used free slot, for a step that writes it from position 0 and
        keeps nothing (an embedding's): give it back with None."""
        slot = self._free.pop(0)
        self._kept.pop(slot, None)
        self._prompt_end.pop(slot, None)
        return slot

    def _known(self, slot: int) -> list[int] | None:
        """Where a free slot's state is known (None: its model has none): after its kept
        tokens, and at its last prompt's end."""
        if not self._states:
            return None
        kept = len(self._kept.get(slot, ()))
        return [kept] + ([self._prompt_end[slot]] if slot in self._prompt_end else [])

    def give_back(self, slot: int, kept: Sequence[int] | None) -> None:
        """`slot` is free again, its cache holding the KV of `kept` (None: not known, as after a
        step that failed half-way)."""
        self._free.append(slot)
        if kept and self.reuse:
            self._kept[slot] = list(kept)
