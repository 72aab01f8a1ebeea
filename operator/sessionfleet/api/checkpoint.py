"""WorkerCheckpoint: one saved state of a worker, recorded like a VolumeSnapshot."""

from __future__ import annotations

from datetime import datetime
from typing import ClassVar, Final, Literal

from pydantic import Field

from sessionfleet.api._common import (
    AbsolutePath,
    ApiModel,
    CelRule,
    CheckpointDriver,
    Condition,
    DescribedEnum,
    ObjectName,
    conditions_field,
    path_inside,
)
from sessionfleet.api._resource import AGE_COLUMN, CustomResource, KindInfo, PrinterColumn
from sessionfleet.api.session import SessionId


class CheckpointReason(DescribedEnum):
    """Why a checkpoint was taken."""

    DRAIN = (
        "Drain",
        "The worker is drained and its sessions migrate. Set by the operator only: "
        "one a user creates is marked Failed (ReservedCheckpointReason) and never run.",
    )
    PERIODIC = (
        "Periodic",
        "The worker's checkpoint interval elapsed. Set by the operator only: "
        "one a user creates is marked Failed (ReservedCheckpointReason) and never run.",
    )
    MANUAL = "Manual", "A user asked for it."
    PRE_STOP = "PreStop", "The worker's pod is stopping."


OPERATOR_REASONS: Final = frozenset({CheckpointReason.DRAIN, CheckpointReason.PERIODIC})
"""Reasons only the operator gives its own WorkerCheckpoints.

The API server cannot tell who creates an object, so the CRD cannot refuse them; the
operator refuses (marks Failed, never runs) a checkpoint with one of these reasons
that it did not create itself: see :func:`reserved_reason_problem`.
"""


def reserved_reason_problem(reason: CheckpointReason, created_by_operator: bool) -> str | None:
    """Return why the operator refuses a checkpoint for its reason; ``None``: it may run.

    ``created_by_operator``: a replica of the operator created this object, as its
    signed provenance annotation shows (:mod:`sessionfleet.policy.provenance`).
    """
    if reason in OPERATOR_REASONS and not created_by_operator:
        return (
            f"reason {reason.value} is set only by the operator; "
            f"ask for a checkpoint with reason {CheckpointReason.MANUAL.value}"
        )
    return None


def checkpoint_root(storage_path: str, namespace: str) -> str:
    """Return the directory a namespace's checkpoints lie under: ``<path>/<namespace>``."""
    return f"{storage_path.rstrip('/')}/{namespace}"


def destination_problem(destination: str | None, storage_path: str, namespace: str) -> str | None:
    """Return why the operator refuses a checkpoint's ``spec.destination``, or ``None``.

    The destination must lie strictly inside ``<storage.path>/<namespace>/`` of the
    worker: inside the storage every epoch's pod mounts, and out of other namespaces'
    checkpoints, which a shared storage root (the node agent's, a ReadWriteMany claim)
    would otherwise let one namespace overwrite and another then restore. The models
    already made both paths absolute with no ``.``, ``..`` or ``//``, so the check is
    lexical and exact. The worker's ``storage.path`` is the namespace's own to set, so
    this alone keeps nothing apart on a shared root: the node agent, which writes on
    one, also requires ``<its root>/<namespace>/`` by whole components and follows no
    link below its root (:mod:`sessionfleet.checkpoint.paths`).
    """
    if destination is None:
        return None
    root = checkpoint_root(storage_path, namespace)
    if not path_inside(destination, root):
        return f"destination {destination} is not inside {root}/, the worker's checkpoint storage"
    return None


class CheckpointPhase(DescribedEnum):
    """Where a checkpoint is in its life."""

    PENDING = "Pending", "Accepted, not started."
    RUNNING = "Running", "The driver is writing it."
    SUCCEEDED = "Succeeded", "Written and usable for restore."
    FAILED = "Failed", "Not written; the error says why."


class WorkerCheckpointSpec(ApiModel):
    """What to checkpoint and why. Immutable once created, like a VolumeSnapshot."""

    worker: ObjectName = Field(description="The InferenceWorker to checkpoint.")
    reason: CheckpointReason = Field(
        default=CheckpointReason.MANUAL, description="Why the checkpoint is taken."
    )
    driver: CheckpointDriver | None = Field(
        default=None, description="The driver; unset: the worker's configured driver."
    )
    sessions: list[SessionId] = Field(
        default_factory=list,
        max_length=1024,
        description="Only these sessions (per-session migration); empty: the whole worker.",
    )
    destination: AbsolutePath | None = Field(
        default=None,
        description=(
            "Where to write it; unset: <storage.path>/<namespace>/<worker>/<name> of the "
            "worker. An absolute path of at most 1024 printable ASCII characters, with no "
            "'.' or '..' segment, no '//', no trailing '/' and no '%' or '\\'. The operator "
            "runs the checkpoint only when it lies inside <storage.path>/<namespace>/ of the "
            "worker; otherwise it is marked Failed (DestinationOutsideStorage)."
        ),
    )

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(rule="self == oldSelf", message="a WorkerCheckpoint's spec is immutable"),
    )


class CapturedSession(ApiModel):
    """One session captured in a checkpoint."""

    session_id: SessionId = Field(description="The session's id.")
    tokens: int = Field(ge=0, description="Tokens of the session's prefix in the checkpoint.")


class WorkerCheckpointStatus(ApiModel):
    """The outcome of a checkpoint, written by the operator."""

    observed_generation: int | None = Field(
        default=None, ge=0, description="The metadata.generation the operator last acted on."
    )
    phase: CheckpointPhase | None = Field(default=None, description="Where the checkpoint is.")
    epoch: int | None = Field(default=None, ge=0, description="The worker epoch it came from.")
    started_at: datetime | None = Field(default=None, description="When writing began.")
    completed_at: datetime | None = Field(default=None, description="When writing ended.")
    duration_seconds: float | None = Field(default=None, ge=0, description="How long it took.")
    size_bytes: int | None = Field(default=None, ge=0, description="Its size on storage.")
    location: str | None = Field(default=None, description="Where it was written.")
    sessions: list[CapturedSession] = Field(
        default_factory=list, description="The sessions it captured."
    )
    total_tokens: int | None = Field(default=None, ge=0, description="Tokens captured in all.")
    error: str | None = Field(default=None, description="Why it failed, when it did.")
    conditions: list[Condition] = conditions_field("checkpoint")


class WorkerCheckpoint(CustomResource):
    """One saved state of a worker."""

    info: ClassVar[KindInfo] = KindInfo(
        kind="WorkerCheckpoint",
        plural="workercheckpoints",
        singular="workercheckpoint",
        short_names=("wcp",),
        printer_columns=(
            PrinterColumn("Worker", ".spec.worker", "string", "The checkpointed worker."),
            PrinterColumn("Reason", ".spec.reason", "string", "Why it was taken."),
            PrinterColumn("Phase", ".status.phase", "string", "Where it is."),
            PrinterColumn("Size", ".status.sizeBytes", "integer", "Bytes on storage."),
            AGE_COLUMN,
        ),
    )

    kind: Literal["WorkerCheckpoint"] = Field(default="WorkerCheckpoint", description="The kind.")
    spec: WorkerCheckpointSpec = Field(description="What to checkpoint and why.")
    status: WorkerCheckpointStatus = Field(
        default_factory=WorkerCheckpointStatus, description="The outcome."
    )
