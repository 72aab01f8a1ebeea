"""The operator's checkpoint key: fetched (or created) once, then signs and verifies.

Every replica reads the same Secret (``--checkpoint-key-secret``), so a checkpoint one
leader signed is recognised by the next (policy/provenance.py says what is signed).
Only a leader creates it, when it finds none: a standby's writes are refused, and it
needs the key only once it leads.
"""

from __future__ import annotations

import logging
import secrets
from datetime import datetime

from sessionfleet.controllers.fleet import Fleet
from sessionfleet.kube import SECRETS, Conflict, KubeError, NotFound
from sessionfleet.policy.checkpoint import CheckpointState
from sessionfleet.policy.provenance import (
    KEY_BYTES,
    CheckpointIdentity,
    provenance_problem,
    sign,
)
from sessionfleet.resources.checkpoints import build_checkpoint_key_secret, checkpoint_key_of

log = logging.getLogger(__name__)


class CheckpointKeyUnusable(KubeError):
    """The checkpoint key Secret exists but holds no usable key."""

    def __init__(self, message: str) -> None:
        super().__init__(0, message)


async def checkpoint_key(fleet: Fleet) -> bytes:
    """Return the key that signs the operator's checkpoints, reading it on first use.

    Without a Secret configured (run outside a pod without a namespace), the key lives
    in this process only, and a restarted operator refuses its predecessor's pending
    Drain and Periodic checkpoints.
    """
    if fleet.checkpointing.key is not None:
        return fleet.checkpointing.key
    where = fleet.config.checkpoint_key_secret
    if where is None:
        log.warning(
            "no --checkpoint-key-secret: checkpoints are signed with a key of this process "
            "only; another replica or a restart refuses its pending Drain and Periodic ones"
        )
        fleet.checkpointing.key = secrets.token_bytes(KEY_BYTES)
        return fleet.checkpointing.key
    namespace, name = where
    try:
        body = await fleet.kube.get(SECRETS, name, namespace)
    except NotFound:
        try:
            body = await fleet.kube.create(
                SECRETS,
                build_checkpoint_key_secret(name, namespace, secrets.token_bytes(KEY_BYTES)),
                namespace,
            )
            log.info("checkpoint key: created Secret %s/%s", namespace, name)
        except Conflict:
            body = await fleet.kube.get(SECRETS, name, namespace)  # another replica's
    key = checkpoint_key_of(body)
    if key is None:
        raise CheckpointKeyUnusable(
            f"Secret {namespace}/{name} holds no checkpoint key (data.key, at least 16 "
            "bytes): delete it and the operator creates one"
        )
    fleet.checkpointing.key = key
    return key


async def signature(fleet: Fleet, identity: CheckpointIdentity, now: datetime) -> str:
    """Return the provenance annotation for a checkpoint the operator is about to create."""
    return sign(await checkpoint_key(fleet), identity, now)


def forgery(key: bytes, checkpoint: CheckpointState) -> str | None:
    """Return why a checkpoint is not the operator's own; ``None``: any replica made it."""
    return provenance_problem(
        key, CheckpointIdentity.of(checkpoint), checkpoint.provenance, checkpoint.created_at
    )
