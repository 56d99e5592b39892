"""The KV cache of one device's slice: preallocated, one slot per concurrent sequence; beside
it, the linear-attention layers' fixed-size states (`LinearStates`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from edgetp.models.config import ModelConfig
from edgetp.models.errors import ModelError
from edgetp.models.families import family_of
from edgetp.models.kvformat import (
    DEFAULT_KV_FORMAT,
    KVArrays,
    kv_arrays,
    kv_parts,
    kv_tensor,
    row_bytes,
)
from edgetp.models.layers import Slice, StepBatch

# A context past any window: the layers whose cache holds fewer positions keep a ring (or none)
_UNBOUNDED = 2**62


class KVCache:
    """Keys and values for `slots` sequences of up to `max_context` tokens, this slice's KV heads.

    Allocated once, zero-filled (pages are touched only as positions are written), so memory is
    known up front and a step never allocates cache.
    """

    def __init__(
        self,
        config: ModelConfig,
        s: Slice,
        slots: int,
        max_context: int,
        kv_format: str = DEFAULT_KV_FORMAT,
    ) -> None:
        def shape(layer: int) -> tuple[int, ...]:  # (S, n_kv, positions, hd)
            view, share = family_of(config).layer_view(config, s, layer)  # layers may differ
            return (slots, share.n_kv, positions(config, layer, max_context), view.head_dim)

        # Stored as `kv_format` (models/kvformat.py); read back as float32 by every path.
        self.kv_format = kv_format
        self.keys = [kv_tensor(kv_format, shape(i)) for i in range(config.n_layers)]
        self.values = [kv_tensor(kv_format, shape(i)) for i in range(config.n_layers)]
        # The same memory as arrays, for the decode path (models/block_rows.py, attention_rows).
        self.key_arrays = [kv_arrays(k) for k in self.keys]
        self.value_arrays = [kv_arrays(v) for v in self.values]
        self.slots = slots
        self.max_context = max_context
        self.linear = LinearStates(config, s, slots) if config.linear_layers else None
        rings = [i for i in range(config.n_layers) if 0 < self.keys[i].shape[2] < max_context]
        self.rings = RingUndo(self.key_arrays, self.value_arrays, rings, slots) if rings else None

    def begin_step(self, batch: StepBatch) -> None:
        """Before a step's first layer: copy the positions a sequence takes from another slot
        (`StepBatch.sources`), then bring each sequence's rings and linear states to its
        start."""
        for source, slot, n in batch.copies():
            self.copy(source, slot, n)
        if self.rings is not None:
            self.rings.begin_step(batch)
        if self.linear is not None:
            self.linear.begin_step(batch)

    def copy(self, source: int, slot: int, n: int) -> None:
        """Slot `source`'s keys and values of positions [0, n) into slot `slot`. A ring holds
        position p at p % W: the master asks this of a ring only while the source, its drafts
        included, has written fewer than W positions (reuse.py), so they lie at [0, n) there
        too; a layer that keeps none copies none."""
        if self.linear is not None:
            raise ModelError(
                "a linear-attention model's state cannot be copied between slots: start the "
                "sequence from position 0"
            )
        for cache in (*self.key_arrays, *self.value_arrays):
            for part in kv_parts(cache):
                held = min(n, part.shape[2])
                part[slot, :, :held] = part[source, :, :held]
        if self.rings is not None:
            self.rings.forget(slot)

    @property
    def nbytes(self) -> int:
        """The bytes the keys and values take."""
        return sum(t.nbytes for t in (*self.keys, *self.values))

    @staticmethod
    def bytes_per_token(config: ModelConfig, s: Slice, kv_format: str = DEFAULT_KV_FORMAT) -> int:
        """A slot's bytes per token of context: those of the layers that attend to all of it."""
        full = [i for i in range(config.n_layers) if positions(config, i, _UNBOUNDED) == _UNBOUNDED]
        return sum(_position_bytes(config, s, i, kv_format) for i in full)

    @staticmethod
    def window_bytes(config: ModelConfig, s: Slice, kv_format: str = DEFAULT_KV_FORMAT) -> int:
        """A slot's bytes for the local layers' rings, whatever the context (at most this)."""
        held = [positions(config, i, _UNBOUNDED) for i in range(config.n_layers)]
        rings = [i for i, n in enumerate(held) if 0 < n < _UNBOUNDED]
        window = config.sliding_window or 0
        ring_bytes = window * sum(_position_bytes(config, s, i, kv_format) for i in rings)
        return ring_bytes + LinearStates.slot_bytes(config, s)


