"""Index values: what the operator keeps in memory of each watched object.

Index keys, not bodies: each record holds only what decisions read, so thousands of
sessions cost little memory. Every record is built by parsing the body with the API
models; an object that does not parse keeps its reason for a condition.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sessionfleet.api import (
    AgentSession,
    AgentSessionStatus,
    ConditionStatus,
    ConditionType,
    DrainPolicySpec,
    InferenceWorker,
    InferenceWorkerStatus,
    SessionPhase,
    parse,
)
from sessionfleet.api.checkpoint import WorkerCheckpoint
from sessionfleet.api.drainpolicy import DrainPolicy
from sessionfleet.api.labels import PROVENANCE_ANNOTATION
from sessionfleet.policy.checkpoint import CheckpointState
from sessionfleet.policy.handshake import RouterLease, acks_of
from sessionfleet.policy.sessions import SessionState
from sessionfleet.resources.leases import lease_state

Key = tuple[str, str]


def resource_version(body: Mapping[str, Any]) -> int:
    """Return the resourceVersion as a number, to tell whether a read predates a write.

    The API server documents resourceVersions as opaque, but the etcd-backed server
    hands out increasing integers; anything else compares as 0 (never newer).
    """
    try:
        return int((body.get("metadata") or {}).get("resourceVersion", "0"))
    except ValueError:
        return 0


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """One InferenceWorker as the operator sees it."""

    namespace: str
    name: str
    resource_version: int
    worker: InferenceWorker | None
    invalid: str | None = None
    raw_status: Mapping[str, Any] = field(default_factory=dict)
    uid: str = ""

    @property
    def key(self) -> Key:
        """The worker's (namespace, name)."""
        return (self.namespace, self.name)

    @property
    def status(self) -> InferenceWorkerStatus:
        """The parsed status (empty when the object is invalid)."""
        return self.worker.status if self.worker is not None else InferenceWorkerStatus()


def worker_record(body: Mapping[str, Any]) -> WorkerRecord:
    """Parse an InferenceWorker body into a record."""
    meta = body.get("metadata") or {}
    parsed = parse(InferenceWorker, body)
    return WorkerRecord(
        namespace=str(meta.get("namespace", "")),
        name=str(meta.get("name", "")),
        resource_version=resource_version(body),
        worker=parsed.obj,
        invalid=None if parsed.ok else parsed.message,
        raw_status=dict(body.get("status") or {}),
        uid=str(meta.get("uid", "")),
    )


def session_record(body: Mapping[str, Any]) -> SessionState:
    """Parse an AgentSession body into the state the session decision reads."""
    meta = body.get("metadata") or {}
    namespace, name = str(meta.get("namespace", "")), str(meta.get("name", ""))
    parsed = parse(AgentSession, body)
    if parsed.obj is None:
        spec = body.get("spec") or {}
        return SessionState(
            namespace,
            name,
            str(spec.get("sessionId", "")),
            str(spec.get("model", "")),
            invalid=parsed.message,
            resource_version=resource_version(body),
            uid=str(meta.get("uid", "")),
        )
    session = parsed.obj
    spec, status = session.spec, session.status
    return SessionState(
        namespace=namespace,
        name=name,
        session_id=spec.session_id,
        model=spec.model,
        generation=session.metadata.generation,
        created_at=_created(meta),
        parent_session_id=spec.parent_session_id,
        hint=spec.worker_hint,
        pin=spec.worker_pin,
        finished=spec.finished,
        ttl_seconds=spec.ttl_seconds_after_finished,
        phase=status.phase,
        worker=status.worker,
        epoch=status.epoch,
        observed_generation=status.observed_generation,
        bound_at=status.bound_at,
        last_activity=status.last_activity,
        finished_at=status.finished_at,
        lost_since=_lost_since(status),
        prompt_tokens=status.prompt_tokens or 0,
        turns=status.turns or 0,
        recomputed_tokens=status.recomputed_tokens or 0,
        migrations=tuple(m.wire() for m in status.migrations),
        migrating_since=status.migrating_since,
        acks=tuple(sorted(acks_of(session.metadata.annotations).items())),
        resource_version=resource_version(body),
        uid=str(meta.get("uid", "")),
    )


def _lost_since(status: AgentSessionStatus) -> datetime | None:
    """Return when a Lost session became Lost: the operator wrote its Ready condition then."""
    if status.phase is not SessionPhase.LOST:
        return None
    ready = [c for c in status.conditions if c.type is ConditionType.READY]
    return ready[0].last_transition_time if ready else None


def _created(meta: Mapping[str, Any]) -> datetime | None:
    stamp = meta.get("creationTimestamp")
    return datetime.fromisoformat(str(stamp).replace("Z", "+00:00")) if stamp else None


@dataclass(frozen=True, slots=True)
class PolicyRecord:
    """One DrainPolicy: its spec, or why it could not be parsed, and its status as seen."""

    name: str
    spec: DrainPolicySpec | None
    invalid: str | None = None
    namespace: str = ""
    generation: int | None = None
    resource_version: int = 0
    raw_status: Mapping[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> Key:
        """The policy's (namespace, name)."""
        return (self.namespace, self.name)


def policy_record(body: Mapping[str, Any]) -> PolicyRecord:
    """Parse a DrainPolicy body into a record; an invalid one keeps its parse problem."""
    parsed = parse(DrainPolicy, body)
    meta = body.get("metadata") or {}
    generation = meta.get("generation")
    return PolicyRecord(
        name=str(meta.get("name", "")),
        spec=parsed.obj.spec if parsed.obj is not None else None,
        invalid=None if parsed.ok else parsed.message,
        namespace=str(meta.get("namespace", "")),
        generation=generation if isinstance(generation, int) else None,
        resource_version=resource_version(body),
        raw_status=dict(body.get("status") or {}),
    )


def checkpoint_record(body: Mapping[str, Any]) -> CheckpointState | None:
    """Parse a WorkerCheckpoint body; ``None`` when it does not parse (the API rejects those)."""
    parsed = parse(WorkerCheckpoint, body)
    if parsed.obj is None:
        return None
    checkpoint = parsed.obj
    spec, status = checkpoint.spec, checkpoint.status
    meta = body.get("metadata") or {}
    return CheckpointState(
        namespace=str(meta.get("namespace", "")),
        name=str(meta.get("name", "")),
        worker=spec.worker,
        reason=spec.reason,
        phase=status.phase,
        created_at=_created(meta),
        started_at=status.started_at,
        completed_at=status.completed_at,
        location=status.location,
        epoch=status.epoch,
        sessions=tuple(spec.sessions),
        captured_tokens=status.total_tokens or 0,
        driver=spec.driver,
        destination=spec.destination,
        resource_version=resource_version(body),
        uid=str(meta.get("uid", "")),
        provenance=(meta.get("annotations") or {}).get(PROVENANCE_ANNOTATION),
        refused=any(
            c.type is ConditionType.VALID and c.status is ConditionStatus.FALSE
            for c in status.conditions
        ),
    )


def lease_record(body: Mapping[str, Any]) -> RouterLease:
    """Reduce a router replica's coordination.k8s.io Lease to what the handshake needs."""
    return lease_state(body)
