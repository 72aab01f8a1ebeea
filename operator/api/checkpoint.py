"""WorkerCheckpoint: one saved state of a worker, recorded like a VolumeSnapshot."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, ClassVar, Literal

from pydantic import Field, StringConstraints

from sessionfleet.api._common import (
    ApiModel,
    CelRule,
    CheckpointDriver,
    Condition,
    DescribedEnum,
    ObjectName,
    conditions_field,
)
from sessionfleet.api._resource import AGE_COLUMN, CustomResource, KindInfo, PrinterColumn
from sessionfleet.api.session import SessionId


class CheckpointReason(DescribedEnum):
    """Why a checkpoint was taken."""

    DRAIN = "Drain", "The worker is drained and its sessions migrate."
    PERIODIC = "Periodic", "The worker's checkpoint interval elapsed."
    MANUAL = "Manual", "A user asked for it."
    PRE_STOP = "PreStop", "The worker's pod is stopping."


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
    destination: Annotated[str, StringConstraints(max_length=1024)] | None = Field(
        default=None,
        description="Where to write it; unset: under the worker's checkpoint storage path.",
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
