"""A device's layer executor: its slice of every layer, its KV cache, and the two partials."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from edgetp.memory.experts import ExpertPool
from edgetp.memory.shards import tensor_specs
from edgetp.memory.window import LayerWindow, ResidentLayers
from edgetp.models import rows_native
from edgetp.models.backends import (
    BLOCKS,
    Block,
    BlockBackend,
    Hidden,
    RowBlocks,
    StepTables,
    TorchBlocks,
    first_capable,
)
from edgetp.models.config import ModelConfig
from edgetp.models.families import family_of
from edgetp.models.kernels import SCALE_SUFFIX, leave_a_core_to_the_loader, linear_rows
from edgetp.models.kvformat import DEFAULT_KV_FORMAT
from edgetp.models.layers import MATRICES, Slice, StepBatch
from edgetp.models.moe import Routing, expert_specs
from edgetp.models.quant import matrix_size
from edgetp.models.rope import Rope
from edgetp.node.device import matrix_shapes, prepare
from edgetp.node.kernel_table import Shape
from edgetp.node.kvcache import KVCache


class SliceExecutor:
    """Computes one slice's attention and FFN partials, layer by layer, for a step's batch.

    A decode step's hidden state comes as NumPy rows (B, D) and its partials go back as rows
    (`StepBatch.rows`); any other step is torch (B, T, D).
    """

    def __init__(
        self,
        config: ModelConfig,
        s: Slice,
        weights: LayerWindow | ResidentLayers,
        rope: Rope,
        cache: KVCache,
        local_rope: Rope | None = None,
    ) -> None:
        if weights.n_layers != config.n_layers:
            raise ValueError(f"expected {config.n_layers} layers, got {weights.n_layers}")
        self.config = config
        self.slice = s
        # each layer's shape and this slice's share of it (a family's may differ by layer)
        self._views = [family_of(config).layer_view(config, s, i) for i in range(config.n_layers)]
        self.weights = weights
        # A slice that streams gives its loader a core (models/kernels.py says why).
        leave_a_core_to_the_loader(isinstance(weights, LayerWindow) and not weights.resident)
        self.rope = rope
        # the second table (`ModelConfig.own_rope`): the local layers' (Gemma 3), if they have
        # their own, or the unrotated layers' (SmolLM3)
        self.local_rope = local_rope
        self.cache = cache
        # What a sequence costs this node's memory, reported with its step figures: its fixed
        # state whatever its length (a gated DeltaNet's, the local layers' KV rings) and its KV
        # per token of context, in the slots and context its cache was given.
        kv = cache.kv_format
        self.sequence_figures: dict[str, int | str] = {
            "state_bytes_per_sequence": KVCache.window_bytes(config, s, kv),
            "kv_bytes_per_token": KVCache.bytes_per_token(config, s, kv),
            "kv_cache": kv,
            "kv_cache_bytes": cache.nbytes,
            "slots": cache.slots,
            "context": cache.max_context,
        }
        self._batch: StepBatch | None = None
        # This device's ways of computing the blocks, the preferred first (models/backends.py):
        # the C blocks where it admits them (`admit_native`), NumPy rows, torch for the rest.
        self.backends: list[BlockBackend] = [
            RowBlocks(config, s, cache.key_arrays, cache.value_arrays),
            TorchBlocks(config, s, self._views, cache.keys, cache.values, cache.linear),
        ]
        self._chosen: dict[Block, BlockBackend] = {}  # the current step's backend of each block
        # A decode step's blocks in one C call each, where this device admitted them.
        self.native: rows_native.NativeBlocks | None = None
        self.native_step = False  # the current step runs on them
        # This node's rows of the lm_head, where the plan splits it (master.cluster.plan.head_rows).
        self.lm_head: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def hold_head(self, tensors: dict[str, torch.Tensor], rows: tuple[int, int]) -> None:
        """Take this node's `rows` of the lm_head, as its head shard holds them."""
        w = tensors["lm_head"]
        if matrix_size(w) != (rows[1] - rows[0], self.config.hidden):
            raise ValueError(f"a head shard of {tuple(w.shape)} for lm_head rows {rows}")
        self.lm_head = w, tensors.get("lm_head" + SCALE_SUFFIX)

    def logits(self, rows: np.ndarray) -> np.ndarray:
        """Final-normed rows (R, D) times this node's rows of the lm_head: (R, its rows)."""
        if self.lm_head is None:
            raise ValueError("this node was given no rows of the lm_head")
        w, scale = self.lm_head
        if not w.shape[0]:  # a vocabulary smaller than a run of rows per node
            return np.zeros((rows.shape[0], 0), np.float32)
        return linear_rows(rows, w, scale=scale)

    def admit_native(self) -> None:
        """Run decode steps on native blocks if the slice is resident, its products have the
        kernels the blocks can call, and this device's build of them agrees with the NumPy path
        (models/rows_native.py). After `node.device.prepare`: the kernels are its choice."""
        if not self.weights.resident:
            return
        layers = [self.weights.get(i) for i in range(self.config.n_layers)]
        self.native = rows_native.admit(
            self.config, self.slice, layers, self.cache.key_arrays, self.cache.value_arrays,
            self.cache.linear,
        )  # fmt: skip
        if self.native is not None:
            self.backends.insert(0, self.native)

    def matrix_shapes(self) -> list[Shape]:
        """The (dtype, out, in) of the matrices this slice multiplies: what needs a kernel."""
        layers = self.weights.specs()
        experts = self.config.n_stacked
        shapes = sorted(
            {s for specs in layers for s in matrix_shapes(expert_specs(specs, experts), MATRICES)}
        )
        if self.lm_head is not None:
            w = self.lm_head[0]
            shapes += matrix_shapes({"lm_head": (w.dtype, tuple(w.shape))}, ["lm_head"])
        return shapes

    def begin_step(self, batch: StepBatch) -> None:
        """Positions are the same for every layer of a step: look up RoPE tables once; and
        which backend computes each block in this step."""
        self._batch = batch
        self.cache.begin_step(batch)
        local = self.local_rope
        step = StepTables(
            batch,
            self.rope.tables(batch.positions()),
            local.tables(batch.positions()) if local is not None else None,
            self.rope.rows(batch.starts) if batch.rows else None,
            local.rows(batch.starts) if local is not None and batch.rows else None,
        )
        self._chosen = {block: first_capable(self.backends, block, batch) for block in BLOCKS}
        for backend in dict.fromkeys(self._chosen.values()):
            backend.start_step(step)
        self.native_step = self.native is not None and self._chosen["ffn"] is self.native

    def attention(self, index: int, h: Hidden) -> Hidden:
        """The layer's first block: its attention, or its gated DeltaNet."""
        assert self._batch is not None, "begin_step first"
        started = time.perf_counter()
        weights = self.weights.get(index)
        if self.config.is_linear(index):
            out = self._chosen["linear"].linear_attention(index, h, weights)
        else:
            out = self._chosen["attention"].attention(index, h, weights)
        self.weights.figures.compute_s += time.perf_counter() - started
        return out

    def ffn(self, index: int, h: Hidden, routing: Routing | None = None) -> Hidden:
        """The layer's second and last block: its weights may leave the window after this.
        A mixture of experts' is computed for the experts the master's `routing` chose."""
        started = time.perf_counter()
        weights = self.weights.get(index)
        if self.config.moe:
            if routing is None:
                raise ValueError(f"layer {index}'s experts need the step's routing")
            if self.weights.experts is not None:
                out = self._pooled_experts(index, h, weights, routing, self.weights.experts)
            else:
                out = self._chosen["experts"].experts(index, h, weights, routing)
        else:
            out = self._chosen["ffn"].ffn(index, h, weights)
        self.weights.release(index)
        self.weights.figures.compute_s += time.perf_counter() - started
        return out

    def _pooled_experts(
        self,
        index: int,
        h: Hidden,
        dense: dict[str, torch.Tensor],
        routing: Routing,
        pool: ExpertPool,
    ) -> Hidden:
        """A mixture's FFN partial from a streaming node's expert pool: the experts it holds
        compute while those it lacks are read, each expert multiplying its tokens from its
        slot. Each partial is added once those of the experts below it are, so the sums are in
        the order of the experts held in memory (`models.moe`), whatever order the reads end
        in, and only partials computed ahead of that order are kept."""
        backend = self._chosen["experts"]
        chosen = [int(e) for e in np.unique(routing.experts)]
        w = dense | pool.tensors[index]
        rows = h.reshape(-1, self.config.hidden)  # (N, D), the routing's tokens in order
        picked = {e: np.nonzero(routing.experts == e) for e in chosen}  # (tokens, which)
        out = np.zeros_like(rows)
        ahead: dict[int, np.ndarray] = {}  # computed, not yet added
        to_add = iter(chosen)
        next_e = next(to_add, None)

        def compute(e: int, slot: int) -> None:
            nonlocal next_e
            tokens, which = picked[e]
            one = Routing(
                np.full((len(tokens), 1), slot, dtype=np.int64),
                routing.weights[tokens, which][:, None],
            )
            x = np.ascontiguousarray(rows[tokens])  # (n, D)
            ahead[e] = backend.experts(index, x, w, one)
            while next_e in ahead:
                out[picked[next_e][0]] += ahead.pop(next_e)
                next_e = next(to_add, None)

        pool.compute(index, chosen, compute)
        return out.reshape(h.shape)

    def close(self) -> None:
        self.weights.close()
        self.backends = [b for b in self.backends if b is not self.native]
        self.native = None  # its blocks hold the weights too


