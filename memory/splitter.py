"""Splitting a source model into per-node, per-layer shard files, one layer at a time.

A band of one source tensor's rows is in memory at a time, never a whole layer or matrix, so
the master can split a model far bigger than its RAM. A split is cached: the manifest is keyed
by the model's identity and the plan, and a second start with the same plan writes nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from edgetp.memory.files import atomic_write
from edgetp.memory.shards import Manifest, ShardRef, ShardStore, ShardWriter, Spec
from edgetp.models.dtypes import DTYPE_CHOICES, EXACT_WIDENING, STAND_INS
from edgetp.models.families import family_of
from edgetp.models.kernels import dequantize, dtype_name, quantize
from edgetp.models.layers import (
    POST_NORMS,
    ROUTER,
    Part,
    Slice,
    cast_matrix,
    cut,
    slice_dtypes,
    slice_parts,
)
from edgetp.models.quant import columns_fit
from edgetp.models.ranges import merge
from edgetp.models.source import ModelSource

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]


def model_identity(source: ModelSource) -> str:
    """A short fingerprint of the model: its config and the size of its weight files."""
    sizes = [f.stat().st_size for f in source.weight_files()]
    text = json.dumps([source.config.to_dict(), sizes], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def plan_key(
    identity: str,
    slices: Sequence[Slice],
    dtype: str = "f32",
    head_rows: Sequence[tuple[int, int]] | None = None,
) -> str:
    parts: list = [identity, [s.to_dict() for s in slices]]
    if dtype != "f32":  # f32 keys stay as they were: existing caches remain valid
        parts.append(dtype)
    if head_rows:  # "own": the master's globals hold its rows of an untied head, not all of it
        parts.append([list(r) for r in head_rows] + ["own"])
    text = json.dumps(parts)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


BAND_BYTES = 32 << 20  # float32 bytes of a source tensor read at a time


@dataclass(frozen=True)
class NodeShards:
    """What one node's share of a split is: its shard of every layer, and its globals (the
    master) or its rows of the lm_head (a worker, where the head is split; else None)."""

    layers: list[ShardRef]
    extra: ShardRef | None

    def to_dict(self) -> dict:
        return {"layers": [vars(r) for r in self.layers],
                "extra": vars(self.extra) if self.extra else None}  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict) -> NodeShards:
        extra = d.get("extra")
        return cls([ShardRef(**r) for r in d["layers"]], ShardRef(**extra) if extra else None)


# The workers' shares of a split, each split by its own worker (their refs, node 1 first; None
# for a worker that could not: the master splits that share).
SplitElsewhere = Callable[[], list[NodeShards | None]]


def split_model(
    source: ModelSource,
    slices: Sequence[Slice],
    store: ShardStore,
    progress: Progress | None = None,
    dtype: str = "f32",
    head_rows: Sequence[tuple[int, int]] | None = None,
    workers: SplitElsewhere | None = None,
) -> Manifest:
    """Shards for every (node, layer) and the master's globals; reused when already split.
    With `head_rows` (one vocabulary range per node), every node but the master also gets a
    shard of its rows of the lm_head, and the master's globals hold only its own rows of it.

    `dtype` (one of `DTYPE_CHOICES`) is how the matrices and the embedding/lm_head are stored;
    norms and biases stay float32. Tensors are read a band of rows at a time and every node's
    share of a band goes straight to its shard file, so the split holds no whole matrix: a 70B
    model splits within what the master needs to run it.

    With `workers`, the master writes only its own share, and `workers()` has each worker split
    its own from the same source (`split_node`): a model read by byte ranges is then fetched a
    slice a device, and no device, the master included, fetches the whole file. The share of a
    worker that cannot reach the hub the master splits, to ship it as any other.
    """
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"unknown shard dtype {dtype!r}: choose one of {', '.join(DTYPE_CHOICES)}")
    identity = model_identity(source)
    key = plan_key(identity, slices, dtype, head_rows)
    manifest_path = store.root / "manifests" / f"{key}.json"
    if workers is not None:  # the workers' shards are theirs: a cached manifest cannot tell
        shares = [split_node(source, slices, 0, store, dtype, head_rows, progress)]
        for k, share in enumerate(workers(), start=1):  # a worker without the hub: its share
            shares.append(share or split_node(source, slices, k, store, dtype, head_rows))
    else:
        if manifest_path.is_file():
            manifest = Manifest.from_json(manifest_path.read_text())
            refs = [r for node in manifest.nodes for r in node]
            if store.present([*refs, manifest.globals, *manifest.heads]):
                return manifest
        layers = _split_layers(source, slices, range(len(slices)), store, dtype, progress)
        globals_ref, heads = _split_globals(source, slices, range(len(slices)), store, dtype,
                                            head_rows)  # fmt: skip
        shares = [NodeShards(layers[0], globals_ref)]
        shares += [NodeShards(refs, heads.get(k)) for k, refs in enumerate(layers[1:], start=1)]
    source.fetched()
    total = source.config.n_layers + 1
    if progress:
        progress(total, total)
    globals_ref = shares[0].extra
    assert globals_ref is not None  # the master's share holds the globals
    manifest = Manifest(
        model=source.name,
        identity=identity,
        config=source.config.to_dict(),
        slices=[s.to_dict() for s in slices],
        nodes=[share.layers for share in shares],
        globals=globals_ref,
        head_rows=[list(r) for r in head_rows or []],
        heads=[share.extra for share in shares[1:] if share.extra] if head_rows else [],
    )
    manifest.extra["dtype"] = dtype
    freq = source.rope_freq_factors()
    if freq is not None:  # every node needs them for RoPE; a few dozen floats
        manifest.extra["rope_freq_factors"] = freq.tolist()
    atomic_write(manifest_path, manifest.to_json().encode())
    return manifest


def split_node(
    source: ModelSource,
    slices: Sequence[Slice],
    node: int,
    store: ShardStore,
    dtype: str = "f32",
    head_rows: Sequence[tuple[int, int]] | None = None,
    progress: Progress | None = None,
) -> NodeShards:
    """Node `node`'s share of the split alone, as `split_model` writes it (the same bytes):
    reading only the rows and columns of each tensor that its slices hold. Kept, by plan and
    node, so that a second start with the same plan writes and fetches nothing."""
    key = plan_key(model_identity(source), slices, dtype, head_rows)
    record = store.root / "nodes" / f"{key}-{node}.json"
    if record.is_file():
        share = NodeShards.from_dict(json.loads(record.read_text()))
        if store.present([*share.layers, *([share.extra] if share.extra else [])]):
            return share
    (layers,) = _split_layers(source, slices, [node], store, dtype, progress)
    globals_ref, heads = _split_globals(source, slices, [node], store, dtype, head_rows)
    source.fetched()
    share = NodeShards(layers, globals_ref if node == 0 else heads.get(node))
    atomic_write(record, json.dumps(share.to_dict()).encode())
    return share


def _split_layers(
    source: ModelSource,
    slices: Sequence[Slice],
    which: Iterable[int],
    store: ShardStore,
    dtype: str,
    progress: Progress | None,
) -> list[list[ShardRef]]:
    """The shards of every layer for nodes `which` (their refs, a list a node)."""
    config = source.config
    which = list(which)
    nodes: list[list[ShardRef]] = [[] for _ in which]
    total = config.n_layers + 1
    told: set[str] = set()  # matrices whose cut through blocks was logged
    stood_in: set[str] = set()  # matrices stored in a K-quant's stand-in, logged
    for i in range(config.n_layers):
        # a layer's kind (attention or linear attention) and its shape (the family's) cut it
        cuts = {
            k: slice_parts(*family_of(config).layer_view(config, slices[k], i), i) for k in which
        }
        dtypes = source.matrix_dtypes(i, dtype)
        for m in dtypes.keys() - stood_in:
            if dtype in STAND_INS and dtypes[m] == STAND_INS[dtype]:
                stood_in.add(m)
                log.warning("%s's rows are not whole blocks of %s's 256: stored as %s, as "
                            "llama.cpp does", m, dtype, dtypes[m])  # fmt: skip
        shards = []
        for node, c in cuts.items():
            kept = slice_dtypes(c, dtypes)
            for m in kept.keys() - told:
                if kept[m] != dtypes[m]:
                    told.add(m)
                    log.warning(
                        "node %d's columns of %s cut through %s's blocks: its slices of %s are "
                        "stored as f32 (the same values, in more bytes)",
                        node,
                        m,
                        dtypes[m],
                        m,
                    )
            shards.append({n: _Fused(n, parts, kept.get(n)) for n, parts in c.items()})
        for refs, ref in zip(nodes, _write(source, i, shards, store), strict=True):
            refs.append(ref)
        if progress:
            progress(i + 1, total)
    return nodes


def _split_globals(
    source: ModelSource,
    slices: Sequence[Slice],
    which: Iterable[int],
    store: ShardStore,
    dtype: str,
    head_rows: Sequence[tuple[int, int]] | None,
) -> tuple[ShardRef | None, dict[int, ShardRef]]:
    """The master's globals (if node 0 is of `which`), and the rows of the lm_head of the
    workers of `which` where the head is split, by node."""
    config = source.config
    which = set(which)
    head = source.head_dtype(dtype)
    globals_ref = None
    if 0 in which:
        # the norms and the router stay float32; POST_NORMS and ROUTER are 2-D, hence "f32"
        # rather than a vector's None
        norm_dtypes: dict[str, str | None] = {
            "final_norm": None, POST_NORMS: "f32", ROUTER: "f32"
        }  # fmt: skip
        norm_dtypes |= family_of(config).global_dtypes(source, dtype)  # the family's, the master's
        whole = {
            n: _Fused(n, (Part(n, (0, source.shape(None, n)[0])),), norm_dtypes.get(n, head))
            for n in source.global_names()
        }
        if head_rows and "lm_head" in whole and head_rows[0][1] > head_rows[0][0]:
            # Split by vocabulary, the master multiplies only its rows: it holds only those (a
            # 70B head is 0.5 GB in f16). A tied head is the embedding, which it needs whole.
            start, end = head_rows[0]
            whole["lm_head"] = _Fused("lm_head", (Part("lm_head", (start, end)),), head)
        (globals_ref,) = _write(source, None, [whole], store)
    heads: dict[int, ShardRef] = {}
    workers = sorted(k for k in which if k > 0)
    if head_rows and workers:  # the workers' rows of the lm_head (a tied model's embedding)
        name = "embedding" if config.tied_embeddings else "lm_head"
        rows = [_Fused("lm_head", (Part(name, head_rows[k]),), head) for k in workers]
        refs = _write(source, None, [{"lm_head": f} for f in rows], store)
        heads = dict(zip(workers, refs, strict=True))
    return globals_ref, heads


@dataclass(frozen=True)
class _Fused:
    """One tensor of a shard: its parts of the source's tensors, stacked by rows, and its shard
    dtype (None: not a matrix, kept float32)."""

    name: str
    parts: tuple[Part, ...]
    dtype: str | None

    def specs(self, source: ModelSource, layer: int | None) -> dict[str, Spec]:
        rows = sum(p.n_rows for p in self.parts)
        if self.dtype is None:  # a vector, or a linear attention's convolution taps (rows, taps)
            tail = source.shape(layer, self.parts[0].source)[1:]
            return {self.name: (torch.float32, (rows, *tail))}
        first = self.parts[0]
        cols = first.cols or (0, source.shape(layer, first.source)[1])
        shape = (rows, cols[1] - cols[0])
        meta = quantize(torch.empty(shape, device="meta"), self.dtype)
        return {self.name + k: (t.dtype, tuple(t.shape)) for k, t in meta.items()}


def _write(
    source: ModelSource,
    layer: int | None,
    shards: list[dict[str, _Fused]],
    store: ShardStore,
) -> list[ShardRef]:
    """Write one shard per entry of `shards`, reading each source tensor once, in bands."""
    specs = [
        {k: v for f in shard.values() for k, v in f.specs(source, layer).items()}
        for shard in shards
    ]
    writers = [ShardWriter(store, spec) for spec in specs]
    try:
        # every shard's tensors: a later node may hold one the first does not
        for name in sorted({p.source for shard in shards for f in shard.values() for p in f.parts}):
            parts = [p for shard in shards for f in shard.values() for p in f.parts
                     if p.source == name]  # fmt: skip
            # the columns these shards cut, if all cut some: a remote source fetches only those
            cols = None
            if all(p.cols for p in parts):
                cols = (min(p.cols[0] for p in parts), max(p.cols[1] for p in parts))  # type: ignore[index]
            source.only_columns(layer, name, cols)
            stored = source.stored_type(layer, name).lower()
            carry = any(
                f.dtype is not None and (stored == f.dtype or (stored, f.dtype) in EXACT_WIDENING)
                for shard in shards
                for f in shard.values()
                if any(p.source == name for p in f.parts)
            )
            wanted = merge(p.rows for p in parts)
            for first, band in _bands(source, layer, name, carry, wanted):
                rows = (first, first + band.shape[0])
                values: torch.Tensor | None = None  # as floats, for a slice cut within blocks
                for writer, shard in zip(writers, shards, strict=True):
                    for f in shard.values():
                        offset = 0
                        for p in f.parts:
                            a, b = max(p.rows[0], rows[0]), min(p.rows[1], rows[1])
                            if p.source == name and a < b:
                                whole = p.cols is None or columns_fit(dtype_name(band), *p.cols)
                                if whole:
                                    piece = cut(band, p, rows)
                                else:
                                    if values is None:
                                        values = dequantize(band)
                                    piece = cut(values, p, rows)
                                at = offset + a - p.rows[0]
                                if f.dtype is None:
                                    writer.write_rows(f.name, at, piece.float())
                                else:
                                    for k, t in cast_matrix(piece, f.dtype).items():
                                        writer.write_rows(f.name + k, at, t)
                            offset += p.n_rows
        return [w.finish() for w in writers]
    except BaseException:
        for w in writers:
            w.abandon()
        raise


def _bands(
    source: ModelSource,
    layer: int | None,
    name: str,
    blocks: bool,
    wanted: Sequence[tuple[int, int]],
) -> Iterator[tuple[int, torch.Tensor]]:
    """The tensor's rows in `wanted`, a band at a time (whole heads, so Q and K can be
    un-permuted: each wanted range starts at a head)."""
    shape = source.shape(layer, name)
    if len(shape) == 1:
        yield 0, source.rows(layer, name, 0, shape[0])
        return
    head = source.config.head_dim
    step = max(head, BAND_BYTES // (4 * shape[1]) // head * head)
    for lo, hi in wanted:
        for first in range(lo, hi, step):
            yield first, source.rows(layer, name, first, min(first + step, hi), blocks)
