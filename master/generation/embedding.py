"""Embeddings: one vector for a text, from the model's own hidden states, no lm_head.

The vector is the final norm's output (the state the lm_head would read) averaged over the
input's tokens, then scaled to length 1. The served models are decoders: no token sees the whole
input but the last, and the last alone leans on what comes next rather than on what was said;
the mean over every token is what llama.cpp's server gives such models by default (pooling
"mean"), and with unit length a dot product is the cosine OpenAI's clients expect.

An input is computed like a prompt's prefill, from position 0 in a free KV-cache slot, on the
batcher's thread (the one that calls the engine): its keys and values are written to that slot
as any step's are, so the slot is handed back holding nothing known, and the sums across nodes
are the same ones generation makes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from edgetp.master.cluster.engine import Engine
from edgetp.models.layers import StepBatch

# Tokens one embedding step computes at most (inputs x the longest of them, padding included):
# a step holds (B, T, D) floats per layer on the master, and the steps of running answers wait.
STEP_TOKENS = 4096


def chunk(lengths: Sequence[int], free: int) -> int:
    """How many of the inputs of `lengths` (in order) the next step takes: at most `free`
    (slots), at most STEP_TOKENS padded tokens, at least one."""
    taken, widest = 0, 0
    for n in lengths[:free]:
        widest = max(widest, n)
        if taken and (taken + 1) * widest > STEP_TOKENS:
            break
        taken += 1
    return taken


def embed_step(
    engine: Engine, inputs: Sequence[Sequence[int]], slots: Sequence[int]
) -> list[np.ndarray]:
    """Each input's unit vector (D,) float32: one step, input b in KV slot `slots[b]` from 0."""
    batch = StepBatch(tuple(slots), (0,) * len(inputs), tuple(len(t) for t in inputs))
    hidden = engine.final_hidden(inputs, batch)  # (B, T, D), right-padded
    out = []
    for b, n in enumerate(batch.lengths):
        mean = hidden[b, :n].double().mean(0)  # the padding's rows left out
        out.append((mean / mean.norm().clamp_min(torch.finfo(torch.float64).tiny)).float().numpy())
    return out
