"""Hidden inputs, drawn from the CRDs: whatever the API server accepts, nothing raises on it.

Every object the operator reads comes through the API server, which checks it against
the generated CRD schema (``crds/*.yaml``) and against nothing the operator controls:
an object stored before a rule existed, a status written by anyone allowed the status
subresource, and values at the edges of their bounds all reach the parsers. For each
kind, these properties draw whole objects the served version's ``openAPIV3Schema``
accepts (spec, and status where the kind has one: the operator parses the statuses it
reads back) and check that

- ``sessionfleet.api.parse`` returns a parsed object or an ``InvalidSpec`` result,
  never an exception (an object a CEL rule refuses may be refused by the model);
- the index records the operator builds from watch events never raise;
- the pure decisions that read a parsed object (the worker plan, drains, checkpoint
  timing and retention, the session decision, placement, the migration handshake)
  never raise on it;

and that ``parse_duration`` answers any string the CRDs' Duration pattern accepts
with a ``timedelta`` or a ``ValueError``.

The objects are drawn by :func:`from_crd_schema`, a small translation of the CRD
keyword subset (the one ``sessionfleet.api.crd`` may emit) into Hypothesis strategies,
with the API server's own semantics: unknown fields pruned (no extra keys, except under
``x-kubernetes-preserve-unknown-fields``), ``x-kubernetes-int-or-string``, list types
``set`` and ``map``, Go's RE2 reading of ``$`` (end of text only) and RFC 3339
date-times. hypothesis-jsonschema was the first choice, but its latest release (0.23.1,
and its source as of December 2025) draws objects with a private Hypothesis helper
whose interface changed in Hypothesis 6.170.10 (``AttributeError: 'many' object has no
attribute 'more'`` on any object schema); and it knows none of the Kubernetes
extensions (an int-or-string node would draw any JSON value, and every object would
carry fields the API server prunes). A self-check validates drawn objects against the
schema with ``jsonschema``.

The examples are fixed (``derandomize``), so every run of ``make test`` draws the same;
``SESSIONFLEET_CRD_EXAMPLES=2000`` draws that many per property, at random.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, datetime, timedelta, timezone
from functools import cache
from itertools import product
from pathlib import Path
from typing import Any, TypeVar

import jsonschema
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessionfleet.api import (
    KINDS_BY_NAME,
    AgentSession,
    CheckpointDriver,
    CheckpointPhase,
    CheckpointReason,
    CustomResource,
    DrainPolicy,
    DrainPolicySpec,
    InferenceWorker,
    Parsed,
    Reason,
    SessionPhase,
    WorkerCheckpoint,
    WorkerPhase,
    destination_problem,
    parse,
    parse_duration,
    reserved_reason_problem,
)
from sessionfleet.api._common import DURATION_PATTERN, MAX_DURATION
from sessionfleet.api.worker import CheckpointSettings
from sessionfleet.controllers.records import (
    checkpoint_record,
    policy_record,
    session_record,
    worker_record,
)
from sessionfleet.policy.checkpoint import (
    abandoned,
    checkpoint_location,
    checkpoint_name,
    latest_usable,
    periodic_due,
    retention_victims,
)
from sessionfleet.policy.drain import (
    DrainDecision,
    PinnedSession,
    decide_drain,
    drain_trigger,
    holds_while_pinned,
    resolve_policy,
)
from sessionfleet.policy.handshake import RouterLease, handshake, stamp
from sessionfleet.policy.observed import NodeState, PodState
from sessionfleet.policy.placement import (
    Placement,
    PlacementRequest,
    WorkerLoad,
    admit_or_place,
    place,
)
from sessionfleet.policy.recovery import RecoveryBlock
from sessionfleet.policy.sessions import SessionDecision, WorkerBrief, decide_session
from sessionfleet.policy.worker import WorkerObservation, WorkerPlan, plan_worker, pod_name

CRDS = Path(__file__).resolve().parent.parent / "crds"

EXAMPLES = int(os.environ.get("SESSIONFLEET_CRD_EXAMPLES", "0"))
"""Examples per property, drawn at random when set (unset: the fixed ones of make test)."""


def examples(default: int) -> settings:
    return settings(
        max_examples=EXAMPLES or default,
        derandomize=not EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# --- the served schemas -------------------------------------------------------------------


@cache
def served_schema(kind: str) -> dict[str, Any]:
    """The ``openAPIV3Schema`` of the served version of ``kind``'s generated CRD."""
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["kind"] == kind:
            (version,) = [v for v in crd["spec"]["versions"] if v["served"]]
            return version["schema"]["openAPIV3Schema"]  # type: ignore[no-any-return]
    raise AssertionError(f"no CRD for {kind} in {CRDS}")


