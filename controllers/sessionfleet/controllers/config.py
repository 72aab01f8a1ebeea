"""The operator's own settings: command-line flags, not custom resources."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sessionfleet.policy.checkpoint import DEFAULT_CHECKPOINT_TIMEOUT
from sessionfleet.policy.handshake import DEFAULT_ACK_TIMEOUT
from sessionfleet.policy.recovery import (
    DEFAULT_MAX_CONCURRENT_NODE_RECOVERIES,
    DEFAULT_NODE_NOT_READY_TOLERATION,
    DEFAULT_UNHEALTHY_NODE_THRESHOLD,
)
from sessionfleet.policy.sessions import DEFAULT_IDLE_TIMEOUT, DEFAULT_LOST_TIMEOUT
from sessionfleet.resources.pods import EngineImages


@dataclass(frozen=True, slots=True)
class OperatorConfig:
    """How the operator runs."""

    namespaces: tuple[str, ...] = ()
    """Namespaces to serve; empty serves the whole cluster."""
    kubeconfig: str | None = None
    idle_timeout: timedelta = DEFAULT_IDLE_TIMEOUT
    lost_timeout: timedelta = DEFAULT_LOST_TIMEOUT
    """A Lost session with no turn for this long (since it became Lost) is finished."""
    node_not_ready_toleration: timedelta = DEFAULT_NODE_NOT_READY_TOLERATION
    max_concurrent_node_recoveries: int = DEFAULT_MAX_CONCURRENT_NODE_RECOVERIES
    """Workers moved off NotReady nodes at once, fleet-wide."""
    unhealthy_node_threshold: float = DEFAULT_UNHEALTHY_NODE_THRESHOLD
    """Beyond this share of NotReady nodes, no worker is moved off a NotReady node."""
    resync_seconds: float = 2.0
    """The longest the fleet loop sleeps without an event; deadlines are met within it."""
    full_resync_seconds: float = 60.0
    """How often a pass takes every worker and session, not only what events marked."""
    scrape_interval_seconds: float = 15.0
    """How often each Ready worker's engine metrics are read."""
    scrape_timeout_seconds: float = 3.0
    kv_store_interval_seconds: float = 60.0
    """How often each vLLM KV store is told its live sessions (controllers/kvstores.py)."""
    kv_store_grace_seconds: float = 300.0
    """A session idle this long and not live for the operator loses its blocks."""
    max_concurrent_writes: int = 16
    session_writes: int = 16
    """Session writes in flight at once; the rest wait by urgency (:mod:`.turns`)."""
    status_coalesce_seconds: float = 5.0
    """A worker's counters (pinned sessions, KV usage…) are written at most this often."""
    counter_writes_per_second: float = 20.0
    """Writes of workers' counters alone, fleet-wide: with more workers than
    ``status_coalesce_seconds`` times this, each worker's counters wait longer."""
    checkpoint_timeout: timedelta = DEFAULT_CHECKPOINT_TIMEOUT
    """The longest a checkpoint runs; a Running one left by a restart fails after it."""
    checkpoint_key_secret: tuple[str, str] | None = None
    """(namespace, name) of the Secret whose key signs the operator's checkpoints; every
    replica reads the same one. None: a key of this process only."""
    ack_timeout: timedelta = DEFAULT_ACK_TIMEOUT
    """The longest a migration waits for router acknowledgements before moving anyway."""
    event_series_seconds: float = 30.0
    """The least time between two updates of one Event's count of repeats (its series)."""
    metrics_port: int = 8080
    health_port: int = 8081
    images: EngineImages = field(default_factory=EngineImages)
    engine_peers: tuple[dict[str, Any], ...] = ()
    """Who may reach a worker's engine port (NetworkPolicyPeer objects): the operator
    keeps a NetworkPolicy per worker that admits only them. Empty: no such policy."""
    stock_kopf_start: bool = False
    """Leave kopf's index readiness as kopf has it: quadratic in the watched objects
    (controllers/sessionfleet/controllers/kopfstart.py); for comparison, or if a kopf
    upgrade and the fix disagree."""
