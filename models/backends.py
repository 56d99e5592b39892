"""Where a slice's blocks are computed: one interface, a backend per way of computing them.

Each computation (attention, a gated DeltaNet, the FFN, a mixture's experts) is written once
per backend: in torch (`TorchBlocks`, `models.block_math`, the reference: every block, any
step), as NumPy rows (`RowBlocks`, `models.block_rows`: a decode step) and in C
(`models.rows_native.NativeBlocks`: a decode step's attention and FFN, where a device admitted
them). Each says which blocks it computes for a step (`supports`); an executor holds its
device's backends in order of preference and runs each block on the first that supports it
(node/executor.py), so what a backend lacks is said once, here, not at every call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol

import numpy as np
import torch

from edgetp.models.block_math import attention_partial, ffn_partial
from edgetp.models.block_rows import attention_rows, ffn_rows
from edgetp.models.config import ModelConfig
from edgetp.models.families import family_of
from edgetp.models.kvformat import KVArrays, KVTensor
from edgetp.models.layers import Slice, StepBatch
from edgetp.models.moe import Routing, moe_partial, moe_rows

# The hidden state, from the embedding to the final norm, on every node: float32 NumPy, rows
# (B, D) in a decode step, (B, T, D) in any other. The prefill's layer math is torch's: it
# converts at its edge (`_as_tensor`), without a copy where it may.
Hidden = np.ndarray
Weights = dict[str, torch.Tensor]  # a layer's tensors, as the slice's shard names them

# The computations a layer's blocks are made of: its attention or gated DeltaNet, then its FFN
# or its mixture's experts.
Block = Literal["attention", "linear", "ffn", "experts"]
BLOCKS: tuple[Block, ...] = ("attention", "linear", "ffn", "experts")


@dataclass(frozen=True)
class StepTables:
    """A step's sequences and their RoPE tables, looked up once for every layer."""

    batch: StepBatch
    cos_sin: tuple[torch.Tensor, torch.Tensor]  # `Rope.tables` of the batch's positions
    local_cos_sin: tuple[torch.Tensor, torch.Tensor] | None  # the second table's, if any
    # a decode step's, (B, 1, half) each (`Rope.rows`); None in any other step
    cos_sin_rows: tuple[np.ndarray, np.ndarray] | None
    local_cos_sin_rows: tuple[np.ndarray, np.ndarray] | None


class RecurrentStates(Protocol):
    """A gated DeltaNet's states beside the KV cache (node.kvcache.LinearStates)."""

    conv: dict[int, torch.Tensor]
    states: dict[int, torch.Tensor]

    def prepare(self, layer: int, taps: torch.Tensor) -> None: ...
    def finish(self, layer: int, x: torch.Tensor, beta: torch.Tensor, g: torch.Tensor) -> None: ...


class BlockBackend(ABC):
    """One way of computing a slice's partials of a layer's blocks. `h` is a step's `Hidden`,
    `w` the layer's weights; each returns the partial, shaped as h. A backend is asked only
    for the blocks it `supports` in the step it was last given (`start_step`); those it
    computes none of keep these bodies."""

    name: ClassVar[str]

    @abstractmethod
    def supports(self, block: Block, batch: StepBatch) -> bool:
        """Whether this backend computes `block` for a step of `batch`."""

    @abstractmethod
    def start_step(self, step: StepTables) -> None:
        """The step the next blocks belong to."""

    def attention(self, index: int, h: Hidden, w: Weights) -> Hidden:
        raise NotImplementedError(f"{self.name} has no attention")

    def linear_attention(self, index: int, h: Hidden, w: Weights) -> Hidden:
        raise NotImplementedError(f"{self.name} has no gated DeltaNet")

    def ffn(self, index: int, h: Hidden, w: Weights) -> Hidden:
        raise NotImplementedError(f"{self.name} has no FFN")

    def experts(self, index: int, h: Hidden, w: Weights, routing: Routing) -> Hidden:
        raise NotImplementedError(f"{self.name} has no experts")


def first_capable(backends: list[BlockBackend], block: Block, batch: StepBatch) -> BlockBackend:
    """The first of a device's `backends` (in its order of preference) that computes `block`
    for this step: the last is torch's, which computes all."""
    for backend in backends:
        if backend.supports(block, batch):
            return backend
    raise ValueError(f"no backend computes {block} for this step ({[b.name for b in backends]})")


def _window(config: ModelConfig, index: int) -> int | None:
    """How many last positions layer `index` attends to: a local layer's window, else all."""
    return config.sliding_window if config.is_local(index) else None


