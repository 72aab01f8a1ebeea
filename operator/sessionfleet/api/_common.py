"""Building blocks shared by every kind.

Base models, enums with descriptions, durations, conditions, label selectors and
CEL rule declarations.

Everything here is pure: no I/O, so that the API can be imported by the router's
hot path, the simulator and the CRD generator alike.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Final, Self

from pydantic import (
    AfterValidator,
    AliasGenerator,
    BaseModel,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    StringConstraints,
    WithJsonSchema,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

GROUP = "sessionfleet.dev"
VERSION = "v1alpha1"
API_VERSION: Final = "sessionfleet.dev/v1alpha1"

# The CRD generator folds this key into the field's description and removes it.
MEMBER_DESCRIPTIONS_KEY = "x-sessionfleet-members"

# --- enums --------------------------------------------------------------------------


class DescribedEnum(StrEnum):
    """A string enum whose members each carry one sentence of documentation.

    Members are declared as ``NAME = "Value", "What it means."``; the sentence ends
    up in the CRD field description, so ``kubectl explain`` lists every value.
    """

    description: str

    def __new__(cls, value: str, description: str = "") -> Self:
        member = str.__new__(cls, value)
        member._value_ = value
        member.description = description
        return member

    @classmethod
    def describe_members(cls) -> str:
        """Return one line per member, ``Value: description``, for schema text."""
        return "\n".join(f"{m.value}: {m.description}" for m in cls)

    @classmethod
    def __get_pydantic_json_schema__(
        cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        schema = handler.resolve_ref_schema(handler(core_schema))
        schema[MEMBER_DESCRIPTIONS_KEY] = cls.describe_members()
        return schema


class ConditionStatus(DescribedEnum):
    """Whether a condition holds."""

    TRUE = "True", "The condition holds."
    FALSE = "False", "The condition does not hold."
    UNKNOWN = "Unknown", "The controller cannot tell yet."


class ConditionType(DescribedEnum):
    """The kinds of condition the controllers set."""

    READY = "Ready", "The object is doing its job: a worker serves, a session is bound."
    VALID = "Valid", "The spec could be parsed and acted on."
    DRAINING = "Draining", "A drain of the worker is in progress."
    DRAIN_HELD = "DrainHeld", "Eviction of the worker's pod is blocked because sessions are pinned."
    RECOVERING = "Recovering", "The worker's pod is being replaced by a new epoch."
    CHECKPOINTED = (
        "Checkpointed",
        "A usable checkpoint exists: on a worker, its newest; on a WorkerCheckpoint, this one.",
    )
    CONFLICT = (
        "Conflict",
        "A DrainPolicy cannot be applied as written: several select the same worker, or the "
        "one a worker references is missing or invalid.",
    )
    RECONCILED = "Reconciled", "The operator could act on the object; False says what failed."
    ENGINE_METRICS = "EngineMetrics", "The engine's metrics could be read and used."
    KV_STORE = "KVStore", "vLLM only: the engine's KV store can save sessions' prefix blocks."


class Reason(DescribedEnum):
    """Machine-readable reasons for conditions and events (CamelCase constants)."""

    INVALID_SPEC = "InvalidSpec", "The spec could not be parsed; the message names the field."
    PARSED = "Parsed", "The spec was parsed and accepted."
    POD_PENDING = "PodPending", "The worker's pod exists but is not scheduled or not started."
    POD_STARTING = "PodStarting", "The worker's pod runs but is not ready yet."
    POD_READY = "PodReady", "The worker's pod is ready to serve."
    POD_FAILED = "PodFailed", "The worker's pod failed."
    POD_DELETED = "PodDeleted", "The worker's pod was deleted by someone other than the operator."
    NODE_NOT_READY = "NodeNotReady", "The worker's node has been NotReady beyond the toleration."
    NEW_EPOCH = "NewEpoch", "A new pod (epoch) replaces the previous one."
    RECOVERY_BACK_OFF = (
        "RecoveryBackOff",
        "Pods keep failing before Ready; the next epoch waits, doubling each time.",
    )
    NO_READY_WORKER = "NoReadyWorker", "No Ready worker serves the session's model."
    NO_CAPACITY = "NoCapacity", "Every worker serving the model is at capacity."
    PINNED_WORKER_UNAVAILABLE = (
        "PinnedWorkerUnavailable",
        "The worker the session is pinned to is missing, not Ready or full.",
    )
    BOUND = "Bound", "The session is bound to a worker."
    WORKER_DELETED = "WorkerDeleted", "The session's worker was deleted; its cache is gone."
    WORKER_RECOVERING = "WorkerRecovering", "The session's worker is being recreated."
    MIGRATING = "Migrating", "The session moves to another worker at its next turn boundary."
    FINISHED_BY_CLIENT = "FinishedByClient", "The client marked the session finished."
    IDLE_TIMEOUT = "IdleTimeout", "The session had no turn for longer than the idle timeout."
    LOST_EXPIRED = (
        "LostExpired",
        "The session was Lost and had no turn for the lost-session timeout; it is deleted "
        "after ttlSecondsAfterFinished.",
    )
    DRAIN_REQUESTED = "DrainRequested", "The worker's spec asks for a drain (drain: true)."
    NODE_CORDONED = "NodeCordoned", "The worker's node was cordoned (unschedulable)."
    DISRUPTION_TAINT = "DisruptionTaint", "The worker's node carries a disruption taint."
    SESSIONS_PINNED = "SessionsPinned", "Sessions are still pinned to the worker."
    GRACE_PERIOD_EXPIRED = "GracePeriodExpired", "The drain's grace period passed: migrating."
    DEADLINE_REACHED = "DeadlineReached", "The drain deadline passed."
    DRAINED = "Drained", "No session is pinned to the worker any more."
    POLICY_CONFLICT = "PolicyConflict", "Several DrainPolicies select this worker."
    POLICY_NOT_FOUND = "PolicyNotFound", "The referenced DrainPolicy does not exist."
    POLICY_INVALID = (
        "PolicyInvalid",
        "The referenced DrainPolicy exists but its spec could not be parsed; the message says why.",
    )
    CHECKPOINT_SUCCEEDED = "CheckpointSucceeded", "The checkpoint was written."
    CHECKPOINT_FAILED = "CheckpointFailed", "The checkpoint could not be written."
    DRIVER_UNSUPPORTED = (
        "DriverUnsupported",
        "The checkpoint driver cannot run here (driver none, a driver this operator lacks, or "
        "a node without what it needs); nothing was attempted.",
    )
    RESERVED_CHECKPOINT_REASON = (
        "ReservedCheckpointReason",
        "A WorkerCheckpoint the operator did not create has reason Drain or Periodic, "
        "which only the operator sets: it is marked Failed and never run.",
    )
    DESTINATION_OUTSIDE_STORAGE = (
        "DestinationOutsideStorage",
        "A WorkerCheckpoint's destination is not inside <storage.path>/<namespace>/ of its "
        "worker: it is marked Failed and never run.",
    )
    RECONCILE_ERROR = (
        "ReconcileError",
        "Acting on the object failed; the message says how. Other objects are unaffected.",
    )
    RECONCILE_SUCCEEDED = "ReconcileSucceeded", "The last pass acted on the object without error."
    METRICS_READ = "MetricsRead", "The engine's metrics were read."
    NON_FINITE_METRICS = (
        "NonFiniteMetrics",
        "The engine reported NaN or infinite values; they are ignored.",
    )
    KV_STORE_WRITABLE = "KVStoreWritable", "The engine's KV store answered and can be written."
    KV_STORE_DEGRADED = (
        "KVStoreDegraded",
        "The engine's KV store cannot be written (full, read-only, missing): sessions "
        "are served, and a moved or restarted one recomputes what was not saved.",
    )
    RECOVERY_CAPPED = (
        "RecoveryCapped",
        "The most workers allowed to recover at once are recovering: this one waits its turn.",
    )
    DISRUPTION_THRESHOLD = (
        "DisruptionThreshold",
        "Too many nodes are NotReady at once (more likely a control-plane or network fault "
        "than lost nodes): workers are not moved.",
    )


class EngineType(DescribedEnum):
    """The inference engine a worker runs."""

    VLLM = "vllm", "The vLLM OpenAI-compatible server: the production engine."
    SIM = "sim", "The simulated vLLM-compatible engine, for tests, benchmarks and sandboxes."


class CheckpointDriver(DescribedEnum):
    """How a worker's state is saved and restored."""

    NONE = "none", "No checkpoints: a lost or drained worker's sessions recompute their prefix."
    ENGINE = "engine", "The engine exports its KV state to shared storage and re-imports it."
    CRIU = "criu", "The node agent checkpoints GPU state (CUDA API) and dumps the process (CRIU)."
    KUBELET = "kubelet", "The kubelet checkpoint API, through the API server's node proxy."


