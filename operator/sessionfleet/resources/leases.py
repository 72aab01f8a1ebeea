"""coordination.k8s.io Leases: pure builders.

Each router replica holds a Lease ``router-<replica>`` and renews it, so the operator
knows which replicas are alive and must acknowledge a migration (see
:mod:`sessionfleet.policy.handshake`). The operator replicas elect their leader on
one Lease (see :mod:`sessionfleet.policy.leadership`).

The project has no pydantic model of a Lease: it is a core Kubernetes kind, not one of
ours, and nothing validates or generates a schema from it here. Its keys are therefore
written out below, in this one place, as the other core objects are in :mod:`.pods`;
the router only calls these functions.
"""

from __future__ import annotations

from typing import Any, Final

from sessionfleet.policy.handshake import ROUTER_COMPONENT, ROUTER_COMPONENT_LABEL
from sessionfleet.policy.leadership import LeaseRecord, transitions_after
from sessionfleet.resources.times import rfc3339

LEASE_API_VERSION: Final = "coordination.k8s.io/v1"
MAX_NAME_LENGTH: Final = 253


def router_lease_name(replica: str) -> str:
    """Return the name of a router replica's Lease."""
    return f"router-{replica}"[:MAX_NAME_LENGTH]


def router_lease(replica: str, *, duration_seconds: int, now: float) -> dict[str, Any]:
    """Return the Lease a router replica creates, acquired and renewed at Unix time ``now``.

    Times are ``metav1.MicroTime``: RFC 3339 with microseconds.
    """
    stamp = rfc3339(now, micros=True)
    return {
        "apiVersion": LEASE_API_VERSION,
        "kind": "Lease",
        "metadata": {
            "name": router_lease_name(replica),
            "labels": {ROUTER_COMPONENT_LABEL: ROUTER_COMPONENT},
        },
        "spec": {
            "holderIdentity": replica,
            "leaseDurationSeconds": duration_seconds,
            "acquireTime": stamp,
            "renewTime": stamp,
        },
    }


def lease_renewal(replica: str, *, now: float) -> dict[str, Any]:
    """Return the merge patch that renews a replica's Lease at Unix time ``now``."""
    return {"spec": {"renewTime": rfc3339(now, micros=True), "holderIdentity": replica}}


def leader_lease(name: str, identity: str, *, duration_seconds: int, now: float) -> dict[str, Any]:
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
) -> dict[str, Any]:
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


def leader_lease_release(record: LeaseRecord, *, now: float) -> dict[str, Any]:
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
