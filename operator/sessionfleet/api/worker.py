"""InferenceWorker: one serving instance with a stable identity across pod epochs."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, StringConstraints

from sessionfleet.api._common import (
    AbsolutePath,
    ApiModel,
    CelRule,
    CheckpointDriver,
    Condition,
    DescribedEnum,
    Duration,
    DurationBounds,
    EngineType,
    ModelName,
    ObjectName,
    conditions_field,
    format_duration,
    immutable,
    nested_default,
    parse_duration,
)
from sessionfleet.api._resource import AGE_COLUMN, CustomResource, KindInfo, PrinterColumn

Quantity = Annotated[
    int | str,
    Field(description="A Kubernetes resource quantity, such as 4, 500m or 16Gi."),
]


class WorkerPhase(DescribedEnum):
    """Where a worker is in its life."""

    PENDING = "Pending", "No pod yet, or the pod is not scheduled."
    STARTING = "Starting", "The pod runs and the engine is loading; not serving yet."
    READY = "Ready", "The engine serves; new sessions may be placed here."
    DRAINING = "Draining", "A drain is in progress: no new sessions, pinned ones are held."
    DRAINED = "Drained", "The drain finished: no session is pinned any more."
    RECOVERING = "Recovering", "The pod failed or vanished; a new epoch is starting."
    FAILED = "Failed", "The worker cannot run; see its conditions for the reason."


class EnvVar(ApiModel):
    """An environment variable with a literal value."""

    name: Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=256)] = (
        Field(description="The variable's name.")
    )
    value: Annotated[str, StringConstraints(max_length=4096)] = Field(
        default="", description="The variable's value."
    )


class EngineSpec(ApiModel):
    """The inference engine the worker runs and how to start it."""

    type: EngineType = Field(default=EngineType.VLLM, description="The engine to run.")
    image: Annotated[str, StringConstraints(max_length=512)] | None = Field(
        default=None,
        description="The container image; defaults to the operator's image for the engine type.",
        examples=["registry.example.com/sessionfleet-vllm:0.32.0"],
    )
    args: list[Annotated[str, StringConstraints(max_length=4096)]] = Field(
        default_factory=list,
        max_length=128,
        description="Extra engine arguments, appended after the ones the operator sets.",
    )
    env: list[EnvVar] = Field(
        default_factory=list, max_length=128, description="Extra environment variables."
    )
    port: int = Field(
        default=8000, ge=1, le=65535, description="The port the engine's HTTP server listens on."
    )


class ResourceRequirements(ApiModel):
    """Compute resources for the engine container, beside the GPUs."""

    requests: dict[str, Quantity] = Field(
        default_factory=dict, description="Minimum resources, such as cpu: 8, memory: 64Gi."
    )
    limits: dict[str, Quantity] = Field(
        default_factory=dict, description="Maximum resources, such as memory: 96Gi."
    )


MAX_TOLERATION_SECONDS = 365 * 24 * 3600
MAX_SESSIONS_PER_WORKER = 100_000
MAX_KV_TOKENS = 100_000_000

CHECKPOINT_INTERVAL = DurationBounds(
    minimum=timedelta(seconds=1),
    maximum=timedelta(days=7),
    why="0s would copy the KV cache without pause, and a checkpoint a week old is of "
    "little use to restore",
)
"""Any engine's periodic checkpoint interval; 0s (continuous copying) is refused."""
VLLM_MIN_CHECKPOINT_INTERVAL = timedelta(minutes=1)
"""vLLM's: each checkpoint writes gigabytes of KV cache to shared storage."""
_VLLM_MIN_INTERVAL = format_duration(VLLM_MIN_CHECKPOINT_INTERVAL)


class Toleration(ApiModel):
    """Lets the worker's pod run on nodes with a matching taint."""

    key: Annotated[str, StringConstraints(max_length=317)] | None = Field(
        default=None, description="The taint key; empty with operator Exists matches all."
    )
    operator: Literal["Exists", "Equal"] = Field(
        default="Equal", description="Exists ignores the value; Equal compares it."
    )
    value: Annotated[str, StringConstraints(max_length=63)] | None = Field(
        default=None, description="The taint value for operator Equal."
    )
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="The taint effect to match; empty matches all effects."
    )
    toleration_seconds: int | None = Field(
        default=None,
        ge=0,
        le=MAX_TOLERATION_SECONDS,
        description=(
            "For NoExecute: how long the pod stays after the taint, at most a year "
            "(31536000); leave it unset to tolerate the taint for ever."
        ),
    )