# --- scalar types -------------------------------------------------------------------

# At most six digits per number: the largest a pattern-valid duration can be,
# 999999h999999m999999s (about 116 years), stays far inside Go's time.Duration (about
# 292 years), which Kubernetes CEL's duration() parses into; a longer number would
# overflow there (and in timedelta) instead of being refused.
DURATION_PATTERN = r"^([0-9]{1,6}h)?([0-9]{1,6}m)?([0-9]{1,6}s)?$"
DURATION_MAX_LENGTH = 16
_DURATION_PARTS = re.compile(r"([0-9]+)([hms])")
_UNIT_SECONDS = {"h": 3600, "m": 60, "s": 1}
MAX_DURATION: Final = timedelta(days=365)
"""The longest duration :func:`parse_duration` accepts: no field or flag means more."""

Duration = Annotated[
    str,
    StringConstraints(pattern=DURATION_PATTERN, min_length=2, max_length=DURATION_MAX_LENGTH),
    Field(
        description=(
            "A duration such as 90s, 30m or 1h30m (hours, minutes and seconds, "
            "at most six digits each)."
        ),
        examples=["90s", "30m", "1h30m"],
    ),
]
"""A duration written as Kubernetes CEL's ``duration()`` reads it: ``1h30m``, ``90s``."""