def subschema(kind: str, *path: str) -> dict[str, Any]:
    """A node of ``kind``'s schema by property names: ``subschema(kind, "spec", "checkpoint")``."""
    node = served_schema(kind)
    for name in path:
        node = node["properties"][name]
    return node


def test_every_crd_is_covered() -> None:
    kinds = {yaml.safe_load(p.read_text())["spec"]["names"]["kind"] for p in CRDS.glob("*.yaml")}
    assert (
        kinds
        == set(KINDS_BY_NAME)
        == {
            "InferenceWorker",
            "AgentSession",
            "DrainPolicy",
            "WorkerCheckpoint",
        }
    )


# --- strategies for what a CRD schema accepts ---------------------------------------------

HANDLED_KEYWORDS = frozenset(
    {
        "type",
        "format",
        "enum",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "minLength",
        "maxLength",
        "pattern",
        "minItems",
        "maxItems",
        "items",
        "properties",
        "required",
        "additionalProperties",
        "nullable",
        "x-kubernetes-int-or-string",
        "x-kubernetes-preserve-unknown-fields",
        "x-kubernetes-list-type",
        "x-kubernetes-list-map-keys",
        "x-kubernetes-map-type",
    }
)
IGNORED_KEYWORDS = frozenset(
    {
        "description",
        # The API server fills defaults in; the models fill in the same ones, and an
        # object stored before a default existed has none.
        "default",
        # CEL rules: the models carry their own copies (CelRule.check) and may refuse
        # what a rule refuses; a refusal is a result, not an exception.
        "x-kubernetes-validations",
    }
)

MAX_ITEMS = 3
"""The most items drawn for a list or map: the properties are about shapes and edges."""
MAX_TEXT = 24
INT64 = (-(2**63), 2**63 - 1)

JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(*INT64)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
ANY_JSON = st.recursive(
    JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=MAX_ITEMS)
        | st.dictionaries(st.text(max_size=8), inner, max_size=MAX_ITEMS)
    ),
    max_leaves=6,
)


def rfc3339_times() -> st.SearchStrategy[str]:
    """Date-times as Kubernetes' ``format: date-time`` accepts them (RFC 3339, Go's parser).

    Any year from 1 to 9999, fractions of 1-9 digits, ``Z`` or an offset up to ±23:59
    (the end of the calendar in one zone is past it in UTC).
    """
    clock = st.tuples(st.integers(0, 23), st.integers(0, 59), st.integers(0, 59)).map(
        lambda t: f"{t[0]:02d}:{t[1]:02d}:{t[2]:02d}"
    )
    fraction = st.just("") | st.from_regex(r"\.[0-9]{1,9}", fullmatch=True)
    offset = st.just("Z") | st.tuples(
        st.sampled_from("+-"), st.integers(0, 23), st.integers(0, 59)
    ).map(lambda t: f"{t[0]}{t[1]:02d}:{t[2]:02d}")
    extremes = st.sampled_from(
        ["0001-01-01T00:00:00+23:59", "9999-12-31T23:59:59.999999999-23:59", "9999-12-31T23:59:59Z"]
    )
    drawn = st.builds(
        lambda d, c, f, o: f"{d.isoformat()}T{c}{f}{o}", st.dates(), clock, fraction, offset
    )
    return drawn | extremes


