"""Live figures of a running master: its nodes, the allreduce, the generation loop.

Plain dicts, so any front can show them: the REST bridge serves them at /v1/cluster. They are
read from the loop's thread-safe stats and from the hub's lists without stopping a step. The
loop's own counters are kept here too (`BatcherStats`): the batcher fills a copy under its lock,
and what it counts is what the fronts show.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from edgetp.master.cluster.engine import Executor
from edgetp.master.cluster.hub import Hub
from edgetp.master.cluster.membership import Member, State
from edgetp.master.cluster.session import Session
from edgetp.memory.window import process_memory
from edgetp.models.config import ModelConfig
from edgetp.models.layers import Slice

ALLREDUCE_WINDOW = 1024  # latest sums summarized


@dataclass(frozen=True)
class CancelRecord:
    """When a cancel came and when the loop acted on it, counted in steps started."""

    id: str
    tokens: int  # tokens generated before the sequence was dropped
    requested_during_step: int  # steps started when the cancel came
    dropped_before_step: int  # the first step that no longer carried it

    @property
    def late_steps(self) -> int:
        """Steps started after the cancel that still carried the sequence: 0 when on time.

        The step already running when the cancel came finishes its token regardless.
        """
        return self.dropped_before_step - 1 - self.requested_during_step


@dataclass(frozen=True)
class ReuseRecord:
    """The last request admitted: its prompt, and how much of it a slot's KV cache held."""

    id: str
    prompt_tokens: int
    reused_tokens: int  # not prefilled: a finished request's keys and values served them


@dataclass
class BatcherStats:
    """Counters and live figures; a copy taken under the batcher's lock."""

    slots: int
    active: int
    waiting: int
    steps: int
    submitted: int
    completed: int
    cancelled: int
    failed: int
    prompt_tokens: int
    completion_tokens: int
    largest_batch: int
    reused_tokens: int = 0  # prompt tokens whose KV a finished request left in its slot
    last_reuse: ReuseRecord | None = None
    step_ms_recent: list[float] = field(default_factory=list)
    batch_recent: list[int] = field(default_factory=list)
    tokens_per_s: float = 0.0
    last_cancel: CancelRecord | None = None
    down: str | None = None
    recovered: int = 0  # requests that went on after a node was lost in their step
    last_loss: str | None = None  # what the last node loss was and what became of it
    replans_mid_answer: int = 0  # re-plans between two steps while answers ran (joins, leaves)
    speculation: dict[str, float | str] | None = None  # drafts' acceptance, tokens a step
    longest_gap_ms: float = 0.0  # the longest a decoding stream waited for its next token
    prefill_chunk: int = 0  # prompt tokens a step feeds while others decode (chunked prefill)


def generation_figures(stats: BatcherStats) -> dict[str, Any]:
    out = asdict(stats)
    out.pop("down")
    if stats.last_cancel is not None:
        out["last_cancel"]["late_steps"] = stats.last_cancel.late_steps
    return out


def _hops(hub: Hub, m: Member) -> dict[str, Any]:
    """A worker's link as timed (a sum-sized message's round trip) beside what its partials
    took to come back, less its compute, over its recent sums: the hop's cost over the raw
    round trip. (A partial that arrives while the master computes its own is seen as that ends.)"""
    out: dict[str, Any] = {}
    if m.link is not None:
        out["link_rtt_us"] = round(m.link.rtt_s * 1e6, 1)
    hops = hub.transport.hop_seconds.get(m.identity)
    if hops:
        recent = list(hops.copy())  # one C call: safe while the loop thread appends
        out["hop_us_median"] = round(statistics.median(recent) * 1e6, 1)
        out["hop_us_p99"] = round(percentile(recent, 0.99) * 1e6, 1)
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
                    **_hops(hub, m),
                    "heartbeat_silence_s": round(silence, 3) if silence != float("inf") else None,
                    "address": m.address or None,
                    "restarts": hub.restarts.get(m.name, 0),
                    "kv_cache_bytes": m.figures.get("kv_cache_bytes"),
                    **_stream(m.figures),
                }
            )
            if m.figures.get("rss") is not None:
                nodes[-1]["rss_bytes"] = m.figures["rss"]
        # deque.copy() is one C call: safe while the loop thread appends.
        recent = list(hub.allreduce_seconds.copy())[-ALLREDUCE_WINDOW:]
        if recent:
            allreduce = {
                "sums": hub.sums,
                "median_us": round(statistics.median(recent) * 1e6, 1),
                "p99_us": round(percentile(recent, 0.99) * 1e6, 1),
                "wire": hub.transport.wire,
            }
    return {
        "model": model,
        "context": session.max_context,
        "layers": config.n_layers,
        "nodes": nodes,
        "allreduce": allreduce,
        "attention": {"on": session.attention.name, "why": session.attention.why},
        "generation": generation_figures(stats),
        "down": stats.down,
    }


def _stream(figures: dict[str, Any]) -> dict[str, Any]:
    """A node's latest per-step figures (window, loader, memory, what a sequence costs it)
    under the schema's names."""
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
        "activations": figures.get("activations"),
        "state_bytes_per_sequence": figures.get("state_bytes_per_sequence"),
        "kv_bytes_per_token": figures.get("kv_bytes_per_token"),
        "kv_cache": figures.get("kv_cache"),
        "slots": figures.get("slots"),
        "context": figures.get("context"),
        "expert_hit_rate": _hit_rate(figures),
        "expert_read_hidden_ms": (
            round(figures["expert_hidden_s"] * 1000, 3) if "expert_hidden_s" in figures else None
        ),
    }


def _hit_rate(figures: dict[str, Any]) -> float | None:
    """The share of the last step's chosen experts that a node's expert cache held; None where
    it holds every expert (or chose none)."""
    hits, misses = figures.get("expert_hits"), figures.get("expert_misses")
    if hits is None or misses is None or not hits + misses:
        return None
    return round(hits / (hits + misses), 4)


def _share(s: Any, c: ModelConfig) -> float:
    """The fraction of the model's query heads and FFN columns a slice holds, weighted."""
    attn = 4 * c.hidden * c.head_dim  # rough weights per query head (q, o and its share of kv)
    ffn = 3 * c.hidden  # weights per FFN column
    total = c.n_heads * attn + c.ffn_hidden * ffn
    return round((s.n_q * attn + s.n_ffn * ffn) / total, 4)


def _kv_bytes(executor: Executor) -> int:
    return executor.cache.nbytes


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of `values`, nearest rank below: p99 is `percentile(v, 0.99)`."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
