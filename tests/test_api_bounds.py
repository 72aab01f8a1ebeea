"""Bounds in the API: durations, sizes and paths, in the models and in the CRDs.

Each bound is refused by the model naming its field, accepted at its boundary, and
declared in the generated CRD (schema keyword or CEL rule), so that the API server
refuses what the operator would. The invalid examples (examples/invalid/) carry one
manifest per rule; e2e/test_api.py sends them to a real API server.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from sessionfleet.api import KINDS_BY_NAME, CheckpointReason, Reason, parse, parse_duration
from sessionfleet.api._common import (
    ABSOLUTE_PATH_PATTERN,
    DURATION_PATTERN,
    MAX_DURATION,
    AbsolutePath,
    Duration,
    absolute_path_problem,
    format_duration,
    path_inside,
)
from sessionfleet.api.checkpoint import (
    OPERATOR_REASONS,
    destination_problem,
    reserved_reason_problem,
)
from sessionfleet.api.crd import structural_schema

GO_MAX_DURATION_SECONDS = (2**63 - 1) // 10**9
"""Go's time.Duration, into which Kubernetes CEL's duration() parses: about 292 years."""


def _parse(kind: str, spec: dict[str, Any]) -> tuple[bool, str]:
    body = {
        "apiVersion": "sessionfleet.dev/v1alpha1",
        "kind": kind,
        "metadata": {"name": "x"},
        "spec": spec,
    }
    result = parse(KINDS_BY_NAME[kind], body)
    if not result.ok:
        assert result.reason is Reason.INVALID_SPEC
    return result.ok, result.message


def _worker(**spec: Any) -> tuple[bool, str]:
    return _parse("InferenceWorker", {"model": "m", **spec})


def _sim_worker(**spec: Any) -> tuple[bool, str]:
    return _worker(**{"engine": {"type": "sim"}, "gpus": 0, **spec})


# --- durations ------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["9999999h", "1234567s", "999999999999999h", "1h1234567m"])
def test_more_than_six_digits_is_not_a_duration(text: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)
    with pytest.raises(ValidationError):
        TypeAdapter(Duration).validate_python(text)


def test_parse_duration_refuses_more_than_a_year_clearly() -> None:
    assert parse_duration("8760h") == MAX_DURATION
    for text in ("8760h1s", "999999h", "999999h999999m"):
        with pytest.raises(ValueError, match=r"longer than the most accepted, 8760h \(365 days\)"):
            parse_duration(text)


def test_the_largest_pattern_valid_duration_fits_go_and_timedelta() -> None:
    largest = 999999 * 3600 + 999999 * 60 + 999999
    assert largest < GO_MAX_DURATION_SECONDS
    assert timedelta(seconds=largest) > MAX_DURATION
    assert re.fullmatch(DURATION_PATTERN, "999999h999999m999999s")


@given(h=st.integers(0, 999999), m=st.integers(0, 999999), s=st.integers(0, 999999))
def test_parse_duration_never_overflows(h: int, m: int, s: int) -> None:
    text = f"{h}h{m}m{s}s"
    seconds = h * 3600 + m * 60 + s
    if len(text) > 16:
        with pytest.raises(ValueError, match="not a duration"):
            parse_duration(text)
    elif seconds > MAX_DURATION.total_seconds():
        with pytest.raises(ValueError, match="longer than"):
            parse_duration(text)
    else:
        assert parse_duration(text).total_seconds() == seconds


@given(st.integers(0, int(MAX_DURATION.total_seconds())))
def test_format_duration_round_trips(seconds: int) -> None:
    text = format_duration(timedelta(seconds=seconds))
    assert len(text) <= 16
    assert parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize(
    ("interval", "ok"),
    [
        ("0s", False),
        ("1s", True),
        ("168h", True),
        ("167h59m60s", True),
        ("168h1s", False),
        ("999999h", False),
        ("999999999999999h", False),
    ],
)
def test_checkpoint_interval_bounds(interval: str, ok: bool) -> None:
    accepted, message = _sim_worker(checkpoint={"interval": interval})
    assert accepted is ok, message
    if not ok:
        assert "spec.checkpoint" in message and "interval" in message


@pytest.mark.parametrize(("interval", "ok"), [("59s", False), ("1m", True), ("60s", True)])
def test_vllm_checkpoint_interval_is_at_least_a_minute(interval: str, ok: bool) -> None:
    accepted, message = _worker(engine={"type": "vllm"}, gpus=1, checkpoint={"interval": interval})
    assert accepted is ok, message
    if not ok:
        assert "checkpoint.interval must be at least 1m for engine vllm" in message
    # The simulated engine may checkpoint more often.
    assert _sim_worker(checkpoint={"interval": interval})[0]


@pytest.mark.parametrize(
    ("spec", "ok", "field"),
    [
        ({"deadline": "1s", "gracePeriod": "0s"}, True, ""),
        ({"deadline": "0s", "gracePeriod": "0s"}, False, "deadline"),
        ({"deadline": "24h", "gracePeriod": "24h"}, True, ""),
        ({"deadline": "24h1s", "gracePeriod": "1m"}, False, "deadline"),
        ({"deadline": "999999h", "gracePeriod": "1m"}, False, "deadline"),
        ({"deadline": "24h", "gracePeriod": "24h1s"}, False, "gracePeriod"),
        ({"gracePeriod": "999999h"}, False, "gracePeriod"),
    ],
)
def test_drain_duration_bounds(spec: dict[str, str], ok: bool, field: str) -> None:
    accepted, message = _parse("DrainPolicy", spec)
    assert accepted is ok, message
    if not ok:
        assert f"{field} must be between" in message


# --- sizes ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "ok", "field"),
    [
        ({"capacity": {"kvTokens": 100_000_000}}, True, ""),
        ({"capacity": {"kvTokens": 100_000_001}}, False, "spec.capacity.kvTokens"),
        ({"capacity": {"kvTokens": 10**15}}, False, "spec.capacity.kvTokens"),
        ({"capacity": {"maxSessions": 100_000}}, True, ""),
        ({"capacity": {"maxSessions": 100_001}}, False, "spec.capacity.maxSessions"),
        ({"gpus": 16}, True, ""),
        ({"gpus": 17}, False, "spec.gpus"),
        ({"checkpoint": {"retention": 100}}, True, ""),
        ({"checkpoint": {"retention": 101}}, False, "spec.checkpoint.retention"),
        (
            {"template": {"tolerations": [{"operator": "Exists", "tolerationSeconds": 31536000}]}},
            True,
            "",
        ),
        (
            {"template": {"tolerations": [{"operator": "Exists", "tolerationSeconds": 31536001}]}},
            False,
            "spec.template.tolerations.0.tolerationSeconds",
        ),
    ],
)
def test_size_bounds(spec: dict[str, Any], ok: bool, field: str) -> None:
    accepted, message = _sim_worker(**spec)
    assert accepted is ok, message
    if not ok:
        assert message.startswith(f"{field}:"), message


# --- paths ----------------------------------------------------------------------------

GOOD_PATHS = [
    "/a",
    "/var/lib/sessionfleet/checkpoints",
    "/a/.hidden",
    "/a/..b",
    "/a/b..",
    "/a/...",
    "/with space/and-[brackets]",
    "/" + "a" * 1023,
]
BAD_PATHS = [
    ("", "absolute"),
    ("relative/path", "absolute"),
    ("/", "'/' itself"),
    ("/../../etc", "'..' segment"),
    ("/a/../b", "'..' segment"),
    ("/a/./b", "'.' or '..' segment"),
    ("/a/..", "'..' segment"),
    ("/a/.", "'.' or '..' segment"),
    ("//a", "empty segment"),
    ("/a//b", "empty segment"),
    ("/a/", "trailing '/'"),
    ("/a/%2e%2e/b", "printable ASCII"),
    ("/a\\..\\b", "printable ASCII"),
    ("/a\nb", "printable ASCII"),
    ("/a\x7f", "printable ASCII"),
    ("/caf\u00e9", "printable ASCII"),
    ("/" + "a" * 1024, "at most 1024"),
]


@pytest.mark.parametrize("path", GOOD_PATHS)
def test_good_paths(path: str) -> None:
    assert absolute_path_problem(path) is None
    assert re.fullmatch(ABSOLUTE_PATH_PATTERN, path)
    assert TypeAdapter(AbsolutePath).validate_python(path) == path


@pytest.mark.parametrize(("path", "problem"), BAD_PATHS)
def test_bad_paths_are_refused_in_words(path: str, problem: str) -> None:
    found = absolute_path_problem(path)
    assert found is not None and problem in found, found
    assert not (re.fullmatch(ABSOLUTE_PATH_PATTERN, path) and len(path) <= 1024)
    with pytest.raises(ValidationError, match=re.escape(problem)):
        TypeAdapter(AbsolutePath).validate_python(path)


@given(st.text(alphabet="/.a%\\ \x7f\u00e9", max_size=12))
def test_the_crd_pattern_and_the_model_agree(path: str) -> None:
    assert (absolute_path_problem(path) is None) == bool(
        re.fullmatch(ABSOLUTE_PATH_PATTERN, path)
    ), path


def test_storage_path_refuses_climbing_out() -> None:
    accepted, message = _sim_worker(checkpoint={"storage": {"path": "/../../etc"}})
    assert not accepted
    assert message.startswith("spec.checkpoint.storage.path: must have no '.' or '..' segment")


def test_checkpoint_destination_refuses_climbing_out() -> None:
    spec = {"worker": "w", "destination": "/var/lib/sessionfleet/checkpoints/../../etc"}
    accepted, message = _parse("WorkerCheckpoint", spec)
    assert not accepted
    assert message.startswith("spec.destination: must have no '.' or '..' segment")
    assert _parse("WorkerCheckpoint", {"worker": "w", "destination": "/ckpt/ns/golden"})[0]


ROOT = "/var/lib/sessionfleet/checkpoints"


@pytest.mark.parametrize(
    ("destination", "inside"),
    [
        (None, True),
        (f"{ROOT}/agents/w/golden", True),
        (f"{ROOT}/agents/x", True),
        (f"{ROOT}/agents", False),  # the namespace's directory itself
        (f"{ROOT}/agents-evil/w", False),  # a prefix of the name is not inside it
        (f"{ROOT}/other/w/x", False),  # another namespace's checkpoints
        (ROOT, False),
        ("/etc/cron.d/x", False),
        ("/var/lib/sessionfleet/checkpointsX/agents/w", False),
    ],
)
def test_destination_must_lie_inside_the_namespace_directory(
    destination: str | None, inside: bool
) -> None:
    problem = destination_problem(destination, ROOT, "agents")
    assert (problem is None) is inside, problem
    if not inside:
        assert problem is not None and f"{ROOT}/agents/" in problem


def test_path_inside_is_by_segment() -> None:
    assert path_inside("/a/b/c", "/a/b")
    assert not path_inside("/a/bc", "/a/b")
    assert not path_inside("/a/b", "/a/b")


# --- reasons only the operator gives ----------------------------------------------


@pytest.mark.parametrize("reason", list(CheckpointReason))
def test_drain_and_periodic_are_the_operators(reason: CheckpointReason) -> None:
    reserved = reason in (CheckpointReason.DRAIN, CheckpointReason.PERIODIC)
    assert (reason in OPERATOR_REASONS) is reserved
    assert reserved_reason_problem(reason, created_by_operator=True) is None
    problem = reserved_reason_problem(reason, created_by_operator=False)
    assert (problem is not None) is reserved
    if problem is not None:
        assert f"reason {reason.value} is set only by the operator" in problem
        assert "Set by the operator only" in reason.description


def test_refusal_reasons_are_documented_in_the_api() -> None:
    for reason in (Reason.RESERVED_CHECKPOINT_REASON, Reason.DESTINATION_OUTSIDE_STORAGE):
        assert reason.description.endswith("it is marked Failed and never run.")


# --- the CRDs carry the same bounds -------------------------------------------------


def _rules(node: dict[str, Any], field_path: str) -> list[str]:
    rules = node.get("x-kubernetes-validations", [])
    return [r["rule"] for r in rules if r.get("fieldPath") == field_path]


def _spec(kind: str) -> dict[str, Any]:
    return structural_schema(KINDS_BY_NAME[kind])["properties"]["spec"]  # type: ignore[no-any-return]


def test_drain_policy_crd_bounds_its_durations() -> None:
    spec = _spec("DrainPolicy")
    assert _rules(spec, ".deadline") == [
        "!has(self.deadline) || (duration(self.deadline) >= duration('1s') && "
        "duration(self.deadline) <= duration('24h'))"
    ]
    assert (
        "!has(self.gracePeriod) || (duration(self.gracePeriod) >= duration('0s') && "
        "duration(self.gracePeriod) <= duration('24h'))"
    ) in _rules(spec, ".gracePeriod")
    for name in ("deadline", "gracePeriod"):
        assert spec["properties"][name]["pattern"] == DURATION_PATTERN


def test_worker_crd_bounds_interval_sizes_and_path() -> None:
    spec = _spec("InferenceWorker")
    checkpoint = spec["properties"]["checkpoint"]
    assert _rules(checkpoint, ".interval") == [
        "!has(self.interval) || (duration(self.interval) >= duration('1s') && "
        "duration(self.interval) <= duration('168h'))"
    ]
    assert checkpoint["properties"]["interval"]["pattern"] == DURATION_PATTERN
    (vllm,) = _rules(spec, ".checkpoint.interval")
    assert vllm.startswith("!has(self.checkpoint) || !has(self.checkpoint.interval) || ")
    assert vllm.endswith("duration(self.checkpoint.interval) >= duration('1m')")
    capacity = spec["properties"]["capacity"]["properties"]
    assert capacity["kvTokens"]["maximum"] == 100_000_000
    assert capacity["maxSessions"]["maximum"] == 100_000
    path = checkpoint["properties"]["storage"]["properties"]["path"]
    assert (path["pattern"], path["maxLength"]) == (ABSOLUTE_PATH_PATTERN, 1024)
    toleration = spec["properties"]["template"]["properties"]["tolerations"]["items"]
    assert toleration["properties"]["tolerationSeconds"]["maximum"] == 31536000


def test_checkpoint_crd_checks_the_destination_path() -> None:
    destination = _spec("WorkerCheckpoint")["properties"]["destination"]
    assert (destination["pattern"], destination["maxLength"]) == (ABSOLUTE_PATH_PATTERN, 1024)
    assert "DestinationOutsideStorage" in destination["description"]


def _nodes(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path, schema)]
    for name, child in schema.get("properties", {}).items():
        out += _nodes(child, f"{path}.{name}")
    if "items" in schema:
        out += _nodes(schema["items"], f"{path}[]")
    return out


@pytest.mark.parametrize("kind", sorted(KINDS_BY_NAME))
def test_rules_on_defaulted_objects_guard_every_field_they_read(kind: str) -> None:
    """The API server checks a node's rules against its ``default: {}`` too.

    Nested defaults are not applied to that {} first, so a rule that reads a field
    without ``has()`` would make the CRD itself invalid.
    """
    for path, node in _nodes(structural_schema(KINDS_BY_NAME[kind])):
        if node.get("default") != {}:
            continue
        for rule in node.get("x-kubernetes-validations", []):
            if "oldSelf" in rule["rule"]:
                continue
            for name in set(re.findall(r"\bself\.(\w+)", rule["rule"])):
                assert f"has(self.{name})" in rule["rule"], f"{kind}{path}: {rule['rule']}"


def test_bad_duration_text_never_reaches_a_rule_check() -> None:
    # A pattern error is reported for the field; the model's rules do not run on it.
    accepted, message = _sim_worker(checkpoint={"interval": "999999999999999h"})
    assert not accepted
    assert message.startswith("spec.checkpoint.interval:"), message
