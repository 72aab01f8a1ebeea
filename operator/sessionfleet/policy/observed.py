"""Observations of core objects, reduced to what decisions need.

Controllers build these from pods and nodes; the simulator builds them directly.
Keeping them small and frozen lets indexes hold thousands without much memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sessionfleet.api import HoldMechanism
from sessionfleet.api.labels import CA_SAFE_TO_EVICT, KARPENTER_DO_NOT_DISRUPT


@dataclass(frozen=True, slots=True)
class NodeState:
    """What drains and recovery need to know of a node."""

    name: str
    ready: bool = True
    not_ready_since: datetime | None = None
    unschedulable: bool = False
    taint_keys: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class PodState:
    """What the worker controller needs to know of one of a worker's pods."""

    name: str
    epoch: int
    phase: str = "Pending"
    scheduled: bool = False
    ready: bool = False
    node: str | None = None
    pod_ip: str | None = None
    deleting: bool = False
    terminated: bool = False
    message: str = ""
    holds: frozenset[HoldMechanism] = frozenset()
    """The hold annotations the pod carries (Karpenter's, cluster-autoscaler's)."""
    uid: str = ""
    """The pod's uid: the operator's writes to it name it, so they miss a namesake."""


def _parse_time(value: Any) -> datetime | None:
    if not value:
        return None
    return datetime.fromisoformat(str(value).replace("Z", "+00:00"))


def _condition(conditions: Any, kind: str) -> Mapping[str, Any]:
    for condition in conditions or ():
        if condition.get("type") == kind:
            return condition  # type: ignore[no-any-return]
    return {}


def node_state(body: Mapping[str, Any]) -> NodeState:
    """Reduce a core/v1 Node to a :class:`NodeState`."""
    status = body.get("status") or {}
    ready = _condition(status.get("conditions"), "Ready")
    is_ready = ready.get("status") == "True"
    spec = body.get("spec") or {}
    return NodeState(
        name=str((body.get("metadata") or {}).get("name", "")),
        ready=is_ready,
        not_ready_since=None if is_ready else _parse_time(ready.get("lastTransitionTime")),
        unschedulable=bool(spec.get("unschedulable")),
        taint_keys=frozenset(str(t.get("key")) for t in spec.get("taints") or () if t.get("key")),
    )


def pod_holds(annotations: Mapping[str, Any]) -> frozenset[HoldMechanism]:
    """Return the hold mechanisms a pod's annotations put up."""
    holds = set()
    if annotations.get(KARPENTER_DO_NOT_DISRUPT) == "true":
        holds.add(HoldMechanism.KARPENTER_DO_NOT_DISRUPT)
    if annotations.get(CA_SAFE_TO_EVICT) == "false":
        holds.add(HoldMechanism.CLUSTER_AUTOSCALER_SAFE_TO_EVICT)
    return frozenset(holds)


def pod_state(body: Mapping[str, Any], epoch_label: str) -> PodState:
    """Reduce a core/v1 Pod to a :class:`PodState`; the epoch comes from its label."""
    meta = body.get("metadata") or {}
    status = body.get("status") or {}
    spec = body.get("spec") or {}
    containers = status.get("containerStatuses") or ()
    terminated = next(
        (c["state"]["terminated"] for c in containers if (c.get("state") or {}).get("terminated")),
        None,
    )
    message = str(status.get("message") or "")
    if terminated is not None:
        message = message or (
            f"container exited with code {terminated.get('exitCode')}"
            f" ({terminated.get('reason', 'Error')})"
        )
    try:
        epoch = int((meta.get("labels") or {}).get(epoch_label, "0"))
    except ValueError:
        epoch = 0
    return PodState(
        name=str(meta.get("name", "")),
        epoch=epoch,
        phase=str(status.get("phase") or "Pending"),
        scheduled=_condition(status.get("conditions"), "PodScheduled").get("status") == "True"
        or bool(spec.get("nodeName")),
        ready=_condition(status.get("conditions"), "Ready").get("status") == "True",
        node=spec.get("nodeName"),
        pod_ip=status.get("podIP"),
        deleting=bool(meta.get("deletionTimestamp")),
        uid=str(meta.get("uid") or ""),
        holds=pod_holds(meta.get("annotations") or {}),
        terminated=terminated is not None,
        message=message,
    )