class PodOverlay(ApiModel):
    """Pod settings merged into the worker's pod as the operator builds it."""

    labels: dict[str, str] = Field(default_factory=dict, description="Extra pod labels.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Extra pod annotations.")
    node_selector: dict[str, str] = Field(
        default_factory=dict,
        description="Node labels the pod requires, such as nvidia.com/gpu.product: H100.",
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=64, description="Taints the pod tolerates."
    )
    affinity: dict[str, Any] | None = Field(
        default=None, description="A core/v1 Affinity, copied into the pod unchanged."
    )
    volumes: list[dict[str, Any]] = Field(
        default_factory=list, max_length=64, description="core/v1 Volumes added to the pod."
    )
    volume_mounts: list[dict[str, Any]] = Field(
        default_factory=list,
        max_length=64,
        description="core/v1 VolumeMounts added to the engine container.",
    )
    service_account_name: ObjectName | None = Field(
        default=None, description="The ServiceAccount the pod runs as."
    )
    priority_class_name: Annotated[str, StringConstraints(max_length=253)] | None = Field(
        default=None, description="The pod's PriorityClass."
    )
    runtime_class_name: Annotated[str, StringConstraints(max_length=253)] | None = Field(
        default=None, description="The pod's RuntimeClass, such as nvidia."
    )


class Capacity(ApiModel):
    """How much the worker can hold; placement compares load against it."""

    max_sessions: int = Field(
        default=32,
        ge=1,
        le=MAX_SESSIONS_PER_WORKER,
        description=(
            "The most sessions pinned at once, 1 to 100000: a coding agent's context is "
            "12K-200K tokens, so even the largest KV cache (see kvTokens) holds far fewer."
        ),
    )
    kv_tokens: int = Field(
        default=0,
        ge=0,
        le=MAX_KV_TOKENS,
        description=(
            "KV cache capacity in tokens, for placement; 0 means unknown "
            "(placement then uses maxSessions and the engine's reported KV usage). "
            "At most 100000000: the largest GPU node (8 H200, 1.1 TB of HBM) holds about "
            "34 million tokens of a 1B model's 16-bit KV cache (32 KiB a token), and about "
            "4 million of a 32B model's (256 KiB a token)."
        ),
    )


class CheckpointStorage(ApiModel):
    """Where checkpoints are written."""

    claim_name: ObjectName | None = Field(
        default=None, description="A PersistentVolumeClaim mounted for checkpoints."
    )
    path: AbsolutePath = Field(
        default="/var/lib/sessionfleet/checkpoints",
        description=(
            "The directory checkpoints are written under, <path>/<namespace>/<worker>/<name>: "
            "an absolute path of at most 1024 printable ASCII characters, with no '.' or "
            "'..' segment, no '//', no trailing '/' and no '%' or '\\'."
        ),
    )
    remote_url: (
        Annotated[str, StringConstraints(pattern=r"^(redis|rediss|lm|s3|file)://", max_length=1024)]
        | None
    ) = Field(
        default=None,
        description=(
            "The shared store of kvStore.type LMCache (its remote_url), such as redis://host:6379."
        ),
    )


class KVStoreType(DescribedEnum):
    """The KV store a vLLM worker's engine saves its prefix blocks to and loads them from."""

    SESSIONFLEET = (
        "Sessionfleet",
        "sessionfleet's KV connector (vLLM's connector interface, CPU and CUDA): every "
        "engine of the model saves its completed prefix blocks under the checkpoint "
        "storage and loads any saved prefix, so a moved or restarted session continues "
        "from its cache (docs/kvstore.md).",
    )
    LMCACHE = (
        "LMCache",
        "LMCache's connector with the shared remote store in storage.remoteUrl "
        "(GPU fleets; not in the project's image).",
    )
    VLLM_OFFLOADING = (
        "VllmOffloading",
        "vLLM's own OffloadingConnector with a file-system tier under the checkpoint "
        "storage, shared by every engine of the model (CUDA or XPU GPUs only).",
    )
    NONE = "None", "No KV store: a moved or restarted session recomputes its prefix."