def parse_duration(text: str) -> timedelta:
    """Return the :class:`timedelta` for a :data:`Duration` string such as ``1h30m``.

    :class:`ValueError` for anything else, and for a duration longer than
    :data:`MAX_DURATION` (a year): no setting is meant to be longer, and an absurd one
    such as ``999999h`` is a mistake, not a wish.
    """
    if (
        not isinstance(text, str)
        or not 2 <= len(text) <= DURATION_MAX_LENGTH
        or re.fullmatch(DURATION_PATTERN, text) is None
    ):
        raise ValueError(
            f"not a duration: {str(text)[:40]!r} (expected forms such as 90s, 30m, 1h30m, "
            "with at most six digits per number)"
        )
    seconds = sum(int(n) * _UNIT_SECONDS[unit] for n, unit in _DURATION_PARTS.findall(text))
    if seconds > MAX_DURATION.total_seconds():
        raise ValueError(
            f"duration {text} is longer than the most accepted, "
            f"{format_duration(MAX_DURATION)} (365 days)"
        )
    return timedelta(seconds=seconds)


def format_duration(value: timedelta) -> str:
    """Write a whole-second :class:`timedelta` as a :data:`Duration`: ``1h30m``, ``90s``."""
    seconds = int(value.total_seconds())
    if seconds < 0:
        raise ValueError(f"a duration is not negative: {value}")
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    text = (f"{hours}h" if hours else "") + (f"{minutes}m" if minutes else "")
    return text + (f"{secs}s" if secs or not text else "")


# --- paths --------------------------------------------------------------------------