def _position_bytes(config: ModelConfig, s: Slice, layer: int, kv_format: str) -> int:
    """A slot's bytes of keys and values a position in `layer`'s cache."""
    view, share = family_of(config).layer_view(config, s, layer)
    return 2 * share.n_kv * row_bytes(kv_format, view.head_dim)


def positions(config: ModelConfig, layer: int, max_context: int) -> int:
    """Positions a layer's cache holds: a local layer only its window, as a ring; a
    linear-attention layer none (its state is `LinearStates`'); a layer that reads another's
    none, and a local layer others read all of them (`Family.kv_source`)."""
    family = family_of(config)
    if config.is_linear(layer) or family.shares_kv(config, layer):
        return 0
    whole = family.keeps_whole_context(config, layer)
    if config.is_local(layer) and config.sliding_window and not whole:
        return min(config.sliding_window, max_context)
    return max_context


# Tokens of a step whose inputs a slot keeps, with its state before them, so that a later step
# may start at any of their positions: a speculative step's drafts (master/generation/speculate.py:
# at most 8 after the sequence's token), rejected, are undone so; the rings keep as many of a
# run of steps (`RingUndo`). A wider step is a prompt's: its end state is kept instead, for the
# next turn of a conversation to carry on from there.
KEPT_TOKENS = 16


@dataclass(frozen=True)
class Resume:
    """How a sequence's state is brought to its step's start: from zeros (a new sequence), as
    it is, from the state at the end of the slot's last prompt (`prompt`), or (`rewind`) from
    the state kept before its slot's last step, stepped forward again over `replay` of that
    step's tokens. `keep`: this step's start state and inputs are kept; `ends_prompt`: its
    end state is kept as the slot's prompt's."""

    zero: bool = False
    prompt: bool = False
    rewind: bool = False
    replay: int = 0
    keep: bool = False
    ends_prompt: bool = False


class RingUndo:
    """What the latest steps overwrote in the local layers' rings, kept to undo them.

    A ring of W positions holds position p at p % W: a step's tokens overwrite the W-old
    positions the window no longer reads, but rejected drafts would have overwritten positions
    that the tokens after them still read: a target's, checked in one step, and a draft
    model's, made a token a step (master/generation/speculate.py). So before each step the
    ring positions it will write are copied here, for the last `KEPT_TOKENS` positions of a
    run of steps that each carry on where the last ended (a step wider than that, a prompt's,
    ends the run and keeps nothing). A step that starts within the run (after a rejected
    draft) first puts back what the run wrote from its start on, as `LinearStates` takes back
    its state. The copies cost a step's positions, not a ring's."""

    def __init__(
        self, keys: list[KVArrays], values: list[KVArrays], layers: list[int], slots: int
    ) -> None:
        # Each ring's arrays (a q8_0 cache's codes and scales), with room beside each for
        # KEPT_TOKENS positions per slot: position p's at p % KEPT_TOKENS.
        self.flat = [p for a in (keys, values) for i in layers for p in kv_parts(a[i])]
        self.kept = [
            np.zeros((*p.shape[:2], KEPT_TOKENS, *p.shape[3:]), p.dtype) for p in self.flat
        ]
        # Per slot: the positions [kept_from, kept_to) whose overwritten ring entries are kept.
        self.kept_from = [0] * slots
        self.kept_to = [0] * slots

    def forget(self, slot: int) -> None:
        """`slot` holds another sequence's positions now (a copy): nothing of its last steps is
        to be undone."""
        self.kept_from[slot] = self.kept_to[slot] = -1

    def begin_step(self, batch: StepBatch) -> None:
        for slot, start, n in zip(batch.slots, batch.starts, batch.lengths, strict=True):
            first, end = self.kept_from[slot], self.kept_to[slot]
            if first <= start < end:  # back within the run: undo the rest of it
                for ring, copy in zip(self.flat, self.kept, strict=True):
                    w = ring.shape[2]
                    # the newest first: a ring entry two of them wrote gets its oldest copy back
                    for p in range(end - 1, start - 1, -1):
                        ring[slot, :, p % w] = copy[slot, :, p % KEPT_TOKENS]
                end = start
            elif start != end:  # not where the run ended: a new run
                first = end = start
            if n > KEPT_TOKENS:  # a prompt's step: the run ends with nothing kept
                first = end = start + n
            else:
                for ring, copy in zip(self.flat, self.kept, strict=True):
                    w = ring.shape[2]
                    if n == 1:  # a decode step's one position: no index lists to build
                        copy[slot, :, start % KEPT_TOKENS] = ring[slot, :, start % w]
                        continue
                    where = [p % w for p in range(start, start + n)]
                    kept = [p % KEPT_TOKENS for p in range(start, start + n)]
                    copy[slot][:, kept] = ring[slot][:, where]
                end = start + n
                first = max(first, end - KEPT_TOKENS)
            self.kept_from[slot], self.kept_to[slot] = first, end