MAX_KV_STORE_GIB = 1_000_000


class KVStoreSettings(ApiModel):
    """The KV store of a vLLM worker (ignored by the simulated engine, which exports its own)."""

    type: KVStoreType = Field(
        default=KVStoreType.SESSIONFLEET, description="Which KV store the engine uses."
    )
    max_gib: int = Field(
        default=100,
        alias="maxGiB",
        ge=0,
        le=MAX_KV_STORE_GIB,
        description=(
            "Sessionfleet store only: the most GiB of blocks kept for this worker's model "
            "in its storage (0: no cap), 0 to 1000000. Above it the least recently used "
            "blocks are removed."
        ),
    )


class CheckpointSettings(ApiModel):
    """When and how the worker's state is saved."""

    driver: CheckpointDriver = Field(
        default=CheckpointDriver.ENGINE, description="The checkpoint driver."
    )
    interval: Duration | None = Field(
        default=None,
        description=(
            "Take a periodic checkpoint this often, skipped when nothing changed; unset: none. "
            "Between 1s and 168h (7 days), and at least 1m for engine vllm: each "
            "checkpoint copies the worker's KV cache (gigabytes for vLLM)."
        ),
    )
    retention: int = Field(
        default=3,
        ge=1,
        le=100,
        description=(
            "How many checkpoints of the worker to keep, 1 to 100 (each holds a copy of "
            "the KV cache)."
        ),
    )
    storage: CheckpointStorage = Field(
        default_factory=CheckpointStorage,
        json_schema_extra=nested_default(),
        description="Where checkpoints are written.",
    )
    kv_store: KVStoreSettings = Field(
        default_factory=KVStoreSettings,
        json_schema_extra=nested_default(),
        description=(
            "vLLM only: the KV store that carries sessions' prefixes across workers and "
            "epochs (used with every driver but none)."
        ),
    )

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CHECKPOINT_INTERVAL.rule("interval", "interval"),
        CelRule(
            rule="!has(self.kvStore) || !has(self.kvStore.type) || "
            "self.kvStore.type != 'LMCache' || (has(self.storage) && has(self.storage.remoteUrl))",
            message="kvStore.type LMCache needs storage.remoteUrl (the shared store's URL)",
            field_path=".kvStore.type",
            check=lambda s: (
                s.kv_store.type != KVStoreType.LMCACHE or s.storage.remote_url is not None
            ),
        ),
    )


class InferenceWorkerSpec(ApiModel):
    """The desired state of one serving instance."""

    model: ModelName = Field(
        json_schema_extra=immutable("model"),
        description="The served model's name, as clients send it in the request's model field.",
    )
    engine: EngineSpec = Field(
        default_factory=EngineSpec,
        json_schema_extra=nested_default(),
        description="The engine to run and how to start it.",
    )
    gpus: int = Field(default=1, ge=0, le=16, description="GPUs (nvidia.com/gpu) for the pod.")
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements,
        json_schema_extra=nested_default(),
        description="CPU and memory for the engine container.",
    )
    template: PodOverlay = Field(
        default_factory=PodOverlay,
        json_schema_extra=nested_default(),
        description="Pod settings merged into the pod the operator builds.",
    )
    capacity: Capacity = Field(
        default_factory=Capacity,
        json_schema_extra=nested_default(),
        description="How much the worker can hold, for placement.",
    )
    checkpoint: CheckpointSettings = Field(
        default_factory=CheckpointSettings,
        json_schema_extra=nested_default(),
        description="When and how the worker's state is saved.",
    )
    drain_policy_ref: ObjectName | None = Field(
        default=None,
        description=(
            "The DrainPolicy to use; unset: the one whose selector matches, else the default."
        ),
    )
    drain: bool = Field(
        default=False,
        description=(
            "Request a drain: hold, migrate or wait per the DrainPolicy, then stop the pod."
        ),
    )

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="self.engine.type != 'vllm' || self.gpus >= 1",
            message="engine vllm needs at least one GPU (gpus >= 1)",
            field_path=".gpus",
            check=lambda s: s.engine.type != EngineType.VLLM or s.gpus >= 1,
        ),
        CelRule(
            # has() guards: interval is optional, and checkpoint has the default {}.
            rule="!has(self.checkpoint) || !has(self.checkpoint.interval) || "
            "self.engine.type != 'vllm' || "
            f"duration(self.checkpoint.interval) >= duration('{_VLLM_MIN_INTERVAL}')",
            message=f"checkpoint.interval must be at least {_VLLM_MIN_INTERVAL} for engine "
            "vllm: each checkpoint copies gigabytes of KV cache",
            field_path=".checkpoint.interval",
            check=lambda s: (
                s.engine.type != EngineType.VLLM
                or s.checkpoint.interval is None
                or parse_duration(s.checkpoint.interval) >= VLLM_MIN_CHECKPOINT_INTERVAL
            ),
        ),
    )