# One path segment: printable ASCII other than '/', '%' and backslash (nothing on the way
# decodes a path, so an encoded '..' would only be a strange name; refusing the
# characters keeps the path shown the path used, as the node agent's checked_path
# does), and neither '.' nor '..'. Written without look-arounds: Kubernetes checks
# CRD patterns with Go's RE2.
_SEGMENT_CHAR = r"[\x20-\x24\x26-\x2d\x30-\x5b\x5d-\x7e]"  # no '.', '/', '%', '\'
_SEGMENT_CHAR_OR_DOT = r"[\x20-\x24\x26-\x2e\x30-\x5b\x5d-\x7e]"
_SEGMENT = (
    rf"(?:{_SEGMENT_CHAR}{_SEGMENT_CHAR_OR_DOT}*"
    rf"|\.{_SEGMENT_CHAR}{_SEGMENT_CHAR_OR_DOT}*"
    rf"|\.\.{_SEGMENT_CHAR_OR_DOT}+)"
)
ABSOLUTE_PATH_PATTERN = rf"^(?:/{_SEGMENT})+$"
"""An absolute path below ``/``: no ``.`` or ``..`` segment, no ``//``, no trailing ``/``."""
PATH_MAX_LENGTH = 1024

_PATH_TEXT = re.compile(r"[\x20-\x24\x26-\x5b\x5d-\x7e]*")


def absolute_path_problem(text: str) -> str | None:
    """Return what is wrong with ``text`` as an :data:`AbsolutePath`, in words, or ``None``.

    The same rules as :data:`ABSOLUTE_PATH_PATTERN` (the CRD's), with a reason a
    person can act on instead of the pattern.
    """
    if not text.startswith("/"):
        return "must be an absolute path, starting with '/'"
    if text == "/":
        return "must not be '/' itself"
    if len(text) > PATH_MAX_LENGTH:
        return f"must be at most {PATH_MAX_LENGTH} characters"
    if not _PATH_TEXT.fullmatch(text):
        return "may hold only printable ASCII characters other than '%' and '\\'"
    segments = text.split("/")[1:]
    if "" in segments:
        return "must have no empty segment: no '//' and no trailing '/'"
    if "." in segments or ".." in segments:
        return "must have no '.' or '..' segment"
    return None


def _check_absolute_path(text: str) -> str:
    problem = absolute_path_problem(text)
    if problem is not None:
        raise ValueError(f"{problem}: {text[:80]!r}")
    return text


AbsolutePath = Annotated[
    str,
    AfterValidator(_check_absolute_path),
    WithJsonSchema(
        {
            "type": "string",
            "pattern": ABSOLUTE_PATH_PATTERN,
            "minLength": 2,
            "maxLength": PATH_MAX_LENGTH,
        }
    ),
    Field(
        description=(
            "An absolute directory path of at most 1024 printable ASCII characters: "
            "no '.' or '..' segment, no empty segment ('//'), no trailing '/', "
            "no '%' or '\\'; '/' alone is refused."
        ),
        examples=["/var/lib/sessionfleet/checkpoints"],
    ),
]
"""A normalised absolute path: the lexical form is the path the operator and agent use.

The model checks it with :func:`absolute_path_problem` (a message in words); the CRD
carries the equivalent :data:`ABSOLUTE_PATH_PATTERN`.
"""


def path_inside(path: str, root: str) -> bool:
    """Whether the :data:`AbsolutePath` ``path`` lies strictly below ``root`` (lexically).

    Both are normalised by their pattern (no ``.``, ``..``, ``//`` or trailing ``/``),
    so comparing segment prefixes is exact; symlinks are the node agent's to resolve.
    """
    return path.startswith(root.rstrip("/") + "/")


DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
ObjectName = Annotated[
    str,
    StringConstraints(pattern=DNS_LABEL_PATTERN, min_length=1, max_length=63),
    Field(description="The name of an object in the same namespace."),
]
ModelName = Annotated[
    str,
    StringConstraints(min_length=1, max_length=256),
    Field(description="The served model's name, as clients send it in the request's model field."),
]
REASON_PATTERN = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"


