"""The router replica's coordination.k8s.io Lease: pure builders.

Each router replica holds a Lease ``router-<replica>`` and renews it, so the operator
knows which replicas are alive and must acknowledge a migration (see
:mod:`sessionfleet.policy.handshake`).

The project has no pydantic model of a Lease: it is a core Kubernetes kind, not one of
ours, and nothing validates or generates a schema from it here. Its keys are therefore
written out below, in this one place, as the other core objects are in :mod:`.pods`;
the router only calls these functions.
"""

from __future__ import annotations

from typing import Any, Final

from sessionfleet.policy.handshake import ROUTER_COMPONENT, ROUTER_COMPONENT_LABEL
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
