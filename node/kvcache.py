"""The KV cache of one device's slice: preallocated, one slot per concurrent sequence."""

from __future__ import annotations

import torch

from models.config import ModelConfig
from models.layers import Slice

# Keys and values stay float32 whatever the weights' dtype: they are a small part of memory at
# edge context lengths, and the attention math on them is float32 in both paths.
KV_DTYPE = torch.float32


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
        shape = (slots, s.n_kv, max_context, config.head_dim)  # (S, n_kv, ctx, hd)
        self.keys = [torch.zeros(shape, dtype=dtype) for _ in range(config.n_layers)]
        self.values = [torch.zeros(shape, dtype=dtype) for _ in range(config.n_layers)]
        # The same memory as arrays, for the decode path (models/layers.py, attention_rows).
        self.key_arrays = [k.numpy() for k in self.keys]
        self.value_arrays = [v.numpy() for v in self.values]
        self.slots = slots
        self.max_context = max_context

    @staticmethod
    def bytes_per_token(config: ModelConfig, s: Slice, dtype: torch.dtype = KV_DTYPE) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * config.n_layers * s.n_kv * config.head_dim * itemsize
