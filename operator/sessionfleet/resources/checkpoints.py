"""The WorkerCheckpoint objects the operator creates, built from the API model: pure."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sessionfleet.api import (
    API_VERSION,
    CheckpointReason,
    InferenceWorker,
    WorkerCheckpoint,
    WorkerCheckpointSpec,
)
from sessionfleet.resources.labels import WORKER_LABEL
from sessionfleet.resources.pods import owner_reference
from sessionfleet.resources.status import wire


def build_checkpoint(
    worker: InferenceWorker,
    name: str,
    namespace: str,
    worker_name: str,
    reason: CheckpointReason,
    sessions: Sequence[str] = (),
) -> dict[str, Any]:
    """Return a WorkerCheckpoint of ``worker_name`` for ``reason``, owned by ``worker``.

    Only ``sessions`` (a per-session migration), or the whole worker when empty. The
    owner reference is not a controller one: a checkpoint outlives no worker, but the
    worker's controller does not manage it as its own.
    """
    spec = WorkerCheckpointSpec(worker=worker_name, reason=reason, sessions=list(sessions))
    return {
        "apiVersion": API_VERSION,
        "kind": WorkerCheckpoint.info.kind,
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {WORKER_LABEL: worker_name},
            "ownerReferences": [{**owner_reference(worker), "controller": False}],
        },
        "spec": wire(spec),
    }
