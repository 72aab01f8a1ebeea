"""The WorkerCheckpoint objects the operator creates, built from the API model: pure."""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from typing import Any

from sessionfleet.api import (
    API_VERSION,
    CheckpointReason,
    InferenceWorker,
    WorkerCheckpoint,
    WorkerCheckpointSpec,
)
from sessionfleet.api.labels import MANAGED_BY, PROVENANCE_ANNOTATION, WORKER_LABEL
from sessionfleet.resources.pods import owner_reference
from sessionfleet.resources.status import wire


def build_checkpoint(
    worker: InferenceWorker,
    name: str,
    namespace: str,
    worker_name: str,
    reason: CheckpointReason,
    sessions: Sequence[str] = (),
    provenance: str | None = None,
) -> dict[str, Any]:
    """Return a WorkerCheckpoint of ``worker_name`` for ``reason``, owned by ``worker``.

    Only ``sessions`` (a per-session migration), or the whole worker when empty. The
    owner reference is not a controller one: a checkpoint outlives no worker, but the
    worker's controller does not manage it as its own. ``provenance``: the signed
    annotation that shows any replica of the operator that it created this one.
    """
    spec = WorkerCheckpointSpec(worker=worker_name, reason=reason, sessions=list(sessions))
    annotations = {PROVENANCE_ANNOTATION: provenance} if provenance else {}
    return {
        "apiVersion": API_VERSION,
        "kind": WorkerCheckpoint.info.kind,
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {WORKER_LABEL: worker_name},
            **({"annotations": annotations} if annotations else {}),
            "ownerReferences": [{**owner_reference(worker), "controller": False}],
        },
        "spec": wire(spec),
    }


MIN_KEY_BYTES = 16
"""The shortest checkpoint key accepted from a Secret someone wrote by hand."""

CHECKPOINT_KEY_FIELD = "key"
"""The data field of the checkpoint key Secret that holds the key."""


def build_checkpoint_key_secret(name: str, namespace: str, key: bytes) -> dict[str, Any]:
    """Return the Secret holding the key that signs the operator's WorkerCheckpoints.

    Immutable: a key that changed under running replicas would make each refuse the
    others' checkpoints; to rotate it, delete the Secret and restart the operator.
    """
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(MANAGED_BY)},
        "type": "Opaque",
        "immutable": True,
        "data": {CHECKPOINT_KEY_FIELD: base64.b64encode(key).decode()},
    }


def checkpoint_key_of(secret: Mapping[str, Any]) -> bytes | None:
    """Return the key a checkpoint key Secret holds; ``None`` if none, or a short one."""
    encoded = (secret.get("data") or {}).get(CHECKPOINT_KEY_FIELD)
    if not isinstance(encoded, str):
        return None
    try:
        key = base64.b64decode(encoded, validate=True)
    except ValueError:
        return None
    return key if len(key) >= MIN_KEY_BYTES else None
