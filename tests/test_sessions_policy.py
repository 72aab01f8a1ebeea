"""The session decision: bind, restore, lose, finish, expire."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from sessionfleet.api import Reason, SessionPhase, WorkerPhase
from sessionfleet.policy.sessions import (
    Action,
    SessionState,
    WorkerBrief,
    decide_session,
    next_check,
)

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
NEW = SessionState("ns", "s", "sid", "m", created_at=NOW - timedelta(seconds=1))
BOUND = replace(NEW, phase=SessionPhase.BOUND, worker="w", epoch=1, last_activity=NOW)
READY = WorkerBrief("w", WorkerPhase.READY, 1, "w-1")


@pytest.mark.parametrize(
    ("session", "worker", "action", "phase", "reason"),
    [
        (NEW, None, Action.PLACE, None, None),
        (BOUND, READY, Action.NOTHING, None, None),
        (BOUND, None, Action.UPDATE, SessionPhase.LOST, Reason.WORKER_DELETED),
        (
            BOUND,
            WorkerBrief("w", WorkerPhase.RECOVERING, 2, None),
            Action.UPDATE,
            SessionPhase.RESTORING,
            Reason.WORKER_RECOVERING,
        ),
        (
            replace(BOUND, phase=SessionPhase.RESTORING),
            WorkerBrief("w", WorkerPhase.RECOVERING, 2, None),
            Action.NOTHING,
            None,
            None,
        ),
        (
            replace(BOUND, phase=SessionPhase.RESTORING),
            WorkerBrief("w", WorkerPhase.READY, 2, "w-2"),
            Action.UPDATE,
            SessionPhase.BOUND,
            Reason.BOUND,
        ),
        # a recovery that went unseen still updates the epoch
        (
            BOUND,
            WorkerBrief("w", WorkerPhase.READY, 2, "w-2"),
            Action.UPDATE,
            SessionPhase.BOUND,
            Reason.BOUND,
        ),
        # draining workers keep their sessions bound
        (BOUND, WorkerBrief("w", WorkerPhase.DRAINING, 1, "w-1"), Action.NOTHING, None, None),
        (
            replace(BOUND, finished=True),
            READY,
            Action.UPDATE,
            SessionPhase.FINISHED,
            Reason.FINISHED_BY_CLIENT,
        ),
        (
            replace(BOUND, last_activity=NOW - timedelta(hours=1)),
            READY,
            Action.UPDATE,
            SessionPhase.FINISHED,
            Reason.IDLE_TIMEOUT,
        ),
        (replace(BOUND, phase=SessionPhase.LOST), None, Action.NOTHING, None, None),
        (replace(NEW, invalid="spec.model: required"), None, Action.NOTHING, None, None),
        # a migrating session waits for the drain to move it ...
        (
            replace(BOUND, phase=SessionPhase.MIGRATING),
            WorkerBrief("w", WorkerPhase.DRAINING, 1, "w-1"),
            Action.NOTHING,
            None,
            None,
        ),
        # ... and stays if the drain ends first
        (
            replace(BOUND, phase=SessionPhase.MIGRATING),
            READY,
            Action.UPDATE,
            SessionPhase.BOUND,
            Reason.BOUND,
        ),
    ],
)
def test_decide_session(
    session: SessionState,
    worker: WorkerBrief | None,
    action: Action,
    phase: SessionPhase | None,
    reason: Reason | None,
) -> None:
    decision = decide_session(session, worker, NOW, timedelta(minutes=30))
    assert (decision.action, decision.phase, decision.reason) == (action, phase, reason)


def test_finished_sessions_are_deleted_after_their_ttl() -> None:
    finished = replace(
        BOUND, phase=SessionPhase.FINISHED, finished_at=NOW - timedelta(seconds=50), ttl_seconds=60
    )
    kept = decide_session(finished, READY, NOW)
    assert kept.action is Action.NOTHING and kept.recheck_at == NOW + timedelta(seconds=10)
    assert decide_session(finished, READY, NOW + timedelta(seconds=10)).action is Action.DELETE


@pytest.mark.parametrize("finished_at", ["9999-12-31T23:59:59Z", "9999-12-31T23:59:59-23:59"])
def test_a_finish_time_at_the_end_of_the_calendar_never_expires(finished_at: str) -> None:
    # The CRD's date-time accepts any year up to 9999; the TTL would carry it past the
    # calendar's end (OverflowError before, found by tests/test_crd_properties.py).
    finished = replace(
        BOUND, phase=SessionPhase.FINISHED, finished_at=datetime.fromisoformat(finished_at)
    )
    decision = decide_session(finished, READY, NOW)
    assert (decision.action, decision.recheck_at) == (Action.NOTHING, None)


def test_pinned_and_context_estimate() -> None:
    assert BOUND.pinned and not NEW.pinned
    assert not replace(BOUND, phase=SessionPhase.FINISHED).pinned
    assert replace(BOUND, prompt_tokens=3000, turns=3).context_tokens == 1000


LOST = replace(
    BOUND,
    phase=SessionPhase.LOST,
    created_at=NOW - timedelta(hours=6),
    last_activity=NOW - timedelta(hours=5),
)


@pytest.mark.parametrize(
    ("session", "action", "recheck"),
    [
        # Lost a minute ago, its last turn long before: kept until it has been Lost 10m.
        (replace(LOST, lost_since=NOW - timedelta(minutes=1)), Action.NOTHING, 9),
        # Lost long ago, but still served elsewhere: its last turn keeps it.
        (
            replace(LOST, lost_since=NOW - timedelta(hours=2), last_activity=NOW),
            Action.NOTHING,
            10,
        ),
        (replace(LOST, lost_since=NOW - timedelta(minutes=10)), Action.UPDATE, None),
        # No Ready condition (written by hand): its last turn counts.
        (LOST, Action.UPDATE, None),
        (replace(LOST, last_activity=None, bound_at=None, created_at=None), Action.NOTHING, None),
    ],
)
def test_lost_sessions_are_finished_after_the_lost_timeout(
    session: SessionState, action: Action, recheck: int | None
) -> None:
    lost_timeout = timedelta(minutes=10)
    decision = decide_session(session, None, NOW, timedelta(minutes=30), lost_timeout)
    assert decision.action is action
    expected = None if recheck is None else NOW + timedelta(minutes=recheck)
    if action is Action.UPDATE:
        assert (decision.phase, decision.reason) == (SessionPhase.FINISHED, Reason.LOST_EXPIRED)
        assert "deleted after ttlSecondsAfterFinished" in decision.message
    else:
        assert decision.recheck_at == expected
    # The loop wakes for it with no event: the deadline is the one decided on.
    if action is Action.NOTHING:
        assert next_check(session, timedelta(minutes=30), lost_timeout) == expected
    # Finished, it then goes the way of every finished session: deleted after its TTL.
    finished = replace(session, phase=SessionPhase.FINISHED, finished_at=NOW)
    later = decide_session(finished, None, NOW + timedelta(hours=1), lost_timeout=lost_timeout)
    assert later.action is Action.DELETE
