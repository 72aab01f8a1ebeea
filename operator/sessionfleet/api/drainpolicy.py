"""DrainPolicy: how drains of the selected workers behave, declared as GitOps manifests."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated, ClassVar, Final, Literal

from pydantic import Field, StringConstraints

from sessionfleet.api._common import (
    ApiModel,
    CelRule,
    Condition,
    DescribedEnum,
    Duration,
    DurationBounds,
    LabelSelector,
    conditions_field,
    nested_default,
    parse_duration,
)
from sessionfleet.api._resource import AGE_COLUMN, CustomResource, KindInfo, PrinterColumn


class DrainMode(DescribedEnum):
    """What a drain does with the sessions pinned to the worker."""

    WAIT = "Wait", "Hold the drain until the pinned sessions finish or the deadline passes."
    MIGRATE = "Migrate", "Move the pinned sessions to other workers at once, at turn boundaries."
    WAIT_THEN_MIGRATE = (
        "WaitThenMigrate",
        "Hold for the grace period, then move the sessions still pinned.",
    )


class DeadlineAction(DescribedEnum):
    """What happens when the drain deadline passes with sessions still pinned."""

    RELEASE = "Release", "Remove the hold: the drain proceeds and those sessions lose their cache."
    HOLD = "Hold", "Keep holding: the platform's own deadline decides."


class HoldMechanism(DescribedEnum):
    """A way of making the platform wait while sessions are pinned."""

    POD_DISRUPTION_BUDGET = (
        "PodDisruptionBudget",
        "A PodDisruptionBudget on the worker's pod: the Eviction API answers 429.",
    )
    KARPENTER_DO_NOT_DISRUPT = (
        "KarpenterDoNotDisrupt",
        "The karpenter.sh/do-not-disrupt annotation on the pod.",
    )
    CLUSTER_AUTOSCALER_SAFE_TO_EVICT = (
        "ClusterAutoscalerSafeToEvict",
        'The cluster-autoscaler.kubernetes.io/safe-to-evict: "false" annotation on the pod.',
    )


class MigrationScope(DescribedEnum):
    """What moves when sessions migrate."""

    SESSION = "Session", "Each session moves on its own to the best other worker."
    WORKER = "Worker", "The whole worker is checkpointed and restarted elsewhere; sessions follow."


DEADLINE = DurationBounds(
    minimum=timedelta(seconds=1),
    maximum=timedelta(hours=24),
    why="no platform waits longer for a drain (GKE about 1h, Karpenter its NodePool's "
    "terminationGracePeriod)",
)
"""A drain's deadline: 0s would release every hold at once, like having none."""
GRACE_PERIOD = DurationBounds(minimum=timedelta(0), maximum=timedelta(hours=24))
"""A drain's grace period: 0s migrates at once (spot interruptions)."""


DEFAULT_DISRUPTION_TAINTS = (
    "karpenter.sh/disrupted",
    "ToBeDeletedByClusterAutoscaler",
    "DeletionCandidateOfClusterAutoscaler",
)


class DrainTriggers(ApiModel):
    """The signals that start a drain of a worker."""

    worker_drain: bool = Field(default=True, description="The worker's spec.drain set to true.")
    node_cordon: bool = Field(
        default=True, description="The worker's node cordoned (spec.unschedulable)."
    )
    taints: list[Annotated[str, StringConstraints(min_length=1, max_length=317)]] = Field(
        default=list(DEFAULT_DISRUPTION_TAINTS),
        max_length=32,
        json_schema_extra={"x-kubernetes-list-type": "set"},
        description="Node taint keys that announce a disruption.",
    )


