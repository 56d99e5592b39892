"""The split plan: which heads and FFN columns each device computes.

A pure function of the model config and the devices' capacities, so it is tested without
sockets. Shares follow capacity (largest remainder), not forced equal:

- nodes <= KV heads: attention is split by whole KV-head groups (each group with its query heads),
  so no KV head is computed twice;
- nodes > KV heads: query heads are split instead, and a slice holds a copy of each KV head its
  query heads read (the KV heads are replicated);
- FFN intermediate columns are split in multiples of `FFN_ALIGN` where the size allows: a
  block of quantized weights (models/quant.py) is 32 columns of the FFN's down projection.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from models.config import ModelConfig
from models.layers import Slice, full_layer_shapes, kv_heads_for
from models.quant import BLOCK, FORMATS

FFN_ALIGN = BLOCK
MASTER_FLOOR = 0.05  # of its own speed: a master too slow for any layer still keeps a slice
# Bytes a weight takes in a shard, by shard dtype (int8's per-row scales: a rounding error).
BYTES_PER_WEIGHT = {
    "f32": 4.0, "f16": 2.0, "bf16": 2.0, "int8": 1.0,
    **{name: f.block_bytes / BLOCK for name, f in FORMATS.items()},
}  # fmt: skip


def proportional_counts(total: int, capacities: Sequence[float]) -> list[int]:
    """Split `total` units in proportion to capacities; the counts sum to `total` exactly."""
    if not capacities or any(c <= 0 for c in capacities):
        raise ValueError(f"capacities must be positive, got {list(capacities)}")
    whole = sum(capacities)
    exact = [total * c / whole for c in capacities]
    counts = [int(x) for x in exact]
    # Hand the remaining units to the largest fractional parts (ties: the earlier node).
    order = sorted(range(len(exact)), key=lambda i: (counts[i] - exact[i], i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def _ranges(counts: list[int], unit: int = 1) -> list[tuple[int, int]]:
    out, start = [], 0
    for n in counts:
        out.append((start, start + n * unit))
        start += n * unit
    return out


def plan_slices(config: ModelConfig, capacities: Sequence[float]) -> list[Slice]:
    """One slice per device, in the order of `capacities`."""
    n = len(capacities)
    group = config.group_size
    if n <= config.n_kv_heads:
        groups = _ranges(proportional_counts(config.n_kv_heads, capacities))
        q_ranges = [(g0 * group, g1 * group) for g0, g1 in groups]
    else:
        q_ranges = _ranges(proportional_counts(config.n_heads, capacities))

    align = FFN_ALIGN if config.ffn_hidden % FFN_ALIGN == 0 else 1
    units = config.ffn_hidden // align
    ffn_ranges = _ranges(proportional_counts(units, capacities), align)

    return [Slice(q, kv_heads_for(q, group), f) for q, f in zip(q_ranges, ffn_ranges, strict=True)]


def with_master_head(
    config: ModelConfig, speeds: Sequence[float], head_speed: float | None = None
) -> list[float]:
    """Capacities for the layers' split when the first node, the master, also multiplies the
    lm_head alone at the end of every token, from each node's `speeds` for the layers and the
    master's for its head (`head_speed`; default its speed for the layers).

    A node's time is the weights it multiplies over its speed. With the layers' weights L, the
    head's H, speeds c and the head's speed h, every node is busy equally long when a token takes
    T = (L + c0 H / h) / sum(c): the master's layers then take c0 (T - H / h) of it and any other
    node's c_i T, so the master's capacity for the layers is c0 - c0 H sum(c) / (h L + c0 H), the
    others' as measured. (Weights are counted, not bytes: the head is taken to be stored as the
    layers are.) For SmolLM2 the head is a fifth of a token's weights: on two equal devices the
    master takes 37% of the layers. The head stays in memory, so a master whose layers stream
    from a slow disk still multiplies it at its compute speed.
    """
    per_layer = sum(math.prod(shape) for shape in full_layer_shapes(config).values())
    layers = config.n_layers * per_layer  # the norms and biases in it: a rounding error
    head = config.vocab_size * config.hidden
    c0, h = speeds[0], head_speed or speeds[0]
    master = c0 - c0 * head * sum(speeds) / (h * layers + c0 * head)
    return [max(master, MASTER_FLOOR * c0), *speeds[1:]]


def with_disk_reads(
    speeds: Sequence[float],
    disks: Sequence[float | None],
    budgets: Sequence[int],
    forced: Sequence[bool],
    layers_bytes: int,
    layers_weights: int,
) -> list[float]:
    """Speeds for the split when some nodes stream their slice from disk: a node with a forced
    window, or whose memory budget cannot hold its share of the layers' `layers_bytes`, goes no
    faster than its disk (`disks`, GB/s; None: not measured) delivers weights.

    `speeds` are GB/s of float32 weights through a matmul, so a disk's GB/s of shard bytes
    count 4 / (bytes a weight takes in the shards) times. A node that must stream at its
    compute-speed share is taken to stream at any share: a smaller one may fit, but the
    figures would then flip between plans.
    """
    per_weight = layers_bytes / max(layers_weights, 1)
    streams = list(forced)
    result = list(speeds)
    for _ in range(len(speeds)):  # each pass can only add streaming nodes
        total = sum(result)
        streams = [
            s or budget < layers_bytes * c / total
            for s, budget, c in zip(streams, budgets, result, strict=True)
        ]
        result = [
            min(c, d * 4 / per_weight) if s and d else c
            for c, d, s in zip(speeds, disks, streams, strict=True)
        ]
    return result
