"""`/metrics`: the bridge's counters and the cluster's state in Prometheus' text format.

Read at scrape time from the figures the server keeps anyway (the batcher's counters, the hub's
nodes and its allreduce latencies), so nothing on the generation path counts twice.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Callable, Iterator
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from edgetp.master.cluster.membership import State
from edgetp.master.generation.batcher import Batcher


class BridgeCollector(Collector):
    """The batcher's and the cluster's figures as Prometheus metrics, taken when scraped."""

    def __init__(self, batcher: Callable[[], Batcher | None]) -> None:
        self.batcher = batcher  # the resident model's (a server may switch models)
        self.routes: collections.Counter[tuple[str, str, str]] = collections.Counter()

    def collect(self) -> Iterator[Metric]:
        routes = CounterMetricFamily(
            "edgetp_http_requests", "HTTP requests answered, by route and status",
            labels=["method", "route", "status"],
        )  # fmt: skip
        for labels, count in sorted(self.routes.items()):
            routes.add_metric(list(labels), count)
        yield routes
        batcher = self.batcher()
        up = GaugeMetricFamily("edgetp_up", "1 while the cluster serves, 0 once it is down")
        stats = batcher.stats() if batcher is not None else None
        up.add_metric([], 0.0 if stats is None or stats.down else 1.0)
        yield up
        if batcher is None or stats is None:  # no model loaded (between two, or unloaded)
            return
        requests = CounterMetricFamily(
            "edgetp_requests", "requests, by what became of them", labels=["outcome"]
        )
        outcomes = {"submitted": stats.submitted, "completed": stats.completed,
                    "cancelled": stats.cancelled, "failed": stats.failed}  # fmt: skip
        for outcome, count in outcomes.items():
            requests.add_metric([outcome], count)
        yield requests
        yield CounterMetricFamily(
            "edgetp_prompt_tokens", "prompt tokens taken", stats.prompt_tokens
        )
        yield CounterMetricFamily(
            "edgetp_completion_tokens", "tokens generated", stats.completion_tokens
        )
        yield CounterMetricFamily("edgetp_steps", "steps of the engine", stats.steps)
        yield CounterMetricFamily(
            "edgetp_recovered_requests",
            "requests that went on after a node was lost in their step",
            stats.recovered,
        )
        yield CounterMetricFamily(
            "edgetp_replans_mid_answer",
            "re-plans between two steps while answers ran (joins, leaves)",
            stats.replans_mid_answer,
        )
        yield GaugeMetricFamily(
            "edgetp_longest_token_gap_seconds",
            "the longest a decoding stream has waited between two of its tokens",
            stats.longest_gap_ms / 1000,
        )
        yield GaugeMetricFamily("edgetp_requests_running", "requests generating", stats.active)
        yield GaugeMetricFamily("edgetp_requests_waiting", "requests waiting for a slot",
                                stats.waiting)  # fmt: skip
        yield GaugeMetricFamily("edgetp_slots", "KV-cache slots (requests at once)", stats.slots)
        yield GaugeMetricFamily(
            "edgetp_decode_tokens_per_second", "tokens a second over recent steps",
            stats.tokens_per_s,
        )  # fmt: skip
        yield from self._cluster(batcher)

    def _cluster(self, batcher: Batcher) -> Iterator[Metric]:
        hub = batcher.session.hub
        nodes = GaugeMetricFamily(
            "edgetp_nodes", "worker nodes by membership state (the master not counted)",
            labels=["state"],
        )  # fmt: skip
        states = [m.state for m in hub.nodes] if hub is not None else []
        for state in State:
            if state is not State.GONE:
                nodes.add_metric([state.value], sum(s is state for s in states))
        yield nodes
        if hub is not None:
            yield CounterMetricFamily(
                "edgetp_allreduce_sums",
                "star allreduce sums since the start: a step pays one a block whatever its "
                "batch, so concurrent sequences share them",
                hub.sums,
            )
        recent = sorted(hub.allreduce_seconds) if hub is not None else []
        if recent:
            allreduce = GaugeMetricFamily(
                "edgetp_allreduce_seconds",
                "latency a sum adds beyond the slowest node's compute, over recent sums",
                labels=["quantile"],
            )
            allreduce.add_metric(["0.5"], statistics.median(recent))
            allreduce.add_metric(["0.99"], recent[min(len(recent) - 1, int(0.99 * len(recent)))])
            yield allreduce


def add_metrics(app: FastAPI, batcher: Callable[[], Batcher | None]) -> None:
    """Serve `/metrics` on `app` (outside the OpenAPI document: it is for scrapers, not
    clients; like /health it needs no key)."""
    registry = CollectorRegistry(auto_describe=False)
    collector = BridgeCollector(batcher)
    registry.register(collector)
    app.add_middleware(_RouteCounter, counts=collector.routes)

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


class _RouteCounter:
    """Counts each answered request under its route's path template (e.g.
    /v1/responses/{response_id}), so every API's traffic shows apart. Plain ASGI: a
    BaseHTTPMiddleware would stand between a handler and the client's disconnect."""

    def __init__(self, app: Any, counts: collections.Counter[tuple[str, str, str]]) -> None:
        self.app = app
        self.counts = counts

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [0]

        async def sending(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unrouted"
            self.counts[(scope["method"], route, str(status[0]))] += 1
