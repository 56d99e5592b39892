"""Live figures of a running master: its nodes, the allreduce, the generation loop.

Plain dicts, so any front can show them: the REST bridge serves them at /v1/cluster. They are
read from the loop's thread-safe stats and from the hub's lists without stopping a step.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from master.batcher import BatcherStats
from master.engine import Executor
from master.membership import State
from master.session import Session
from memory.window import process_memory
from models.config import ModelConfig
from models.layers import Slice

ALLREDUCE_WINDOW = 1024  # latest sums summarized


def generation_figures(stats: BatcherStats) -> dict[str, Any]:
    out = dataclasses.asdict(stats)
    out.pop("down")
    if stats.last_cancel is not None:
        out["last_cancel"]["late_steps"] = stats.last_cancel.late_steps
    return out


def cluster_figures(session: Session, model: str, stats: BatcherStats) -> dict[str, Any]:
    """The master and every worker (those that joined since the plan too), the allreduce
    latency, and the generation counters."""
    engine = session.engine  # None while the session re-plans
    config = session.config
    own = engine.slices if engine else []
    slices = [s.to_dict() for s in own]
    kv = sum(_kv_bytes(ex) for ex in engine.executors) if engine else 0
    hub = session.hub
    nodes: list[dict[str, Any]] = [
        {
            "name": "master",
            "role": "master",
            "alive": stats.down is None,
            "ready": engine is not None,  # False while it re-plans and loads its slice
            "slices": slices,
            "address": hub.address if hub else None,
            "rss_bytes": process_memory()["rss"],
            "memory_budget_bytes": session.memory.budget,
            "kv_cache_bytes": kv or None,
            "share": _share(own[0], config) if own else None,
            **_stream(engine.figures if engine else {}),
        }
    ]
    allreduce = None
    if hub is not None:
        for m in hub.nodes:
            silence = hub.heartbeat.silence(m.name)
            nodes.append(
                {
                    "name": m.name,
                    "role": "worker",
                    "alive": m.alive,
                    "ready": m.ready,
                    "standby": m.state is State.STANDBY,
                    "slices": [m.slice] if m.slice else [],
                    "share": _share(Slice.from_dict(m.slice), config) if m.slice else None,
                    "memory_budget_bytes": m.capacity.memory_budget,
                    "cores": m.capacity.cores,
                    "speed_gb_s": m.capacity.speed,
                    "disk_gb_s": m.capacity.disk,
                    "message_us": round(m.capacity.message_s * 1e6, 1),
                    "heartbeat_silence_s": round(silence, 3) if silence != float("inf") else None,
                    "address": m.address or None,
                    "restarts": hub.restarts.get(m.name, 0),
                    **_stream(m.figures),
                }
            )
            if m.figures.get("rss") is not None:
                nodes[-1]["rss_bytes"] = m.figures["rss"]
        # deque.copy() is one C call: safe while the loop thread appends.
        recent = list(hub.allreduce_seconds.copy())[-ALLREDUCE_WINDOW:]
        if recent:
            allreduce = {
                "sums": len(hub.allreduce_seconds),
                "median_us": round(statistics.median(recent) * 1e6, 1),
                "p99_us": round(percentile(recent, 0.99) * 1e6, 1),
            }
    return {
        "model": model,
        "context": session.max_context,
        "layers": config.n_layers,
        "nodes": nodes,
        "allreduce": allreduce,
        "generation": generation_figures(stats),
        "down": stats.down,
    }


def _stream(figures: dict[str, Any]) -> dict[str, Any]:
    """A node's latest per-step figures (window, loader, memory) under the schema's names."""
    if not figures:
        return {}
    return {
        "window": figures.get("window"),
        "peak_rss_bytes": figures.get("peak_rss"),
        "bytes_read_per_token": figures.get("bytes_read"),
        "loader_wait_ms": round(figures.get("wait_s", 0.0) * 1000, 3),
        "load_ms": round(figures.get("load_s", 0.0) * 1000, 3),
        "compute_ms": round(figures.get("compute_s", 0.0) * 1000, 3),
        "kernels": figures.get("kernels"),
    }


def _share(s: Any, c: ModelConfig) -> float:
    """The fraction of the model's query heads and FFN columns a slice holds, weighted."""
    attn = 4 * c.hidden * c.head_dim  # rough weights per query head (q, o and its share of kv)
    ffn = 3 * c.hidden  # weights per FFN column
    total = c.n_heads * attn + c.ffn_hidden * ffn
    return round((s.n_q * attn + s.n_ffn * ffn) / total, 4)


def _kv_bytes(executor: Executor) -> int:
    return sum(t.nbytes for t in (*executor.cache.keys, *executor.cache.values))


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of `values`, nearest rank below: p99 is `percentile(v, 0.99)`."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
