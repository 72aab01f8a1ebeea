"""Checkpoint timing, retention and location: pure decisions for WorkerCheckpoints."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

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
    completed_at: datetime | None = None
    location: str | None = None
    epoch: int | None = None
    sessions: tuple[str, ...] = ()
    """The sessions the spec asked for; empty: the whole worker."""
    captured_tokens: int = 0
    driver: CheckpointDriver | None = None
    destination: str | None = None
    resource_version: int = 0

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
    return max(usable, key=lambda c: c.completed_at or datetime.min) if usable else None


def retention_victims(checkpoints: Sequence[CheckpointState], keep: int) -> list[str]:
    """Names of finished checkpoints beyond the newest ``keep`` of the worker, oldest first.

    Pending and Running ones are never deleted; a Failed one counts like any other, so
    that failures do not accumulate either.
    """
    finished = [
        c
        for c in checkpoints
        if c.phase in (CheckpointPhase.SUCCEEDED, CheckpointPhase.FAILED)
        and c.reason is not CheckpointReason.MANUAL
    ]
    finished.sort(key=lambda c: c.completed_at or c.created_at or datetime.min, reverse=True)
    return [c.name for c in reversed(finished[keep:])]


def checkpoint_location(
    storage_path: str, namespace: str, worker: str, name: str, destination: str | None
) -> str:
    """Where a checkpoint is written: the spec's destination, or under the storage path."""
    if destination:
        return destination
    return f"{storage_path.rstrip('/')}/{namespace}/{worker}/{name}"


def checkpoint_name(worker: str, reason: CheckpointReason, epoch: int, now: datetime) -> str:
    """Return a unique, sortable name for a checkpoint the operator creates."""
    stamp = now.strftime("%Y%m%d-%H%M%S")
    return f"{worker}-{reason.value.lower()}-e{epoch}-{stamp}"[:253]
