"""The operator's status patches, built from the API models: pure functions.

Every status the operator writes (InferenceWorker, AgentSession, WorkerCheckpoint,
DrainPolicy) and every condition is built here: the values are validated by the status
model and dumped with ``by_alias=True, mode="json", exclude_unset=True``, so the
camelCase keys come from the models' aliases and the shapes from their types.

Two rules keep the output what the status comparisons expect
(:func:`sessionfleet.controllers.status.status_patch`):

- A field given as ``None`` is written as ``None``: in a merge patch it deletes the
  field, and in a desired status it means "absent". A field not given is left out.
- Times are written as pydantic's JSON mode writes a ``datetime``, which is
  ``moment.isoformat()`` with ``+00:00`` written ``Z`` (microseconds kept when not
  zero), the form the operator has always written; ``tests/test_status_builders.py``
  holds that equality.

Lists built elsewhere from the models — conditions from :func:`condition`, migrations
from :func:`migration` and the ones a session already carries — go in as they are.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, Final

from pydantic import BaseModel

from sessionfleet.api import (
    AgentSessionStatus,
    CheckpointPhase,
    Condition,
    ConditionStatus,
    ConditionType,
    DrainPolicyStatus,
    InferenceWorkerStatus,
    Reason,
    SessionPhase,
    WorkerCheckpointStatus,
    WorkerPhase,
)
from sessionfleet.api.checkpoint import CapturedSession
from sessionfleet.api.session import Migration, MigrationReason
from sessionfleet.policy.worker import ConditionPlan

_BUILT: Final = frozenset({"conditions", "migrations"})
"""Fields whose value is a list of entries already in wire form."""


def wire(model: BaseModel) -> dict[str, Any]:
    """Return the fields set on ``model`` as the API server stores them."""
    return model.model_dump(by_alias=True, mode="json", exclude_unset=True)


def wire_names(model: type[BaseModel], *names: str) -> frozenset[str]:
    """Return the wire (camelCase) names of ``model``'s fields ``names``."""
    return frozenset(model.model_fields[name].alias or name for name in names)


def _status(model: type[BaseModel], fields: Mapping[str, Any]) -> dict[str, Any]:
    """Return ``fields`` (by Python name) as a status patch of ``model``, in their order.

    ``None`` stays ``None`` (delete the field); :data:`_BUILT` lists are taken as they are.
    """
    given = {k: v for k, v in fields.items() if v is not None and k not in _BUILT}
    dumped = wire(model.model_validate(given))
    out: dict[str, Any] = {}
    for name, value in fields.items():
        alias = model.model_fields[name].alias or name
        if value is None:
            out[alias] = None
        elif name in _BUILT:
            out[alias] = list(value)
        else:
            out[alias] = dumped[alias]
    return out


# --- conditions ---------------------------------------------------------------------


def condition(
    plan: ConditionPlan,
    now: datetime,
    generation: int | None = None,
    last_transition_time: str | None = None,
) -> dict[str, Any]:
    """Return one condition: ``type``, ``status``, ``reason``, ``message``, ``lastTransitionTime``.

    ``observedGeneration`` only with ``generation``. ``last_transition_time`` is a
    stored time to keep (the status did not change), written back as it was stored;
    without it the transition is ``now``.
    """
    fields: dict[str, Any] = {
        "type": plan.type,
        "status": plan.status,
        "reason": plan.reason.value,
        "message": plan.message,
        "last_transition_time": now,
    }
    if generation is not None:
        fields["observed_generation"] = generation
    entry = wire(Condition.model_validate(fields))
    if last_transition_time is not None:
        entry["lastTransitionTime"] = last_transition_time
    return entry


def merge_conditions(
    existing: Iterable[Mapping[str, Any]],
    planned: Iterable[ConditionPlan],
    now: datetime,
    generation: int | None = None,
) -> list[dict[str, Any]]:
    """Return the planned conditions, keeping lastTransitionTime where status is unchanged."""
    before = {c.get("type"): c for c in existing}
    out = []
    for plan in planned:
        old = before.get(plan.type.value, {})
        kept = old.get("lastTransitionTime") if old.get("status") == plan.status.value else None
        out.append(condition(plan, now, generation, kept))
    return out


def ready_condition(ready: bool, reason: Reason, message: str, now: datetime) -> dict[str, Any]:
    """Return a session's ``Ready`` condition, changed ``now``."""
    status = ConditionStatus.TRUE if ready else ConditionStatus.FALSE
    return condition(ConditionPlan(ConditionType.READY, status, reason, message), now)


