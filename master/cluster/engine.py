"""The master's engine: embed, run every layer as a sum of slice partials, final norm, lm_head.

The executors compute the partials; the engine owns the residual stream and does the sums. Here
all executors run in this process; a remote node is an executor whose partials arrive over the
wire, and the sum is the same.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol

import numpy as np
import torch

from edgetp.master.cluster.plan import plan_slices
from edgetp.memory.figures import StreamFigures
from edgetp.memory.pages import pack
from edgetp.memory.shards import Manifest, ShardStore, tensor_specs
from edgetp.memory.window import (
    FIGURES_KEPT,
    LayerWindow,
    ResidentLayers,
    step_figures,
)
from edgetp.models.block_math import rms_norm
from edgetp.models.block_rows import rms_norm_rows
from edgetp.models.config import ModelConfig
from edgetp.models.errors import ModelError
from edgetp.models.families import family_of
from edgetp.models.kernels import (
    SCALE_SUFFIX,
    activations,
    embed,
    kernel_set,
    linear,
    linear_rows,
)
from edgetp.models.kvformat import DEFAULT_KV_FORMAT
from edgetp.models.layers import (
    POST_NORMS,
    ROUTER,
    Slice,
    StepBatch,
    attention_on_first,
    slice_layer,
)
from edgetp.models.moe import Routing, route
from edgetp.models.rows_native import MAX_ROWS, NativeBlocks, post_norm_rows
from edgetp.models.source import ModelSource
from edgetp.node import hop
from edgetp.node.device import matrix_shapes, prepare
from edgetp.node.executor import Hidden, check_kernels_before_loading, make_executor
from edgetp.node.kernel_table import Shape
from edgetp.node.kvcache import KVCache
from edgetp.node.protocol import ATTENTION, FFN, HEAD, Block

log = logging.getLogger(__name__)

DEFAULT_CONTEXT = 2048


def context_size(config: ModelConfig, requested: int | None) -> int:
    """Tokens of KV cache to allocate: as asked (default 2048), at most the model's context."""
    if requested is not None and requested < 2:
        raise ModelError(f"--context must be at least 2 tokens, got {requested}")
    return min(requested or DEFAULT_CONTEXT, config.context_length)


class Executor(Protocol):
    """What the engine needs of a slice computed in this process (node.executor has the one
    implementation, made by `make_executor`)."""

    slice: Slice
    weights: LayerWindow | ResidentLayers
    cache: KVCache
    native: NativeBlocks | None  # its decode blocks in C, where this device admitted them
    native_step: bool  # the current step runs on them
    sequence_figures: dict[str, int | str]  # what a sequence costs its memory

    def matrix_shapes(self) -> list[Shape]: ...
    def admit_native(self) -> None: ...
    def begin_step(self, batch: StepBatch) -> None: ...
    def attention(self, index: int, h: Hidden) -> Hidden: ...
    def ffn(self, index: int, h: Hidden, routing: Routing | None = None) -> Hidden: ...
    def close(self) -> None: ...


class Remote(Protocol):
    """The other devices: given a block's input, later the sum of their partials (an array).

    A step starts with `begin_step` (its batch goes out with the step's first block)."""

    def begin_step(self, batch: StepBatch) -> None: ...
    def send(self, block: Block, layer: int, h: Hidden, routing: Routing | None = None) -> None: ...
    def gather(self, block: Block, layer: int, local_compute: float = 0.0) -> np.ndarray | None: ...
    def decode_layers(
        self,
        blocks: NativeBlocks,
        h: np.ndarray,
        post_norms: np.ndarray | None,
        eps: float,
        attention_alone: bool,
    ) -> tuple[np.ndarray, float]: ...
    def gather_rows(self, layer: int, local_compute: float = 0.0) -> list[np.ndarray]: ...

    allreduce_seconds: deque[float]  # recent per-sum latencies (master.cluster.transport)

    @property
    def sums(self) -> int: ...  # every sum since the start