def small_durations() -> st.SearchStrategy[str]:
    """Durations of a few hours or less: those the bounds accept, drawn often enough."""
    parts = st.tuples(
        st.none() | st.integers(0, 30),
        st.none() | st.integers(0, 90),
        st.none() | st.integers(0, 90),
    )
    return parts.map(
        lambda p: "".join(f"{n}{u}" for n, u in zip(p, "hms", strict=True) if n is not None)
    ).filter(lambda text: len(text) >= 2)


def pattern_strings(pattern: str) -> st.SearchStrategy[str]:
    """Strings the API server's RE2 finds ``pattern`` in.

    RE2's ``$`` matches only at the end of the text, while Python's also matches before
    a final newline: an anchored pattern is drawn as a full match, which both agree on.
    """
    anchored = pattern.startswith("^") and pattern.endswith("$") and not pattern.endswith("\\$")
    strings = st.from_regex(pattern, fullmatch=anchored)
    if pattern == DURATION_PATTERN:
        strings = strings | small_durations()
    return strings


def from_crd_schema(node: Mapping[str, Any], where: str = "<root>") -> st.SearchStrategy[Any]:
    """A strategy for the values a structural CRD schema node accepts, after pruning."""
    unknown = set(node) - HANDLED_KEYWORDS - IGNORED_KEYWORDS
    assert not unknown, f"{where}: teach from_crd_schema the keywords {sorted(unknown)}"
    strategy = _values(node, where)
    return st.none() | strategy if node.get("nullable") else strategy


def _values(node: Mapping[str, Any], where: str) -> st.SearchStrategy[Any]:
    if "enum" in node:
        return st.sampled_from(node["enum"])
    if node.get("x-kubernetes-int-or-string"):
        return st.integers(*INT64) | _strings({**node, "type": "string"})
    kind = node.get("type")
    if kind == "object" or (kind is None and node.get("x-kubernetes-preserve-unknown-fields")):
        return _objects(node, where)
    if kind == "array":
        return _arrays(node, where)
    if kind == "string":
        return _strings(node)
    if kind == "integer":
        return _integers(node)
    if kind == "number":
        floats = st.floats(
            node.get("minimum"),
            node.get("maximum"),
            allow_nan=False,
            allow_infinity=False,
            exclude_min=bool(node.get("exclusiveMinimum")),
            exclude_max=bool(node.get("exclusiveMaximum")),
        )
        return floats | _integers(node)  # JSON does not tell 50 from 50.0
    if kind == "boolean":
        return st.booleans()
    raise AssertionError(f"{where}: no strategy for type {kind!r}")


def _integers(node: Mapping[str, Any]) -> st.SearchStrategy[int]:
    """Whole numbers within the bounds (OpenAPI v3.0: exclusive bounds are flags)."""
    low, high = node.get("minimum"), node.get("maximum")
    least = INT64[0] if low is None else math.ceil(low)
    if node.get("exclusiveMinimum") and least == low:
        least += 1
    most = INT64[1] if high is None else math.floor(high)
    if node.get("exclusiveMaximum") and most == high:
        most -= 1
    return st.integers(least, most)


def _strings(node: Mapping[str, Any]) -> st.SearchStrategy[str]:
    low, high = node.get("minLength", 0), node.get("maxLength")
    if node.get("format") == "date-time":
        strings = rfc3339_times()
    elif "format" in node:
        raise AssertionError(f"no strategy for format {node['format']!r}")
    elif "pattern" in node:
        strings = pattern_strings(node["pattern"])
    else:
        most = MAX_TEXT if high is None else min(high, max(low, MAX_TEXT))
        return st.text(min_size=low, max_size=most)
    return strings.filter(lambda s: low <= len(s) <= (high if high is not None else len(s)))


