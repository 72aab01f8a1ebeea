"""Durations, label selectors, enums and conditions shared by every kind."""

from __future__ import annotations

from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from sessionfleet.api import DrainMode, LabelSelector, Reason, parse_duration
from sessionfleet.api._common import Duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("30m", 1800), ("1h30m", 5400), ("2h", 7200), ("1h0m5s", 3605), ("0s", 0)],
)
def test_parse_duration(text: str, seconds: int) -> None:
    assert parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["", "5", "5 minutes", "1m30h", "-5s", "1.5h", "5d", "m"])
def test_bad_durations_are_rejected_by_parser_and_model(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)
    with pytest.raises(ValidationError):
        TypeAdapter(Duration).validate_python(text)


@given(h=st.integers(0, 99), m=st.integers(0, 59), s=st.integers(0, 59))
def test_duration_round_trip(h: int, m: int, s: int) -> None:
    text = (f"{h}h" if h else "") + (f"{m}m" if m else "") + (f"{s}s" if s or not (h or m) else "")
    assert parse_duration(text).total_seconds() == h * 3600 + m * 60 + s


@pytest.mark.parametrize(
    ("selector", "labels", "matches"),
    [
        ({}, {}, True),
        ({}, {"a": "1"}, True),
        ({"matchLabels": {"pool": "x"}}, {"pool": "x", "b": "2"}, True),
        ({"matchLabels": {"pool": "x"}}, {"pool": "y"}, False),
        ({"matchExpressions": [{"key": "z", "operator": "In", "values": ["1"]}]}, {"z": "1"}, True),
        ({"matchExpressions": [{"key": "z", "operator": "In", "values": ["1"]}]}, {}, False),
        ({"matchExpressions": [{"key": "z", "operator": "NotIn", "values": ["1"]}]}, {}, True),
        (
            {"matchExpressions": [{"key": "z", "operator": "NotIn", "values": ["1"]}]},
            {"z": "1"},
            False,
        ),
        ({"matchExpressions": [{"key": "z", "operator": "Exists"}]}, {"z": ""}, True),
        ({"matchExpressions": [{"key": "z", "operator": "DoesNotExist"}]}, {"z": ""}, False),
    ],
)
def test_label_selector(selector: dict[str, object], labels: dict[str, str], matches: bool) -> None:
    assert LabelSelector.model_validate(selector).matches(labels) is matches


def test_enum_members_carry_descriptions() -> None:
    for enum in (DrainMode, Reason):
        for member in enum:
            assert member.description, member
    assert "WaitThenMigrate: Hold for the grace period" in DrainMode.describe_members()


def test_reasons_are_camel_case() -> None:
    for reason in Reason:
        assert reason.value[0].isupper() and " " not in reason.value
