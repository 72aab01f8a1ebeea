"""coordination.k8s.io Leases: pure builders.

Each router (or Endpoint Picker) replica holds one Lease of a fixed set of *slots*,
``<prefix>-0`` … ``<prefix>-<count-1>``, with its own name as ``holderIdentity``, and
renews it, so the operator knows which replicas are alive and must acknowledge a
migration (see :mod:`sessionfleet.policy.handshake`, keyed on the holder). The names
are fixed so that the replicas' Role can list them in ``resourceNames``: a Lease per
replica (``router-<pod name>``) would need write rights on every Lease of the
namespace, the operator's leader Lease included. The operator replicas elect their
leader on one Lease (see :mod:`sessionfleet.policy.leadership`).

The project has no pydantic model of a Lease: it is a core Kubernetes kind, not one of
ours, and nothing validates or generates a schema from it here. Its keys are therefore
written out below, in this one place, as the other core objects are in :mod:`.pods`;
the router only calls these functions. The shapes are :class:`LeaseBody` and
:class:`LeaseSpec` (TypedDicts): a misspelt key is a type error, not a field the API
server silently drops (a Lease never renewed looks like a dead replica).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, TypedDict

from sessionfleet.policy.handshake import ROUTER_COMPONENT, ROUTER_COMPONENT_LABEL, RouterLease
from sessionfleet.policy.leadership import LeaseRecord, transitions_after
from sessionfleet.resources.times import rfc3339

LEASE_API_VERSION: Final = "coordination.k8s.io/v1"


class LeaseSpec(TypedDict, total=False):
    """A Lease's ``spec`` as the builders below write it (None: clear the field)."""

    holderIdentity: str | None
    leaseDurationSeconds: int
    acquireTime: str | None
    renewTime: str | None
    leaseTransitions: int


class LeaseMetadata(TypedDict, total=False):
    """The part of a Lease's ``metadata`` the builders below write."""

    name: str
    labels: dict[str, str]
    resourceVersion: str


class LeaseBody(TypedDict, total=False):
    """A Lease, or a merge patch of one, as the builders below write it."""

    apiVersion: str
    kind: str
    metadata: LeaseMetadata
    spec: LeaseSpec


MAX_NAME_LENGTH: Final = 253


DEFAULT_SLOTS: Final = 32
"""Slots when none are configured: twice the chart's default autoscaling maximum (10),
plus room for a rolling update's surge and replicas killed without releasing theirs."""


@dataclass(frozen=True, slots=True)
class LeaseSlots:
    """The fixed set of Lease names the replicas of one component share."""

    prefix: str
    count: int = DEFAULT_SLOTS

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError("a replica needs at least one Lease slot")
        longest = len(f"{self.prefix}-{self.count - 1}")
        if not self.prefix or longest > MAX_NAME_LENGTH:
            raise ValueError(f"Lease slot prefix {self.prefix!r} makes names of {longest} chars")

    def names(self) -> list[str]:
        """Return every slot's Lease name, in order: what the Role's resourceNames list."""
        return [f"{self.prefix}-{index}" for index in range(self.count)]

    def order_for(self, replica: str) -> list[str]:
        """Return the slots in the order ``replica`` tries them.

        Each replica starts at its own place (a hash of its name), so replicas that
        start together do not all race for slot 0 and then for slot 1.
        """
        names = self.names()
        start = zlib.crc32(replica.encode()) % self.count
        return names[start:] + names[:start]


def lease_state(body: Mapping[str, Any]) -> RouterLease:
    """Reduce a replica's Lease to its holder, last renewal and duration."""
    spec = body.get("spec") or {}
    renewed = spec.get("renewTime") or spec.get("acquireTime")
    return RouterLease(
        holder=str(spec.get("holderIdentity") or (body.get("metadata") or {}).get("name", "")),
        renewed_at=datetime.fromisoformat(str(renewed).replace("Z", "+00:00")) if renewed else None,
        duration_seconds=int(spec.get("leaseDurationSeconds") or 15),
    )