def _arrays(node: Mapping[str, Any], where: str) -> st.SearchStrategy[list[Any]]:
    items = from_crd_schema(node["items"], f"{where}[]")
    low = node.get("minItems", 0)
    high = max(low, min(node.get("maxItems", MAX_ITEMS), MAX_ITEMS))
    list_type = node.get("x-kubernetes-list-type", "atomic")
    if list_type == "set":
        return st.lists(items, min_size=low, max_size=high, unique_by=_canonical)
    if list_type == "map":
        keys = node["x-kubernetes-list-map-keys"]
        return st.lists(
            items,
            min_size=low,
            max_size=high,
            unique_by=lambda item: tuple(_canonical(item.get(key)) for key in keys),
        )
    return st.lists(items, min_size=low, max_size=high)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _objects(node: Mapping[str, Any], where: str) -> st.SearchStrategy[dict[str, Any]]:
    properties = node.get("properties")
    additional = node.get("additionalProperties")
    if properties is not None:
        # The API server prunes fields the schema does not name, so none are drawn.
        required = set(node.get("required", ()))
        children = {
            name: from_crd_schema(child, f"{where}.{name}") for name, child in properties.items()
        }
        return st.fixed_dictionaries(
            {name: s for name, s in children.items() if name in required},
            optional={name: s for name, s in children.items() if name not in required},
        )
    if isinstance(additional, Mapping):
        values = from_crd_schema(additional, f"{where}{{}}")
        return st.dictionaries(st.text(max_size=MAX_TEXT), values, max_size=MAX_ITEMS)
    if node.get("x-kubernetes-preserve-unknown-fields"):
        return st.dictionaries(st.text(max_size=8), ANY_JSON, max_size=MAX_ITEMS)
    # A bare {type: object} keeps nothing: the API server prunes every field of it.
    return st.just({})


# --- whole objects ------------------------------------------------------------------------

DNS_LABEL = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,20}[a-z0-9])?", fullmatch=True)
LABEL_NAME = st.from_regex(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,10}[A-Za-z0-9])?", fullmatch=True)
LABEL_KEYS = st.builds(
    lambda prefix, name: f"{prefix}/{name}" if prefix else name,
    st.none() | st.sampled_from(["sessionfleet.dev", "app.kubernetes.io", "example.com"]),
    LABEL_NAME,
)
LABELS = st.dictionaries(LABEL_KEYS, st.just("") | LABEL_NAME, max_size=MAX_ITEMS)
ANNOTATIONS = st.dictionaries(
    st.sampled_from(["ack.sessionfleet.dev/r-0", "ack.sessionfleet.dev/r-1"]) | LABEL_KEYS,
    st.text(max_size=MAX_TEXT) | rfc3339_times(),
    max_size=MAX_ITEMS,
)
SERVER_TIMES = st.datetimes(datetime(2000, 1, 1), datetime(2100, 1, 1)).map(
    lambda t: t.strftime("%Y-%m-%dT%H:%M:%SZ")
)


@st.composite
def metadata(draw: st.DrawFn) -> dict[str, Any]:
    """Metadata as the API server returns it: a valid name and namespace, and what it sets."""
    meta: dict[str, Any] = {
        "name": draw(DNS_LABEL),
        "namespace": draw(DNS_LABEL),
        "uid": draw(st.uuids().map(str)),
        "resourceVersion": str(draw(st.integers(1, 2**40))),
        "generation": draw(st.integers(1, 2**31)),
    }
    # The API server always sets creationTimestamp; objects built by hand (tests, the
    # simulator, a fake API) may lack it, and the records say what they do then.
    created = draw(st.none() | SERVER_TIMES)
    if created is not None:
        meta["creationTimestamp"] = created
    if draw(st.booleans()):
        meta["labels"] = draw(LABELS)
    if draw(st.booleans()):
        meta["annotations"] = draw(ANNOTATIONS)
    return meta


@cache
def objects(kind: str) -> st.SearchStrategy[dict[str, Any]]:
    """Whole ``kind`` objects the served schema accepts: apiVersion, kind, metadata and the rest."""
    schema = served_schema(kind)
    body = {
        name: from_crd_schema(child, f".{name}")
        for name, child in schema["properties"].items()
        if name not in ("apiVersion", "kind", "metadata")
    }
    required = set(schema.get("required", ()))
    return st.builds(
        lambda meta, rest: {
            "apiVersion": "sessionfleet.dev/v1alpha1",
            "kind": kind,
            "metadata": meta,
            **rest,
        },
        metadata(),
        st.fixed_dictionaries(
            {k: v for k, v in body.items() if k in required},
            optional={k: v for k, v in body.items() if k not in required},
        ),
    )


