"""Checkpoint timing, retention and location: pure decisions for WorkerCheckpoints."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sessionfleet.api import (
    CheckpointDriver,
    CheckpointPhase,
    CheckpointReason,
    parse_duration,
)


@dataclass(frozen=True, slots=True)
class CheckpointState:
    """What the operator keeps of one WorkerCheckpoint (an index value)."""

    namespace: str
    name: str
    worker: str
    reason: CheckpointReason
    phase: CheckpointPhase | None = None
    created_at: datetime | None = None
    started_at: datetime | None = None
    completed_at: datetime | None = None
    location: str | None = None
    epoch: int | None = None
    sessions: tuple[str, ...] = ()
    """The sessions the spec asked for; empty: the whole worker."""
    captured_tokens: int = 0
    driver: CheckpointDriver | None = None
    destination: str | None = None
    resource_version: int = 0
    uid: str = ""
    refused: bool = False
    """The operator refused to run it (``Valid=False``): a user's own, left to the user."""
    provenance: str | None = None
    """Its provenance annotation: proof that the operator created it (policy/provenance.py)."""

    @property
    def key(self) -> tuple[str, str]:
        """The checkpoint's (namespace, name)."""
        return (self.namespace, self.name)

    @property
    def whole_worker(self) -> bool:
        """Whether it saves the whole worker (usable to restore a new epoch)."""
        return not self.sessions

    @property
    def usable(self) -> bool:
        """Whether a new pod can start from it."""
        return self.phase is CheckpointPhase.SUCCEEDED and self.whole_worker


_LONG_AGO = datetime.min.replace(tzinfo=UTC)
"""Orders a checkpoint without any timestamp first; aware, like every time in a status
(a naive ``datetime.min`` cannot be compared with them)."""

DEFAULT_CHECKPOINT_TIMEOUT = timedelta(minutes=15)
"""The longest a checkpoint may run: above the criu driver's longest step (900 s)."""


def abandoned(
    checkpoint: CheckpointState, running_here: bool, now: datetime, timeout: timedelta
) -> bool:
    """Whether a Running checkpoint has no one left to finish it.

    That is one this process does not run (its operator restarted, or lost the
    leadership) and that started longer than ``timeout`` ago: whoever ran it has
    either finished or given up by then. It is marked Failed so that it no longer
    counts as in flight and periodic checkpoints and moves resume.
    """
    if checkpoint.phase is not CheckpointPhase.RUNNING or running_here:
        return False
    started = checkpoint.started_at or checkpoint.created_at
    return started is None or now - started >= timeout


def periodic_due(
    interval: str | None,
    driver: CheckpointDriver,
    worker_ready: bool,
    last: CheckpointState | None,
    activity_since: datetime | None,
    in_flight: bool,
    now: datetime,
) -> bool:
    """Whether to take a periodic checkpoint now.

    Due when the worker is Ready, a driver is configured, the interval has passed since
    the last whole-worker checkpoint, and a turn happened since it: an idle worker's
    state has not changed, so another copy would only cost storage.
    """
    if interval is None or driver is CheckpointDriver.NONE or not worker_ready or in_flight:
        return False
    if last is None or last.completed_at is None:
        return activity_since is not None
    if now - last.completed_at < parse_duration(interval):
        return False
    return activity_since is not None and activity_since > last.completed_at


def latest_usable(checkpoints: Sequence[CheckpointState]) -> CheckpointState | None:
    """Return the newest Succeeded whole-worker checkpoint, to restore a new epoch from."""
    usable = [c for c in checkpoints if c.usable and c.completed_at is not None]
    return max(usable, key=lambda c: c.completed_at or _LONG_AGO) if usable else None


def retention_victims(checkpoints: Sequence[CheckpointState], keep: int) -> list[str]:
    """Names of finished checkpoints beyond the newest ``keep`` of the worker, oldest first.

    Pending and Running ones are never deleted; a Failed one counts like any other, so
    that failures do not accumulate either. Manual and refused ones are the user's.
    """
    finished = [
        c
        for c in checkpoints
        if c.phase in (CheckpointPhase.SUCCEEDED, CheckpointPhase.FAILED)
        and c.reason is not CheckpointReason.MANUAL
        # A refused one is a user's, whatever its reason says: deleting it is theirs,
        # and a flood of them must not push the worker's own out of retention.
        and not c.refused
    ]
    finished.sort(key=lambda c: c.completed_at or c.created_at or _LONG_AGO, reverse=True)
    return [c.name for c in reversed(finished[keep:])]


def checkpoint_location(
    storage_path: str, namespace: str, worker: str, name: str, destination: str | None
) -> str:
    """Where a checkpoint is written: the spec's destination, or under the storage path."""
    if destination:
        return destination
    return f"{storage_path.rstrip('/')}/{namespace}/{worker}/{name}"


def checkpoint_name(
    worker: str,
    reason: CheckpointReason,
    epoch: int,
    now: datetime,
    sessions: Sequence[str] = (),
) -> str:
    """Return a unique, sortable name for a checkpoint the operator creates.

    The name is per second, so that a create retried within the second meets its own
    object (409) instead of making a second checkpoint. A per-session checkpoint also
    carries a digest of its sessions: a drain moves sessions in batches, as the routers
    acknowledge them, and two batches within one second must get two checkpoints, not
    a conflict that would move the second batch without its cache.
    """
    stamp = now.strftime("%Y%m%d-%H%M%S")
    name = f"{worker}-{reason.value.lower()}-e{epoch}-{stamp}"
    if sessions:
        digest = hashlib.sha256("\n".join(sorted(sessions)).encode()).hexdigest()[:8]
        name = f"{name}-{digest}"
    return name[:253]