class LinearStates:
    """A linear-attention slice's fixed-size state per sequence slot: for each of its layers and
    slots, each value head's (dk, dv) recurrent state and the convolution's last K - 1 inputs.

    The state holds one position: the one after the last token a slot took in. A step may
    start there; at 0 (a new sequence, or a replay after a node was lost: the state is zeroed);
    at a position within the slot's last step, when that step was short enough to keep its
    inputs (`KEPT_TOKENS`): its state before that step is taken back and stepped forward over
    the tokens before the new start, which undoes a speculative step's rejected drafts at the
    cost of one copy of the state more (a state kept after every draft would cost eight); or
    at the end of the slot's last prompt (a step wider than that), whose state is a copy more,
    for a conversation's next turn, whose prompt holds the last one but seldom the answer's
    tokens as they were sampled. Any other start is an error: its state is not known here
    (master/generation/reuse.py asks for none).
    """

    def __init__(self, config: ModelConfig, s: Slice, slots: int) -> None:
        self.config, self.slice = config, s
        c = sum(family_of(config).linear_channels(config, s))
        nv, dk, dv = s.n_linear, config.linear_k_dim, config.linear_v_dim
        taps = max(config.linear_conv - 1, 0)

        def zeros(*shape: int) -> dict[int, torch.Tensor]:
            return {i: torch.zeros(shape) for i in config.linear_layers}

        self.states, self.conv = zeros(slots, nv, dk, dv), zeros(slots, c, taps)
        self.kept_states, self.kept_conv = zeros(slots, nv, dk, dv), zeros(slots, c, taps)
        self.kept_x = zeros(slots, KEPT_TOKENS, c)
        self.kept_beta, self.kept_g = zeros(slots, KEPT_TOKENS, nv), zeros(slots, KEPT_TOKENS, nv)
        self.prompt_states, self.prompt_conv = zeros(slots, nv, dk, dv), zeros(slots, c, taps)
        self.at = [0] * slots  # the position each slot's state is at
        self.kept_at = [-1] * slots  # where its kept state is (-1: none)
        self.kept_tokens = [0] * slots  # inputs kept after it
        self.prompt_at = [-1] * slots  # where its last prompt's end state is (-1: none)
        self._resume: list[Resume] = []
        self._batch: StepBatch | None = None  # the step under way, until the next begins

    @staticmethod
    def slot_bytes(config: ModelConfig, s: Slice) -> int:
        """A slot's bytes of state, whatever the context: the state and the convolution's
        inputs, as much again kept to undo a step and for the last prompt's end, and the
        kept step's inputs."""
        if not config.linear_layers:
            return 0
        c, nv = sum(family_of(config).linear_channels(config, s)), s.n_linear
        state = nv * config.linear_k_dim * config.linear_v_dim + c * max(config.linear_conv - 1, 0)
        kept = KEPT_TOKENS * (c + 2 * nv)
        return 4 * len(config.linear_layers) * (3 * state + kept)

    def begin_step(self, batch: StepBatch) -> None:
        """The last step went through (each of its slots' state is past its tokens); check
        where each of this step's sequences starts against its slot's states, and say how each
        layer brings the state there (`prepare`)."""
        self._end_step()
        resume = []
        for slot, start, n in zip(batch.slots, batch.starts, batch.lengths, strict=True):
            kept, count = self.kept_at[slot], self.kept_tokens[slot]
            ends = {"keep": 1 < n <= KEPT_TOKENS, "ends_prompt": n > KEPT_TOKENS}
            if start == 0:
                resume.append(Resume(zero=True, **ends))
            elif start == self.at[slot]:
                resume.append(Resume(**ends))
            elif kept >= 0 and kept <= start <= kept + count:
                resume.append(Resume(rewind=True, replay=start - kept, **ends))
            elif start == self.prompt_at[slot]:
                resume.append(Resume(prompt=True, **ends))
            else:
                raise ModelError(
                    f"slot {slot}'s linear-attention state is at position {self.at[slot]}, "
                    f"not at {start} where its step starts: a linear-attention model continues a "
                    "sequence only from where its state is (start it again from position 0)"
                )
        self._resume, self._batch = resume, batch

    def prepare(self, layer: int, taps: torch.Tensor) -> None:
        """Bring layer `layer`'s state of each of the step's sequences to its start (`taps`:
        the layer's convolution, to step a kept state forward), keeping it where asked."""
        assert self._batch is not None, "begin_step first"
        for slot, how in zip(self._batch.slots, self._resume, strict=True):
            state, conv = self.states[layer][slot], self.conv[layer][slot]
            if how.zero:
                state.zero_()
                conv.zero_()
            elif how.prompt:
                state.copy_(self.prompt_states[layer][slot])
                conv.copy_(self.prompt_conv[layer][slot])
            elif how.rewind:
                state.copy_(self.kept_states[layer][slot])
                conv.copy_(self.kept_conv[layer][slot])
                r = how.replay
                kept = (self.kept_x[layer][slot, :r], self.kept_beta[layer][slot, :r],
                        self.kept_g[layer][slot, :r])  # fmt: skip
                family = family_of(self.config)
                family.linear_recur(*kept, taps, conv, state, self.slice, self.config)
            if how.keep:
                self.kept_states[layer][slot].copy_(state)
                self.kept_conv[layer][slot].copy_(conv)

    def finish(self, layer: int, x: torch.Tensor, beta: torch.Tensor, g: torch.Tensor) -> None:
        """After layer `layer`'s step: keep its inputs (B, T, ...) for the sequences that keep
        them, and the end state of those that end a prompt."""
        assert self._batch is not None
        for b, (slot, n, how) in enumerate(
            zip(self._batch.slots, self._batch.lengths, self._resume, strict=True)
        ):
            if how.keep:
                self.kept_x[layer][slot, :n] = x[b, :n]
                self.kept_beta[layer][slot, :n] = beta[b, :n]
                self.kept_g[layer][slot, :n] = g[b, :n]
            if how.ends_prompt:
                self.prompt_states[layer][slot].copy_(self.states[layer][slot])
                self.prompt_conv[layer][slot].copy_(self.conv[layer][slot])

    def _end_step(self) -> None:
        """Each slot of the last step: its state is past the step's tokens, and its kept
        states (where it kept them) at the step's start or end. A step that failed half-way
        leaves layers apart: its sequences are started again from 0 (master/generation/reuse.py)."""
        if self._batch is None:
            return
        batch = self._batch
        for slot, start, n, how in zip(
            batch.slots, batch.starts, batch.lengths, self._resume, strict=True
        ):
            self.at[slot] = start + n
            self.kept_at[slot] = start if how.keep else -1
            self.kept_tokens[slot] = n if how.keep else 0
            if how.ends_prompt:
                self.prompt_at[slot] = start + n
            elif how.zero:  # another sequence: the last prompt's end is not its
                self.prompt_at[slot] = -1
        self._batch = None
