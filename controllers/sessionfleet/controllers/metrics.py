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
WRITES_WAITING = Gauge(
    "sessionfleet_operator_session_writes_waiting",
    "Session writes waiting for a turn, by urgency (holds_worker, bind, finish, cleanup).",
    ["urgency"],
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
SPAWNED_FAILURES = Counter(
    "sessionfleet_operator_spawned_failures_total",
    "Work run beside the fleet loop (checkpoints, migrations, session steps) that raised.",
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
DRAIN_HELD = Gauge(
    "sessionfleet_drain_held_seconds",
    "Seconds a draining worker has been draining (since status.drainStartedAt).",
    ["namespace", "worker"],
)
DRAIN_DEADLINE = Gauge(
    "sessionfleet_drain_deadline_seconds",
    "The deadline of a draining worker's DrainPolicy, in seconds (compare with held).",
    ["namespace", "worker"],
)
RECOVERY_DURATION = Histogram(
    "sessionfleet_recovery_duration_seconds",
    "From a new epoch's start (status.lastRecoveryAt) to the worker Ready again; for an "
    "epoch that restores a checkpoint (sessionfleet_restores_total), the restore time.",
    buckets=(1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600),
)
CHECKPOINT_DURATION = Histogram(
    "sessionfleet_checkpoint_duration_seconds",
    "How long a checkpoint that was written took, as its driver reports it.",
    ["driver"],
    buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900),
)
CHECKPOINT_SIZE = Histogram(
    "sessionfleet_checkpoint_size_bytes",
    "The size of each checkpoint written.",
    ["driver"],
    buckets=(1e3, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11),
)
PASS_SECONDS = Histogram(
    "sessionfleet_operator_pass_seconds",
    "How long a pass of the fleet loop took: full (every object, the safety net) or "
    "marked (what events touched and what was due).",
    ["kind"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
PASS_OBJECTS = Histogram(
    "sessionfleet_operator_pass_objects",
    "Objects one pass of the fleet loop looked at, by kind of pass and resource.",
    ["kind", "resource"],
    buckets=(0, 1, 10, 100, 1000, 10000, 100000, 1000000),
)
CHECKPOINT_FAILURES = Counter(
    "sessionfleet_checkpoint_failures_total",
    "Checkpoints marked Failed, by the condition's reason.",
    ["reason"],
)
