"""The operator's Prometheus metrics, served at ``/metrics`` on the metrics port."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

SESSIONS = Gauge("sessionfleet_sessions", "AgentSessions by phase.", ["phase"])
PINNED = Gauge(
    "sessionfleet_worker_pinned_sessions",
    "Sessions pinned to each worker.",
    ["namespace", "worker"],
)
BIND_LATENCY = Histogram(
    "sessionfleet_bind_latency_seconds",
    "Time from an AgentSession's creation to its binding.",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
DRAINS = Gauge("sessionfleet_drains_in_progress", "Workers draining now.")
DRAIN_DURATION = Histogram(
    "sessionfleet_drain_duration_seconds",
    "From a drain's start to the worker being Drained.",
    buckets=(1, 5, 15, 30, 60, 120, 300, 600, 900, 1800),
)
RECOVERIES = Counter(
    "sessionfleet_recoveries_total", "Worker pods replaced by a new epoch.", ["reason"]
)
MIGRATIONS = Counter(
    "sessionfleet_migrations_total", "Sessions moved to another worker.", ["reason"]
)
RECOMPUTED_TOKENS = Gauge(
    "sessionfleet_recomputed_tokens",
    "Prompt tokens recomputed after the first turn, summed over live sessions.",
)
API_WRITES = Counter(
    "sessionfleet_operator_api_writes_total",
    "Write requests the operator sent to the API server.",
    ["verb", "resource"],
)
CHECKPOINTS = Counter(
    "sessionfleet_checkpoints_total", "Checkpoints written, by reason.", ["reason"]
)
RESTORES = Counter("sessionfleet_restores_total", "New epochs started from a checkpoint.")
LEADER = Gauge(
    "sessionfleet_operator_leader",
    "1 while this replica holds the leader-election Lease (and may write), else 0.",
)
LAST_PASS = Gauge(
    "sessionfleet_operator_last_pass_timestamp_seconds",
    "Unix time the fleet loop last finished a pass (the leader's only).",
)
EVENTS_WRITTEN = Counter(
    "sessionfleet_events_written_total",
    "Kubernetes Events written: new ones (create) and repeats folded into one (series).",
    ["kind"],
)
EVENTS_DROPPED = Counter(
    "sessionfleet_events_dropped_total",
    "Kubernetes Events not written (queue_full: a burst beyond the queue; api_error).",
    ["reason"],
)
