"""The kopf adapter: the installed kopf is one it was tested with, and its names still work.

An upgrade of kopf that moves or changes a private name fails here, with the name in
the message, instead of failing in a running operator.
"""

from __future__ import annotations

import asyncio
import re
import tomllib
from pathlib import Path

import kopf
import pytest

from sessionfleet.controllers import (
    handlers,  # noqa: F401 - registers the handlers
    kopfcompat,
)

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _dotted(numbers: tuple[int, ...]) -> str:
    return ".".join(map(str, numbers))


def test_the_installed_kopf_is_inside_the_range_the_adapter_was_tested_with() -> None:
    found = kopfcompat.kopf_version()
    lowest, above = kopfcompat.TESTED_RANGE
    assert kopfcompat.is_tested(found), (
        f"kopf {_dotted(found)} is outside {_dotted(lowest)} <= kopf < {_dotted(above)}: "
        "test kopfcompat's private names against it, then widen TESTED_RANGE and pyproject"
    )


def test_pyproject_bounds_kopf_as_the_adapter_declares() -> None:
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    (kopf_pin,) = [d for d in dependencies if re.match(r"kopf\b", d)]
    lowest, above = kopfcompat.TESTED_RANGE
    assert kopf_pin == f"kopf>={_dotted(lowest)},<{_dotted(above)}"


@pytest.mark.parametrize(
    ("found", "tested"),
    [((1, 45, 2), True), ((1, 45, 9), True), ((1, 45, 1), False), ((1, 46), False), ((2,), False)],
)
def test_is_tested_reads_the_range_as_inclusive_then_exclusive(
    found: tuple[int, ...], tested: bool
) -> None:
    assert kopfcompat.is_tested(found) is tested


@pytest.mark.parametrize(
    ("text", "numbers"),
    [("1.45.2", (1, 45, 2)), ("1.46.0rc1", (1, 46, 0)), ("2.0", (2, 0)), ("1.45.dev3", (1, 45))],
)
def test_release_numbers_stop_at_a_pre_release_tail(text: str, numbers: tuple[int, ...]) -> None:
    assert kopfcompat.release_numbers(text) == numbers


async def test_toggle_sets_keep_what_kopfstart_overrides() -> None:
    toggles = kopfcompat.aiotoggles.ToggleSet(all)
    assert isinstance(toggles._condition, asyncio.Condition), "ToggleSet._condition moved"
    assert isinstance(toggles._toggles, set), "ToggleSet._toggles is no longer a set"
    toggle = kopfcompat.aiotoggles.Toggle(False, name="probe", condition=toggles._condition)
    toggles._toggles.add(toggle)
    assert toggles.is_off()
    await toggle.turn_to(True)
    assert toggles.is_on()


async def test_insights_still_report_the_scan_as_served_reads_it() -> None:
    insights = kopfcompat.Insights()
    workers = kopfcompat.Resource("sessionfleet.dev", "v1alpha1", "inferenceworkers")
    insights.watched_resources.add(workers)
    insights.indexed_resources.add(kopfcompat.Resource("", "v1", "pods"))
    insights.ready_resources.set()
    await asyncio.wait_for(insights.ready_resources.wait(), timeout=1)
    found = {(r.group, r.version, r.plural) for r in insights.watched_resources}
    assert found == {("sessionfleet.dev", "v1alpha1", "inferenceworkers")}


def test_the_registry_still_lists_every_kind_of_handler() -> None:
    found = kopfcompat.registered_handlers(kopf.get_default_registry())
    plurals = {h.selector.plural or h.selector.any_name for h in found if h.selector}
    assert {"inferenceworkers", "pods", "nodes"} <= plurals


def test_namespace_patterns_still_read_as_kopfs_namespace_option() -> None:
    assert kopfcompat.select_specific_namespaces(["team-a", "team-b"]) == {"team-a", "team-b"}
    assert kopfcompat.select_specific_namespaces(["team-*"]) == set()
    patterns = ["team-*,!team-x", "prod"]
    assert kopfcompat.matches_namespace("team-a", patterns)
    assert kopfcompat.matches_namespace("prod", patterns)
    assert not kopfcompat.matches_namespace("team-x", patterns)
    assert not kopfcompat.matches_namespace("other", patterns)
