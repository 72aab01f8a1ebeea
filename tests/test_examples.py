"""Every example manifest parses; every invalid one is rejected naming its field."""

from __future__ import annotations

from typing import Any

from conftest import EXPECT_ERROR, INVALID, VALID

from sessionfleet.api import KINDS_BY_NAME, Reason, parse


def test_there_is_a_valid_example_of_every_kind() -> None:
    assert {doc["kind"] for _, doc in VALID} == set(KINDS_BY_NAME)


def test_invalid_examples_cover_every_kind() -> None:
    assert {doc["kind"] for _, doc in INVALID} == set(KINDS_BY_NAME)


def test_valid_example_parses(valid_manifest: dict[str, Any]) -> None:
    model = KINDS_BY_NAME[valid_manifest["kind"]]
    result = parse(model, valid_manifest)
    assert result.ok, result.message
    assert result.obj is not None
    assert result.obj.metadata.name == valid_manifest["metadata"]["name"]


def test_invalid_example_is_rejected_naming_the_field(invalid_manifest: dict[str, Any]) -> None:
    model = KINDS_BY_NAME[invalid_manifest["kind"]]
    expected = invalid_manifest["metadata"]["annotations"][EXPECT_ERROR]
    result = parse(model, invalid_manifest)
    assert not result.ok
    assert result.reason is Reason.INVALID_SPEC
    assert expected in result.message, result.message


def test_parse_reports_every_problem_with_its_path() -> None:
    body = {
        "apiVersion": "sessionfleet.dev/v1alpha1",
        "kind": "DrainPolicy",
        "metadata": {"name": "p"},
        "spec": {"mode": "Sometimes", "deadline": "soon"},
    }
    result = parse(KINDS_BY_NAME["DrainPolicy"], body)
    assert "spec.mode:" in result.message
    assert "spec.deadline:" in result.message


def test_wire_round_trip_keeps_camel_case() -> None:
    _, doc = next((n, d) for n, d in VALID if d["kind"] == "InferenceWorker")
    worker = KINDS_BY_NAME["InferenceWorker"].model_validate(doc)
    spec = worker.spec.wire()  # type: ignore[attr-defined]
    assert spec["drainPolicyRef"] == "eks-upgrade"
    assert spec["capacity"]["kvTokens"] == 1_500_000
    assert spec["checkpoint"]["kvStore"] == {"type": "Sessionfleet", "maxGiB": 500}