ResourceT = TypeVar("ResourceT", bound=CustomResource)


def parsed_or_refused(model: type[ResourceT], body: dict[str, Any]) -> Parsed[ResourceT]:
    """Parse ``body``, asserting the contract: an object, or InvalidSpec with a message."""
    result = parse(model, body)
    assert isinstance(result, Parsed)
    if result.ok:
        assert result.obj is not None and result.reason is None
    else:
        assert result.reason is Reason.INVALID_SPEC and result.message, result
    return result


NOW = st.datetimes(datetime(2000, 1, 1), datetime(2100, 1, 1), timezones=st.just(UTC))
TIMES = st.datetimes(timezones=st.sampled_from([UTC, timezone(timedelta(hours=-23, minutes=-59))]))
"""Any instant: observations (a node's lastTransitionTime) are not bounded by a schema."""
ANY_TIME = st.none() | NOW | TIMES


# --- the self-check: drawn objects are what the schema accepts ----------------------------


def to_json_schema(node: Mapping[str, Any]) -> dict[str, Any]:
    """The CRD schema as plain JSON Schema, with the API server's pruning made explicit."""
    out: dict[str, Any] = {
        k: v for k, v in node.items() if not k.startswith("x-kubernetes") and k != "default"
    }
    if node.get("x-kubernetes-int-or-string"):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if "properties" in node:
        out["properties"] = {k: to_json_schema(v) for k, v in node["properties"].items()}
        if not node.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if isinstance(node.get("additionalProperties"), Mapping):
        out["additionalProperties"] = to_json_schema(node["additionalProperties"])
    if "items" in node:
        out["items"] = to_json_schema(node["items"])
    if node.get("x-kubernetes-list-type") == "set":
        out["uniqueItems"] = True
    for flag, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if flag in node:  # OpenAPI v3.0's flag is draft 7's bound
            del out[flag]
            if node[flag]:
                out[flag] = out.pop(bound)
    return out


RFC3339 = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,9})?(Z|[+-][0-9]{2}:[0-9]{2})"
)


@pytest.mark.parametrize("kind", sorted(KINDS_BY_NAME))
def test_drawn_objects_are_accepted_by_the_schema(kind: str) -> None:
    schema = to_json_schema(served_schema(kind))
    checker = jsonschema.FormatChecker(formats=())
    checker.checks("date-time")(
        lambda text: not isinstance(text, str) or bool(RFC3339.fullmatch(text))
    )
    validator = jsonschema.Draft7Validator(schema, format_checker=checker)

    @examples(25)
    @given(objects(kind))
    def check(body: dict[str, Any]) -> None:
        errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(body)]
        assert not errors, errors

    check()


# --- parsing and records ------------------------------------------------------------------


@examples(150)
@given(objects("InferenceWorker"))
def test_workers_parse_and_record_without_raising(body: dict[str, Any]) -> None:
    result = parsed_or_refused(InferenceWorker, body)
    record = worker_record(body)
    assert (record.worker is not None) == result.ok
    assert (record.invalid is None) == result.ok
    record.status  # noqa: B018 - the property reads the parsed or the empty status


@examples(150)
@given(objects("AgentSession"))
def test_sessions_parse_and_record_without_raising(body: dict[str, Any]) -> None:
    result = parsed_or_refused(AgentSession, body)
    state = session_record(body)
    assert (state.invalid is None) == result.ok


@examples(150)
@given(objects("DrainPolicy"))
def test_policies_parse_and_record_without_raising(body: dict[str, Any]) -> None:
    result = parsed_or_refused(DrainPolicy, body)
    record = policy_record(body)
    assert (record.spec is not None) == result.ok


@examples(150)
@given(objects("WorkerCheckpoint"))
def test_checkpoints_parse_and_record_without_raising(body: dict[str, Any]) -> None:
    result = parsed_or_refused(WorkerCheckpoint, body)
    state = checkpoint_record(body)
    assert (state is not None) == result.ok


