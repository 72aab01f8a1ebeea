"""The sessionfleet.dev/v1alpha1 API: the four kinds as pydantic models.

These models are the single source of truth: the CRDs in ``crds/``, the chart's CRD
templates and the API reference are generated from them (``sessionfleet crds``).
"""

from sessionfleet.api._common import (
    API_VERSION,
    GROUP,
    VERSION,
    CelRule,
    CheckpointDriver,
    Condition,
    ConditionStatus,
    ConditionType,
    DescribedEnum,
    Duration,
    EngineType,
    LabelSelector,
    ObjectMeta,
    Reason,
    format_duration,
    parse_duration,
)
from sessionfleet.api._resource import CustomResource, KindInfo, PrinterColumn
from sessionfleet.api.checkpoint import (
    OPERATOR_REASONS,
    CheckpointPhase,
    CheckpointReason,
    WorkerCheckpoint,
    WorkerCheckpointSpec,
    WorkerCheckpointStatus,
    destination_problem,
    reserved_reason_problem,
)
from sessionfleet.api.drainpolicy import (
    DeadlineAction,
    DrainMode,
    DrainPolicy,
    DrainPolicySpec,
    DrainPolicyStatus,
    HoldMechanism,
    MigrationScope,
)
from sessionfleet.api.kinds import KINDS, KINDS_BY_NAME
from sessionfleet.api.parse import Parsed, parse
from sessionfleet.api.session import (
    AgentSession,
    AgentSessionSpec,
    AgentSessionStatus,
    MigrationReason,
    SessionClient,
    SessionPhase,
)
from sessionfleet.api.worker import (
    InferenceWorker,
    InferenceWorkerSpec,
    InferenceWorkerStatus,
    KVStoreType,
    WorkerPhase,
)

__all__ = [
    "API_VERSION",
    "GROUP",
    "KINDS",
    "KINDS_BY_NAME",
    "OPERATOR_REASONS",
    "VERSION",
    "AgentSession",
    "AgentSessionSpec",
    "AgentSessionStatus",
    "CelRule",
    "CheckpointDriver",
    "CheckpointPhase",
    "CheckpointReason",
    "Condition",
    "ConditionStatus",
    "ConditionType",
    "CustomResource",
    "DeadlineAction",
    "DescribedEnum",
    "DrainMode",
    "DrainPolicy",
    "DrainPolicySpec",
    "DrainPolicyStatus",
    "Duration",
    "EngineType",
    "HoldMechanism",
    "InferenceWorker",
    "InferenceWorkerSpec",
    "InferenceWorkerStatus",
    "KVStoreType",
    "KindInfo",
    "LabelSelector",
    "MigrationReason",
    "MigrationScope",
    "ObjectMeta",
    "Parsed",
    "PrinterColumn",
    "Reason",
    "SessionClient",
    "SessionPhase",
    "WorkerCheckpoint",
    "WorkerCheckpointSpec",
    "WorkerCheckpointStatus",
    "WorkerPhase",
    "destination_problem",
    "format_duration",
    "parse",
    "parse_duration",
    "reserved_reason_problem",
]
