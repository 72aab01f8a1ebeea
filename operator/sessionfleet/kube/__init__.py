"""Thin Kubernetes API access: one async client, one exception tree, resource paths."""

from sessionfleet.kube.client import Kube
from sessionfleet.kube.config import KubeConfig
from sessionfleet.kube.errors import (
    ApiUnavailable,
    Conflict,
    Forbidden,
    Gone,
    Invalid,
    KubeError,
    NotFound,
    NotLeading,
    TooManyRequests,
)
from sessionfleet.kube.reflector import Event, reflect
from sessionfleet.kube.resources import (
    CHECKPOINTS,
    CORE_EVENTS,
    DRAIN_POLICIES,
    EVENTS,
    LEASES,
    NETWORK_POLICIES,
    NODES,
    PDBS,
    PODS,
    SECRETS,
    SESSIONS,
    WORKERS,
    Resource,
)

__all__ = [
    "CHECKPOINTS",
    "CORE_EVENTS",
    "DRAIN_POLICIES",
    "EVENTS",
    "LEASES",
    "NETWORK_POLICIES",
    "NODES",
    "PDBS",
    "PODS",
    "SECRETS",
    "SESSIONS",
    "WORKERS",
    "ApiUnavailable",
    "Conflict",
    "Event",
    "Forbidden",
    "Gone",
    "Invalid",
    "Kube",
    "KubeConfig",
    "KubeError",
    "NotFound",
    "NotLeading",
    "Resource",
    "TooManyRequests",
    "reflect",
]