# --- planning on what parsed --------------------------------------------------------------

NAMES = st.sampled_from(["s-0", "s-1", "s-2", "s-3"])
PINNED = st.lists(st.builds(PinnedSession, NAMES), max_size=4, unique_by=lambda p: p.name)
NODE_NAMES = st.sampled_from(["n-0", "n-1"])
TAINTS = st.frozensets(
    st.sampled_from(["karpenter.sh/disrupted", "ToBeDeletedByClusterAutoscaler", "other"])
    | st.text(max_size=8),
    max_size=3,
)
NODES = st.builds(NodeState, NODE_NAMES, st.booleans(), ANY_TIME, st.booleans(), TAINTS)


def parsed_objects(kind: str, model: type[ResourceT]) -> st.SearchStrategy[ResourceT]:
    """Objects of ``kind`` that parse: the decisions read parsed objects only."""

    def parsed(body: dict[str, Any]) -> ResourceT | None:
        return parse(model, body).obj

    return objects(kind).map(parsed).filter(lambda obj: obj is not None)  # type: ignore[return-value]


@st.composite
def pods_of(draw: st.DrawFn, worker: str, epoch: int) -> list[PodState]:
    epochs = st.sampled_from(sorted({0, max(epoch - 1, 0), epoch, epoch + 1})) | st.integers(
        0, 2**40
    )
    pods = []
    for pod_epoch in draw(st.lists(epochs, max_size=3, unique=True)):
        pods.append(
            PodState(
                name=draw(st.just(pod_name(worker, pod_epoch)) | DNS_LABEL),
                epoch=pod_epoch,
                phase=draw(
                    st.sampled_from(["Pending", "Running", "Succeeded", "Failed", "Unknown"])
                ),
                scheduled=draw(st.booleans()),
                ready=draw(st.booleans()),
                node=draw(st.none() | NODE_NAMES),
                pod_ip=draw(st.none() | st.just("10.0.0.7") | st.text(max_size=8)),
                deleting=draw(st.booleans()),
                terminated=draw(st.booleans()),
                message=draw(st.text(max_size=MAX_TEXT)),
            )
        )
    return pods


@examples(150)
@given(
    worker=parsed_objects("InferenceWorker", InferenceWorker),
    policies=st.lists(parsed_objects("DrainPolicy", DrainPolicy), max_size=2),
    data=st.data(),
)
def test_worker_plans_never_raise(
    worker: InferenceWorker, policies: list[DrainPolicy], data: st.DataObject
) -> None:
    meta, spec, status = worker.metadata, worker.spec, worker.status
    # Policies under their own names, and sometimes under the name the worker refers to.
    names = [p.metadata.name for p in policies]
    if spec.drain_policy_ref is not None and policies and data.draw(st.booleans()):
        names[0] = spec.drain_policy_ref
    choice = resolve_policy(
        meta.labels,
        spec.drain_policy_ref,
        {n: p.spec for n, p in zip(names, policies, strict=True)},
    )
    observation = WorkerObservation(
        name=meta.name,
        spec=spec,
        status=status,
        pods=data.draw(pods_of(meta.name, status.epoch or 0)),
        node=data.draw(st.none() | NODES),
        pinned=data.draw(PINNED),
        policy=choice,
        now=data.draw(NOW),
        node_not_ready_toleration=timedelta(seconds=data.draw(st.integers(0, 3600))),
        recovery_block=data.draw(
            st.none() | st.builds(RecoveryBlock, st.sampled_from(list(Reason)), st.text(max_size=8))
        ),
    )
    # Its status in every phase: the schema lets any phase stand beside any other field.
    for phase in (None, *WorkerPhase):
        in_phase = replace(observation, status=status.model_copy(update={"phase": phase}))
        assert isinstance(plan_worker(in_phase), WorkerPlan)


