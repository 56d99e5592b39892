"""The KV cache of one device's slice: preallocated, one slot per concurrent sequence."""

from __future__ import annotations

import torch

from models.config import ModelConfig
from models.gemma4 import keeps_whole_context, layer_view, shares_kv
from models.layers import Slice

# Keys and values stay float32 whatever the weights' dtype: they are a small part of memory at
# edge context lengths, and the attention math on them is float32 in both paths.
KV_DTYPE = torch.float32
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
        dtype: torch.dtype = KV_DTYPE,
    ) -> None:
        def shape(layer: int) -> tuple[int, ...]:  # (S, n_kv, positions, hd)
            view, share = layer_view(config, s, layer)  # Gemma 4's global layers differ
            return (slots, share.n_kv, positions(config, layer, max_context), view.head_dim)

        self.keys = [torch.zeros(shape(i), dtype=dtype) for i in range(config.n_layers)]
        self.values = [torch.zeros(shape(i), dtype=dtype) for i in range(config.n_layers)]
        # The same memory as arrays, for the decode path (models/block_rows.py, attention_rows).
        self.key_arrays = [k.numpy() for k in self.keys]
        self.value_arrays = [v.numpy() for v in self.values]
        self.slots = slots
        self.max_context = max_context

    @staticmethod
    def bytes_per_token(config: ModelConfig, s: Slice, dtype: torch.dtype = KV_DTYPE) -> int:
        """A slot's bytes per token of context: those of the layers that attend to all of it."""
        full = [i for i in range(config.n_layers) if positions(config, i, _UNBOUNDED) == _UNBOUNDED]
        return sum(_position_bytes(config, s, i, dtype) for i in full)

    @staticmethod
    def window_bytes(config: ModelConfig, s: Slice, dtype: torch.dtype = KV_DTYPE) -> int:
        """A slot's bytes for the local layers' rings, whatever the context (at most this)."""
        held = [positions(config, i, _UNBOUNDED) for i in range(config.n_layers)]
        rings = [i for i, n in enumerate(held) if 0 < n < _UNBOUNDED]
        window = config.sliding_window or 0
        return window * sum(_position_bytes(config, s, i, dtype) for i in rings)


def _position_bytes(config: ModelConfig, s: Slice, layer: int, dtype: torch.dtype) -> int:
    """A slot's bytes of keys and values a position in `layer`'s cache."""
    view, share = layer_view(config, s, layer)
    return 2 * share.n_kv * view.head_dim * torch.empty((), dtype=dtype).element_size()


def positions(config: ModelConfig, layer: int, max_context: int) -> int:
    """Positions a layer's cache holds: a local layer only its window, as a ring; a layer that
    reads another's none, and a local layer others read all of them (models/gemma4.py)."""
    if shares_kv(config, layer):
        return 0
    if config.is_local(layer) and config.sliding_window and not keeps_whole_context(config, layer):
        return min(config.sliding_window, max_context)
    return max_context