def _as_tensor(h: Hidden) -> torch.Tensor:
    """A step's (B, T, D) for torch's layer math; a received message's read-only memory is
    copied (torch may not share memory it must not write)."""
    return torch.from_numpy(h if h.flags.writeable else h.copy())


class RowBlocks(BlockBackend):
    """A decode step's blocks as NumPy rows (B, D) (`models.block_rows`, `models.moe`): between
    messages every torch call runs cold (`attention_rows` says why NumPy)."""

    name = "numpy"

    def __init__(
        self, config: ModelConfig, s: Slice, keys: list[KVArrays], values: list[KVArrays]
    ) -> None:
        self.config, self.slice = config, s
        self.keys, self.values = keys, values  # each layer's cache as arrays
        self.tables: StepTables | None = None

    def supports(self, block: Block, batch: StepBatch) -> bool:
        # Gemma 4's attention (a value norm, KV shared across layers) and a gated DeltaNet are
        # torch's only.
        if block == "linear" or (block == "attention" and self.config.value_norm):
            return False
        return batch.rows

    def start_step(self, step: StepTables) -> None:
        self.tables = step

    def attention(self, index: int, h: Hidden, w: Weights) -> Hidden:
        step = self.tables
        assert step is not None, "start_step first"
        own = self.config.own_rope(index)
        cos_sin = step.local_cos_sin_rows if own else step.cos_sin_rows
        assert cos_sin is not None
        return attention_rows(
            h, w, self.slice, self.config, cos_sin, self.keys[index], self.values[index],
            step.batch, _window(self.config, index),
        )  # fmt: skip

    def ffn(self, index: int, h: Hidden, w: Weights) -> Hidden:
        return ffn_rows(h, w, self.config)

    def experts(self, index: int, h: Hidden, w: Weights, routing: Routing) -> Hidden:
        return moe_rows(h, w, self.config, routing)


class TorchBlocks(BlockBackend):
    """Every block for any step in torch (`models.block_math`): the reference. A decode step's
    rows (B, D) are one token a sequence, (B, 1, D) to it."""

    name = "torch"

    def __init__(
        self,
        config: ModelConfig,
        s: Slice,
        views: list[tuple[ModelConfig, Slice]],
        keys: list[KVTensor],
        values: list[KVTensor],
        linear: RecurrentStates | None,
    ) -> None:
        self.config, self.slice = config, s
        self.views = views  # each layer's shape and this slice's share of it (Gemma 4's differ)
        self.keys, self.values = keys, values  # each layer's cache as tensors
        self.linear = linear  # a gated DeltaNet's states, where the model has such layers
        self.tables: StepTables | None = None

    def supports(self, block: Block, batch: StepBatch) -> bool:
        return True

    def start_step(self, step: StepTables) -> None:
        self.tables = step

    def attention(self, index: int, h: Hidden, w: Weights) -> Hidden:
        step = self.tables
        assert step is not None, "start_step first"
        rows = step.batch.rows
        cos_sin = step.local_cos_sin if self.config.own_rope(index) else step.cos_sin
        assert cos_sin is not None
        cache = family_of(self.config).kv_source(self.config, index)  # its own, or a shared one
        x = _as_tensor(h[:, None] if rows else h)  # (B, T, D)
        view, share = self.views[index]
        with torch.inference_mode():
            out = attention_partial(
                x, w, share, view, cos_sin, self.keys[cache], self.values[cache], step.batch,
                _window(self.config, index), shared_kv=cache != index,
            ).numpy()  # fmt: skip
        return out[:, 0] if rows else out

    def linear_attention(self, index: int, h: Hidden, w: Weights) -> Hidden:
        """A gated DeltaNet layer's partial, from and into its states beside the KV cache."""
        states, step = self.linear, self.tables
        assert states is not None and step is not None
        with torch.inference_mode():
            states.prepare(index, w["conv"])
            x = _as_tensor(h)
            out, inputs, beta, g = family_of(self.config).linear_partial(
                x.unsqueeze(1) if step.batch.rows else x,
                w,
                self.slice,
                self.config,
                states.conv[index],
                states.states[index],
                step.batch,
            )
            states.finish(index, inputs, beta, g)
        return out.reshape(h.shape).numpy()

    def ffn(self, index: int, h: Hidden, w: Weights) -> Hidden:
        with torch.inference_mode():
            return ffn_partial(_as_tensor(h), w, self.config).numpy()

    def experts(self, index: int, h: Hidden, w: Weights, routing: Routing) -> Hidden:
        with torch.inference_mode():
            return moe_partial(_as_tensor(h), w, self.config, routing).numpy()