@examples(150)
@given(
    policy=parsed_objects("DrainPolicy", DrainPolicy),
    started=TIMES,
    now=NOW,
    pinned=PINNED,
    node=st.none() | NODES,
    worker_drain=st.booleans(),
    labels=LABELS,
    reference=st.none() | st.just("same") | DNS_LABEL,
)
def test_drain_decisions_never_raise(
    policy: DrainPolicy,
    started: datetime,
    now: datetime,
    pinned: list[PinnedSession],
    node: NodeState | None,
    worker_drain: bool,
    labels: dict[str, str],
    reference: str | None,
) -> None:
    spec = policy.spec
    assert isinstance(decide_drain(spec, started, now, pinned), DrainDecision)
    assert isinstance(decide_drain(spec, now, now, pinned), DrainDecision)
    drain_trigger(worker_drain, node, spec.triggers)
    holds_while_pinned(spec, len(pinned))
    resolve_policy(labels, reference, {"same": spec, policy.metadata.name: DrainPolicySpec()})


@examples(150)
@given(
    checkpoint=objects("WorkerCheckpoint"),
    created=ANY_TIME,
    completed=ANY_TIME,
    settings_=from_crd_schema(subschema("InferenceWorker", "spec", "checkpoint")),
    worker_ready=st.booleans(),
    activity=ANY_TIME,
    in_flight=st.booleans(),
    running_here=st.booleans(),
    created_by_operator=st.booleans(),
    now=NOW,
    timeout=st.integers(0, 3600),
)
def test_checkpoint_decisions_never_raise(
    checkpoint: dict[str, Any],
    created: datetime | None,
    completed: datetime | None,
    settings_: dict[str, Any],
    worker_ready: bool,
    activity: datetime | None,
    in_flight: bool,
    running_here: bool,
    created_by_operator: bool,
    now: datetime,
    timeout: int,
) -> None:
    state = checkpoint_record(checkpoint)
    if state is None:
        return  # refused by the model: checkpoint_record says so with None
    try:
        worker_settings = CheckpointSettings.model_validate(settings_)
    except ValueError:
        worker_settings = CheckpointSettings()  # the worker's own parse refused it
    storage = worker_settings.storage.path
    checkpoint_location(storage, state.namespace, state.worker, state.name, state.destination)
    destination_problem(state.destination, storage, state.namespace)
    reserved_reason_problem(state.reason, created_by_operator)
    checkpoint_name(state.worker, state.reason, state.epoch or 0, now)
    # The worker's checkpoints: this one under every reason, in every phase, refused or
    # not, with its own times, other times and none (the schema lets any reason and
    # phase stand beside any timestamps, and metadata may lack creationTimestamp).
    variants = product(
        CheckpointReason,
        (None, *CheckpointPhase),
        ((state.created_at, state.completed_at), (created, completed), (None, None)),
        (False, True),
    )
    states = [
        replace(
            state,
            name=f"{state.name}-{i}",
            reason=reason,
            phase=phase,
            created_at=times[0],
            completed_at=times[1],
            refused=refused,
        )
        for i, (reason, phase, times, refused) in enumerate(variants)
    ]
    for one in (state, *states):
        abandoned(one, running_here, now, timedelta(seconds=timeout))
        for driver, ready, flying in (
            (worker_settings.driver, worker_ready, in_flight),
            (CheckpointDriver.ENGINE, True, False),
        ):
            periodic_due(worker_settings.interval, driver, ready, one, activity, flying, now)
    last = latest_usable(states)
    assert last is None or last.usable
    periodic_due(
        worker_settings.interval,
        worker_settings.driver,
        worker_ready,
        last,
        activity,
        in_flight,
        now,
    )
    for keep in (1, worker_settings.retention):
        victims = retention_victims(states, keep)
        assert set(victims) <= {s.name for s in states}
    retention_victims([state], worker_settings.retention)


WORKER_PHASES = st.none() | st.sampled_from(list(WorkerPhase))


