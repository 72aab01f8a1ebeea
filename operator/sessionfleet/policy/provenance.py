"""Provenance of the WorkerCheckpoints the operator creates: sign and verify, pure.

Drain and Periodic checkpoints are the operator's own; one a user creates with such a
reason must never run (the API server cannot tell who created an object, so the CRD
cannot refuse it). Which ones the operator made used to live in the memory of the
process that made them, so a new leader refused its predecessor's not-yet-started
checkpoints, a drain's among them. The proof now lives on the object: an annotation
holding an HMAC-SHA256, keyed by a Secret only the operator's ServiceAccount may read,
over the checkpoint's namespace, name, every spec field and the time it was signed.

- Copied onto another checkpoint, the digest no longer matches its name or spec.
- Changed fields: the spec is immutable (CEL), and a changed one would not match.
- Replayed (the signed object deleted and created again under the same name with the
  same annotation): the signing time must lie within :data:`SIGNATURE_SKEW` of the
  ``creationTimestamp`` the API server gives the object, so a replay is possible only
  in that window, and only of the operator's own checkpoint, unchanged.

The uid would bind a digest to one object, but the API server assigns it when the
object is created, after it is signed: the signing time stands in for it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Final

from sessionfleet.api import CheckpointDriver, CheckpointReason
from sessionfleet.policy.checkpoint import CheckpointState

VERSION: Final = "v1"
"""The layout of the signed message; a later layout gets a new version."""

SIGNATURE_SKEW: Final = timedelta(minutes=5)
"""How far the signing time may lie from the object's creationTimestamp: the operator
signs just before it creates, so this covers clock skew between it and the API server."""

KEY_BYTES: Final = 32
"""The length of a checkpoint key (HMAC-SHA256's block is 64 bytes, its output 32)."""


@dataclass(frozen=True, slots=True)
class CheckpointIdentity:
    """What a provenance digest covers: where the checkpoint is and everything it asks."""

    namespace: str
    name: str
    worker: str
    reason: CheckpointReason
    sessions: tuple[str, ...] = ()
    driver: CheckpointDriver | None = None
    destination: str | None = None

    @classmethod
    def of(cls, checkpoint: CheckpointState) -> CheckpointIdentity:
        """Return the identity of a checkpoint as the index holds it."""
        return cls(
            namespace=checkpoint.namespace,
            name=checkpoint.name,
            worker=checkpoint.worker,
            reason=checkpoint.reason,
            sessions=checkpoint.sessions,
            driver=checkpoint.driver,
            destination=checkpoint.destination,
        )


def _message(identity: CheckpointIdentity, signed_at: int) -> bytes:
    # JSON of a list: no field can run into the next, whatever characters it holds.
    fields = [
        VERSION,
        identity.namespace,
        identity.name,
        identity.worker,
        identity.reason.value,
        list(identity.sessions),
        identity.driver.value if identity.driver is not None else None,
        identity.destination,
        signed_at,
    ]
    return json.dumps(fields, separators=(",", ":")).encode()


def _digest(key: bytes, identity: CheckpointIdentity, signed_at: int) -> str:
    mac = hmac.new(key, _message(identity, signed_at), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).decode().rstrip("=")


def sign(key: bytes, identity: CheckpointIdentity, now: datetime) -> str:
    """Return the provenance annotation's value: ``v1.<unix seconds>.<HMAC>``."""
    signed_at = int(now.timestamp())
    return f"{VERSION}.{signed_at}.{_digest(key, identity, signed_at)}"


def provenance_problem(
    key: bytes, identity: CheckpointIdentity, annotation: str | None, created_at: datetime | None
) -> str | None:
    """Return why a checkpoint is not shown to be the operator's own; ``None``: it is.

    ``annotation`` is the object's provenance annotation, ``created_at`` its
    ``creationTimestamp``.
    """
    if not annotation:
        return "it carries no provenance annotation: the operator did not create it"
    version, _, rest = annotation.partition(".")
    signed_text, _, digest = rest.partition(".")
    if version != VERSION or not signed_text.isdigit() or not digest:
        return "its provenance annotation is malformed"
    signed_at = int(signed_text)
    if not hmac.compare_digest(digest, _digest(key, identity, signed_at)):
        return (
            "its provenance annotation does not match its namespace, name and spec "
            "(copied from another checkpoint, or signed with another key)"
        )
    signed = datetime.fromtimestamp(signed_at, UTC)
    if created_at is None or abs(created_at - signed) > SIGNATURE_SKEW:
        return (
            f"its provenance annotation was signed at {signed.isoformat()}, not when the "
            "object was created: a copy of a deleted checkpoint"
        )
    return None
