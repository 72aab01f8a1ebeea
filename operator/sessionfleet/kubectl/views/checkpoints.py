"""``kubectl sessionfleet checkpoint``: the WorkerCheckpoint it creates, and its outcome."""

from __future__ import annotations

from typing import Any

from sessionfleet.api import (
    API_VERSION,
    CheckpointPhase,
    CheckpointReason,
    ConditionStatus,
    ConditionType,
    WorkerCheckpoint,
    WorkerCheckpointSpec,
    parse,
)
from sessionfleet.api.labels import WORKER_LABEL
from sessionfleet.kubectl.views.format import NONE
from sessionfleet.kubectl.views.snapshot import Body, condition


def manual_checkpoint(worker: str, namespace: str) -> dict[str, Any]:
    """Return a WorkerCheckpoint of ``worker`` with reason Manual, named by the API server.

    No owner reference: a manual checkpoint is the user's to delete, and the operator's
    retention leaves it alone.
    """
    spec = WorkerCheckpointSpec(worker=worker, reason=CheckpointReason.MANUAL)
    return {
        "apiVersion": API_VERSION,
        "kind": WorkerCheckpoint.info.kind,
        "metadata": {
            "generateName": f"{worker}-manual-",
            "namespace": namespace,
            "labels": {WORKER_LABEL: worker},
        },
        "spec": spec.wire(),
    }


def checkpoint_phase(body: Body) -> str:
    """Return a WorkerCheckpoint's phase, ``Pending`` until the operator writes one."""
    phase = (body.get("status") or {}).get("phase")
    return str(phase) if phase else CheckpointPhase.PENDING.value


def checkpoint_done(body: Body) -> bool | None:
    """Whether the checkpoint Succeeded (``True``), Failed (``False``), or is not over."""
    phase = checkpoint_phase(body)
    if phase == CheckpointPhase.SUCCEEDED.value:
        return True
    if phase == CheckpointPhase.FAILED.value:
        return False
    return None


def checkpoint_summary(body: Body) -> str:
    """Return what a finished checkpoint holds, or why it failed, in a few lines."""
    read = parse(WorkerCheckpoint, body)
    if read.obj is None:
        return f"the checkpoint cannot be read: {read.message}"
    status = read.obj.status
    if status.phase is CheckpointPhase.FAILED:
        done = condition(status.conditions, ConditionType.CHECKPOINTED)
        valid = condition(status.conditions, ConditionType.VALID)
        reason = next(
            (
                c.reason
                for c in (valid, done)
                if c is not None and c.status is ConditionStatus.FALSE
            ),
            "",
        )
        prefix = f"{reason}: " if reason else ""
        return f"failed: {prefix}{status.error or 'no error recorded'}"
    if status.phase is not CheckpointPhase.SUCCEEDED:
        return f"{checkpoint_phase(body)}"
    size = _size(status.size_bytes)
    took = f" in {status.duration_seconds:.1f}s" if status.duration_seconds is not None else ""
    epoch = f" of epoch {status.epoch}" if status.epoch is not None else ""
    lines = [
        f"written{took}{epoch}: {size}, {len(status.sessions)} session(s), "
        f"{status.total_tokens or 0} tokens",
        f"location: {status.location or NONE}",
    ]
    return "\n".join(lines)


def _size(count: int | None) -> str:
    """Return a size in bytes for people: ``812 B``, ``3.4 MiB``."""
    if count is None:
        return "size unknown"
    if count < 1024:
        return f"{count} B"
    value, unit = count / 1024, "KiB"
    for bigger in ("MiB", "GiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.1f} {unit}"
