"""The master's engine: embed, run every layer as a sum of slice partials, final norm, lm_head.

The executors compute the partials; the engine owns the residual stream and does the sums. Here
all executors run in this process; a remote node is an executor whose partials arrive over the
wire, and the sum is the same.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from master.plan import plan_slices
from models.config import ModelConfig
from models.errors import ModelError
from models.kernels import linear
from models.layers import Rope, Slice, StepBatch, rms_norm, rope_inv_freq, slice_layer
from models.source import ModelSource
from node.executor import SliceExecutor
from node.kvcache import KVCache

log = logging.getLogger(__name__)

DEFAULT_CONTEXT = 2048


def context_size(config: ModelConfig, requested: int | None) -> int:
    """Tokens of KV cache to allocate: as asked (default 2048), at most the model's context."""
    if requested is not None and requested < 2:
        raise ModelError(f"--context must be at least 2 tokens, got {requested}")
    return min(requested or DEFAULT_CONTEXT, config.context_length)


class Executor(Protocol):
    """What the engine needs of a device's slice, wherever it runs."""

    def begin_step(self, batch: StepBatch) -> None: ...
    def attention(self, index: int, h: torch.Tensor) -> torch.Tensor: ...
    def ffn(self, index: int, h: torch.Tensor) -> torch.Tensor: ...


class Engine:
    def __init__(
        self,
        config: ModelConfig,
        embedding: torch.Tensor,
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
        executors: Sequence[Executor],
        max_context: int,
        slots: int,
    ) -> None:
        self.config = config
        self.embedding = embedding
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.executors = list(executors)
        self.max_context = max_context
        self.slots = slots

    @classmethod
    def local(
        cls,
        source: ModelSource,
        capacities: Sequence[float] = (1.0,),
        max_context: int | None = None,
        slots: int = 1,
        progress: Callable[[int, int], None] | None = None,
    ) -> Engine:
        """All slices of the plan for `capacities` in this process (one slice: one device)."""
        config = source.config
        max_context = context_size(config, max_context)
        slices = plan_slices(config, capacities)
        per_slice: list[list[dict[str, torch.Tensor]]] = [[] for _ in slices]
        for i in range(config.n_layers):
            full = source.layer(i)  # one full layer in memory at a time
            for layers, s in zip(per_slice, slices, strict=True):
                layers.append(slice_layer(config, full, s))
            if progress:
                progress(i + 1, config.n_layers)
        rope = Rope(rope_inv_freq(config, source.rope_freq_factors()), max_context)
        executors = [
            SliceExecutor(
                config, s, layers, rope, KVCache(config, s, slots, max_context, torch.float32)
            )
            for s, layers in zip(slices, per_slice, strict=True)
        ]
        embedding = source.embedding()
        lm_head = embedding if config.tied_embeddings else source.lm_head()
        return cls(config, embedding, source.final_norm(), lm_head, executors, max_context, slots)

    @property
    def slices(self) -> list[Slice]:
        return [e.slice for e in self.executors]  # type: ignore[attr-defined]

    @torch.inference_mode()
    def forward(
        self, tokens: Sequence[Sequence[int]], batch: StepBatch, all_logits: bool = False
    ) -> torch.Tensor:
        """Logits for the step: (B, V) at each sequence's last new token, or (B, T, V)."""
        for n, st in zip(batch.lengths, batch.starts, strict=True):
            if st + n > self.max_context:
                raise ModelError(
                    f"sequence of {st + n} tokens exceeds the context of {self.max_context}"
                )
        T = batch.width
        ids = torch.tensor([list(t) + [0] * (T - len(t)) for t in tokens])  # (B, T) right-padded
        h = F.embedding(ids, self.embedding)  # (B, T, D)
        for ex in self.executors:
            ex.begin_step(batch)
        for i in range(self.config.n_layers):
            h = h + self._sum(ex.attention(i, h) for ex in self.executors)
            h = h + self._sum(ex.ffn(i, h) for ex in self.executors)
        if not all_logits:
            last = torch.tensor(batch.lengths) - 1
            h = h[torch.arange(batch.size), last]  # (B, D)
        return linear(rms_norm(h, self.final_norm, self.config.norm_eps), self.lm_head)

    @staticmethod
    def _sum(partials: object) -> torch.Tensor:
        it = iter(partials)  # type: ignore[call-overload]
        total = next(it)
        for p in it:
            total = total + p
        return total