class DrainPolicySpec(ApiModel):
    """How drains of the selected workers behave."""

    selector: LabelSelector = Field(
        default_factory=LabelSelector,
        json_schema_extra=nested_default(),
        description="The InferenceWorkers this policy applies to, by label; empty selects all.",
    )
    mode: DrainMode = Field(
        default=DrainMode.WAIT_THEN_MIGRATE, description="What happens to pinned sessions."
    )
    grace_period: Duration = Field(
        default="2m",
        description=(
            "For WaitThenMigrate: how long to wait before migrating; 0s to 24h, and at "
            "most the deadline."
        ),
    )
    deadline: Duration = Field(
        default="10m",
        description=(
            "The longest a drain is held, 1s to 24h; keep it inside the platform's limit (EKS 15m)."
        ),
    )
    on_deadline: DeadlineAction = Field(
        default=DeadlineAction.RELEASE, description="What to do when the deadline passes."
    )
    triggers: DrainTriggers = Field(
        default_factory=DrainTriggers,
        json_schema_extra=nested_default(),
        description="The signals that start a drain.",
    )
    holds: list[HoldMechanism] = Field(
        default=list(HoldMechanism),
        max_length=3,
        json_schema_extra={"x-kubernetes-list-type": "set"},
        description="The hold mechanisms to use while sessions are pinned.",
    )
    migration_scope: MigrationScope = Field(
        default=MigrationScope.SESSION, description="What moves when sessions migrate."
    )
    checkpoint: bool = Field(
        default=True,
        description=(
            "Migrate through a checkpoint when the worker's driver allows; "
            "otherwise sessions are rebound without cache and the recomputation is counted."
        ),
    )

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        DEADLINE.rule("deadline", "deadline"),
        GRACE_PERIOD.rule("gracePeriod", "grace_period"),
        CelRule(
            # has() guards: the API server also checks the rule against the CRD's
            # default for spec ({}), before nested defaults are filled in.
            rule="!has(self.gracePeriod) || !has(self.deadline) || "
            "duration(self.gracePeriod) <= duration(self.deadline)",
            message="gracePeriod must not be longer than deadline",
            field_path=".gracePeriod",
            check=lambda s: parse_duration(s.grace_period) <= parse_duration(s.deadline),
        ),
        CelRule(
            rule="!has(self.migrationScope) || !has(self.mode) || "
            "self.migrationScope != 'Worker' || self.mode != 'Wait'",
            message="migrationScope Worker needs mode Migrate or WaitThenMigrate",
            field_path=".migrationScope",
            check=lambda s: s.migration_scope != MigrationScope.WORKER or s.mode != DrainMode.WAIT,
        ),
    )


MAX_LISTED_WORKERS: Final = 100
"""The most worker names a DrainPolicy's status lists; ``matchedWorkers`` counts them all."""


class DrainPolicyStatus(ApiModel):
    """What the operator observed of the policy."""

    observed_generation: int | None = Field(
        default=None, ge=0, description="The metadata.generation the operator last acted on."
    )
    matched_workers: int | None = Field(
        default=None,
        ge=0,
        description=(
            "InferenceWorkers this policy governs: those whose drainPolicyRef names it, and "
            "those its selector alone matches (a worker two policies select is in neither's "
            "count: it drains under the built-in default, and the Conflict condition names it)."
        ),
    )
    workers: list[Annotated[str, StringConstraints(min_length=1, max_length=253)]] = Field(
        default_factory=list,
        max_length=MAX_LISTED_WORKERS,
        description=(
            f"The names of the workers counted in matchedWorkers, sorted; the first "
            f"{MAX_LISTED_WORKERS} when there are more."
        ),
    )
    active_drains: int | None = Field(
        default=None, ge=0, description="Drains in progress under this policy."
    )
    conditions: list[Condition] = conditions_field("policy")


class DrainPolicy(CustomResource):
    """Drain behaviour for the InferenceWorkers its selector matches."""

    info: ClassVar[KindInfo] = KindInfo(
        kind="DrainPolicy",
        plural="drainpolicies",
        singular="drainpolicy",
        short_names=("dpol",),
        printer_columns=(
            PrinterColumn("Mode", ".spec.mode", "string", "What happens to pinned sessions."),
            PrinterColumn("Grace", ".spec.gracePeriod", "string", "Wait before migrating."),
            PrinterColumn("Deadline", ".spec.deadline", "string", "Longest hold."),
            PrinterColumn("Workers", ".status.matchedWorkers", "integer", "Workers it governs."),
            AGE_COLUMN,
        ),
    )

    kind: Literal["DrainPolicy"] = Field(default="DrainPolicy", description="The kind.")
    spec: DrainPolicySpec = Field(
        default_factory=DrainPolicySpec,
        json_schema_extra=nested_default(),
        description="How drains behave.",
    )
    status: DrainPolicyStatus = Field(
        default_factory=DrainPolicyStatus, description="What the operator observed."
    )
