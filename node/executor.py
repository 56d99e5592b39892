"""A device's layer executor: its slice of every layer, its KV cache, and the two partials."""

from __future__ import annotations

import torch

from models.config import ModelConfig
from models.layers import Rope, Slice, StepBatch, attention_partial, ffn_partial
from node.kvcache import KVCache


class SliceExecutor:
    """Computes one slice's attention and FFN partials, layer by layer, for a step's batch."""

    def __init__(
        self,
        config: ModelConfig,
        s: Slice,
        layers: list[dict[str, torch.Tensor]],
        rope: Rope,
        cache: KVCache,
    ) -> None:
        if len(layers) != config.n_layers:
            raise ValueError(f"expected {config.n_layers} layers, got {len(layers)}")
        self.config = config
        self.slice = s
        self.layers = layers
        self.rope = rope
        self.cache = cache
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
        self._batch: StepBatch | None = None

    def begin_step(self, batch: StepBatch) -> None:
        """Positions are the same for every layer of a step: look up RoPE tables once."""
        self._batch = batch
        self._cos_sin = self.rope.tables(batch.positions())

    def attention(self, index: int, h: torch.Tensor) -> torch.Tensor:
        assert self._batch is not None and self._cos_sin is not None, "begin_step first"
        return attention_partial(
            h,
            self.layers[index],
            self.slice,
            self.config,
            self._cos_sin,
            self.cache.keys[index],
            self.cache.values[index],
            self._batch,
        )

    def ffn(self, index: int, h: torch.Tensor) -> torch.Tensor:
        return ffn_partial(h, self.layers[index], self.config)
