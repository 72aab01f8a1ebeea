"""The worker plan: first pod, recovery by epochs, drains, holds and phases."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from sessionfleet.api import (
    ConditionType,
    DrainPolicySpec,
    HoldMechanism,
    InferenceWorkerSpec,
    InferenceWorkerStatus,
    Reason,
    WorkerPhase,
)
from sessionfleet.policy.drain import DEFAULT_POLICY, PinnedSession, PolicyChoice
from sessionfleet.policy.observed import NodeState, PodState
from sessionfleet.policy.recovery import RecoveryBlock
from sessionfleet.policy.worker import WorkerObservation, WorkerPlan, plan_worker

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
DEFAULT_CHOICE = PolicyChoice(None, DEFAULT_POLICY)
SPEC = InferenceWorkerSpec.model_validate({"model": "m", "engine": {"type": "sim"}, "gpus": 1})


def ready_pod(epoch: int = 1, **kw: object) -> PodState:
    base = PodState(
        f"w-{epoch}", epoch, "Running", scheduled=True, ready=True, node="n1", pod_ip="127.1.0.4"
    )
    return replace(base, **kw)  # type: ignore[arg-type]


def observe(
    status: dict[str, object] | None = None,
    pods: list[PodState] | None = None,
    node: NodeState | None = None,
    pinned: int = 0,
    spec: InferenceWorkerSpec = SPEC,
    policy: PolicyChoice = DEFAULT_CHOICE,
    now: datetime = NOW,
    recovery_block: RecoveryBlock | None = None,
) -> WorkerPlan:
    return plan_worker(
        WorkerObservation(
            name="w",
            spec=spec,
            status=InferenceWorkerStatus.model_validate(status or {}),
            pods=pods or [],
            node=node,
            pinned=[PinnedSession(f"s{i}") for i in range(pinned)],
            policy=policy,
            now=now,
            recovery_block=recovery_block,
        )
    )


def condition(plan: WorkerPlan, kind: ConditionType) -> tuple[str, Reason]:
    found = next(c for c in plan.conditions if c.type is kind)
    return found.status.value, found.reason


def test_a_new_worker_gets_its_first_pod() -> None:
    plan = observe()
    assert (plan.epoch, plan.create_pod, plan.phase) == (1, True, WorkerPhase.PENDING)


def test_a_created_pod_not_yet_seen_is_created_again_idempotently() -> None:
    plan = observe({"epoch": 1, "phase": "Pending"})
    assert (plan.epoch, plan.create_pod, plan.recovery) == (1, True, None)


def test_a_ready_pod_makes_a_ready_worker_with_an_endpoint() -> None:
    plan = observe({"epoch": 1, "pod": "w-1"}, [ready_pod()], NodeState("n1"))
    assert plan.phase is WorkerPhase.READY and not plan.create_pod
    assert plan.endpoint == "http://127.1.0.4:8000" and plan.node == "n1"
    assert condition(plan, ConditionType.READY) == ("True", Reason.POD_READY)


def test_a_deleted_pod_is_replaced_by_a_new_epoch() -> None:
    plan = observe({"epoch": 1, "pod": "w-1", "phase": "Ready"}, [])
    assert (plan.epoch, plan.create_pod, plan.recovery) == (2, True, Reason.POD_DELETED)
    assert plan.phase is WorkerPhase.RECOVERING


def test_a_failed_pod_is_replaced_and_deleted() -> None:
    failed = ready_pod(phase="Failed", ready=False, terminated=True, message="exit 1")
    plan = observe({"epoch": 1, "pod": "w-1", "phase": "Ready"}, [failed])
    assert (plan.epoch, plan.recovery, plan.delete_pods) == (2, Reason.POD_FAILED, ("w-1",))
    assert "exit 1" in next(
        c.message for c in plan.conditions if c.type is ConditionType.RECOVERING
    )


def test_a_pod_stuck_terminating_does_not_block_the_new_epoch() -> None:
    stuck = ready_pod(deleting=True)
    plan = observe({"epoch": 1, "pod": "w-1", "phase": "Ready"}, [stuck])
    assert (plan.epoch, plan.create_pod, plan.delete_pods) == (2, True, ())


def test_a_node_not_ready_beyond_toleration_moves_the_worker() -> None:
    node = NodeState("n1", ready=False, not_ready_since=NOW - timedelta(minutes=5))
    plan = observe({"epoch": 1, "pod": "w-1", "phase": "Ready"}, [ready_pod()], node)
    assert (plan.epoch, plan.recovery) == (2, Reason.NODE_NOT_READY)


@pytest.mark.parametrize("reason", [Reason.RECOVERY_CAPPED, Reason.DISRUPTION_THRESHOLD])
def test_a_blocked_node_recovery_keeps_the_worker_and_says_why(reason: Reason) -> None:
    node = NodeState("n1", ready=False, not_ready_since=NOW - timedelta(minutes=5))
    block = RecoveryBlock(reason, "3 of 4 nodes are NotReady")
    plan = observe(
        {"epoch": 1, "pod": "w-1", "phase": "Ready"}, [ready_pod()], node, recovery_block=block
    )
    assert (plan.epoch, plan.recovery, plan.create_pod, plan.delete_pods) == (1, None, False, ())
    assert condition(plan, ConditionType.RECOVERING) == ("False", reason)
    assert [c.type for c in plan.conditions].count(ConditionType.RECOVERING) == 1
    # A failed pod is replaced whatever the gate says: the block is for NotReady nodes.
    failed = ready_pod(phase="Failed")
    plan = observe({"epoch": 1, "pod": "w-1"}, [failed], node, recovery_block=block)
    assert plan.recovery is Reason.POD_FAILED and plan.epoch == 2


def test_recovering_lasts_until_the_new_pod_is_ready() -> None:
    starting = ready_pod(2, ready=False)
    plan = observe({"epoch": 2, "pod": "w-2", "phase": "Recovering"}, [starting])
    assert plan.phase is WorkerPhase.RECOVERING and plan.recovery is None
    plan = observe({"epoch": 2, "pod": "w-2", "phase": "Recovering"}, [ready_pod(2)])
    assert plan.phase is WorkerPhase.READY


@pytest.mark.parametrize(
    "cause", [Reason.NODE_NOT_READY, Reason.POD_FAILED, Reason.POD_DELETED, Reason.NEW_EPOCH]
)
def test_the_cause_of_a_recovery_stays_its_reason_until_the_new_pod_is_ready(
    cause: Reason,
) -> None:
    """The cap on moves off NotReady nodes counts NodeNotReady recoveries until Ready."""
    recovering = {
        "epoch": 2,
        "pod": "w-2",
        "phase": "Recovering",
        "conditions": [
            {
                "type": "Recovering",
                "status": "True",
                "reason": cause.value,
                "message": "pod w-1 lost",
                "lastTransitionTime": "2026-11-29T11:59:00Z",
            }
        ],
    }
    plan = observe(recovering, [ready_pod(2, ready=False)])
    assert condition(plan, ConditionType.RECOVERING) == ("True", cause)
    plan = observe(recovering, [ready_pod(2)])
    assert condition(plan, ConditionType.RECOVERING) == ("False", Reason.POD_READY)


def test_a_stale_status_never_deletes_a_newer_pod() -> None:
    # The status still says epoch 1 but epoch 2's pod exists: our own write is in flight.
    plan = observe({"epoch": 1, "pod": "w-1", "phase": "Ready"}, [ready_pod(2)])
    assert plan.epoch == 2 and "w-2" not in plan.delete_pods and plan.recovery is None


def test_old_epochs_are_cleaned_up() -> None:
    plan = observe({"epoch": 2, "pod": "w-2"}, [ready_pod(1), ready_pod(2)])
    assert plan.delete_pods == ("w-1",)


def test_pinned_sessions_are_held_even_without_a_drain() -> None:
    plan = observe({"epoch": 1, "pod": "w-1"}, [ready_pod()], NodeState("n1"), pinned=2)
    assert plan.holds == frozenset(HoldMechanism) and plan.phase is WorkerPhase.READY
    assert condition(plan, ConditionType.DRAIN_HELD) == ("True", Reason.SESSIONS_PINNED)
    assert observe({"epoch": 1, "pod": "w-1"}, [ready_pod()], NodeState("n1")).holds == frozenset()


def test_a_cordoned_node_drains_its_workers_and_holds() -> None:
    node = NodeState("n1", unschedulable=True)
    plan = observe({"epoch": 1, "pod": "w-1"}, [ready_pod()], node, pinned=1)
    assert plan.phase is WorkerPhase.DRAINING and plan.drain_started_at == NOW
    assert plan.holds and not plan.migrate  # WaitThenMigrate: still in its grace period
    assert condition(plan, ConditionType.DRAINING)[0] == "True"


def test_a_drain_resumes_from_the_recorded_start() -> None:
    node = NodeState("n1", unschedulable=True)
    started = NOW - timedelta(minutes=3)
    plan = observe(
        {"epoch": 1, "pod": "w-1", "drainStartedAt": started.isoformat()},
        [ready_pod()],
        node,
        pinned=2,
    )
    assert plan.drain_started_at == started and plan.migrate == ("s0", "s1")


def test_a_drain_with_nothing_pinned_is_done_and_releases() -> None:
    node = NodeState("n1", unschedulable=True)
    plan = observe({"epoch": 1, "pod": "w-1"}, [ready_pod()], node)
    assert plan.phase is WorkerPhase.DRAINED and plan.drain_done and plan.holds == frozenset()
    assert plan.delete_pods == ()  # the node's drain evicts it, not us


def test_drain_true_deletes_the_pod_when_done_and_stays_drained() -> None:
    spec = SPEC.model_copy(update={"drain": True})
    plan = observe({"epoch": 1, "pod": "w-1"}, [ready_pod()], NodeState("n1"), spec=spec)
    assert plan.phase is WorkerPhase.DRAINED and plan.delete_pods == ("w-1",)
    plan = observe({"epoch": 1, "pod": "w-1", "phase": "Drained"}, [], spec=spec)
    assert plan.phase is WorkerPhase.DRAINED and not plan.create_pod and plan.recovery is None


def test_undrained_worker_starts_a_fresh_epoch() -> None:
    plan = observe({"epoch": 1, "pod": "w-1", "phase": "Drained"}, [])
    assert (plan.epoch, plan.create_pod) == (2, True)


def test_policy_conflicts_show_as_a_condition() -> None:
    choice = PolicyChoice(None, DEFAULT_POLICY, Reason.POLICY_CONFLICT, "a, b select it")
    plan = observe({"epoch": 1, "pod": "w-1"}, [ready_pod()], policy=choice)
    assert condition(plan, ConditionType.CONFLICT) == ("True", Reason.POLICY_CONFLICT)


def test_a_pod_failing_again_before_ready_backs_off() -> None:
    failed = ready_pod(2, phase="Failed", ready=False, terminated=True)
    status = {
        "epoch": 2,
        "pod": "w-2",
        "phase": "Recovering",
        "consecutiveFailures": 2,
        "lastRecoveryAt": (NOW - timedelta(seconds=5)).isoformat(),
    }
    plan = observe(status, [failed])
    assert (plan.epoch, plan.create_pod, plan.phase) == (2, False, WorkerPhase.RECOVERING)
    assert condition(plan, ConditionType.RECOVERING) == ("True", Reason.RECOVERY_BACK_OFF)
    assert plan.recheck_after == pytest.approx(15)  # 20 s for the second failure, 5 s gone
    later = observe(
        {**status, "lastRecoveryAt": (NOW - timedelta(seconds=21)).isoformat()}, [failed]
    )
    assert (later.epoch, later.create_pod, later.consecutive_failures) == (3, True, 3)
    assert later.last_recovery_at == NOW


def test_a_ready_pod_resets_the_failure_count() -> None:
    plan = observe({"epoch": 3, "pod": "w-3", "consecutiveFailures": 2}, [ready_pod(3)])
    assert plan.phase is WorkerPhase.READY and plan.consecutive_failures == 0


def test_the_first_recovery_is_immediate() -> None:
    plan = observe({"epoch": 1, "pod": "w-1", "phase": "Ready"}, [])
    assert (plan.epoch, plan.consecutive_failures) == (2, 1)


def test_migration_scope_worker_moves_the_worker_instead_of_its_sessions() -> None:
    spec = DrainPolicySpec.model_validate({"mode": "Migrate", "migrationScope": "Worker"})
    node = NodeState("n1", unschedulable=True)
    plan = observe(
        {"epoch": 1, "pod": "w-1"}, [ready_pod()], node, pinned=2, policy=PolicyChoice("p", spec)
    )
    assert plan.move_worker and plan.migrate == () and plan.holds
    per_session = DrainPolicySpec.model_validate({"mode": "Migrate"})
    plan = observe(
        {"epoch": 1, "pod": "w-1"},
        [ready_pod()],
        node,
        pinned=2,
        policy=PolicyChoice("p", per_session),
    )
    assert not plan.move_worker and plan.migrate == ("s0", "s1")
