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

from collections.abc import Sequence

from models.config import ModelConfig
from models.layers import Slice, kv_heads_for
from models.quant import BLOCK

FFN_ALIGN = BLOCK


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
