"""The operator's bookkeeping between its writes and the watch events that report them."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from datetime import UTC, datetime

from sessionfleet.api import SessionPhase
from sessionfleet.controllers.config import OperatorConfig
from sessionfleet.controllers.fleet import Fleet
from sessionfleet.controllers.sessionbook import BindingLedger
from sessionfleet.controllers.sessions import next_step
from sessionfleet.policy.sessions import Action, SessionState

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def test_ledger_counts_unseen_bindings_per_worker() -> None:
    ledger = BindingLedger()
    ledger.add(("ns", "a"), "w1", 0)
    ledger.add(("ns", "b"), "w1", 0)
    ledger.add(("ns", "c"), "w2", 0)
    ledger.add(("other", "a"), "w1", 0)
    assert ledger.unseen == Counter({("ns", "w1"): 2, ("ns", "w2"): 1, ("other", "w1"): 1})

    ledger.observe(("ns", "a"), None)  # the create event: not bound yet
    ledger.observe(("ns", "b"), "w2")  # bound elsewhere: not the binding we wrote
    assert ledger.unseen[("ns", "w1")] == 2
    ledger.observe(("ns", "a"), "w1")  # the watch shows our binding
    assert ledger.unseen[("ns", "w1")] == 1

    ledger.add(("ns", "c"), "w1", 0)  # rebound before it was seen: its count moves
    assert ledger.unseen == Counter({("ns", "w1"): 2, ("other", "w1"): 1})

    for key in (("ns", "b"), ("ns", "c"), ("ns", "c"), ("other", "a"), ("ns", "zz")):
        ledger.settle(key)
    assert not ledger.pending and not ledger.unseen


def _fleet(*sessions: SessionState) -> Fleet:
    fleet = Fleet(config=OperatorConfig(), kube=None, http=None)  # type: ignore[arg-type]
    for session in sessions:
        fleet.sessions.cache.put(session)
    return fleet


def test_a_deleted_session_is_not_deleted_again_while_the_index_still_shows_it() -> None:
    finished = SessionState(
        "ns",
        "s",
        "id-s",
        "m",
        phase=SessionPhase.FINISHED,
        worker="w",
        finished_at=NOW,
        ttl_seconds=0,
        resource_version=5,
    )
    fleet = _fleet(finished)
    step = next_step(fleet, finished, NOW)
    assert step is not None and step.action is Action.DELETE

    fleet.sessions.deleted[("ns", "s")] = 5  # what the delete records
    assert next_step(fleet, finished, NOW) is None
    fleet.sessions.forget_deleted()
    assert ("ns", "s") in fleet.sessions.deleted  # the index still shows it

    # A session created anew under the same name is a newer version: it gets its steps.
    anew = SessionState("ns", "s", "id-s", "m", created_at=NOW, resource_version=9)
    step = next_step(fleet, anew, NOW)
    assert step is not None and step.action is Action.PLACE
    fleet.sessions.cache.put(anew)
    fleet.sessions.forget_deleted()
    assert not fleet.sessions.deleted


def test_the_deleted_record_goes_once_the_watch_reports_the_deletion() -> None:
    fleet = _fleet()
    fleet.sessions.deleted[("ns", "gone")] = 7
    fleet.sessions.forget_deleted()
    assert not fleet.sessions.deleted


def test_next_step_is_none_for_a_bound_session_that_needs_nothing() -> None:
    bound = SessionState(
        "ns",
        "s",
        "id-s",
        "m",
        created_at=NOW,
        phase=SessionPhase.BOUND,
        worker="w",
        bound_at=NOW,
        resource_version=3,
    )
    fleet = _fleet(bound)
    # Its worker is unknown to this fleet, so the step is to mark it Lost ...
    step = next_step(fleet, bound, NOW)
    assert step is not None and step.phase is SessionPhase.LOST
    # ... unless our own write of it has not come back yet.
    fleet.freshness.written[("ns", "s")] = 4
    assert next_step(fleet, replace(bound, resource_version=3), NOW) is None


def test_worker_counters_are_coalesced_but_phase_changes_are_not() -> None:
    import time

    from sessionfleet.controllers.records import WorkerRecord
    from sessionfleet.controllers.workers import worth_writing

    fleet = Fleet(config=OperatorConfig(), kube=None, http=None)  # type: ignore[arg-type]
    record = WorkerRecord("ns", "w", 1, None)
    counters = {"pinnedSessions": 3}
    assert worth_writing(fleet, record, counters)  # never written: write
    fleet.worker_writes.status_written_at[record.key] = time.monotonic()
    assert not worth_writing(fleet, record, counters)  # written just now: wait
    assert worth_writing(fleet, record, {"pinnedSessions": 3, "phase": "Draining"})
    assert not worth_writing(fleet, record, {})
    fleet.worker_writes.status_written_at[record.key] = time.monotonic() - 6
    assert worth_writing(fleet, record, counters)


def test_a_large_fleets_counters_wait_longer_so_their_writes_keep_to_the_budget() -> None:
    import time

    from sessionfleet.controllers.records import WorkerRecord
    from sessionfleet.controllers.workers import worth_writing

    config = OperatorConfig(status_coalesce_seconds=5.0, counter_writes_per_second=20.0)
    fleet = Fleet(config=config, kube=None, http=None)  # type: ignore[arg-type]
    workers = {("ns", f"w{i}"): [WorkerRecord("ns", f"w{i}", 1, None)] for i in range(500)}
    fleet.indexes.workers = workers  # type: ignore[assignment]  # kopf's index: key -> records
    record = workers[("ns", "w0")][0]
    assert fleet.counter_interval() == 25.0
    fleet.worker_writes.status_written_at[record.key] = time.monotonic() - 6
    assert not worth_writing(fleet, record, {"pinnedSessions": 3})  # 6 s: not yet
    assert worth_writing(fleet, record, {"phase": "Draining"})  # never waits
    fleet.worker_writes.status_written_at[record.key] = time.monotonic() - 26
    assert worth_writing(fleet, record, {"pinnedSessions": 3})