# --- InferenceWorker ----------------------------------------------------------------


def worker_status(
    *,
    observed_generation: int | None,
    phase: WorkerPhase,
    epoch: int | None,
    pod: str | None,
    node: str | None,
    endpoint: str | None,
    pinned_sessions: int | None,
    active_sessions: int | None,
    kv_cache_usage_percent: int | None,
    prefix_hit_rate_percent: float | None,
    running_requests: int | None,
    waiting_requests: int | None,
    drain_started_at: datetime | None,
    consecutive_failures: int | None,
    last_recovery_at: datetime | None,
    last_checkpoint: str | None,
    restore_count: int | None,
    conditions: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    """Return a worker's whole status, every field present (``None``: absent)."""
    return _status(
        InferenceWorkerStatus,
        {
            "observed_generation": observed_generation,
            "phase": phase,
            "epoch": epoch,
            "pod": pod,
            "node": node,
            "endpoint": endpoint,
            "pinned_sessions": pinned_sessions,
            "active_sessions": active_sessions,
            "kv_cache_usage_percent": kv_cache_usage_percent,
            "prefix_hit_rate_percent": prefix_hit_rate_percent,
            "running_requests": running_requests,
            "waiting_requests": waiting_requests,
            "drain_started_at": drain_started_at,
            "consecutive_failures": consecutive_failures,
            "last_recovery_at": last_recovery_at,
            "last_checkpoint": last_checkpoint,
            "restore_count": restore_count,
            "conditions": conditions,
        },
    )


def invalid_worker_status(conditions: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Return the status of a worker whose spec does not parse: phase Failed and why."""
    return _status(InferenceWorkerStatus, {"phase": WorkerPhase.FAILED, "conditions": conditions})


# --- AgentSession -------------------------------------------------------------------


def session_phase_status(
    phase: SessionPhase,
    generation: int | None,
    reason: Reason,
    message: str,
    now: datetime,
    binding: tuple[int | None, str | None] | None = None,
) -> dict[str, Any]:
    """Return a session's move to ``phase`` (Bound again, Restoring, Finished, Lost, …).

    Ready is True only when Bound; Finished adds ``finishedAt``; a Bound session with
    ``binding`` (its worker's epoch and pod now) records them.
    """
    fields: dict[str, Any] = {
        "phase": phase,
        "observed_generation": generation,
        "conditions": [ready_condition(phase is SessionPhase.BOUND, reason, message, now)],
    }
    if phase is SessionPhase.FINISHED:
        fields["finished_at"] = now
    if phase is SessionPhase.BOUND and binding is not None:
        fields["epoch"], fields["pod"] = binding
    return _status(AgentSessionStatus, fields)


def session_pending_status(
    generation: int | None, reason: Reason, message: str, now: datetime
) -> dict[str, Any]:
    """Return the status of a session that cannot be placed yet, with why."""
    return _status(
        AgentSessionStatus,
        {
            "phase": SessionPhase.PENDING,
            "observed_generation": generation,
            "conditions": [ready_condition(False, reason, message, now)],
        },
    )


def session_bound_status(
    worker: str,
    pod: str | None,
    epoch: int | None,
    generation: int | None,
    message: str,
    now: datetime,
) -> dict[str, Any]:
    """Return the status binding a session to ``worker`` (its pod and epoch now)."""
    return _status(
        AgentSessionStatus,
        {
            "phase": SessionPhase.BOUND,
            "worker": worker,
            "pod": pod,
            "epoch": epoch,
            "bound_at": now,
            "observed_generation": generation,
            "conditions": [ready_condition(True, Reason.BOUND, message, now)],
        },
    )


def session_migrating_status(message: str, now: datetime) -> dict[str, Any]:
    """Return the status that starts a session's turn-boundary handshake."""
    return _status(
        AgentSessionStatus,
        {
            "phase": SessionPhase.MIGRATING,
            "migrating_since": now,
            "conditions": [ready_condition(False, Reason.MIGRATING, message, now)],
        },
    )


def migration(source: str, target: str, now: datetime, checkpoint: str | None) -> dict[str, Any]:
    """Return one drain move; through a checkpoint, nothing is recomputed."""
    fields: dict[str, Any] = {
        "from_worker": source,
        "to_worker": target,
        "reason": MigrationReason.DRAIN,
        "at": now,
    }
    if checkpoint is not None:
        fields["checkpoint"] = checkpoint
        fields["recomputed_tokens"] = 0
    return wire(Migration.model_validate(fields))


def session_rebound_status(
    worker: str,
    pod: str | None,
    epoch: int | None,
    migrations: Sequence[Mapping[str, Any]],
    message: str,
    now: datetime,
) -> dict[str, Any]:
    """Return the status rebinding a migrated session: Bound to ``worker``, no longer migrating.

    ``migrations``: the whole list, the session's earlier moves and this one (from
    :func:`migration`).
    """
    return _status(
        AgentSessionStatus,
        {
            "phase": SessionPhase.BOUND,
            "worker": worker,
            "pod": pod,
            "epoch": epoch,
            "bound_at": now,
            "migrating_since": None,
            "migrations": migrations,
            "conditions": [ready_condition(True, Reason.BOUND, message, now)],
        },
    )


# --- WorkerCheckpoint ---------------------------------------------------------------


def checkpoint_outcome_conditions(
    reason: Reason, message: str, now: datetime
) -> list[dict[str, Any]]:
    """Return the checkpoint's ``Checkpointed`` condition for how it ended.

    True with ``CheckpointSucceeded``; False with ``DriverUnsupported`` when the driver
    cannot work here at all (nothing was attempted), else ``CheckpointFailed``.
    """
    status = (
        ConditionStatus.TRUE if reason is Reason.CHECKPOINT_SUCCEEDED else ConditionStatus.FALSE
    )
    return [condition(ConditionPlan(ConditionType.CHECKPOINTED, status, reason, message), now)]


def checkpoint_failed_status(reason: Reason, error: str, now: datetime) -> dict[str, Any]:
    """Return the status of a checkpoint that was not written: Failed, with why."""
    return _status(
        WorkerCheckpointStatus,
        {
            "phase": CheckpointPhase.FAILED,
            "error": error,
            "completed_at": now,
            "conditions": checkpoint_outcome_conditions(reason, error, now),
        },
    )


def checkpoint_refused_status(reason: Reason, problem: str, now: datetime) -> dict[str, Any]:
    """Return the status of a checkpoint the operator will not run: Failed, ``Valid=False``."""
    valid = ConditionPlan(ConditionType.VALID, ConditionStatus.FALSE, reason, problem)
    return _status(
        WorkerCheckpointStatus,
        {
            "phase": CheckpointPhase.FAILED,
            "error": problem,
            "completed_at": now,
            "conditions": [condition(valid, now)],
        },
    )


def checkpoint_running_status(epoch: int, now: datetime) -> dict[str, Any]:
    """Return the status of a checkpoint its driver starts writing from ``epoch``."""
    return _status(
        WorkerCheckpointStatus,
        {"phase": CheckpointPhase.RUNNING, "started_at": now, "epoch": epoch},
    )


def checkpoint_succeeded_status(
    *,
    completed_at: datetime,
    seconds: float,
    size_bytes: int,
    location: str,
    sessions: Mapping[str, int],
    total_tokens: int,
) -> dict[str, Any]:
    """Return the status of a written checkpoint: timings, size, where, what it captured."""
    captured = [
        CapturedSession(session_id=sid, tokens=tokens) for sid, tokens in sorted(sessions.items())
    ]
    return _status(
        WorkerCheckpointStatus,
        {
            "phase": CheckpointPhase.SUCCEEDED,
            "completed_at": completed_at,
            "duration_seconds": round(seconds, 6),
            "size_bytes": size_bytes,
            "location": location,
            "sessions": captured,
            "total_tokens": total_tokens,
            "conditions": checkpoint_outcome_conditions(
                Reason.CHECKPOINT_SUCCEEDED,
                f"{total_tokens} tokens of {len(sessions)} session(s)",
                completed_at,
            ),
        },
    )


# --- DrainPolicy --------------------------------------------------------------------


def policy_status(
    *,
    observed_generation: int | None,
    matched_workers: int,
    workers: Sequence[str],
    active_drains: int,
    conditions: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    """Return a DrainPolicy's whole status; an empty ``workers`` list is absent."""
    return _status(
        DrainPolicyStatus,
        {
            "observed_generation": observed_generation,
            "matched_workers": matched_workers,
            "workers": list(workers) or None,
            "active_drains": active_drains,
            "conditions": conditions,
        },
    )
