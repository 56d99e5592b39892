"""A device's layer executor: its slice of every layer, its KV cache, and the two partials."""

from __future__ import annotations

import time

import torch

from memory.window import LayerWindow, ResidentLayers
from models.config import ModelConfig
from models.kernels import leave_a_core_to_the_loader
from models.layers import Rope, Slice, StepBatch, attention_partial, ffn_partial
from node.kvcache import KVCache


class SliceExecutor:
    """Computes one slice's attention and FFN partials, layer by layer, for a step's batch."""

    def __init__(
        self,
        config: ModelConfig,
        s: Slice,
        weights: LayerWindow | ResidentLayers,
        rope: Rope,
        cache: KVCache,
    ) -> None:
        if weights.n_layers != config.n_layers:
            raise ValueError(f"expected {config.n_layers} layers, got {weights.n_layers}")
        self.config = config
        self.slice = s
        self.weights = weights
        # A slice that streams gives its loader a core (models/kernels.py says why).
        leave_a_core_to_the_loader(isinstance(weights, LayerWindow) and not weights.resident)
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
        started = time.perf_counter()
        weights = self.weights.get(index)
        if self.weights.mode == "load-only":  # a benchmark of the loader alone
            out = h.new_zeros(h.shape)
        else:
            out = attention_partial(
                h,
                weights,
                self.slice,
                self.config,
                self._cos_sin,
                self.cache.keys[index],
                self.cache.values[index],
                self._batch,
            )
        self.weights.figures.compute_s += time.perf_counter() - started
        return out

    def ffn(self, index: int, h: torch.Tensor) -> torch.Tensor:
        """The layer's second and last block: its weights may leave the window after this."""
        started = time.perf_counter()
        weights = self.weights.get(index)
        if self.weights.mode == "load-only":
            out = h.new_zeros(h.shape)
        else:
            out = ffn_partial(h, weights, self.config)
        self.weights.release(index)
        self.weights.figures.compute_s += time.perf_counter() - started
        return out

    def close(self) -> None:
        self.weights.close()