def slot_claimable(body: Mapping[str, Any], replica: str, now: datetime) -> bool:
    """Whether ``replica`` may take the slot Lease ``body`` over.

    Its own (a restart under the same name), or one whose holder has not renewed it
    within its duration: a replica that stopped without releasing it. A Lease with no
    holder at all (``holderIdentity`` cleared) is free too.
    """
    if not (body.get("spec") or {}).get("holderIdentity"):
        return True
    state = lease_state(body)
    return state.holder == replica or not state.live(now)


def router_lease(name: str, replica: str, *, duration_seconds: int, now: float) -> LeaseBody:
    """Return the slot Lease ``name`` as ``replica`` holds it from Unix time ``now``.

    The body of a create, and of the merge patch that takes an expired slot over.
    Times are ``metav1.MicroTime``: RFC 3339 with microseconds.
    """
    stamp = rfc3339(now, micros=True)
    return {
        "apiVersion": LEASE_API_VERSION,
        "kind": "Lease",
        "metadata": {
            "name": name,
            "labels": {ROUTER_COMPONENT_LABEL: ROUTER_COMPONENT},
        },
        "spec": {
            "holderIdentity": replica,
            "leaseDurationSeconds": duration_seconds,
            "acquireTime": stamp,
            "renewTime": stamp,
        },
    }


def lease_renewal(replica: str, *, now: float) -> LeaseBody:
    """Return the merge patch that renews a replica's Lease at Unix time ``now``."""
    return {"spec": {"renewTime": rfc3339(now, micros=True), "holderIdentity": replica}}


def lease_release() -> LeaseBody:
    """Return the merge patch by which a replica gives its slot up at a clean shutdown.

    No holder and no times: the operator counts the replica gone at once (a Lease never
    renewed is not live) and any replica may claim the slot.
    """
    return {"spec": {"holderIdentity": None, "acquireTime": None, "renewTime": None}}


def leader_lease(name: str, identity: str, *, duration_seconds: int, now: float) -> LeaseBody:
    """Return the leader-election Lease as its first holder creates it at Unix time ``now``."""
    stamp = rfc3339(now, micros=True)
    return {
        "apiVersion": LEASE_API_VERSION,
        "kind": "Lease",
        "metadata": {"name": name},
        "spec": {
            "holderIdentity": identity,
            "leaseDurationSeconds": duration_seconds,
            "acquireTime": stamp,
            "renewTime": stamp,
            "leaseTransitions": 0,
        },
    }


def leader_lease_claim(
    record: LeaseRecord, identity: str, *, duration_seconds: int, now: float
) -> LeaseBody:
    """Return the merge patch by which ``identity`` renews or takes over the Lease.

    It carries the resourceVersion it was decided from: the API server refuses it (409)
    when another candidate wrote the Lease in between.
    """
    stamp = rfc3339(now, micros=True)
    keeps = record.holder == identity
    return {
        "metadata": {"resourceVersion": record.resource_version},
        "spec": {
            "holderIdentity": identity,
            "leaseDurationSeconds": duration_seconds,
            "acquireTime": record.acquire_time if keeps and record.acquire_time else stamp,
            "renewTime": stamp,
            "leaseTransitions": transitions_after(record, identity),
        },
    }


def leader_lease_release(record: LeaseRecord, *, now: float) -> LeaseBody:
    """Return the merge patch by which a stopping leader gives the Lease up at once.

    As client-go does: no holder, a one-second duration, so a standby takes over on
    its next retry instead of waiting out the lease.
    """
    stamp = rfc3339(now, micros=True)
    return {
        "metadata": {"resourceVersion": record.resource_version},
        "spec": {
            "holderIdentity": None,
            "leaseDurationSeconds": 1,
            "acquireTime": stamp,
            "renewTime": stamp,
        },
    }
