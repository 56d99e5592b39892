"""What a cluster bench run's raw figures come to: each node's averages over the decode steps,
where a decoded token's time goes, how well streaming overlaps compute, the least a token can
take under the devices' CPU quotas, and the plan's probes, as the report records them.

Pure functions of figures already taken, so each can be checked without a cluster.
"""

from __future__ import annotations

import math
from typing import Any

from edgetp.master.cluster.hub import Link
from edgetp.master.cluster.plan import SplitEstimate


def link_figures(link: Link | None) -> dict[str, float | None]:
    """A worker's link as the master timed it, for the record (none for the master)."""
    if link is None:
        return {}
    rate = None if math.isinf(link.bytes_per_s) else round(link.bytes_per_s * 8 / 1e6, 1)
    return {"link_rtt_us": round(link.rtt_s * 1e6, 1), "link_mbit_s": rate}


def estimate_figures(estimate: SplitEstimate | None) -> dict[str, float] | None:
    """The probes' estimate of a token (`master.cluster.plan.split_estimate`), in ms, for the
    record."""
    if estimate is None:
        return None
    return {
        "alone_ms": round(estimate.alone_s * 1e3, 1),
        "split_ms": round(estimate.split_s * 1e3, 1),
        "compute_ms": round(estimate.compute_s * 1e3, 1),
        "sums_ms": round(estimate.sums_s * 1e3, 1),
    }


def cpu_floor_ms(devices: list[dict[str, Any]]) -> float | None:
    """The least a token can take under the devices' CPU quotas, in ms: the busiest device's CPU
    a token over its share of a core. None unless every device has a quota. A token's ms beyond
    it are the devices waiting on each other (messages, an uneven split, the quotas' periods):
    under a quota the hops of `where_time_goes` also count the periods a device was held, which a
    faster link would not shorten."""
    if not devices or not all(d["device"]["cpu"] for d in devices):
        return None
    return round(max(d["cpu_ms_per_token"] / d["device"]["cpu"] for d in devices), 2)


def overlap(ms_per_token: float, per_node: list[dict[str, Any]]) -> dict[str, Any] | None:
    """How well the slowest streaming node hides its reads behind its compute: ms/token over
    the larger of its reads and its compute (waits excluded) per token, from the same run."""
    streaming = [r for r in per_node if r.get("mb_read_per_token")]
    if not streaming:
        return None
    slowest = max(
        streaming, key=lambda r: max(r["load_ms_per_token"], r["own_compute_ms_per_token"])
    )
    load, compute = slowest["load_ms_per_token"], slowest["own_compute_ms_per_token"]
    bound = max(load, compute)
    ratio = round(ms_per_token / bound, 3) if bound else None
    return {"node": slowest["node"], "load_ms": load, "compute_ms": compute, "ratio": ratio}


def where_time_goes(
    ms: float,
    per_node: list[dict[str, Any]],
    decode_sums: list[float],
    decoded: int,
    speculation: dict[str, Any] | None = None,
) -> dict[str, float]:
    """A decoded token's time, ms: in the layers' blocks (the slowest node's compute, and the
    hops the allreduce adds beyond it: `decode_sums`), in the final norm and lm_head (with
    workers, every node's rows of it and their round trip), in a draft
    model's forwards, and the master's other serial work (embedding, sampling, the generation
    loop). `decoded` tokens came of the decode steps (more than the steps, with speculation)."""
    master = per_node[0]
    if "decode_steps" not in master:
        return {}
    steps = master["decode_steps"]
    per_token = steps / decoded  # the nodes' figures are per step
    hops = sum(decode_sums) * 1000 / decoded
    blocks = master["blocks_ms_per_token"] * per_token
    head = master["head_ms_per_token"] * per_token
    drafting = (speculation or {}).get("drafting_s", 0.0) * 1000 / decoded
    return {
        "ms_per_token": round(ms, 2),
        "compute_ms": round(blocks - hops, 2),
        "hops_ms": round(hops, 2),
        "lm_head_ms": round(head, 2),
        "drafting_ms": round(drafting, 2),
        "other_master_ms": round(ms - blocks - head - drafting, 2),
        "own_compute_ms": {
            r["node"]: round(r["own_compute_ms_per_token"] * per_token, 2) for r in per_node
        },
    }


def node_row(name: str, history: Any) -> dict[str, Any]:
    """A node's loader and memory figures, averaged over the decode steps (one token each), and
    what a sequence costs its memory."""
    steps = list(history)[1:]  # the first step is the prompt's
    if not steps:
        return {"node": name}
    n = len(steps)
    return {
        "node": name,
        "window": steps[-1].get("window"),
        "mb_read_per_token": round(sum(s["bytes_read"] for s in steps) / n / 1e6, 2),
        "load_ms_per_token": round(sum(s["load_s"] for s in steps) / n * 1000, 2),
        "wait_ms_per_token": round(sum(s["wait_s"] for s in steps) / n * 1000, 2),
        "decode_steps": n,
        "compute_ms_per_token": round(sum(s["compute_s"] for s in steps) / n * 1000, 2),
        "own_compute_ms_per_token": round(
            sum(s["compute_s"] - s["wait_s"] for s in steps) / n * 1000, 2
        ),
        **{  # the master's own: where its step's time went (master.cluster.engine)
            f"{key}_ms_per_token": round(sum(s[f"{key}_s"] for s in steps) / n * 1000, 2)
            for key in ("blocks", "head")
            if f"{key}_s" in steps[0]
        },
        "buffer_mb": round(steps[-1]["buffer_bytes"] / 1e6, 1),
        "rss_mb": round(steps[-1]["rss"] / 1e6, 1),
        "peak_rss_mb": round(max(s["peak_rss"] for s in steps) / 1e6, 1),
        # what a sequence costs the node: its state whatever its length, its KV per token
        "state_mb_per_sequence": round(steps[-1]["state_bytes_per_sequence"] / 1e6, 2),
        "kv_kb_per_token": round(steps[-1]["kv_bytes_per_token"] / 1e3, 1),
        "kv_bytes_per_token": steps[-1]["kv_bytes_per_token"],
        "state_bytes_per_sequence": steps[-1]["state_bytes_per_sequence"],
        "slots": steps[-1]["slots"],
        "context": steps[-1]["context"],
        **expert_figures(steps),
    }


def expert_figures(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """A node's expert cache over the decode steps, where it streams a mixture's experts: the
    share of chosen experts it held, the MB of experts read and chosen per token, and the ms a
    token of those reads that the held experts' compute hid."""
    if not steps or "expert_hits" not in steps[-1]:
        return {}
    n = len(steps)
    hits = sum(s.get("expert_hits", 0) for s in steps)
    chosen = hits + sum(s.get("expert_misses", 0) for s in steps)
    return {
        "expert_hit_rate": round(hits / chosen, 3) if chosen else None,
        "expert_mb_read_per_token": round(sum(s["expert_bytes_read"] for s in steps) / n / 1e6, 2),
        "expert_mb_chosen_per_token": round(
            sum(s["expert_bytes_chosen"] for s in steps) / n / 1e6, 2
        ),
        "expert_read_hidden_ms_per_token": round(
            sum(s.get("expert_hidden_s", 0.0) for s in steps) / n * 1000, 2
        ),
        "expert_slots": steps[-1]["expert_slots"],
    }