def make_executor(
    config: ModelConfig,
    s: Slice,
    weights: LayerWindow | ResidentLayers,
    max_context: int,
    slots: int,
    rope_freq_factors: torch.Tensor | None = None,
    kv_format: str = DEFAULT_KV_FORMAT,
) -> SliceExecutor:
    """A slice's executor with its RoPE tables and an empty KV cache (keys and values stored
    as `kv_format`, models/kvformat.py): the one way to build one."""
    rope = Rope(family_of(config).rope_config(config), max_context, rope_freq_factors)
    local_rope = None
    if config.local_layers and config.local_rope_theta is not None:  # unscaled, own base
        local = replace(config, rope_theta=config.local_rope_theta, rope_scaling=None)
        local_rope = Rope(local, max_context)
    if config.unrotated_layers:
        local_rope = Rope(config, max_context, rotate=False)
    cache = KVCache(config, s, slots, max_context, kv_format)
    return SliceExecutor(config, s, weights, rope, cache, local_rope)


def check_kernels_before_loading(
    layer_files: Sequence[Path],
    window: int,
    head: tuple[Path, str, int] | None = None,
    experts: int = 0,
) -> list[Shape]:
    """Check and install the kernels for the slice in `layer_files` (one file per layer) and
    `head` (a shard, the name of its lm_head tensor, this node's rows of it), from the files'
    headers, before any of it is read: a check runs in a child process with a few hundred MB of
    its own (a new interpreter and its test matrices: 213 MB for SmolLM2's), which beside a
    slice that fills a device's memory budget got the node killed by the out-of-memory killer.
    The BLAS threads are set first, as the executor for a window of `window` layers sets them,
    for the check to time the products as they will run. Returns the shapes checked: those
    `SliceExecutor.matrix_shapes` gives once the slice is loaded (`experts`: the model's
    n_stacked, whose stacked matrices are multiplied an expert at a time)."""
    leave_a_core_to_the_loader(min(window, len(layer_files)) < len(layer_files))
    shapes = sorted(
        {
            s
            for f in layer_files
            for s in matrix_shapes(expert_specs(tensor_specs(f), experts), MATRICES)
        }
    )
    if head is not None:
        path, name, rows = head
        dtype, shape = tensor_specs(path)[name]
        shapes += matrix_shapes({"lm_head": (dtype, (rows, *shape[1:]))}, ["lm_head"])
    prepare(shapes)
    return shapes