# --- CEL rules ----------------------------------------------------------------------


@dataclass(frozen=True)
class CelRule:
    """One ``x-kubernetes-validations`` rule, declared on the model it constrains.

    ``check`` is the same rule in Python for rules that read only the new object,
    so that a spec the API server would reject is also rejected when the operator or
    a test parses it. Transition rules (those using ``oldSelf``) have no ``check``:
    only the API server sees the old object.
    """

    rule: str
    message: str
    field_path: str | None = None
    check: Callable[[Any], bool] | None = None

    def to_schema(self) -> dict[str, str]:
        """Return the rule as it appears in a CRD schema."""
        out = {"rule": self.rule, "message": self.message}
        if self.field_path:
            out["fieldPath"] = self.field_path
        return out


def field_rules(*rules: CelRule) -> dict[str, Any]:
    """Field ``json_schema_extra`` attaching CEL rules to that field's schema node."""
    return {"x-kubernetes-validations": [rule.to_schema() for rule in rules]}


def immutable(what: str) -> dict[str, Any]:
    """Field ``json_schema_extra`` making the field immutable once set."""
    return field_rules(CelRule("self == oldSelf", f"{what} is immutable"))


def _emit_cel_rules(schema: dict[str, Any], model: type[Any]) -> None:
    """Write a model's declared :class:`CelRule` objects onto its schema node."""
    rules = getattr(model, "cel_rules", ())
    if rules:
        schema["x-kubernetes-validations"] = [rule.to_schema() for rule in rules]


@dataclass(frozen=True)
class DurationBounds:
    """The shortest and longest values of one :data:`Duration` field, and why.

    :meth:`rule` declares them as a CEL rule of the model holding the field (with a
    ``has()`` guard: the API server also checks a model's rules against the CRD's
    ``default: {}``, before nested defaults are filled in), and its Python ``check``
    makes the model refuse what the API server refuses.
    """

    minimum: timedelta
    maximum: timedelta
    why: str = ""

    def contains(self, text: str | None) -> bool:
        """Whether ``text`` (a duration, or unset) is within the bounds."""
        if text is None:
            return True
        try:
            return self.minimum <= parse_duration(text) <= self.maximum
        except ValueError:
            return False

    def describe(self) -> str:
        """Return ``between 1m and 168h``, for descriptions and messages."""
        return f"between {format_duration(self.minimum)} and {format_duration(self.maximum)}"

    def rule(self, json_name: str, attribute: str) -> CelRule:
        """Return the CEL rule of the model with the field ``json_name`` (Python: ``attribute``)."""
        low, high = format_duration(self.minimum), format_duration(self.maximum)
        value = f"duration(self.{json_name})"
        why = f": {self.why}" if self.why else ""
        return CelRule(
            rule=f"!has(self.{json_name}) || "
            f"({value} >= duration('{low}') && {value} <= duration('{high}'))",
            message=f"{json_name} must be {self.describe()}{why}",
            field_path=f".{json_name}",
            check=lambda model: self.contains(getattr(model, attribute)),
        )


# --- base models --------------------------------------------------------------------


