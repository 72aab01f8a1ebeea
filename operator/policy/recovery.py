"""Recovery: when a worker's pod must be replaced by a new epoch, and the phase a pod implies.

A worker keeps its identity; its pod is disposable. A pod that failed, was deleted
by someone else, or sits on a node NotReady beyond the toleration is replaced by a
pod with the next epoch and a new name — so a pod stuck Terminating on a dead node
never blocks its replacement.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sessionfleet.api import Reason, WorkerPhase
from sessionfleet.policy.observed import NodeState, PodState

DEFAULT_NODE_NOT_READY_TOLERATION = timedelta(seconds=30)
BACKOFF_BASE = timedelta(seconds=10)
BACKOFF_MAX = timedelta(minutes=5)


def recovery_backoff(consecutive_failures: int) -> timedelta:
    """Return how long to wait before the next epoch after this many failures in a row.

    Like a kubelet's CrashLoopBackOff: a worker whose engine dies at start (a bad image,
    a model that does not fit) must not churn pods as fast as the API server allows.
    The first replacement is immediate; then 10 s, 20 s, 40 s … up to 5 minutes.
    """
    if consecutive_failures <= 0:
        return timedelta(0)
    doubling: int = 2 ** min(consecutive_failures - 1, 16)
    return min(BACKOFF_BASE * doubling, BACKOFF_MAX)


def recovery_reason(
    pod: PodState | None,
    pod_was_observed: bool,
    node: NodeState | None,
    now: datetime,
    node_not_ready_toleration: timedelta = DEFAULT_NODE_NOT_READY_TOLERATION,
) -> Reason | None:
    """Return why the current pod must be replaced, or ``None`` while it is fine.

    ``pod_was_observed`` says whether the operator has seen this epoch's pod: a pod
    not yet seen is still being created, not lost.
    """
    if pod is None:
        return Reason.POD_DELETED if pod_was_observed else None
    if pod.deleting:
        return Reason.POD_DELETED
    if pod.phase == "Failed" or pod.terminated:
        return Reason.POD_FAILED
    if (
        node is not None
        and not node.ready
        and node.not_ready_since is not None
        and now - node.not_ready_since >= node_not_ready_toleration
    ):
        return Reason.NODE_NOT_READY
    return None


def pod_phase(pod: PodState | None) -> tuple[WorkerPhase, Reason]:
    """Return the worker phase and reason that a (healthy) pod implies."""
    if pod is None or not pod.scheduled or pod.phase == "Pending":
        return WorkerPhase.PENDING, Reason.POD_PENDING
    if pod.phase == "Running" and pod.ready and pod.pod_ip:
        return WorkerPhase.READY, Reason.POD_READY
    return WorkerPhase.STARTING, Reason.POD_STARTING
