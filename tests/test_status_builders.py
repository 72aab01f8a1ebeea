"""The status builders write what the hand-typed dicts they replace wrote, key for key.

Each expected dict is written out literally: camelCase keys, ``None`` for a field the
merge patch deletes, enum values as strings and times as ``iso()`` wrote them.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from sessionfleet.api import (
    CheckpointReason,
    ConditionStatus,
    ConditionType,
    InferenceWorker,
    InferenceWorkerStatus,
    Reason,
    SessionPhase,
    WorkerCheckpoint,
    WorkerPhase,
)
from sessionfleet.controllers.status import status_patch
from sessionfleet.policy.worker import ConditionPlan
from sessionfleet.resources.checkpoints import build_checkpoint
from sessionfleet.resources.status import (
    checkpoint_failed_status,
    checkpoint_outcome_conditions,
    checkpoint_refused_status,
    checkpoint_running_status,
    checkpoint_succeeded_status,
    condition,
    invalid_worker_status,
    merge_conditions,
    migration,
    policy_status,
    ready_condition,
    session_bound_status,
    session_migrating_status,
    session_pending_status,
    session_phase_status,
    session_rebound_status,
    wire_names,
    worker_status,
)

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
NOW_TEXT = "2026-11-29T12:00:00Z"
FINE = datetime(2026, 11, 29, 12, 0, 1, 250000, tzinfo=UTC)
FINE_TEXT = "2026-11-29T12:00:01.250000Z"


def iso(moment: datetime) -> str:
    """The form the controllers wrote times in before the builders (controllers/status.py)."""
    return moment.isoformat().replace("+00:00", "Z")


@pytest.mark.parametrize(
    "moment",
    [
        NOW,
        FINE,
        datetime(2026, 1, 2, 3, 4, 5, 1, tzinfo=UTC),
        datetime(2026, 1, 2, 3, 4, 5, 500000, tzinfo=UTC),
        datetime(2026, 1, 2, 3, 4, 5, 999999, tzinfo=UTC),
        datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone(timedelta(hours=2))),
        datetime(2026, 1, 2, 3, 4, 5, 120, tzinfo=timezone(timedelta(hours=-5, minutes=-30))),
    ],
)
def test_times_are_written_as_iso_wrote_them(moment: datetime) -> None:
    assert session_migrating_status("m", moment)["migratingSince"] == iso(moment)
    assert checkpoint_running_status(1, moment)["startedAt"] == iso(moment)
    plan = ConditionPlan(ConditionType.READY, ConditionStatus.TRUE, Reason.POD_READY, "")
    assert condition(plan, moment)["lastTransitionTime"] == iso(moment)
    assert iso(FINE) == FINE_TEXT


def _ready(status: str, reason: str, message: str, at: str = NOW_TEXT) -> dict[str, object]:
    return {
        "type": "Ready",
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": at,
    }


# --- conditions ---------------------------------------------------------------------


def test_merge_conditions_keeps_the_stored_transition_time_when_status_is_unchanged() -> None:
    old = [
        {
            "type": "Ready",
            "status": "True",
            "reason": "PodReady",
            "message": "",
            "lastTransitionTime": "2026-11-29T11:00:00.5Z",  # kept as stored, not re-parsed
        },
        {"type": "Valid", "status": "True", "reason": "Parsed", "message": "", "x": 1},
    ]
    planned = [
        ConditionPlan(ConditionType.READY, ConditionStatus.TRUE, Reason.POD_READY, "serving"),
        ConditionPlan(ConditionType.DRAINING, ConditionStatus.FALSE, Reason.DRAINED, ""),
    ]
    assert merge_conditions(old, planned, FINE, 4) == [
        {
            "type": "Ready",
            "status": "True",
            "reason": "PodReady",
            "message": "serving",
            "lastTransitionTime": "2026-11-29T11:00:00.5Z",
            "observedGeneration": 4,
        },
        {
            "type": "Draining",
            "status": "False",
            "reason": "Drained",
            "message": "",
            "lastTransitionTime": FINE_TEXT,
            "observedGeneration": 4,
        },
    ]
    flipped = ConditionPlan(ConditionType.READY, ConditionStatus.FALSE, Reason.POD_FAILED, "x")
    assert merge_conditions(old, [flipped], NOW) == [_ready("False", "PodFailed", "x")]


def test_ready_condition() -> None:
    assert ready_condition(True, Reason.BOUND, "on w-0", NOW) == _ready("True", "Bound", "on w-0")
    assert ready_condition(False, Reason.NO_CAPACITY, "full", FINE) == _ready(
        "False", "NoCapacity", "full", FINE_TEXT
    )


# --- InferenceWorker ----------------------------------------------------------------


def _worker_fields(**overrides: object) -> dict[str, object]:
    fields: dict[str, object] = {
        "observed_generation": 3,
        "phase": WorkerPhase.DRAINING,
        "epoch": 2,
        "pod": "w-0-2",
        "node": "n1",
        "endpoint": "http://10.0.0.5:8000",
        "pinned_sessions": 4,
        "active_sessions": 0,
        "kv_cache_usage_percent": 37,
        "prefix_hit_rate_percent": 91.3,
        "running_requests": 2,
        "waiting_requests": 0,
        "drain_started_at": FINE,
        "consecutive_failures": None,
        "last_recovery_at": NOW,
        "last_checkpoint": "w-0-periodic-1-20261129120000",
        "restore_count": 1,
        "conditions": [_ready("True", "PodReady", "")],
    }
    fields.update(overrides)
    return fields


def test_worker_status_is_the_whole_status_with_none_for_absent_fields() -> None:
    status = worker_status(**_worker_fields())  # type: ignore[arg-type]
    assert status == {
        "observedGeneration": 3,
        "phase": "Draining",
        "epoch": 2,
        "pod": "w-0-2",
        "node": "n1",
        "endpoint": "http://10.0.0.5:8000",
        "pinnedSessions": 4,
        "activeSessions": 0,
        "kvCacheUsagePercent": 37,
        "prefixHitRatePercent": 91.3,
        "runningRequests": 2,
        "waitingRequests": 0,
        "drainStartedAt": FINE_TEXT,
        "consecutiveFailures": None,
        "lastRecoveryAt": NOW_TEXT,
        "lastCheckpoint": "w-0-periodic-1-20261129120000",
        "restoreCount": 1,
        "conditions": [_ready("True", "PodReady", "")],
    }
    assert type(status["kvCacheUsagePercent"]) is int
    assert type(status["prefixHitRatePercent"]) is float
    assert type(status["activeSessions"]) is int
    # What the API server then stores and the watch shows: the next pass writes nothing.
    assert status_patch(status, worker_status(**_worker_fields())) == {}  # type: ignore[arg-type]


def test_worker_status_of_a_new_worker_deletes_what_it_does_not_know() -> None:
    status = worker_status(
        **_worker_fields(  # type: ignore[arg-type]
            phase=WorkerPhase.PENDING,
            epoch=1,
            node=None,
            endpoint=None,
            pinned_sessions=0,
            kv_cache_usage_percent=None,
            prefix_hit_rate_percent=None,
            running_requests=None,
            waiting_requests=None,
            drain_started_at=None,
            last_recovery_at=None,
            last_checkpoint=None,
            restore_count=None,
            conditions=[],
        )
    )
    assert status == {
        "observedGeneration": 3,
        "phase": "Pending",
        "epoch": 1,
        "pod": "w-0-2",
        "node": None,
        "endpoint": None,
        "pinnedSessions": 0,
        "activeSessions": 0,
        "kvCacheUsagePercent": None,
        "prefixHitRatePercent": None,
        "runningRequests": None,
        "waitingRequests": None,
        "drainStartedAt": None,
        "consecutiveFailures": None,
        "lastRecoveryAt": None,
        "lastCheckpoint": None,
        "restoreCount": None,
        "conditions": [],
    }
    assert status_patch({"node": "n1", "epoch": 1}, status)["node"] is None


def test_worker_status_refuses_what_the_api_server_would() -> None:
    with pytest.raises(ValueError):
        worker_status(**_worker_fields(kv_cache_usage_percent=101))  # type: ignore[arg-type]


def test_invalid_worker_status() -> None:
    invalid = ConditionPlan(ConditionType.VALID, ConditionStatus.FALSE, Reason.INVALID_SPEC, "gpus")
    assert invalid_worker_status(merge_conditions([], [invalid], NOW)) == {
        "phase": "Failed",
        "conditions": [
            {
                "type": "Valid",
                "status": "False",
                "reason": "InvalidSpec",
                "message": "gpus",
                "lastTransitionTime": NOW_TEXT,
            }
        ],
    }


def test_counter_fields_are_the_models_wire_names() -> None:
    names = wire_names(InferenceWorkerStatus, "pinned_sessions", "kv_cache_usage_percent")
    assert names == frozenset({"pinnedSessions", "kvCacheUsagePercent"})


# --- AgentSession -------------------------------------------------------------------


def test_session_bound_status() -> None:
    assert session_bound_status("w-0", "w-0-2", 2, 1, "least loaded", NOW) == {
        "phase": "Bound",
        "worker": "w-0",
        "pod": "w-0-2",
        "epoch": 2,
        "boundAt": NOW_TEXT,
        "observedGeneration": 1,
        "conditions": [_ready("True", "Bound", "least loaded")],
    }
    assert session_bound_status("w-0", None, None, 1, "m", FINE) == {
        "phase": "Bound",
        "worker": "w-0",
        "pod": None,
        "epoch": None,
        "boundAt": FINE_TEXT,
        "observedGeneration": 1,
        "conditions": [_ready("True", "Bound", "m", FINE_TEXT)],
    }


def test_session_pending_status() -> None:
    assert session_pending_status(2, Reason.NO_READY_WORKER, "none serve m", NOW) == {
        "phase": "Pending",
        "observedGeneration": 2,
        "conditions": [_ready("False", "NoReadyWorker", "none serve m")],
    }


def test_session_phase_status_finished_lost_restoring_and_bound_again() -> None:
    assert session_phase_status(SessionPhase.FINISHED, 3, Reason.FINISHED_BY_CLIENT, "", NOW) == {
        "phase": "Finished",
        "observedGeneration": 3,
        "conditions": [_ready("False", "FinishedByClient", "")],
        "finishedAt": NOW_TEXT,
    }
    assert session_phase_status(SessionPhase.LOST, 3, Reason.WORKER_DELETED, "gone", NOW) == {
        "phase": "Lost",
        "observedGeneration": 3,
        "conditions": [_ready("False", "WorkerDeleted", "gone")],
    }
    restoring = session_phase_status(
        SessionPhase.RESTORING, 3, Reason.WORKER_RECOVERING, "", NOW, binding=(2, "w-0-2")
    )
    assert restoring == {
        "phase": "Restoring",
        "observedGeneration": 3,
        "conditions": [_ready("False", "WorkerRecovering", "")],
    }
    assert session_phase_status(
        SessionPhase.BOUND, 3, Reason.BOUND, "back", NOW, binding=(3, "w-0-3")
    ) == {
        "phase": "Bound",
        "observedGeneration": 3,
        "conditions": [_ready("True", "Bound", "back")],
        "epoch": 3,
        "pod": "w-0-3",
    }
    assert session_phase_status(
        SessionPhase.BOUND, 3, Reason.BOUND, "", NOW, binding=(None, None)
    ) == {
        "phase": "Bound",
        "observedGeneration": 3,
        "conditions": [_ready("True", "Bound", "")],
        "epoch": None,
        "pod": None,
    }
    assert session_phase_status(SessionPhase.BOUND, 3, Reason.BOUND, "", NOW) == {
        "phase": "Bound",
        "observedGeneration": 3,
        "conditions": [_ready("True", "Bound", "")],
    }


def test_session_migrating_status() -> None:
    assert session_migrating_status("draining", FINE) == {
        "phase": "Migrating",
        "migratingSince": FINE_TEXT,
        "conditions": [_ready("False", "Migrating", "draining", FINE_TEXT)],
    }


def test_migration_entries() -> None:
    assert migration("w-0", "w-1", NOW, None) == {
        "from": "w-0",
        "to": "w-1",
        "reason": "Drain",
        "at": NOW_TEXT,
    }
    assert migration("w-0", "w-1", FINE, "w-0-drain-2-x") == {
        "from": "w-0",
        "to": "w-1",
        "reason": "Drain",
        "at": FINE_TEXT,
        "checkpoint": "w-0-drain-2-x",
        "recomputedTokens": 0,
    }


def test_session_rebound_status_clears_migrating_since_and_appends_the_move() -> None:
    earlier = {"from": "w-2", "to": "w-0", "reason": "Drain", "at": "2026-11-28T10:00:00Z"}
    move = migration("w-0", "w-1", NOW, None)
    status = session_rebound_status("w-1", "w-1-1", 1, [earlier, move], "migrated; why", NOW)
    assert status == {
        "phase": "Bound",
        "worker": "w-1",
        "pod": "w-1-1",
        "epoch": 1,
        "boundAt": NOW_TEXT,
        "migratingSince": None,
        "migrations": [
            {"from": "w-2", "to": "w-0", "reason": "Drain", "at": "2026-11-28T10:00:00Z"},
            {"from": "w-0", "to": "w-1", "reason": "Drain", "at": NOW_TEXT},
        ],
        "conditions": [_ready("True", "Bound", "migrated; why")],
    }


# --- WorkerCheckpoint ---------------------------------------------------------------


def _checkpointed(status: str, reason: str, message: str, at: str = NOW_TEXT) -> dict[str, object]:
    return {
        "type": "Checkpointed",
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": at,
    }


def test_checkpoint_outcome_conditions() -> None:
    assert checkpoint_outcome_conditions(Reason.CHECKPOINT_SUCCEEDED, "ok", NOW) == [
        _checkpointed("True", "CheckpointSucceeded", "ok")
    ]
    assert checkpoint_outcome_conditions(Reason.DRIVER_UNSUPPORTED, "no", NOW) == [
        _checkpointed("False", "DriverUnsupported", "no")
    ]


def test_checkpoint_failed_status() -> None:
    assert checkpoint_failed_status(Reason.CHECKPOINT_FAILED, "worker w-0 not found", NOW) == {
        "phase": "Failed",
        "error": "worker w-0 not found",
        "completedAt": NOW_TEXT,
        "conditions": [_checkpointed("False", "CheckpointFailed", "worker w-0 not found")],
    }


def test_checkpoint_refused_status() -> None:
    assert checkpoint_refused_status(Reason.RESERVED_CHECKPOINT_REASON, "operator only", NOW) == {
        "phase": "Failed",
        "error": "operator only",
        "completedAt": NOW_TEXT,
        "conditions": [
            {
                "type": "Valid",
                "status": "False",
                "reason": "ReservedCheckpointReason",
                "message": "operator only",
                "lastTransitionTime": NOW_TEXT,
            }
        ],
    }


def test_checkpoint_running_status() -> None:
    assert checkpoint_running_status(3, FINE) == {
        "phase": "Running",
        "startedAt": FINE_TEXT,
        "epoch": 3,
    }


def test_checkpoint_succeeded_status() -> None:
    status = checkpoint_succeeded_status(
        completed_at=FINE,
        seconds=1.23456789,
        size_bytes=4096,
        location="/var/lib/sessionfleet/checkpoints/ns/w-0/c",
        sessions={"s-b": 20, "s-a": 10},
        total_tokens=30,
    )
    assert status == {
        "phase": "Succeeded",
        "completedAt": FINE_TEXT,
        "durationSeconds": 1.234568,
        "sizeBytes": 4096,
        "location": "/var/lib/sessionfleet/checkpoints/ns/w-0/c",
        "sessions": [{"sessionId": "s-a", "tokens": 10}, {"sessionId": "s-b", "tokens": 20}],
        "totalTokens": 30,
        "conditions": [
            _checkpointed("True", "CheckpointSucceeded", "30 tokens of 2 session(s)", FINE_TEXT)
        ],
    }
    empty = checkpoint_succeeded_status(
        completed_at=NOW, seconds=0.5, size_bytes=0, location="/x", sessions={}, total_tokens=0
    )
    assert empty["sessions"] == []
    assert empty["sizeBytes"] == 0 and type(empty["sizeBytes"]) is int


def test_checkpoint_object() -> None:
    worker = InferenceWorker.model_validate(
        {
            "metadata": {"name": "w-0", "namespace": "ns", "uid": "u-1"},
            "spec": {"model": "m"},
        }
    )
    body = build_checkpoint(
        worker, "w-0-drain-2-x", "ns", "w-0", CheckpointReason.DRAIN, ("s-a", "s-b")
    )
    assert body == {
        "apiVersion": "sessionfleet.dev/v1alpha1",
        "kind": "WorkerCheckpoint",
        "metadata": {
            "name": "w-0-drain-2-x",
            "namespace": "ns",
            "labels": {"sessionfleet.dev/worker": "w-0"},
            "ownerReferences": [
                {
                    "apiVersion": "sessionfleet.dev/v1alpha1",
                    "kind": "InferenceWorker",
                    "name": "w-0",
                    "uid": "u-1",
                    "controller": False,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {"worker": "w-0", "reason": "Drain", "sessions": ["s-a", "s-b"]},
    }
    periodic = build_checkpoint(worker, "c", "ns", "w-0", CheckpointReason.PERIODIC)
    assert periodic["spec"] == {"worker": "w-0", "reason": "Periodic", "sessions": []}
    assert WorkerCheckpoint.model_validate(body).spec.sessions == ["s-a", "s-b"]


# --- DrainPolicy --------------------------------------------------------------------


def test_policy_status() -> None:
    conditions = [_ready("True", "Parsed", "")]
    assert policy_status(
        observed_generation=2,
        matched_workers=3,
        workers=("a", "b", "c"),
        active_drains=1,
        conditions=conditions,
    ) == {
        "observedGeneration": 2,
        "matchedWorkers": 3,
        "workers": ["a", "b", "c"],
        "activeDrains": 1,
        "conditions": conditions,
    }
    assert policy_status(
        observed_generation=2, matched_workers=0, workers=(), active_drains=0, conditions=[]
    ) == {
        "observedGeneration": 2,
        "matchedWorkers": 0,
        "workers": None,
        "activeDrains": 0,
        "conditions": [],
    }