class ApiModel(BaseModel):
    """Base of every spec and status model: camelCase on the wire, no unknown fields.

    Subclasses may list :class:`CelRule` objects in ``cel_rules``; the generator
    emits them on the model's schema node and :meth:`_check_cel_rules` enforces those
    that have a Python ``check``.
    """

    model_config = ConfigDict(
        alias_generator=AliasGenerator(alias=to_camel),
        populate_by_name=True,
        extra="forbid",
        use_enum_values=False,
        validate_default=True,
        json_schema_extra=_emit_cel_rules,
    )

    cel_rules: ClassVar[tuple[CelRule, ...]] = ()

    @model_validator(mode="after")
    def _check_cel_rules(self) -> Self:
        for cel_rule in type(self).cel_rules:
            if cel_rule.check is not None and not cel_rule.check(self):
                raise ValueError(cel_rule.message)
        return self

    def wire(self) -> dict[str, Any]:
        """Return the object as the API server stores it (camelCase, no unset fields)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


def nested_default() -> dict[str, Any]:
    """Field ``json_schema_extra`` giving an object field the CRD default ``{}``.

    Pydantic does not write defaults built by a factory into the schema; an empty
    object default makes the API server apply the nested fields' own defaults when a
    user leaves the whole object out, as the model does.
    """
    return {"default": {}}


class Condition(ApiModel):
    """The state of one aspect of an object, in the shape of metav1.Condition."""

    type: ConditionType = Field(description="The aspect this condition describes.")
    status: ConditionStatus = Field(description="Whether the condition holds.")
    reason: Annotated[str, StringConstraints(pattern=REASON_PATTERN, max_length=1024)] = Field(
        description="A CamelCase reason for the last transition (see the Reason enum)."
    )
    message: Annotated[str, StringConstraints(max_length=32768)] = Field(
        default="", description="A human-readable explanation of the last transition."
    )
    last_transition_time: datetime = Field(description="When the condition last changed status.")
    observed_generation: int | None = Field(
        default=None, ge=0, description="The metadata.generation this condition was set from."
    )


def conditions_field(kind: str) -> Any:
    """Return the ``conditions`` field of a status: a list map keyed by type (metav1)."""
    return Field(
        default_factory=list,
        max_length=16,
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
        },
        description=f"The {kind}'s conditions, one per type.",
    )


class LabelSelectorOperator(DescribedEnum):
    """Operators of a set-based label requirement."""

    IN = "In", "The label's value is one of the values."
    NOT_IN = "NotIn", "The label is absent or its value is none of the values."
    EXISTS = "Exists", "The label is present, whatever its value."
    DOES_NOT_EXIST = "DoesNotExist", "The label is absent."


class LabelSelectorRequirement(ApiModel):
    """One set-based label requirement."""

    key: Annotated[str, StringConstraints(min_length=1, max_length=317)] = Field(
        description="The label key the requirement applies to."
    )
    operator: LabelSelectorOperator = Field(description="How the key relates to the values.")
    values: list[Annotated[str, StringConstraints(max_length=63)]] = Field(
        default_factory=list,
        max_length=64,
        description="The values for In and NotIn; empty for Exists and DoesNotExist.",
    )


class LabelSelector(ApiModel):
    """Selects objects by their labels; an empty selector selects everything."""

    match_labels: dict[str, Annotated[str, StringConstraints(max_length=63)]] = Field(
        default_factory=dict, description="Labels that must all be present with these values."
    )
    match_expressions: list[LabelSelectorRequirement] = Field(
        default_factory=list, max_length=32, description="Requirements that must all hold."
    )

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Return whether ``labels`` satisfy this selector."""
        if any(labels.get(key) != value for key, value in self.match_labels.items()):
            return False
        for req in self.match_expressions:
            present = req.key in labels
            value = labels.get(req.key)
            match req.operator:
                case LabelSelectorOperator.IN:
                    ok = present and value in req.values
                case LabelSelectorOperator.NOT_IN:
                    ok = not present or value not in req.values
                case LabelSelectorOperator.EXISTS:
                    ok = present
                case LabelSelectorOperator.DOES_NOT_EXIST:
                    ok = not present
            if not ok:
                return False
        return True


class ObjectMeta(BaseModel):
    """The part of metadata the controllers read; the rest is kept as is."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str = Field(default="", description="The object's name.")
    namespace: str = Field(default="", description="The object's namespace.")
    uid: str = Field(default="", description="The object's UID.")
    generation: int = Field(default=0, description="The spec's generation.")
    labels: dict[str, str] = Field(default_factory=dict, description="The object's labels.")
    annotations: dict[str, str] = Field(
        default_factory=dict, description="The object's annotations."
    )
    resource_version: str = Field(
        default="", alias="resourceVersion", description="The object's resourceVersion."
    )