@examples(150)
@given(
    body=objects("AgentSession"),
    worker=st.none()
    | st.builds(
        WorkerBrief,
        DNS_LABEL,
        WORKER_PHASES,
        st.none() | st.integers(0, 2**40),
        st.none() | DNS_LABEL,
    ),
    loads=st.lists(
        st.builds(
            WorkerLoad,
            name=DNS_LABEL,
            model=st.text(max_size=4),
            ready=st.booleans(),
            pinned_sessions=st.integers(0, 100_001),
            max_sessions=st.integers(1, 100_000),
            kv_tokens_capacity=st.integers(0, 100_000_000),
            kv_tokens_pinned=st.integers(0, 2**40),
            kv_usage=st.floats(0, 1),
        ),
        max_size=3,
    ),
    leases=st.lists(
        st.builds(
            RouterLease, st.sampled_from(["r-0", "r-1"]), st.none() | TIMES, st.integers(1, 3600)
        ),
        max_size=2,
    ),
    now=NOW,
    idle=st.integers(1, 86_400),
)
def test_session_decisions_never_raise(
    body: dict[str, Any],
    worker: WorkerBrief | None,
    loads: list[WorkerLoad],
    leases: list[RouterLease],
    now: datetime,
    idle: int,
) -> None:
    state = session_record(body)
    assert isinstance(decide_session(state, worker, now, timedelta(seconds=idle)), SessionDecision)
    if state.invalid is not None:
        return
    # Its status in every phase: the schema lets any phase stand beside any timestamps.
    for phase in (None, *SessionPhase):
        in_phase = replace(state, phase=phase)
        decision = decide_session(in_phase, worker, now, timedelta(seconds=idle))
        assert isinstance(decision, SessionDecision)
        in_phase.pinned  # noqa: B018 - properties read the parsed state
    request = PlacementRequest(
        model=state.model,
        pin=state.pin,
        parent_worker=state.worker,
        expected_tokens=state.context_tokens,
        exclude=frozenset({state.worker} if state.worker else ()),
    )
    assert isinstance(place(request, loads), Placement)
    assert isinstance(admit_or_place(request, loads, hint=state.hint), Placement)
    if state.migrating_since is not None and state.phase is SessionPhase.MIGRATING:
        handshake(
            state.migrating_since, stamp(state.migrating_since), dict(state.acks), leases, now
        )


# --- durations ----------------------------------------------------------------------------


DURATION_FIELDS: dict[str, list[tuple[str, ...]]] = {
    "InferenceWorker": [("spec", "checkpoint", "interval")],
    "DrainPolicy": [("spec", "gracePeriod"), ("spec", "deadline")],
}


def schema_patterns(node: Mapping[str, Any]) -> set[str]:
    found = {node["pattern"]} if "pattern" in node else set()
    for child in (
        *node.get("properties", {}).values(),
        node.get("items"),
        node.get("additionalProperties"),
    ):
        if isinstance(child, Mapping):
            found |= schema_patterns(child)
    return found


def test_the_crds_share_one_duration_pattern() -> None:
    for kind, fields in DURATION_FIELDS.items():
        for path in fields:
            assert subschema(kind, *path)["pattern"] == DURATION_PATTERN, (kind, path)
    patterns: set[str] = set()
    for kind in KINDS_BY_NAME:
        patterns |= schema_patterns(served_schema(kind))
    assert {p for p in patterns if "[0-9]{1,6}" in p} == {DURATION_PATTERN}


DURATION_EDGES = ["0s", "0h0m0s", "8760h", "525600m", "8760h1s", "999999h", "999999h999999m999999s"]


@examples(300)
@given(
    pattern_strings(DURATION_PATTERN)
    | st.from_regex(r"[0-9]{1,6}[hms]", fullmatch=True)
    | st.sampled_from(DURATION_EDGES)
)
def test_parse_duration_answers_every_pattern_string(text: str) -> None:
    # Any length: the CRDs bound it to 2-16 characters, and parse_duration refuses the
    # rest; of what the CRDs accept, it refuses only durations longer than a year.
    try:
        value = parse_duration(text)
    except ValueError as error:
        if 2 <= len(text) <= 16:
            assert "longer than the most accepted" in str(error), (text, error)
        return
    assert timedelta(0) <= value <= MAX_DURATION
    assert 2 <= len(text) <= 16
