"""The turn-boundary handshake: live routers acknowledge before a session moves."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sessionfleet.policy.handshake import RouterLease, acks_of, handshake

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
SINCE = NOW - timedelta(seconds=2)
STAMP = "2026-11-29T11:59:58Z"


def lease(holder: str, seconds_ago: float = 1, duration: int = 15) -> RouterLease:
    return RouterLease(holder, NOW - timedelta(seconds=seconds_ago), duration)


def test_no_router_means_nothing_to_wait_for() -> None:
    assert handshake(SINCE, STAMP, {}, [], NOW).ready


def test_every_live_replica_must_acknowledge_this_migration() -> None:
    leases = [lease("r1"), lease("r2")]
    state = handshake(SINCE, STAMP, {"r1": STAMP}, leases, NOW)
    assert not state.ready and state.waiting_for == ("r2",)
    assert handshake(SINCE, STAMP, {"r1": STAMP, "r2": STAMP}, leases, NOW).ready


def test_an_acknowledgement_of_an_earlier_migration_does_not_count() -> None:
    state = handshake(SINCE, STAMP, {"r1": "2026-11-29T10:00:00Z"}, [lease("r1")], NOW)
    assert not state.ready


def test_dead_replicas_are_not_waited_for() -> None:
    leases = [lease("r1"), lease("dead", seconds_ago=60)]
    assert handshake(SINCE, STAMP, {"r1": STAMP}, leases, NOW).ready


def test_the_wait_is_bounded() -> None:
    long_ago = NOW - timedelta(seconds=31)
    state = handshake(long_ago, STAMP, {}, [lease("r1")], NOW, timedelta(seconds=30))
    assert state.ready and state.timed_out and state.waiting_for == ("r1",)


def test_acks_from_annotations() -> None:
    annotations = {"ack.sessionfleet.dev/r1": STAMP, "other": "x"}
    assert acks_of(annotations) == {"r1": STAMP}
