"""AgentSession: one coding agent's session and the worker it is bound to."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, ClassVar, Literal

from pydantic import Field, StringConstraints

from sessionfleet.api._common import (
    ApiModel,
    CelRule,
    Condition,
    DescribedEnum,
    ModelName,
    ObjectName,
    conditions_field,
    field_rules,
    immutable,
)
from sessionfleet.api._resource import AGE_COLUMN, CustomResource, KindInfo, PrinterColumn

SessionId = Annotated[
    str,
    StringConstraints(min_length=1, max_length=256, pattern=r"^[\x21-\x7e]+$"),
    Field(description="A session id as the client sends it (printable ASCII, no spaces)."),
]


class SessionPhase(DescribedEnum):
    """Where a session is in its life."""

    PENDING = "Pending", "Not bound yet; the Ready condition says why."
    BOUND = "Bound", "Bound to a Ready worker; its turns go there."
    MIGRATING = "Migrating", "Moving to another worker at a turn boundary; turns are held."
    RESTORING = "Restoring", "Its worker is being recreated; turns are held until it is Ready."
    FINISHED = "Finished", "The session ended; it is deleted after ttlSecondsAfterFinished."
    LOST = "Lost", "Its worker was deleted; the session's cache is gone."


class SessionClient(DescribedEnum):
    """Which client convention the router recognised the session id by."""

    HEADER = "Header", "The router's configured session header (X-Session-Id by default)."
    CLAUDE_CODE = "ClaudeCode", "Claude Code's x-claude-code-session-id (or agent id)."
    CODEX = "Codex", "Codex's session-id header."
    OPENCODE = "OpenCode", "OpenCode's x-session-id header."
    API = "API", "Created directly through the Kubernetes API."


class MigrationReason(DescribedEnum):
    """Why a session moved to another worker."""

    DRAIN = "Drain", "Its worker was drained."


class Migration(ApiModel):
    """One move of a session from one worker to another."""

    from_worker: str = Field(alias="from", description="The worker the session left.")
    to_worker: str = Field(alias="to", description="The worker the session moved to.")
    reason: MigrationReason = Field(description="Why the session moved.")
    at: datetime = Field(description="When the session was rebound.")
    checkpoint: str | None = Field(
        default=None, description="The WorkerCheckpoint that carried its state, if any."
    )
    recomputed_tokens: int | None = Field(
        default=None,
        ge=0,
        description="Prefix tokens the move makes the new worker recompute (0 with a checkpoint).",
    )


class AgentSessionSpec(ApiModel):
    """The desired state of a session: who it is and where it would like to run."""

    session_id: SessionId = Field(
        json_schema_extra=immutable("sessionId"), description="The client's session id."
    )
    parent_session_id: SessionId | None = Field(
        default=None,
        json_schema_extra=immutable("parentSessionId"),
        description=(
            "The parent session's id, for subagents; the child starts on its parent's worker."
        ),
    )
    model: ModelName = Field(
        json_schema_extra=immutable("model"),
        description="The model the session talks to; only workers serving it are candidates.",
    )
    client: SessionClient = Field(
        default=SessionClient.API, description="Which client convention named the session."
    )
    worker_hint: ObjectName | None = Field(
        default=None,
        description="A preferred worker (the router's choice); honoured when it has room.",
    )
    worker_pin: ObjectName | None = Field(
        default=None,
        description="A required worker: the session stays Pending until it has room.",
    )
    finished: bool = Field(
        default=False,
        json_schema_extra=field_rules(
            CelRule("self || !oldSelf", "a finished session cannot be resumed")
        ),
        description="The client ended the session; it becomes Finished.",
    )
    ttl_seconds_after_finished: int = Field(
        default=3600,
        ge=0,
        le=30 * 24 * 3600,
        description="Seconds a Finished session is kept before it is deleted.",
    )

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="!has(self.workerHint) || !has(self.workerPin)",
            message="set workerHint or workerPin, not both",
            field_path=".workerPin",
            check=lambda s: s.worker_hint is None or s.worker_pin is None,
        ),
        CelRule(
            rule="!has(self.parentSessionId) || self.parentSessionId != self.sessionId",
            message="parentSessionId must differ from sessionId",
            field_path=".parentSessionId",
            check=lambda s: s.parent_session_id != s.session_id,
        ),
    )


class AgentSessionStatus(ApiModel):
    """The observed state of a session: binding (operator) and usage (router)."""

    observed_generation: int | None = Field(
        default=None, ge=0, description="The metadata.generation the operator last acted on."
    )
    phase: SessionPhase | None = Field(default=None, description="Where the session is.")
    worker: str | None = Field(default=None, description="The worker the session is bound to.")
    pod: str | None = Field(default=None, description="The worker's pod at binding time.")
    epoch: int | None = Field(default=None, ge=0, description="The worker's epoch at binding.")
    bound_at: datetime | None = Field(default=None, description="When the session was bound.")
    migrating_since: datetime | None = Field(
        default=None,
        description=(
            "While Migrating: when the move was asked for. Each live router replica "
            "acknowledges it, once no turn of the session is in flight, by setting the "
            "annotation ack.sessionfleet.dev/<replica> to this timestamp."
        ),
    )
    finished_at: datetime | None = Field(default=None, description="When the session finished.")
    turns: int | None = Field(default=None, ge=0, description="Turns served.")
    prompt_tokens: int | None = Field(default=None, ge=0, description="Prompt tokens, all turns.")
    cached_tokens: int | None = Field(
        default=None, ge=0, description="Prompt tokens served from the prefix cache."
    )
    completion_tokens: int | None = Field(
        default=None, ge=0, description="Generated tokens, all turns."
    )
    recomputed_tokens: int | None = Field(
        default=None,
        ge=0,
        description="Prompt tokens not served from cache after the first turn: work redone.",
    )
    hit_rate_percent: float | None = Field(
        default=None, ge=0, le=100, description="cachedTokens over promptTokens, 0-100."
    )
    last_activity: datetime | None = Field(
        default=None, description="When the last turn completed."
    )
    first_turn_at: datetime | None = Field(
        default=None,
        description=(
            "When the session's first counted turn started. Router replicas write their "
            "turns in any order; the earliest turn is the one whose prefix is not counted "
            "as recomputed."
        ),
    )
    first_turn_uncached_tokens: int | None = Field(
        default=None,
        ge=0,
        description="Prompt tokens of the first turn not served from cache (new by nature).",
    )
    usage_writes: dict[str, int] | None = Field(
        default=None,
        description=(
            "Per router replica, the id of its last usage write the API server applied "
            "(the Unix time in milliseconds; a replica's ids only grow). A replica whose "
            "write got no answer reads its id here to tell whether the write was applied, "
            "so that no usage is counted twice."
        ),
    )
    migrations: list[Migration] = Field(
        default_factory=list, description="Moves to other workers, oldest first."
    )
    conditions: list[Condition] = conditions_field("session")


class AgentSession(CustomResource):
    """One agent session and its binding to a worker."""

    info: ClassVar[KindInfo] = KindInfo(
        kind="AgentSession",
        plural="agentsessions",
        singular="agentsession",
        short_names=("ags", "asess"),
        printer_columns=(
            PrinterColumn("Model", ".spec.model", "string", "The model the session talks to."),
            PrinterColumn("Worker", ".status.worker", "string", "The bound worker."),
            PrinterColumn("Phase", ".status.phase", "string", "Where the session is."),
            PrinterColumn("Turns", ".status.turns", "integer", "Turns served."),
            PrinterColumn("Hit%", ".status.hitRatePercent", "number", "Prefix cache hit rate."),
            AGE_COLUMN,
        ),
    )

    kind: Literal["AgentSession"] = Field(default="AgentSession", description="The kind.")
    spec: AgentSessionSpec = Field(description="The session's identity and placement wishes.")
    status: AgentSessionStatus = Field(
        default_factory=AgentSessionStatus, description="The binding and usage."
    )
