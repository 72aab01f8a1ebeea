"""Recovery triggers and the phase a pod implies."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from sessionfleet.api import Reason, WorkerPhase
from sessionfleet.policy.observed import NodeState, PodState, node_state, pod_state
from sessionfleet.policy.recovery import (
    node_recovery_gate,
    pod_phase,
    recovery_backoff,
    recovery_reason,
)

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
RUNNING = PodState("w-1", 1, "Running", scheduled=True, ready=True, node="n1", pod_ip="127.1.0.2")


@pytest.mark.parametrize(
    ("pod", "observed", "node", "expected"),
    [
        (RUNNING, True, NodeState("n1"), None),
        (None, False, None, None),  # not created yet
        (None, True, None, Reason.POD_DELETED),
        (PodState("w-1", 1, "Running", deleting=True), True, None, Reason.POD_DELETED),
        (PodState("w-1", 1, "Failed"), True, None, Reason.POD_FAILED),
        (PodState("w-1", 1, "Running", terminated=True), True, None, Reason.POD_FAILED),
        (
            RUNNING,
            True,
            NodeState("n1", ready=False, not_ready_since=NOW - timedelta(seconds=5)),
            None,
        ),
        (
            RUNNING,
            True,
            NodeState("n1", ready=False, not_ready_since=NOW - timedelta(seconds=31)),
            Reason.NODE_NOT_READY,
        ),
    ],
)
def test_recovery_reason(
    pod: PodState | None, observed: bool, node: NodeState | None, expected: Reason | None
) -> None:
    assert recovery_reason(pod, observed, node, NOW, timedelta(seconds=30)) is expected


@pytest.mark.parametrize(
    ("pod", "phase"),
    [
        (None, WorkerPhase.PENDING),
        (PodState("w-1", 1, "Pending"), WorkerPhase.PENDING),
        (PodState("w-1", 1, "Running", scheduled=True), WorkerPhase.STARTING),
        (RUNNING, WorkerPhase.READY),
    ],
)
def test_pod_phase(pod: PodState | None, phase: WorkerPhase) -> None:
    assert pod_phase(pod)[0] is phase


def test_pod_state_from_a_failed_pod_body() -> None:
    body = {
        "metadata": {"name": "w-3", "labels": {"sessionfleet.dev/epoch": "3"}},
        "spec": {"nodeName": "gpu-1"},
        "status": {
            "phase": "Failed",
            "podIP": "127.1.0.9",
            "conditions": [{"type": "PodScheduled", "status": "True"}],
            "containerStatuses": [
                {"state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}
            ],
        },
    }
    pod = pod_state(body, "sessionfleet.dev/epoch")
    assert (pod.epoch, pod.phase, pod.terminated, pod.node) == (3, "Failed", True, "gpu-1")
    assert "137" in pod.message and "OOMKilled" in pod.message


def test_node_state_from_a_body() -> None:
    body = {
        "metadata": {"name": "gpu-1"},
        "spec": {"unschedulable": True, "taints": [{"key": "karpenter.sh/disrupted"}]},
        "status": {
            "conditions": [
                {"type": "Ready", "status": "False", "lastTransitionTime": "2026-11-29T11:59:00Z"}
            ]
        },
    }
    node = node_state(body)
    assert node.unschedulable and not node.ready
    assert node.taint_keys == {"karpenter.sh/disrupted"}
    assert node.not_ready_since == NOW - timedelta(minutes=1)


@pytest.mark.parametrize(
    ("failures", "seconds"), [(0, 0), (1, 10), (2, 20), (3, 40), (5, 160), (6, 300), (20, 300)]
)
def test_recovery_backoff_doubles_up_to_five_minutes(failures: int, seconds: int) -> None:
    assert recovery_backoff(failures) == timedelta(seconds=seconds)


def nodes(ready: int, not_ready: int) -> list[NodeState]:
    return [NodeState(f"r{i}", ready=True) for i in range(ready)] + [
        NodeState(f"n{i}", ready=False, not_ready_since=NOW) for i in range(not_ready)
    ]


@pytest.mark.parametrize(
    ("ready", "not_ready", "moving", "allowed"),
    [
        (3, 0, 0, 2),  # nothing NotReady: the full budget
        (2, 1, 0, 2),  # one of three NotReady: a lost node, move its workers
        (2, 1, 1, 1),  # one worker already moving
        (2, 1, 5, 0),  # the budget is spent
        (1, 2, 0, 0),  # two of three NotReady (67% > 55%): a control-plane blip, move none
        (0, 1, 0, 2),  # a single node alone is never called a blip
    ],
)
def test_node_recovery_gate(ready: int, not_ready: int, moving: int, allowed: int) -> None:
    gate = node_recovery_gate(nodes(ready, not_ready), moving, max_concurrent=2)
    granted = [gate.take() for _ in range(4)]
    assert sum(1 for block in granted if block is None) == allowed
    refused = [block for block in granted if block is not None]
    if ready and not_ready >= 2:
        assert refused[0].reason is Reason.DISRUPTION_THRESHOLD
        assert "2 of 3 nodes are NotReady" in refused[0].message
    elif refused:
        assert refused[0].reason is Reason.RECOVERY_CAPPED