def _family_globals(g: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The tensors of the model's family of the master's shard `g` (`Family.global_names`),
    with an int8 table's scales."""
    names = family_of(config).global_names(config)
    return {n: t for n, t in g.items() if n.removesuffix(SCALE_SUFFIX) in names}


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
        remote: Remote | None = None,
        embedding_scale: torch.Tensor | None = None,
        lm_head_scale: torch.Tensor | None = None,
        post_norms: torch.Tensor | None = None,
        head_split: bool = False,
        router: torch.Tensor | None = None,
        family_tensors: dict[str, torch.Tensor] | None = None,
        attention_alone: bool = False,
    ) -> None:
        self.config = config
        # The workers hold no attention (`Slice.attends`): its blocks are this process's, with
        # no sum, and a layer pays one sum, its FFN's.
        self.attention_alone = attention_alone and remote is not None
        # what the model's family computes between the layers' sums (models/family.py), with
        # the tensors it needs for it, the master's alone (Gemma 4's per-layer inputs, ...)
        self.family = family_of(config)
        self.family_tensors = family_tensors or {}
        missing = set(self.family.global_names(config)) - set(self.family_tensors)
        if missing:
            raise ValueError(f"{config.architecture} needs its {', '.join(sorted(missing))}")
        # (n_layers router_rows, D): a mixture of experts' routers (and shared experts' gates),
        # the master's alone (models/moe.py)
        self.router = router
        if config.moe and router is None:
            raise ValueError(f"{config.architecture} needs its experts' router")
        # `lm_head` holds this process's rows of the head and the workers hold the rest
        # (master.cluster.plan.head_rows): the head's logits are gathered like a block's partials.
        self.head_split = head_split
        if head_split and remote is None:
            raise ValueError("a split lm_head needs the workers that hold the rest of it")
        # (2 n_layers, D): each block's summed output is normed before the residual (Gemma 3)
        self.post_norms = post_norms
        if config.post_norms and post_norms is None:
            raise ValueError(f"{config.architecture} needs the post-block norms")
        self._post_norm_rows = (
            None if post_norms is None else np.ascontiguousarray(post_norms.numpy(), np.float32)
        )
        self.remote = remote
        self.embedding = embedding
        self.embedding_scale = embedding_scale
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.lm_head_scale = lm_head_scale
        self.executors = list(executors)
        self.max_context = max_context
        self.slots = slots
        # The master's own figures per step (loader, memory), as workers report theirs.
        self.figures: dict[str, Any] = {}
        self.history: deque[dict[str, Any]] = deque(maxlen=FIGURES_KEPT)
        self._reported = [StreamFigures() for _ in self.executors]
        self._blocks_s = 0.0  # this step's time in `_block`
        # Every matrix this process multiplies gets a kernel this device admitted (one check).
        head = {"lm_head": (lm_head.dtype, tuple(lm_head.shape))}
        prepare(
            [*matrix_shapes(head, ["lm_head"]), *(s for e in executors for s in e.matrix_shapes())]
        )
        for executor in self.executors:
            executor.admit_native()

    @classmethod
    def local(
        cls,
        source: ModelSource,
        capacities: Sequence[float] = (1.0,),
        max_context: int | None = None,
        slots: int = 1,
        progress: Callable[[int, int], None] | None = None,
        kv_format: str = DEFAULT_KV_FORMAT,
    ) -> Engine:
        """All slices of the plan for `capacities` in this process (one slice: one device),
        each slice's keys and values stored as `kv_format`."""
        config = source.config
        max_context = context_size(config, max_context)
        slices = plan_slices(config, capacities)
        per_slice: list[list[dict[str, torch.Tensor]]] = [[] for _ in slices]
        for i in range(config.n_layers):
            full = source.layer(i)  # one full layer in memory at a time
            for layers, s in zip(per_slice, slices, strict=True):
                view, share = family_of(config).layer_view(config, s, i)  # layers may differ
                layers.append(pack(slice_layer(view, full, share, i)))
            if progress:
                progress(i + 1, config.n_layers)
        factors = source.rope_freq_factors()
        executors = [
            make_executor(config, s, ResidentLayers(layers), max_context, slots, factors, kv_format)
            for s, layers in zip(slices, per_slice, strict=True)
        ]
        embedding = pack({"embedding": source.embedding()})["embedding"]
        lm_head = embedding if config.tied_embeddings else pack({"head": source.lm_head()})["head"]
        post_norms = source.tensor(None, POST_NORMS) if config.post_norms else None
        router = source.tensor(None, ROUTER) if config.moe else None
        extra = {n: source.tensor(None, n) for n in family_of(config).global_names(config)}
        return cls(
            config,
            embedding,
            source.final_norm(),
            lm_head,
            executors,
            max_context,
            slots,
            post_norms=post_norms,
            router=router,
            family_tensors=extra,
        )

    @classmethod
    def from_manifest(
        cls,
        manifest: Manifest,
        store: ShardStore,
        max_context: int,
        slots: int,
        remote: Remote | None = None,
        window: int | None = None,
        drop_cache: bool = False,
        kv_format: str = DEFAULT_KV_FORMAT,
    ) -> Engine:
        """The master's engine: its own slice (node 0) and the globals, read from shards.

        The slice streams through a window of `window` layers (default: all of them); its keys
        and values are stored as `kv_format`.
        """
        config = ModelConfig.from_dict(manifest.config)
        s = Slice.from_dict(manifest.slices[0])
        paths = [store.path(ref) for ref in manifest.nodes[0]]
        globals_path = store.path(manifest.globals)
        # Tied: the embedding is the head. The globals hold just the master's rows of an untied
        # head (memory.splitter), all of a tied one, of which it takes its rows.
        specs = tensor_specs(globals_path)
        head = "lm_head" if "lm_head" in specs else "embedding"
        a, b = manifest.head_rows[0] if manifest.head_rows else (0, specs[head][1][0])
        check_kernels_before_loading(
            paths, window or config.n_layers, (globals_path, head, b - a), config.n_stacked
        )
        layers = LayerWindow(paths, window or config.n_layers, drop_cache, experts=config.n_stacked)
        factors = manifest.extra.get("rope_freq_factors")
        freq = torch.tensor(factors) if factors else None
        executor = make_executor(config, s, layers, max_context, slots, freq, kv_format)
        g = store.load(manifest.globals)
        lm_head, lm_head_scale = g[head], g.get(head + SCALE_SUFFIX)
        if lm_head.shape[0] != b - a:  # a view of its rows
            lm_head = lm_head[a:b]
            lm_head_scale = None if lm_head_scale is None else lm_head_scale[a:b]
        return cls(
            config,
            g["embedding"],
            g["final_norm"],
            lm_head,
            [executor],
            max_context,
            slots,
            remote,
            embedding_scale=g.get("embedding" + SCALE_SUFFIX),
            lm_head_scale=lm_head_scale,
            post_norms=g.get(POST_NORMS),
            head_split=bool(manifest.head_rows),
            router=g.get(ROUTER),
            family_tensors=_family_globals(g, config),
            attention_alone=attention_on_first([Slice.from_dict(d) for d in manifest.slices]),
        )

    @property
    def slices(self) -> list[Slice]:
        return [e.slice for e in self.executors]

    @torch.inference_mode()
    def forward(
        self, tokens: Sequence[Sequence[int]], batch: StepBatch, all_logits: bool = False
    ) -> torch.Tensor:
        """Logits for the step: (B, V) at each sequence's last new token, or (B, T, V)."""
        rows = self._as_rows(batch)
        if rows is not None:  # a few tokens in all, on the decode path
            h = self._layers([[t] for seq in tokens for t in seq], rows)  # (R, D)
            head_started = time.perf_counter()
            ends = list(itertools.accumulate(batch.lengths))
            if all_logits:  # every row's, back in (B, T) places (padding's left as zeros)
                each = self._head(h, rows, False)  # (R, V)
                out = each.new_zeros(batch.size, batch.width, each.shape[-1])
                for b, (n, end) in enumerate(zip(batch.lengths, ends, strict=True)):
                    out[b, :n] = each[end - n : end]
            else:  # each sequence's last row's alone
                last = [end - 1 for end in ends]
                at = StepBatch(
                    tuple(rows.slots[i] for i in last),
                    tuple(rows.starts[i] for i in last),
                    (1,) * batch.size,
                )
                out = self._head(h[last], at, False)  # a copy: the rows it names
        else:
            h = self._layers(tokens, batch)
            head_started = time.perf_counter()
            out = self._head(h, batch, all_logits)
        logits = self.family.logits(out, self.config)
        head_s = time.perf_counter() - head_started
        self._record_figures({"blocks_s": self._blocks_s, "head_s": head_s})
        return logits

    def _as_rows(self, batch: StepBatch) -> StepBatch | None:
        """A step of several tokens a sequence, MAX_ROWS in all (draft checks, a prompt's chunk
        beside decoding sequences, short prompts), as a decode step of a row a token, or None.
        A decode step's blocks are one C call each where a step of several tokens is torch's
        ~20 calls a block (a SmolLM2 step of 2 tokens took 5 of one token's time), and its
        rows are not padded to the longest sequence's. A sequence's rows run in order, each
        row's key and value stored before the next row attends (rows.c, models/block_rows.py),
        so each token sees those before it, as in one step of them. Not for a gated DeltaNet
        (its states keep a step's inputs) nor Gemma 4's attention (torch's, its rows stored
        together)."""
        if batch.width < 2 or sum(batch.lengths) > self.row_step_tokens:
            return None
        return batch.as_rows()

    @property
    def row_step_tokens(self) -> int:
        """The most tokens a step may carry in all and still run as a decode step's rows
        (`_as_rows`): 0 for a model with gated DeltaNet layers or Gemma 4's attention, and with
        int8 activations, whose figures (KL-divergence, greedy tokens across node counts) were
        measured with prompts on torch's steps: int8 answers depend on the step's shape."""
        if self.config.linear_layers or self.config.value_norm or activations() == "int8":
            return 0
        return MAX_ROWS

    @torch.inference_mode()
    def final_hidden(self, tokens: Sequence[Sequence[int]], batch: StepBatch) -> torch.Tensor:
        """(B, T, D): the final norm's output at every new token of the step, the lm_head left
        out (what an embedding pools). The step writes its tokens' KV as any step does."""
        h = self._layers(tokens, batch)
        eps = self.config.norm_eps
        if batch.rows:  # (B, D)
            x = torch.from_numpy(rms_norm_rows(h, self.final_norm, eps)).unsqueeze(1)
        else:
            x = rms_norm(torch.from_numpy(h), self.final_norm, eps)
        self._record_figures({"blocks_s": self._blocks_s, "head_s": 0.0})
        return x

    def _layers(self, tokens: Sequence[Sequence[int]], batch: StepBatch) -> Hidden:
        """The hidden state after the last layer: (B, D) in a decode step, else (B, T, D)."""
        for n, st in zip(batch.lengths, batch.starts, strict=True):
            if st + n > self.max_context:
                raise ModelError(
                    f"sequence of {st + n} tokens exceeds the context of {self.max_context}"
                )
        self._blocks_s = 0.0
        T = batch.width
        ids = torch.tensor([list(t) + [0] * (T - len(t)) for t in tokens])  # (B, T) right-padded
        embedded = embed(ids, self.embedding, self.embedding_scale)  # (B, T, D)
        if self.config.embedding_multiplier != 1.0:
            embedded = embedded * self.config.embedding_multiplier
        extra = self.family_tensors
        inputs = self.family.layer_inputs(ids, embedded, extra, self.config)
        h: Hidden = embedded.numpy()  # the one type of the hidden state (node.executor.Hidden)
        if batch.rows:
            h = h.reshape(batch.size, -1)
        for ex in self.executors:
            ex.begin_step(batch)
        if self.remote:
            self.remote.begin_step(batch)
        blocks = self._native_layers()
        if blocks is not None:
            started = time.perf_counter()
            if self.remote is not None:
                h, compute = self.remote.decode_layers(
                    blocks, h, self._post_norm_rows, self.config.norm_eps, self.attention_alone
                )
            else:
                h = blocks.run_layers(h, self._post_norm_rows, self.config.norm_eps)
                compute = time.perf_counter() - started
            self.executors[0].weights.figures.compute_s += compute
            self._blocks_s += time.perf_counter() - started
        else:
            for i in range(self.config.n_layers):
                h = h + self._post_norm(2 * i, self._block(ATTENTION, i, h))
                routing = self._route(i, h)
                out = self._block(FFN, i, h, routing)
                out = self.family.ffn_out(h, i, out, extra, self.config)
                h = h + self._post_norm(2 * i + 1, out)
                h = self.family.end_of_layer(h, i, inputs, extra, self.config)
        return h

    def _native_layers(self) -> NativeBlocks | None:
        """This step's layers run as one native loop (with the workers, node/hop.py, if any)
        when it is a decode step this process's one slice runs natively, on a device that
        builds the loop."""
        if len(self.executors) != 1:
            return None
        if self.remote is not None and not hop.available():
            return None
        ex = self.executors[0]
        return ex.native if ex.native_step else None

    def _route(self, i: int, h: Hidden) -> Routing | None:
        """Layer i's choice of experts for h after its attention sum (models/moe.py), where the
        model has experts. The FFN norm is every slice's; this process's first holds it."""
        if self.router is None:
            return None
        n = self.config.router_rows
        router = self.router[i * n : (i + 1) * n]
        own = self.family.route(h, i, self.family_tensors, router, self.config)
        if own is not None:  # a router of the family's own form
            return Routing(*own)
        norm = self.executors[0].weights.get(i)["ffn_norm"]
        return route(h, norm, router, self.config)

    def _post_norm(self, row: int, out: Hidden) -> Hidden:
        """A block's summed output, normed by POST_NORMS row `row` where the model has them."""
        if self.post_norms is None or self._post_norm_rows is None:
            return out
        w, eps = self.post_norms[row], self.config.norm_eps
        if out.ndim == 2:  # a decode step's rows: as the one-call loop norms them
            return post_norm_rows(out, self._post_norm_rows[row], eps)
        return rms_norm(torch.from_numpy(out), w, eps).numpy()

    def _head(self, h: Hidden, batch: StepBatch, all_logits: bool) -> torch.Tensor:
        """Final norm and lm_head: the end of every step. Logits (B, V), or (B, T, V)."""
        eps = self.config.norm_eps
        if batch.rows:  # (B, D)
            x = torch.from_numpy(rms_norm_rows(h, self.final_norm, eps))
            if all_logits:
                x = x.unsqueeze(1)
        else:
            last = torch.from_numpy(h)
            if not all_logits:
                lengths = torch.tensor(batch.lengths) - 1
                last = last[torch.arange(batch.size), lengths]  # (B, D)
            x = rms_norm(last, self.final_norm, eps)
        if not self.head_split:
            return linear(x, self.lm_head, scale=self.lm_head_scale)
        # Every node's rows of the vocabulary at once: the workers' as a block's partials.
        assert self.remote is not None
        rows = np.ascontiguousarray(x.reshape(-1, x.shape[-1]).numpy(), dtype=np.float32)
        layer = self.config.n_layers
        self.remote.send(HEAD, layer, rows)
        started = time.perf_counter()
        own = linear_rows(rows, self.lm_head, scale=self.lm_head_scale)
        others = self.remote.gather_rows(layer, time.perf_counter() - started)
        return torch.from_numpy(np.concatenate([own, *others], axis=1)).view(*x.shape[:-1], -1)

    def _record_figures(self, times: dict[str, float]) -> None:
        """The step's figures: the loader's and memory's (as workers report theirs), and where
        the step's time went: `blocks_s` in the layers' sums (every node's compute and the
        hops), `head_s` in the final norm and lm_head."""
        if not self.executors:
            return
        weights = self.executors[0].weights
        own = self.executors[0].sequence_figures | {
            "kernels": kernel_set(),
            "activations": activations(),
        }
        self.figures = step_figures(weights, self._reported[0]) | times | own
        self._reported[0] = replace(weights.figures)
        self.history.append(self.figures)

    def close(self) -> None:
        """Stop the loader threads and let go of the slices' weights and KV caches.

        Whoever still holds a closed engine (a re-planned one is replaced, not forgotten: the
        context that built it keeps it) must not keep its memory too.
        """
        for ex in self.executors:
            ex.close()
        self.executors = []

    def _block(self, block: Block, i: int, h: Hidden, routing: Routing | None = None) -> Hidden:
        """The sum of every slice's partial for one block: the star allreduce. An FFN block
        of experts goes with its `routing`."""
        sent = time.perf_counter()
        remote = None if block == ATTENTION and self.attention_alone else self.remote
        if remote:  # send first, so the workers compute while this process does
            remote.send(block, i, h, routing)
        started = time.perf_counter()
        total = None
        for ex in self.executors:
            p = ex.attention(i, h) if block == ATTENTION else ex.ffn(i, h, routing)
            total = p if total is None else total + p
        if remote:
            others = remote.gather(block, i, time.perf_counter() - started)
            if others is not None:
                total = others if total is None else total + others
        assert total is not None, "an engine needs at least one slice"
        self._blocks_s += time.perf_counter() - sent
        return total
