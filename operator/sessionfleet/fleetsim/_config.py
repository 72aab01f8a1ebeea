"""What a simulation runs on: the fleet, its cost model, the operator's settings, disruptions."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sessionfleet.api import CheckpointDriver, DrainPolicySpec
from sessionfleet.policy.drain import DEFAULT_POLICY
from sessionfleet.policy.handshake import DEFAULT_ACK_TIMEOUT
from sessionfleet.policy.recovery import DEFAULT_NODE_NOT_READY_TOLERATION


@dataclass(frozen=True, slots=True)
class CostModel:
    """How long the engine takes: prefill per uncached token, decode per output token.

    A worker runs one prefill at a time, first come first served, so a turn's time to
    first token is its wait behind earlier prefills plus its own prefill. Decoding is
    batched in the engine and modelled as a fixed time per output token that does not
    block other turns' prefills.
    """

    prefill_seconds_per_token: float = 10e-6
    """100K tokens/s: a multi-GPU worker of a large model (assumed, not a published figure)."""
    prefill_overhead_seconds: float = 0.02
    decode_seconds_per_token: float = 0.025
    kv_bytes_per_token: int = 38_000
    """3.8 GB per 100K tokens (Kimi-2.5, FP8; docs/background.md): sizes checkpoints, transfers."""
    checkpoint_bytes_per_second: float = 5e9
    """Bandwidth of saving or loading KV to shared storage."""
    checkpoint_overhead_seconds: float = 0.5

    def transfer_seconds(self, tokens: int) -> float:
        """Time to save or load ``tokens`` of KV through a checkpoint."""
        return (
            self.checkpoint_overhead_seconds
            + tokens * self.kv_bytes_per_token / self.checkpoint_bytes_per_second
        )


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """The workers: how many, how much KV they hold, and what the operator knows of them."""

    workers: int = 16
    kv_tokens: int = 4_000_000
    """KV cache capacity of one worker, in tokens: about 150 GB at 38 KB per token, what
    an 8-GPU node has left beside a large model's weights."""
    block_size: int = 16
    """Tokens per KV block (vLLM's default); only whole blocks are cached."""
    max_sessions: int = 64
    """InferenceWorker spec.capacity.maxSessions: the operator's placement limit."""
    capacity_kv_tokens: int = 0
    """InferenceWorker spec.capacity.kvTokens: 0 (the API default) means unknown."""
    model: str = "agent-model"
    cost: CostModel = field(default_factory=CostModel)
    restart_seconds: float = 120.0
    """A new pod to Ready: scheduling, image, loading the model's weights."""
    termination_grace_seconds: float = 30.0
    """Without a drain hold, how long an evicted pod may finish its turns in flight
    (Kubernetes' default terminationGracePeriodSeconds)."""
    retry_seconds: float = 1.0
    """How soon a turn that found no worker is first tried again; the wait doubles with
    each further try (clients retry with exponential backoff) up to ``retry_max_seconds``."""
    retry_max_seconds: float = 16.0
    load_gate_seconds: float = 2.0
    """affinity-gated: the prefill backlog beyond which a bound worker is reconsidered."""
    admission_cap: int = 0
    """Gateway flow control in front of every strategy: at most this many sessions live in
    the fleet at once; a new session waits, first come first served, for one to end.
    0: no cap (each strategy admits as it routes)."""
    client_timeout_seconds: float = 0.0
    """A client gives up on a turn whose first token has not come this long after it was
    sent (admission wait included); its session counts as failed. 0: clients wait forever."""
    ttft_target_seconds: float = 5.0
    """The time to first token a turn must meet to count as goodput."""
    warmup_seconds: float = 0.0
    """Turns sent before this are served but not measured (a steady-state run)."""
    measure_until_seconds: float = math.inf
    """Turns sent after this are served but not measured (the fleet drains once arrivals
    stop, which is not a steady state either)."""
    session_ttl_seconds: float = 300.0
    """llm-d: how long after its last answer a session's binding still counts."""
    saturation_seconds: float = 5.0
    """llm-d: a worker whose prefill backlog passes this is saturated; when every worker
    is, the request waits at the gateway instead of being placed."""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError("a fleet needs at least one worker")
        if self.kv_tokens < self.block_size:
            raise ValueError("kv_tokens must hold at least one block")
        if self.admission_cap < 0 or self.client_timeout_seconds < 0:
            raise ValueError("admission_cap and client_timeout_seconds must not be negative")
        if self.measure_until_seconds <= self.warmup_seconds:
            raise ValueError("measure_until_seconds must come after warmup_seconds")

    def worker_name(self, index: int) -> str:
        """Return the name of worker ``index``."""
        return f"worker-{index:02d}"


@dataclass(frozen=True, slots=True)
class OperatorSettings:
    """The operator's configuration that the ``operator`` strategy runs with."""

    drain_policy: DrainPolicySpec = field(default_factory=lambda: DEFAULT_POLICY)
    checkpoint_driver: CheckpointDriver = CheckpointDriver.ENGINE
    checkpoint_interval: float | None = None
    """Seconds between periodic checkpoints of every worker (spec.checkpoint.interval)."""
    node_not_ready_toleration: float = DEFAULT_NODE_NOT_READY_TOLERATION.total_seconds()
    ack_timeout: float = DEFAULT_ACK_TIMEOUT.total_seconds()
    """Seconds a Migrating session waits for the routers' acknowledgement before it moves
    anyway (the operator's ``--ack-timeout``)."""
    resync_seconds: float = 2.0
    """How often the operator looks again at a worker whose plan waits on the clock or on
    room elsewhere (its fleet loop's resync period)."""

    @property
    def can_checkpoint(self) -> bool:
        """Whether the workers have a checkpoint driver at all."""
        return self.checkpoint_driver is not CheckpointDriver.NONE

    @property
    def migrate_with_checkpoint(self) -> bool:
        """Whether drained sessions carry their KV to the new worker."""
        return self.can_checkpoint and self.drain_policy.checkpoint

    def label(self) -> str:
        """Return a short description for tables: drain mode and checkpoints."""
        parts = [self.drain_policy.mode.value]
        parts.append("ckpt" if self.migrate_with_checkpoint else "no-ckpt")
        if self.can_checkpoint and self.checkpoint_interval:
            parts.append(f"every {self.checkpoint_interval:g}s")
        return " ".join(parts)


@dataclass(frozen=True, slots=True)
class Drain:
    """A drain of one worker (a node upgrade, a scale-down, spec.drain) at ``at`` seconds."""

    at: float
    worker: int


@dataclass(frozen=True, slots=True)
class Failure:
    """The loss of one worker's pod at ``at`` seconds.

    ``node`` makes it a node going NotReady, which the operator notices only after
    the toleration; a pod failure is seen at once.
    """

    at: float
    worker: int
    node: bool = False


Disruption = Drain | Failure
