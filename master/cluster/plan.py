"""The split plan: which heads and FFN columns each device computes.

A pure function of the model config and the devices' capacities, so it is tested without
sockets. Shares follow capacity (largest remainder), not forced equal:

- nodes <= KV heads: attention is split by whole KV-head groups (each group with its query heads),
  so no KV head is computed twice;
- nodes > KV heads: query heads are split instead, and a slice holds a copy of each KV head its
  query heads read (the KV heads are replicated);
- FFN intermediate columns are split in multiples of a block of the down projection's
  quantized weights (models/quant.py: 32 columns, 256 for the K-quants) where the size allows;
- the lm_head is split by vocabulary rows, so that each node's weights, its layers' and its
  head rows', follow its capacity (`head_rows`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from edgetp.models.config import ModelConfig
from edgetp.models.dtypes import AUTO
from edgetp.models.layers import (
    MATRICES,
    Slice,
    attention_on_first,
    full_layer_shapes,
    kv_heads_for,
    slice_parts,
)
from edgetp.models.quant import BLOCK, FORMATS
from edgetp.models.source import ModelSource
from edgetp.node.kvcache import KVCache, LinearStates

FFN_ALIGN = BLOCK
HEAD_ALIGN = 64  # a run of lm_head rows is a multiple of this many
# The vocabulary goes to nodes in at most this many runs (`head_run`): each node's rows are a
# matrix shape its device checks and times its kernels for once (~6 s at cpu=0.5, most of it
# starting the check's process), and runs of 64 rows made nearly every plan's split a new shape
# (200 of them in one device's table). A run of 768 of SmolLM2's rows, ~0.3% of a 2-device
# share, is finer than the speed probes can tell two devices apart.
HEAD_RUNS = 64
# Bytes a weight takes in a shard, by shard dtype (int8's per-row scales: a rounding error).
BYTES_PER_WEIGHT = {
    "f32": 4.0, "f16": 2.0, "bf16": 2.0, "int8": 1.0,
    **{name: f.block_bytes / f.block_values for name, f in FORMATS.items()},
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


def plan_slices(
    config: ModelConfig,
    capacities: Sequence[float],
    ffn_align: int = FFN_ALIGN,
    attention_first: bool = False,
) -> list[Slice]:
    """One slice per device, in the order of `capacities`, the FFN cut in multiples of
    `ffn_align` columns (`ModelSource.ffn_align`: the down projection's block) where it can be.
    `attention_first`: the first device (the master) holds every head of attention and of a
    gated DeltaNet, the others none, so a layer's attention needs no sum (`choose_attention`)."""
    n = len(capacities)
    group = config.group_size
    if attention_first:
        q_ranges = [(0, config.n_heads)] + [(config.n_heads, config.n_heads)] * (n - 1)
    elif n <= config.n_kv_heads:
        groups = _ranges(proportional_counts(config.n_kv_heads, capacities))
        q_ranges = [(g0 * group, g1 * group) for g0, g1 in groups]
    else:
        q_ranges = _ranges(proportional_counts(config.n_heads, capacities))

    align = next((a for a in (ffn_align, FFN_ALIGN) if config.ffn_hidden % a == 0), 1)
    units = config.ffn_hidden // align
    ffn_ranges = _ranges(proportional_counts(units, capacities), align)

    if attention_first:
        v = config.linear_v_heads
        linear = [(0, v)] + [(v, v)] * (n - 1)
    else:
        linear = _linear_ranges(config, capacities)
    return [
        Slice(q, kv_heads_for(q, group), f, v, kv_heads_for(v, config.linear_group))
        for q, f, v in zip(q_ranges, ffn_ranges, linear, strict=True)
    ]


def _linear_ranges(config: ModelConfig, capacities: Sequence[float]) -> list[tuple[int, int]]:
    """A linear-attention layer's value heads for each slice, cut as attention's query heads:
    by whole key-head groups while there are enough of them, else by value heads (their key
    heads then replicated). (0, 0) for all when the model has no such layers."""
    n = len(capacities)
    if not config.linear_layers:
        return [(0, 0)] * n
    if n <= config.linear_k_heads:
        g = config.linear_group
        groups = _ranges(proportional_counts(config.linear_k_heads, capacities))
        return [(a * g, b * g) for a, b in groups]
    return _ranges(proportional_counts(config.linear_v_heads, capacities))


def head_rows(
    config: ModelConfig,
    slices: Sequence[Slice],
    capacities: Sequence[float],
    row_costs: Sequence[float] | None = None,
) -> list[tuple[int, int]]:
    """Each node's rows of the lm_head (its vocabulary range), in the order of `slices`.

    Whole heads split the layers only so finely (SmolLM2's 3 KV-head groups go 2:1 on two
    devices), so the head's rows even out the rest: each node gets rows such that its weights,
    layers and head together, follow its capacity, where the layers' uneven split allows. Rows
    go in runs of `head_run(config)`. `row_costs[k]` is what a head row costs node k against
    multiplying it alone (`head_row_cost`: a worker's logits also cross its link); 1 for all
    by default.
    """
    n = len(slices)
    costs = list(row_costs) if row_costs is not None else [1.0] * n
    # In head-row units: node k's layers take w_k, its r_k rows r_k * cost_k, over capacity
    # c_k; the same time T on every node, and the rows adding up to the head's, give
    # T = (units + sum w_k / cost_k) / sum(c_k / cost_k) and r_k = (T c_k - w_k) / cost_k.
    run = head_run(config)
    # Attention on the master alone (`attention_first`) runs while the workers wait: not work
    # they share, so the head's rows even out only the FFN's.
    if attention_on_first(slices):
        slices = [without_attention(s) for s in slices]
    w = [config.n_layers * _layer_weights(config, s) / config.hidden / run for s in slices]
    c, m = list(capacities), costs
    if not len(c) == len(m) == n:
        raise ValueError(f"{n} slices, {len(c)} capacities and {len(m)} row costs")
    units = -(-config.vocab_size // run)
    # Every node at least one run where there are enough: a node with no rows would still be
    # asked for its (empty) logits. A node whose layers alone pass T gets just that, and T is
    # found again for the others over the runs left, until every other node wants more.
    least = 1 if units >= n else 0
    fixed: set[int] = set()
    while True:
        free = [k for k in range(n) if k not in fixed]
        left = units - least * len(fixed)
        t = (left + sum(w[k] / m[k] for k in free)) / sum(c[k] / m[k] for k in free)
        wanted = {k: (t * c[k] - w[k]) / m[k] for k in free}
        short = {k for k in free if wanted[k] < least}
        if not short:  # never every node: the free ones want `left`, at least `least` each
            break
        fixed |= short
    extra = proportional_counts(
        left - least * len(free), [max(wanted[k] - least, 1e-12) for k in free]
    )
    counts = [least] * n
    for k, more in zip(free, extra, strict=True):
        counts[k] += more
    return [(a, min(b, config.vocab_size)) for a, b in _ranges(counts, run)]


def without_attention(s: Slice) -> Slice:
    """The slice with its FFN columns alone."""
    return Slice((0, 0), (0, 0), s.ffn)


def head_run(config: ModelConfig) -> int:
    """Rows of the lm_head in one run (`head_rows` deals whole runs): the vocabulary in at most
    HEAD_RUNS of them, each a multiple of HEAD_ALIGN rows (768 for SmolLM2's 49152)."""
    return HEAD_ALIGN * max(1, -(-config.vocab_size // (HEAD_RUNS * HEAD_ALIGN)))


def head_row_cost(config: ModelConfig, speed_gb_s: float, bytes_per_s: float, dtype: str) -> float:
    """What one row of the lm_head costs a worker, against multiplying it where its logit is
    wanted: its weights (`hidden` of them, `dtype`) at `speed_gb_s`, and its logit (4 bytes a
    sequence) sent on a link of `bytes_per_s`. 1 + 0.56 for SmolLM2 in f32 on a 4 GB/s device
    at 100 Mbit/s; 1.06 at 1 Gbit/s."""
    if not bytes_per_s > 0 or math.isinf(bytes_per_s):
        return 1.0
    compute_s = config.hidden * BYTES_PER_WEIGHT[dtype] / (speed_gb_s * 1e9)
    return 1.0 + 4 / bytes_per_s / compute_s


def _layer_weights(config: ModelConfig, s: Slice) -> int:
    """The weights of an average layer a slice holds (`slice_parts`' rows times columns)."""
    kinds = {config.is_linear(i): i for i in range(config.n_layers)}  # one layer of each kind
    total = 0
    for kind, layer in kinds.items():
        full = full_layer_shapes(config, layer)
        weights = sum(
            p.n_rows * (p.cols[1] - p.cols[0] if p.cols else math.prod(full[p.source][1:]))
            for parts in slice_parts(config, s, layer).values()
            for p in parts
        )
        total += weights * sum(config.is_linear(i) == kind for i in range(config.n_layers))
    return total // config.n_layers


def with_messages(
    speeds: Sequence[float], message_s: Sequence[float], model_gb: float, sums: int
) -> list[float]:
    """Speeds for the split when each node's share of the sums takes its time too: per sum the
    master sends the hidden state to every worker and receives every partial, 2 (n - 1)
    messages, where a worker receives one and sends one. `message_s` is each node's time a
    message (node.worker.measure_message_cost), `model_gb` the float32 weights the nodes share
    (layers and lm_head, as `speeds` are GB/s of float32 weights), `sums` a token's sums.

    With node i's share w_i, its token takes w_i / speed_i + o_i (o_i: its messages). Shares
    that make every node take the same T sum to the model: T = (W + sum speed_i o_i) /
    sum speed_i, w_i = speed_i (T - o_i). Returned as the speeds that split the model that way,
    speed_i (1 - o_i / T): their sum is W / T, so 1 / sum is still a token's time.
    """
    n = len(speeds)
    if n < 2:
        return list(speeds)
    messages = [2 * (n - 1) * sums] + [2 * sums] * (n - 1)
    overhead = [m * s for m, s in zip(messages, message_s, strict=True)]
    token = (model_gb + sum(v * o for v, o in zip(speeds, overhead, strict=True))) / sum(speeds)
    # A node whose messages alone take a token still holds a little (every node gets a slice).
    return [max(v * (1 - o / token), 1e-3 * v) for v, o in zip(speeds, overhead, strict=True)]


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


@dataclass(frozen=True)
class SplitEstimate:
    """A token's time as the devices' probes put it, in seconds: on the master alone, and split
    (its compute, every node busy for the same time, and its sums)."""

    alone_s: float
    compute_s: float
    sums_s: float

    @property
    def split_s(self) -> float:
        return self.compute_s + self.sums_s


def split_estimate(
    speeds: Sequence[float], model_gb: float, sums: int, round_trips: Sequence[float]
) -> SplitEstimate:
    """What splitting a token's `model_gb` of float32 weights over devices of `speeds` (GB/s of
    float32 weights, the master first) saves, against what its `sums` cost: each waits for the
    slowest worker's round trip of a hidden state (`round_trips`, s). On a LAN the sums are a
    few ms a token; at 2 ms a round trip (SmolLM2's 61 sums: 122 ms) they cost more than a small
    model's whole token on one device."""
    return SplitEstimate(
        alone_s=model_gb / speeds[0],
        compute_s=model_gb / sum(speeds),
        sums_s=sums * max(round_trips, default=0.0),
    )


# How much faster the probes must put a token on fewer devices before the plan leaves the
# others on standby. Their estimates run under what the devices then take, the master alone's
# more than a split's: at 2 x cpu=0.5, 64.0 ms alone and 52.8 split, where one device took 99.1
# and two 64.2 (docs/bench/bars-cpu0.5-s42.json, in git's history). The margin covers that and
# the probes' noise.
STANDBY_GAIN = 1.5


def workers_to_plan(
    speeds: Sequence[float],
    round_trips: Sequence[float],
    budgets: Sequence[int],
    weights_bytes: int,
    model_gb: float,
    sums: int,
) -> list[int]:
    """The workers (indices into `round_trips`) a plan takes: every one, unless the master with
    only those of the fastest links would make a token STANDBY_GAIN faster by `split_estimate`
    (the master alone: its speed alone). `speeds` and `budgets` (bytes) are the master's then
    each worker's; fewer devices are a choice only where their budgets together hold
    `weights_bytes`, so that leaving a device out never makes the others stream from disk.

    Each sum waits for the slowest round trip, so the sets worth trying are the k fastest links.
    A link that costs more a token than its device's compute saves (the master and a device two
    ms away: SmolLM2's 61 sums take 122 ms, its whole token 60-100 ms on one device) slows every
    token; on standby the device waits, joined, for a plan that needs it.
    """
    order = sorted(range(len(round_trips)), key=lambda k: round_trips[k])

    def token_s(kept: list[int]) -> float:
        return kept_token_s(speeds, round_trips, kept, model_gb, sums)

    everyone = token_s(order)
    best, best_s = order, everyone
    for n in range(len(order) - 1, -1, -1):  # more devices first: they win a tie
        kept = order[:n]
        if budgets[0] + sum(budgets[1 + k] for k in kept) < weights_bytes:
            break  # fewer hold less
        if (kept_s := token_s(kept)) < best_s:
            best, best_s = kept, kept_s
    return sorted(best) if best_s * STANDBY_GAIN < everyone else list(range(len(round_trips)))


def kept_token_s(
    speeds: Sequence[float],
    round_trips: Sequence[float],
    kept: Sequence[int],
    model_gb: float,
    sums: int,
) -> float:
    """`split_estimate`'s seconds a token with the master and only the workers `kept` (indices
    into `round_trips`; `speeds` the master's then each worker's); none kept: the master alone."""
    estimate = split_estimate(
        [speeds[0], *(speeds[1 + k] for k in kept)], model_gb, sums, [round_trips[k] for k in kept]
    )
    return estimate.split_s if kept else estimate.alone_s


ATTENTION_MATRICES = ("wqkv", "wo")  # attention's, or a gated DeltaNet's; the rest: the FFN's


@dataclass(frozen=True)
class AttentionChoice:
    """Where a plan puts attention: split across the devices like the FFN, two sums a layer;
    or every head on the master (`plan_slices`' `attention_first`), one sum a layer, the
    workers idle while it computes. `why`: the figures it was chosen by, or who chose it."""

    on_master: bool
    why: str

    @property
    def name(self) -> str:
        return "master" if self.on_master else "split"


# How much more the sums must save than the bytes say attention costs the master beyond its
# share. Llama-3-8B's shapes at q4_0, 4 devices cpu=0.5,rtt=3ms: the bytes said 12.3 ms a token,
# the layers took 17.9 ms more, for 17.7 ms of sums saved (docs/bench/README.md): a wash the
# estimate alone called a gain. A wash stays split, which holds less on the master.
ATTENTION_GAIN = 1.5


def choose_attention(
    config: ModelConfig,
    speeds: Sequence[float],
    sum_s: float,
    attention_bytes: int,
    master_budget: int | None = None,
) -> AttentionChoice:
    """Attention on the master where the sums it saves, one a layer (`sum_s`: what one costs,
    a round trip to the slowest worker and the master's messages), outweigh what computing
    every head there costs beyond a share of them: its `attention_bytes` (every layer's
    attention matrices in the shards) at the master's speed rather than at all the devices'
    (`speeds`, GB/s, the master first; the FFN's time is the same either way). Not where the
    master's memory budget cannot hold every layer's attention.

    Read as bytes of the shards at a speed probed on float32 weights (`measure_speed`), 4-bit
    attention comes out near its time, a little under (`ATTENTION_GAIN`)."""
    layers = config.n_layers
    alone = attention_bytes / 1e9 / speeds[0]
    shared = attention_bytes / 1e9 / sum(speeds)
    saved = layers * sum_s
    figures = (
        f"{layers} sums a token fewer at ~{sum_s * 1e6:.0f} us each (~{saved * 1e3:.1f} ms) "
        f"against attention's ~{alone * 1e3:.1f} ms on the master alone, ~{shared * 1e3:.1f} "
        f"split"
    )
    if master_budget is not None and master_budget < attention_bytes:
        held = f"{attention_bytes / 2**20:.0f} MiB"
        why = f"split: the master's memory budget cannot hold every layer's attention ({held})"
        return AttentionChoice(False, f"{why}; {figures}")
    if len(speeds) > 1 and saved > ATTENTION_GAIN * (alone - shared):
        return AttentionChoice(True, f"master: {figures}")
    return AttentionChoice(False, f"split: {figures}")


def layers_size(
    source: ModelSource, dtype: str, matrices: Sequence[str] = MATRICES
) -> tuple[int, int]:
    """The bytes the layers' `matrices` take in shards of `dtype`, and their weights."""
    config = source.config
    size = count = 0.0
    for layer in range(config.n_layers):
        shapes = full_layer_shapes(config, layer)
        parts = slice_parts(config, Slice.whole(config), layer)
        weights = {m: sum(math.prod(shapes[p.source]) for p in parts[m]) for m in matrices}
        dtypes = source.matrix_dtypes(layer, dtype)
        size += sum(weights[m] * BYTES_PER_WEIGHT[d] for m, d in dtypes.items() if m in weights)
        count += sum(weights.values())
    return int(size), int(count)


def resident_bytes(
    source: ModelSource, dtype: str, kv_format: str, context: int, slots: int
) -> int:
    """About what the model holds in memory with every layer resident, over all its nodes: its
    layers in shards of `dtype`, the tensors the master holds whole, and a full KV cache of
    `slots` sequences of `context` tokens (stored as `kv_format`; "auto" counted as float32,
    the most it may take)."""
    config = source.config
    head = BYTES_PER_WEIGHT.get(source.head_dtype(dtype), 4.0)
    held = sum(math.prod(source.shape(None, name)) for name in source.global_names()) * head
    whole, kv = Slice.whole(config), "f32" if kv_format == AUTO else kv_format
    per_slot = KVCache.bytes_per_token(config, whole, kv) * context
    per_slot += KVCache.window_bytes(config, whole, kv) + LinearStates.slot_bytes(config, whole)
    return layers_size(source, dtype)[0] + int(held) + per_slot * slots
