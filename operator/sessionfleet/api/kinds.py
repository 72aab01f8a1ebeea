"""The registry of kinds in this API version."""

from __future__ import annotations

from sessionfleet.api._resource import CustomResource
from sessionfleet.api.checkpoint import WorkerCheckpoint
from sessionfleet.api.drainpolicy import DrainPolicy
from sessionfleet.api.session import AgentSession
from sessionfleet.api.worker import InferenceWorker

KINDS: tuple[type[CustomResource], ...] = (
    InferenceWorker,
    AgentSession,
    DrainPolicy,
    WorkerCheckpoint,
)
"""Every kind, in the order the CRDs are generated and documented."""

KINDS_BY_NAME: dict[str, type[CustomResource]] = {model.info.kind: model for model in KINDS}
"""Kinds by their ``kind`` name, for parsing manifests of any kind."""