class InferenceWorkerStatus(ApiModel):
    """The observed state of a worker, written by the operator."""

    observed_generation: int | None = Field(
        default=None, ge=0, description="The metadata.generation the operator last acted on."
    )
    phase: WorkerPhase | None = Field(default=None, description="Where the worker is in its life.")
    epoch: int | None = Field(
        default=None, ge=0, description="The incarnation number: +1 each time the pod is replaced."
    )
    pod: str | None = Field(default=None, description="The current pod, <worker>-<epoch>.")
    node: str | None = Field(default=None, description="The node the current pod runs on.")
    endpoint: str | None = Field(
        default=None, description="The engine's base URL, http://<podIP>:<port>."
    )
    pinned_sessions: int | None = Field(
        default=None, ge=0, description="Sessions bound to this worker that have not finished."
    )
    active_sessions: int | None = Field(
        default=None, ge=0, description="Pinned sessions with a turn in the last minute."
    )
    kv_cache_usage_percent: int | None = Field(
        default=None, ge=0, le=100, description="KV cache usage reported by the engine, 0-100."
    )
    prefix_hit_rate_percent: float | None = Field(
        default=None,
        ge=0,
        le=100,
        description="Prefix cache hits over queries since the engine started, 0-100.",
    )
    running_requests: int | None = Field(
        default=None, ge=0, description="Requests the engine is running."
    )
    waiting_requests: int | None = Field(
        default=None, ge=0, description="Requests queued in the engine."
    )
    drain_started_at: datetime | None = Field(
        default=None, description="When the current drain began."
    )
    last_checkpoint: str | None = Field(
        default=None, description="The newest Succeeded WorkerCheckpoint of this worker."
    )
    consecutive_failures: int | None = Field(
        default=None,
        ge=0,
        description="Epochs in a row whose pod failed before Ready; resets when one is Ready.",
    )
    last_recovery_at: datetime | None = Field(
        default=None, description="When the operator last started a new epoch to recover."
    )
    restore_count: int | None = Field(
        default=None, ge=0, description="How many times a new epoch restored a checkpoint."
    )
    conditions: list[Condition] = conditions_field("worker")


class InferenceWorker(CustomResource):
    """One serving instance with a stable identity; its pod is replaced by epochs."""

    info: ClassVar[KindInfo] = KindInfo(
        kind="InferenceWorker",
        plural="inferenceworkers",
        singular="inferenceworker",
        short_names=("iw", "worker"),
        printer_columns=(
            PrinterColumn("Model", ".spec.model", "string", "The served model."),
            PrinterColumn("Phase", ".status.phase", "string", "Where the worker is in its life."),
            PrinterColumn("Node", ".status.node", "string", "The node of the current pod."),
            PrinterColumn("Sessions", ".status.pinnedSessions", "integer", "Pinned sessions."),
            PrinterColumn("KV%", ".status.kvCacheUsagePercent", "integer", "KV cache usage."),
            PrinterColumn("Epoch", ".status.epoch", "integer", "The pod's incarnation number."),
            AGE_COLUMN,
        ),
    )

    kind: Literal["InferenceWorker"] = Field(default="InferenceWorker", description="The kind.")
    spec: InferenceWorkerSpec = Field(description="The desired state of the worker.")
    status: InferenceWorkerStatus = Field(
        default_factory=InferenceWorkerStatus, description="The observed state of the worker."
    )
