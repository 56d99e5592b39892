"""Splitting a source model into per-node, per-layer shard files, one layer at a time.

Only one full layer (plus, at the end, the embedding) is in memory at once, so the master can
split a model far bigger than its RAM. A split is cached: the manifest is keyed by the model's
identity and the plan, and a second start with the same plan writes nothing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence

from memory.files import atomic_write
from memory.shards import Manifest, ShardStore
from models.dtypes import SHARD_DTYPES, embedding_dtype
from models.kernels import quantize
from models.layers import Slice, cast_layer, slice_layer
from models.source import ModelSource

Progress = Callable[[int, int], None]


def model_identity(source: ModelSource) -> str:
    """A short fingerprint of the model: its config and the size of its weight files."""
    files = [source.path] if source.path.is_file() else sorted(source.path.glob("*.safetensors"))
    sizes = [f.stat().st_size for f in files]
    text = json.dumps([source.config.to_dict(), sizes], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def plan_key(identity: str, slices: Sequence[Slice], dtype: str = "f32") -> str:
    parts: list = [identity, [s.to_dict() for s in slices]]
    if dtype != "f32":  # f32 keys stay as they were: existing caches remain valid
        parts.append(dtype)
    text = json.dumps(parts)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def split_model(
    source: ModelSource,
    slices: Sequence[Slice],
    store: ShardStore,
    progress: Progress | None = None,
    dtype: str = "f32",
) -> Manifest:
    """Shards for every (node, layer) and the master's globals; reused when already split.

    `dtype` (one of `SHARD_DTYPES`) is how the matrices and the embedding/lm_head are stored;
    norms and biases stay float32.
    """
    if dtype not in SHARD_DTYPES:
        raise ValueError(f"unknown shard dtype {dtype!r}: choose one of {', '.join(SHARD_DTYPES)}")
    identity = model_identity(source)
    manifest_path = store.root / "manifests" / f"{plan_key(identity, slices, dtype)}.json"
    if manifest_path.is_file():
        manifest = Manifest.from_json(manifest_path.read_text())
        refs = [r for node in manifest.nodes for r in node] + [manifest.globals]
        if all(store.path(r).is_file() and store.path(r).stat().st_size == r.size for r in refs):
            return manifest

    config = source.config
    nodes: list[list] = [[] for _ in slices]
    total = config.n_layers + 1
    for i in range(config.n_layers):
        full = source.layer(i)
        for refs, s in zip(nodes, slices, strict=True):
            refs.append(store.put(cast_layer(slice_layer(config, full, s), dtype)))
        del full
        if progress:
            progress(i + 1, total)
    globals_ = {"final_norm": source.final_norm()}
    head = embedding_dtype(dtype)
    globals_.update({"embedding" + k: v for k, v in quantize(source.embedding(), head).items()})
    if not config.tied_embeddings:
        globals_.update({"lm_head" + k: v for k, v in quantize(source.lm_head(), head).items()})
    globals_ref = store.put(globals_)
    del globals_
    if progress:
        progress(total, total)
    manifest = Manifest(
        model=source.name,
        identity=identity,
        config=config.to_dict(),
        slices=[s.to_dict() for s in slices],
        nodes=nodes,
        globals=globals_ref,
    )
    manifest.extra["dtype"] = dtype
    freq = source.rope_freq_factors()
    if freq is not None:  # every node needs them for RoPE; a few dozen floats
        manifest.extra["rope_freq_factors"] = freq.tolist()
    atomic_write(manifest_path, manifest.to_json().encode())
    return manifest
