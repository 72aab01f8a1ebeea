"""API resources by group, version and plural, and their URL paths."""

from __future__ import annotations

from dataclasses import dataclass

from sessionfleet.api import GROUP, KINDS_BY_NAME, VERSION


@dataclass(frozen=True, slots=True)
class Resource:
    """One API resource (``pods``, ``agentsessions.sessionfleet.dev``…)."""

    group: str
    version: str
    plural: str
    namespaced: bool = True

    def path(self, namespace: str | None = None, name: str | None = None) -> str:
        """Return the URL path of the collection, or of one object when ``name`` is given."""
        base = f"/api/{self.version}" if not self.group else f"/apis/{self.group}/{self.version}"
        if self.namespaced and namespace:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        return f"{base}/{name}" if name else base


PODS = Resource("", "v1", "pods")
NODES = Resource("", "v1", "nodes", namespaced=False)
EVENTS = Resource("events.k8s.io", "v1", "events")
CORE_EVENTS = Resource("", "v1", "events")
"""The same events in their older core/v1 shape (``involvedObject``, ``message``)."""
LEASES = Resource("coordination.k8s.io", "v1", "leases")
PDBS = Resource("policy", "v1", "poddisruptionbudgets")
NETWORK_POLICIES = Resource("networking.k8s.io", "v1", "networkpolicies")
SECRETS = Resource("", "v1", "secrets")


def _custom(kind: str) -> Resource:
    return Resource(GROUP, VERSION, KINDS_BY_NAME[kind].info.plural)


WORKERS = _custom("InferenceWorker")
SESSIONS = _custom("AgentSession")
DRAIN_POLICIES = _custom("DrainPolicy")
CHECKPOINTS = _custom("WorkerCheckpoint")
