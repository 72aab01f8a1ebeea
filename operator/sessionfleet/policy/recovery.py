"""Recovery: when a worker's pod must be replaced by a new epoch, and the phase a pod implies.

A worker keeps its identity; its pod is disposable. A pod that failed, was deleted
by someone else, or sits on a node NotReady beyond the toleration is replaced by a
pod with the next epoch and a new name — so a pod stuck Terminating on a dead node
never blocks its replacement.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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


DEFAULT_MAX_CONCURRENT_NODE_RECOVERIES = 10
DEFAULT_UNHEALTHY_NODE_THRESHOLD = 0.55
"""Like kube-controller-manager's ``--unhealthy-zone-threshold``: beyond this share of
NotReady nodes, a NotReady node more likely means a control-plane or network fault than
a lost machine, and moving its workers would cold-restart them for nothing."""


@dataclass(frozen=True, slots=True)
class RecoveryBlock:
    """Why a worker on a NotReady node is not moved now."""

    reason: Reason
    message: str


@dataclass
class NodeRecoveryGate:
    """How many workers on NotReady nodes may be moved in this pass, fleet-wide.

    Built once per pass by :func:`node_recovery_gate`; each worker that would move
    takes a slot with :meth:`take`, and gets :attr:`block` when none is left.
    """

    slots: int
    block_all: RecoveryBlock | None = None

    def take(self) -> RecoveryBlock | None:
        """Take a slot; return why not when the move must wait."""
        if self.block_all is not None:
            return self.block_all
        if self.slots <= 0:
            return RecoveryBlock(
                Reason.RECOVERY_CAPPED,
                "the most workers allowed to move off NotReady nodes at once are moving; "
                "this one moves when one of them is Ready",
            )
        self.slots -= 1
        return None


def node_recovery_gate(
    nodes: Sequence[NodeState],
    moving: int,
    *,
    max_concurrent: int = DEFAULT_MAX_CONCURRENT_NODE_RECOVERIES,
    unhealthy_threshold: float = DEFAULT_UNHEALTHY_NODE_THRESHOLD,
) -> NodeRecoveryGate:
    """Return the gate for one pass.

    ``moving`` counts workers already Recovering off a NotReady node. With more than
    ``unhealthy_threshold`` of the nodes NotReady (and at least two of them), no worker
    is moved at all; otherwise at most ``max_concurrent`` move at once.
    """
    not_ready = sum(1 for n in nodes if not n.ready)
    if nodes and not_ready >= 2 and not_ready / len(nodes) > unhealthy_threshold:
        return NodeRecoveryGate(
            0,
            RecoveryBlock(
                Reason.DISRUPTION_THRESHOLD,
                f"{not_ready} of {len(nodes)} nodes are NotReady "
                f"(over {unhealthy_threshold:.0%}): more likely a control-plane or network "
                "fault than lost nodes, so workers stay where they are",
            ),
        )
    return NodeRecoveryGate(max(0, max_concurrent - moving))
