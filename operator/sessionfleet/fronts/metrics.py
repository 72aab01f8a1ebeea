"""The router's Prometheus metrics (``GET /metrics``).

=================================================  =========  ==============================
name                                               type       labels
=================================================  =========  ==============================
``sessionfleet_router_requests_total``             counter    ``route`` (session, stateless,
                                                              other), ``code``
``sessionfleet_router_added_latency_seconds``      histogram  ``route``: time in the router,
                                                              less the time waiting for the
                                                              worker (and for held turns)
``sessionfleet_router_in_flight_requests``         gauge
``sessionfleet_router_held_turns``                 gauge      turns waiting for a session to
                                                              be (re)bound
``sessionfleet_router_holds_total``                counter    ``outcome`` (released, timeout)
``sessionfleet_router_sessions_created_total``     counter    ``outcome`` (created, adopted)
``sessionfleet_router_status_flushes_total``       counter    ``outcome`` (written, conflict,
                                                              failed, gone)
``sessionfleet_router_turns_without_usage_total``  counter    ``worker``
``sessionfleet_router_prompt_tokens_total``        counter    ``worker``
``sessionfleet_router_cached_tokens_total``        counter    ``worker``
``sessionfleet_router_worker_cache_hit_ratio``     gauge      ``worker``: cached over prompt
                                                              tokens of turns routed here
``sessionfleet_router_sessions``                   gauge      sessions known to the router
``sessionfleet_router_workers``                    gauge      ``phase``
=================================================  =========  ==============================

The per-worker token figures and table sizes are read at scrape time, so the hot path
only adds to plain integers; label children are looked up once and cached.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sessionfleet.engines.vllm import Usage
from sessionfleet.fronts.bindings import BindingTable

LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)


class RouterMetrics:
    """Every metric of one router, in its own registry."""

    def __init__(self, table: BindingTable) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self._requests = Counter(
            "sessionfleet_router_requests",
            "Requests answered, by route and HTTP status.",
            ["route", "code"],
            registry=registry,
        )
        self._added = Histogram(
            "sessionfleet_router_added_latency_seconds",
            "Time spent in the router itself: total minus waiting for the worker and holds.",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.in_flight = 0
        """Requests in progress: a plain integer on the hot path, read at scrape time."""
        Gauge(
            "sessionfleet_router_in_flight_requests", "Requests in progress.", registry=registry
        ).set_function(lambda: self.in_flight)
        self.held = Gauge(
            "sessionfleet_router_held_turns",
            "Turns waiting for their session to be bound (Migrating, Restoring, Lost).",
            registry=registry,
        )
        self.holds = Counter(
            "sessionfleet_router_holds",
            "Held turns by outcome: released to a worker, or answered 503 at the timeout.",
            ["outcome"],
            registry=registry,
        )
        self.sessions_created = Counter(
            "sessionfleet_router_sessions_created",
            "New sessions: created by this router, or adopted after another router won.",
            ["outcome"],
            registry=registry,
        )
        self.flushes = Counter(
            "sessionfleet_router_status_flushes",
            "Usage writes to AgentSession status, by outcome.",
            ["outcome"],
            registry=registry,
        )
        self._children: dict[tuple[str, int], Counter] = {}
        self._latency: dict[str, Histogram] = {}
        self.prompt_tokens: Tally[str] = Tally()
        self.cached_tokens: Tally[str] = Tally()
        self.turns_without_usage: Tally[str] = Tally()
        registry.register(_TableCollector(self, table))

    def request(self, route: str, code: int, added_seconds: float | None) -> None:
        """Count one answered request and observe the router's own time for it."""
        child = self._children.get((route, code))
        if child is None:
            child = self._children[(route, code)] = self._requests.labels(route, str(code))
        child.inc()
        if added_seconds is not None:
            histogram = self._latency.get(route)
            if histogram is None:
                histogram = self._latency[route] = self._added.labels(route)
            histogram.observe(added_seconds)

    def usage(self, worker: str, usage: Usage | None) -> None:
        """Add a turn's tokens to its worker's figures."""
        if usage is None:
            self.turns_without_usage[worker] += 1
            return
        self.prompt_tokens[worker] += usage.prompt_tokens
        self.cached_tokens[worker] += usage.cached_tokens or 0


class _TableCollector(Collector):
    """Per-worker token figures and table sizes, read at scrape time."""

    def __init__(self, metrics: RouterMetrics, table: BindingTable) -> None:
        self._metrics = metrics
        self._table = table

    def collect(self) -> Iterator[Metric]:
        metrics = self._metrics
        prompt = CounterMetricFamily(
            "sessionfleet_router_prompt_tokens",
            "Prompt tokens of turns, by worker.",
            labels=["worker"],
        )
        cached = CounterMetricFamily(
            "sessionfleet_router_cached_tokens",
            "Prompt tokens served from the worker's prefix cache, by worker.",
            labels=["worker"],
        )
        ratio = GaugeMetricFamily(
            "sessionfleet_router_worker_cache_hit_ratio",
            "Cached over prompt tokens of the turns this router sent to the worker, 0-1.",
            labels=["worker"],
        )
        for worker, tokens in sorted(metrics.prompt_tokens.items()):
            prompt.add_metric([worker], tokens)
            cached.add_metric([worker], metrics.cached_tokens[worker])
            ratio.add_metric([worker], metrics.cached_tokens[worker] / tokens if tokens else 0.0)
        missing = CounterMetricFamily(
            "sessionfleet_router_turns_without_usage",
            "Turns whose response carried no usage (start engines with "
            "--enable-force-include-usage), by worker.",
            labels=["worker"],
        )
        for worker, turns in sorted(metrics.turns_without_usage.items()):
            missing.add_metric([worker], turns)
        yield from (prompt, cached, ratio, missing)
        yield GaugeMetricFamily(
            "sessionfleet_router_sessions",
            "AgentSessions known to the router.",
            value=sum(1 for _ in self._table.sessions()),
        )
        workers = GaugeMetricFamily(
            "sessionfleet_router_workers", "InferenceWorkers known, by phase.", labels=["phase"]
        )
        for phase, count in sorted(
            Tally(w.phase or "Unknown" for w in self._table.workers.values()).items()
        ):
            workers.add_metric([phase], count)
        yield workers
