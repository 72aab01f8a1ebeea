"""Table tests of the migration plan: handshake first, then where each session goes."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

import pytest

from sessionfleet.api import SessionPhase
from sessionfleet.policy.handshake import RouterLease, stamp
from sessionfleet.policy.migration import MigrationAction, plan_migration
from sessionfleet.policy.placement import WorkerLoad
from sessionfleet.policy.sessions import SessionState

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
SINCE = NOW - timedelta(seconds=5)
TIMEOUT = timedelta(seconds=30)


def routers(now: datetime) -> list[RouterLease]:
    """Two live router replicas."""
    return [RouterLease("r1", now, 15), RouterLease("r2", now, 15)]


def session(name: str, *, migrating: bool = True, acks: tuple[str, ...] = ()) -> SessionState:
    return SessionState(
        namespace="ns",
        name=name,
        session_id=f"id-{name}",
        model="m",
        phase=SessionPhase.MIGRATING if migrating else SessionPhase.BOUND,
        worker="src",
        migrating_since=SINCE if migrating else None,
        acks=tuple((replica, stamp(SINCE)) for replica in acks),
        prompt_tokens=3000,
        turns=3,
    )


def loads(**pinned: int) -> list[WorkerLoad]:
    return [WorkerLoad(name, "m", True, count, max_sessions=4) for name, count in pinned.items()]


@pytest.mark.parametrize(
    ("state", "now", "action", "overdue"),
    [
        (session("s", migrating=False), NOW, MigrationAction.START_HANDSHAKE, ()),
        (session("s", acks=("r1",)), NOW, MigrationAction.WAIT, ()),
        (session("s", acks=("r1", "r2")), NOW, MigrationAction.MOVE, ()),
        # r2 never answered: after the timeout the session moves anyway, and it says so.
        (session("s", acks=("r1",)), SINCE + TIMEOUT, MigrationAction.MOVE, ("r2",)),
    ],
)
def test_the_handshake_gates_the_move(
    state: SessionState, now: datetime, action: MigrationAction, overdue: tuple[str, ...]
) -> None:
    (step,) = plan_migration([state], "src", loads(src=1, dst=0), routers(now), now, TIMEOUT)
    assert step.action is action and step.overdue == overdue
    if action is MigrationAction.MOVE:
        assert step.target == "dst"
    if action is MigrationAction.WAIT:
        assert "r2" in step.message


def test_an_acknowledgement_of_an_earlier_migration_does_not_count() -> None:
    earlier = stamp(SINCE - timedelta(minutes=10))
    stale = dataclasses.replace(session("s"), acks=(("r1", earlier), ("r2", earlier)))
    (step,) = plan_migration([stale], "src", loads(src=1, dst=0), routers(NOW), NOW, TIMEOUT)
    assert step.action is MigrationAction.WAIT


def test_a_batch_spreads_and_never_lands_on_the_source() -> None:
    batch = [session(f"s{i}", acks=("r1", "r2")) for i in range(3)]
    steps = plan_migration(batch, "src", loads(src=0, a=1, b=1), routers(NOW), NOW, TIMEOUT)
    targets = [step.target for step in steps]
    # src is the least loaded, but it drains; without the load of each placed session
    # counted, all three would go to one worker.
    assert "src" not in targets and set(targets) == {"a", "b"}


def test_no_room_anywhere_keeps_the_session() -> None:
    (step,) = plan_migration(
        [session("s", acks=("r1", "r2"))], "src", loads(src=1, full=4), routers(NOW), NOW, TIMEOUT
    )
    assert step.action is MigrationAction.NO_TARGET and step.target is None


def test_a_session_with_saved_state_goes_where_it_can_be_loaded_while_one_has_room() -> None:
    batch = [session(f"s{i}", acks=("r1", "r2")) for i in range(3)]
    # "same" is busier than "other", but only it can load the sessions' saved KV.
    workers = loads(src=0, same=2, other=0)
    steps = plan_migration(
        batch, "src", workers, routers(NOW), NOW, TIMEOUT, frozenset({"src", "same"})
    )
    # Two fit on "same" (4 sessions at most); the third recomputes on "other".
    assert [step.target for step in steps] == ["same", "same", "other"]
    # Without saved state, the least loaded as ever.
    plain = plan_migration(batch, "src", workers, routers(NOW), NOW, TIMEOUT)
    assert [step.target for step in plain] == ["other", "other", "other"]
