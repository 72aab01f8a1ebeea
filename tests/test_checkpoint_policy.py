"""Checkpoint timing, retention, location and naming."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from sessionfleet.api import CheckpointDriver, CheckpointPhase, CheckpointReason
from sessionfleet.policy.checkpoint import (
    CheckpointState,
    checkpoint_location,
    checkpoint_name,
    latest_usable,
    periodic_due,
    retention_victims,
)

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def cp(
    name: str,
    minutes_ago: int,
    phase: CheckpointPhase = CheckpointPhase.SUCCEEDED,
    reason: CheckpointReason = CheckpointReason.PERIODIC,
    sessions: tuple[str, ...] = (),
) -> CheckpointState:
    done = NOW - timedelta(minutes=minutes_ago)
    return CheckpointState(
        "ns", name, "w", reason, phase, created_at=done, completed_at=done, sessions=sessions
    )


LAST = cp("last", 12)


@pytest.mark.parametrize(
    ("interval", "driver", "ready", "last", "activity_min_ago", "in_flight", "due"),
    [
        ("10m", CheckpointDriver.ENGINE, True, LAST, 1, False, True),
        ("15m", CheckpointDriver.ENGINE, True, LAST, 1, False, False),  # not yet
        ("10m", CheckpointDriver.ENGINE, True, LAST, 13, False, False),  # nothing changed
        ("10m", CheckpointDriver.ENGINE, True, LAST, None, False, False),
        ("10m", CheckpointDriver.ENGINE, True, None, 1, False, True),  # the first one
        ("10m", CheckpointDriver.ENGINE, True, None, None, False, False),  # idle from start
        (None, CheckpointDriver.ENGINE, True, LAST, 1, False, False),  # no interval
        ("10m", CheckpointDriver.NONE, True, LAST, 1, False, False),
        ("10m", CheckpointDriver.ENGINE, False, LAST, 1, False, False),  # not Ready
        ("10m", CheckpointDriver.ENGINE, True, LAST, 1, True, False),  # one is running
    ],
)
def test_periodic_due(
    interval: str | None,
    driver: CheckpointDriver,
    ready: bool,
    last: CheckpointState | None,
    activity_min_ago: int | None,
    in_flight: bool,
    due: bool,
) -> None:
    activity = None if activity_min_ago is None else NOW - timedelta(minutes=activity_min_ago)
    assert periodic_due(interval, driver, ready, last, activity, in_flight, NOW) is due


def test_latest_usable_is_the_newest_whole_worker_success() -> None:
    checkpoints = [
        cp("old", 30),
        cp("new", 5),
        cp("failed", 1, CheckpointPhase.FAILED),
        cp("drain", 0, reason=CheckpointReason.DRAIN, sessions=("s",)),
    ]
    best = latest_usable(checkpoints)
    assert best is not None and best.name == "new"
    assert latest_usable([cp("failed", 1, CheckpointPhase.FAILED)]) is None


def test_retention_keeps_the_newest_and_spares_manual_and_running() -> None:
    checkpoints = [
        cp("a", 40),
        cp("b", 30),
        cp("c", 20, CheckpointPhase.FAILED),
        cp("d", 10),
        cp("running", 0, CheckpointPhase.RUNNING),
        cp("mine", 50, reason=CheckpointReason.MANUAL),
    ]
    assert retention_victims(checkpoints, 2) == ["a", "b"]
    assert retention_victims(checkpoints, 10) == []


def test_retention_orders_a_checkpoint_without_timestamps_as_the_oldest() -> None:
    # No completedAt and no creationTimestamp: it sorted under a naive datetime.min,
    # which cannot be compared with the others' times (TypeError before, found by
    # tests/test_crd_properties.py).
    undated = CheckpointState(
        "ns", "undated", "w", CheckpointReason.PERIODIC, CheckpointPhase.FAILED
    )
    assert retention_victims([cp("a", 40), undated, cp("b", 30)], 2) == ["undated"]


def test_location_and_name() -> None:
    assert checkpoint_location("/ckpt/", "ns", "w", "n", None) == "/ckpt/ns/w/n"
    assert checkpoint_location("/ckpt", "ns", "w", "n", "/elsewhere") == "/elsewhere"
    name = checkpoint_name("w", CheckpointReason.PERIODIC, 3, NOW)
    assert name == "w-periodic-e3-20261129-120000"


def test_two_drain_batches_in_one_second_get_two_names() -> None:
    # A drain moves sessions as the routers acknowledge them, one batch per pass, and
    # two passes can fall within one second. With one name per second the second
    # batch's create got 409 and its sessions moved without their cache, silently (as
    # in e2e/test_karpenter.py's spot interruption, three sessions and a router).
    first = checkpoint_name("w", CheckpointReason.DRAIN, 1, NOW, ("id-a", "id-b"))
    second = checkpoint_name("w", CheckpointReason.DRAIN, 1, NOW, ("id-c",))
    assert first != second
    assert first.startswith("w-drain-e1-20261129-120000-")
    # The same batch retried within the second still meets its own object.
    assert first == checkpoint_name("w", CheckpointReason.DRAIN, 1, NOW, ("id-b", "id-a"))


def test_a_running_checkpoint_nobody_runs_is_abandoned_after_the_timeout() -> None:
    from datetime import UTC, datetime, timedelta

    from sessionfleet.api import CheckpointPhase, CheckpointReason
    from sessionfleet.policy.checkpoint import CheckpointState, abandoned

    now = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    timeout = timedelta(minutes=15)

    def state(phase: CheckpointPhase | None, started_minutes_ago: float | None) -> CheckpointState:
        started = (
            None if started_minutes_ago is None else now - timedelta(minutes=started_minutes_ago)
        )
        return CheckpointState("ns", "c", "w", CheckpointReason.PERIODIC, phase, started_at=started)

    running = CheckpointPhase.RUNNING
    assert abandoned(state(running, 16), running_here=False, now=now, timeout=timeout)
    assert not abandoned(state(running, 5), running_here=False, now=now, timeout=timeout)
    assert not abandoned(state(running, 60), running_here=True, now=now, timeout=timeout)
    assert abandoned(state(running, None), running_here=False, now=now, timeout=timeout)
    for phase in (None, CheckpointPhase.PENDING, CheckpointPhase.SUCCEEDED):
        assert not abandoned(state(phase, 60), running_here=False, now=now, timeout=timeout)
