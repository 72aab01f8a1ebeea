"""What a pass of the fleet loop reconciles: marks, deadlines, settled workers, loads."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from sessionfleet.api import InferenceWorkerSpec, InferenceWorkerStatus, SessionPhase, WorkerPhase
from sessionfleet.controllers.config import OperatorConfig
from sessionfleet.controllers.engines import EngineStats
from sessionfleet.controllers.fleet import Fleet
from sessionfleet.controllers.loads import WorkerLoads
from sessionfleet.controllers.loop import due_sessions, reconcile_once, repair
from sessionfleet.controllers.records import WorkerRecord, worker_record
from sessionfleet.controllers.sessions import migrate_sessions, reconcile_session
from sessionfleet.controllers.turns import WriteTurns
from sessionfleet.controllers.work import Batch, Deadlines, WorkQueue, counter_interval
from sessionfleet.policy.drain import DEFAULT_POLICY, PinnedSession, PolicyChoice
from sessionfleet.policy.observed import NodeState, PodState
from sessionfleet.policy.sessions import (
    Action,
    SessionState,
    WorkerBrief,
    decide_session,
    next_check,
)
from sessionfleet.policy.worker import WorkerObservation, plan_worker, settled

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
IDLE = timedelta(minutes=30)
TICK = timedelta(microseconds=1)


def test_deadlines_come_due_in_time_order_and_a_rescheduled_key_only_once() -> None:
    deadlines = Deadlines()
    deadlines.schedule(("ns", "late"), 30.0)
    deadlines.schedule(("ns", "early"), 10.0)
    deadlines.schedule(("ns", "moved"), 5.0)
    deadlines.schedule(("ns", "moved"), 20.0)  # its entry at 5 is stale now
    deadlines.schedule(("ns", "gone"), 1.0)
    deadlines.schedule(("ns", "gone"), None)
    assert deadlines.due(9.9) == []
    assert deadlines.due(20.0) == [("ns", "early"), ("ns", "moved")]
    deadlines.earlier(("ns", "late"), 40.0)  # later than it is: unchanged
    deadlines.earlier(("other", "x"), 25.0)
    assert deadlines.due(100.0) == [("other", "x"), ("ns", "late")]
    assert len(deadlines) == 0 and deadlines.due(1e9) == []


def test_deadlines_stay_bounded_however_often_keys_move() -> None:
    deadlines = Deadlines()
    rng = random.Random(7)
    keys = [("ns", f"s{i}") for i in range(100)]
    for step in range(20_000):
        deadlines.schedule(rng.choice(keys), float(step))
    assert len(deadlines) == 100
    assert len(deadlines._heap) <= 2 * 100 + 64 + 1
    assert sorted(deadlines.due(1e9)) == sorted(keys)


def test_the_first_pass_is_full_then_only_marks_and_what_is_due() -> None:
    work = WorkQueue(full_every=60.0)
    work.worker(("ns", "w1"))
    first = work.take(wall=1000.0, mono=0.0)
    assert first.full
    assert not work.take(wall=1000.0, mono=1.0).workers  # the full pass consumed the mark

    work.worker(("ns", "w1"))
    work.session(("ns", "s1"))
    work.settle(("ns", "draining"), False)
    work.waiting.add(("ns", "unplaced"))
    work.session_deadlines.schedule(("ns", "idle"), 1010.0)
    work.retry("inferenceworkers", ("ns", "failed"), 5.0)
    batch = work.take(wall=1005.0, mono=2.0)
    assert not batch.full
    assert batch.workers == {("ns", "w1"), ("ns", "draining")}
    assert batch.sessions == {("ns", "s1"), ("ns", "unplaced")}

    # Marks are consumed; unsettled workers and waiting sessions come every pass;
    # deadlines when due.
    batch = work.take(wall=1010.0, mono=5.0)
    assert batch.workers == {("ns", "draining"), ("ns", "failed")}
    assert batch.sessions == {("ns", "unplaced"), ("ns", "idle")}

    work.settle(("ns", "draining"), True)
    work.forget_session(("ns", "unplaced"))
    batch = work.take(wall=1011.0, mono=6.0)
    assert not batch.workers and not batch.sessions
    assert work.take(wall=1100.0, mono=60.0).full


def test_a_session_decision_changes_with_the_clock_only_at_its_next_check() -> None:
    brief = WorkerBrief("w", WorkerPhase.READY, 1, "w-1")
    bound = SessionState(
        "ns", "s", "sid", "m", created_at=NOW, phase=SessionPhase.BOUND, worker="w", epoch=1
    )
    cases = [
        (bound, brief),  # idle since its creation
        (replace(bound, last_activity=NOW + timedelta(minutes=3)), brief),
        (replace(bound, phase=SessionPhase.FINISHED, finished_at=NOW, ttl_seconds=90), brief),
        (
            replace(bound, phase=SessionPhase.MIGRATING),
            WorkerBrief("w", WorkerPhase.DRAINING, 1, "w-1"),
        ),
        # Lost: finished at the lost-session timeout (the default, as IDLE's).
        (replace(bound, phase=SessionPhase.LOST, lost_since=NOW + timedelta(minutes=1)), None),
    ]
    for session, worker in cases:
        due = next_check(session, IDLE)
        assert due is not None
        before = decide_session(session, worker, due - TICK, IDLE)
        assert before.action is Action.NOTHING
        assert decide_session(session, worker, NOW, IDLE) == before
        assert decide_session(session, worker, due, IDLE).action is not Action.NOTHING


@pytest.mark.parametrize(
    "session",
    [
        SessionState("ns", "s", "sid", "m", phase=SessionPhase.LOST),  # nothing dated
        SessionState("ns", "s", "sid", "m", invalid="bad spec", created_at=NOW),
        SessionState("ns", "s", "sid", "m"),  # nothing dated yet
        SessionState(
            "ns",
            "s",
            "sid",
            "m",
            phase=SessionPhase.FINISHED,
            finished_at=datetime(9999, 12, 31, tzinfo=UTC),
            ttl_seconds=10**9,
        ),
    ],
)
def test_a_session_with_no_deadline_has_no_next_check(session: SessionState) -> None:
    assert next_check(session, IDLE) is None


SPEC = InferenceWorkerSpec.model_validate({"model": "m", "engine": {"type": "sim"}, "gpus": 1})
READY_NODE = NodeState("n1")
POD = PodState("w-1", 1, "Running", scheduled=True, ready=True, node="n1", pod_ip="127.1.0.4")


def _settled(
    status: dict[str, object] | None = None,
    node: NodeState | None = READY_NODE,
    spec: InferenceWorkerSpec = SPEC,
    pods: tuple[PodState, ...] = (POD,),
) -> bool:
    observation = WorkerObservation(
        name="w",
        spec=spec,
        status=InferenceWorkerStatus.model_validate(
            status or {"epoch": 1, "pod": "w-1", "phase": "Ready"}
        ),
        pods=pods,
        node=node,
        pinned=[PinnedSession("s1")],
        policy=PolicyChoice(None, DEFAULT_POLICY),
        now=NOW,
    )
    return settled(observation, plan_worker(observation))


def test_only_a_ready_worker_on_a_ready_node_waits_for_events() -> None:
    assert _settled()
    assert not _settled({"epoch": 1, "pod": "w-1", "phase": "Starting"})  # becomes Ready now
    assert not _settled(node=NodeState("n1", ready=False, not_ready_since=NOW))  # toleration
    assert not _settled(node=None)
    assert not _settled(node=NodeState("n1", unschedulable=True))  # a cordon drains it
    periodic = SPEC.model_copy(
        update={"checkpoint": SPEC.checkpoint.model_copy(update={"interval": "10m"})}
    )
    assert not _settled(spec=periodic)
    old = replace(POD, name="w-0", epoch=0)
    assert not _settled(pods=(old, POD))  # a pod of an earlier epoch to delete


def _session(name: str, worker: str | None, prompt: int = 100, **kw: object) -> SessionState:
    return SessionState(
        "ns",
        name,
        name,
        "m",
        worker=worker,
        phase=SessionPhase.BOUND if worker else None,
        prompt_tokens=prompt,
        turns=1,
        **kw,  # type: ignore[arg-type]
    )


def test_worker_loads_follow_binds_moves_finishes_and_deletions() -> None:
    loads = WorkerLoads()
    assert loads.update(_session("a", None)) is None and len(loads) == 0
    assert loads.update(_session("a", "w1", 100)) is None
    assert loads.update(_session("b", "w1", 50)) is None
    assert (loads.pinned[("ns", "w1")], loads.tokens[("ns", "w1")]) == (2, 150)
    assert loads.update(_session("a", "w1", 400)) is None  # a longer prompt, same worker
    assert loads.tokens[("ns", "w1")] == 450
    assert loads.update(_session("a", "w2", 400)) == ("ns", "w1")  # migrated
    assert (loads.pinned[("ns", "w1")], loads.pinned[("ns", "w2")]) == (1, 1)
    finished = replace(_session("b", "w1", 50), phase=SessionPhase.FINISHED)
    assert loads.update(finished) == ("ns", "w1")
    assert ("ns", "w1") not in loads.pinned and ("ns", "w1") not in loads.tokens
    assert loads.remove(("ns", "a")) == ("ns", "w2")
    assert loads.remove(("ns", "a")) is None
    assert not loads.pinned and not loads.tokens


def test_a_check_counts_a_session_as_the_index_shows_it_and_says_if_it_was_wrong() -> None:
    loads = WorkerLoads()
    loads.update(_session("a", "w1"))
    loads.update(_session("b", "w1"))  # a deletion of b was missed
    index = {s.key: s for s in (_session("a", "w1"), _session("c", "w2", 30))}  # c's bind too
    keys = [*index, *(loads.counted() - index.keys())]
    assert [loads.check(key, index.get(key)) for key in keys] == [False, True, True]
    assert dict(loads.pinned) == {("ns", "w1"): 1, ("ns", "w2"): 1}
    assert loads.tokens[("ns", "w2")] == 30
    assert not any(loads.check(key, index.get(key)) for key in keys)
    finished = replace(index[("ns", "c")], phase=SessionPhase.FINISHED)
    assert loads.check(("ns", "c"), finished)  # bound but no longer pinned: not counted
    assert dict(loads.pinned) == {("ns", "w1"): 1}


def _worker(name: str, namespace: str = "ns", phase: str = "Ready", **spec: object) -> WorkerRecord:
    return worker_record(
        {
            "apiVersion": "sessionfleet.dev/v1alpha1",
            "kind": "InferenceWorker",
            "metadata": {"name": name, "namespace": namespace, "resourceVersion": "1"},
            "spec": {"model": "m", "engine": {"type": "sim"}, "gpus": 1, **spec},
            "status": {"phase": phase, "epoch": 1, "pod": f"{name}-1"},
        }
    )


def test_placement_sees_counted_sessions_unseen_binds_and_engine_figures() -> None:
    fleet = Fleet(config=OperatorConfig(), kube=None, http=None)  # type: ignore[arg-type]
    workers = [
        _worker("w1", capacity={"maxSessions": 8}),
        _worker("w2", drain=True),
        _worker("w3", namespace="other"),
        _worker("bad", engine={"type": "nope"}),  # invalid: not a placement candidate
    ]
    fleet.indexes.workers = {w.key: [w] for w in workers}
    assert workers[-1].worker is None
    fleet.sessions.worker_loads.update(_session("a", "w1", 300))
    fleet.sessions.worker_loads.update(_session("b", "w1", 100))
    fleet.sessions.ledger.add(("ns", "c"), "w1", 50)  # written, not yet seen
    fleet.engines.stats[("ns", "w1")] = EngineStats(kv_usage=0.25)
    loads = {load.name: load for load in fleet.loads("ns")}
    assert set(loads) == {"w1", "w2"}
    w1, w2 = loads["w1"], loads["w2"]
    assert (w1.pinned_sessions, w1.kv_tokens_pinned, w1.kv_usage, w1.max_sessions) == (
        3,
        400,
        0.25,
        8,
    )
    assert w1.ready and not w2.ready  # a worker asked to drain takes no new session
    assert (w2.pinned_sessions, w2.kv_tokens_pinned, w2.kv_usage) == (0, 0, 0.0)


def test_a_workers_counts_are_looked_at_now_only_when_its_hold_changes() -> None:
    work = WorkQueue()
    work.take(wall=0.0, mono=0.0)  # the first, full pass
    work.worker_counted(("ns", "first"), 0, 1, at=10.0)  # its first pinned session
    work.worker_counted(("ns", "last"), 1, 0, at=10.0)  # its last one finished
    work.worker_counted(("ns", "busy"), 5, 6, at=10.0)  # counters only: coalesced
    work.worker_counted(("ns", "busy"), 6, 7, at=12.0)  # not pushed later by more events
    assert work.take(wall=0.0, mono=1.0).workers == {("ns", "first"), ("ns", "last")}
    assert work.take(wall=0.0, mono=9.0).workers == set()
    assert work.take(wall=0.0, mono=10.0).workers == {("ns", "busy")}


def test_counter_writes_stay_within_their_budget_whatever_the_fleet_size() -> None:
    assert counter_interval(5.0, 4, 20.0) == 5.0  # a small fleet: the floor
    assert counter_interval(5.0, 100, 20.0) == 5.0  # exactly at the budget
    assert counter_interval(5.0, 500, 20.0) == 25.0
    assert counter_interval(5.0, 500, 0.0) == 5.0  # no budget
    for workers in (1, 99, 100, 101, 500, 5000):
        interval = counter_interval(5.0, workers, 20.0)
        # Each worker due once per interval: the fleet's rate never passes the budget.
        assert workers / interval <= 20.0 + 1e-9
        assert interval >= 5.0


def test_the_policies_are_written_again_only_after_something_they_read_changed() -> None:
    work = WorkQueue()
    assert work.take(wall=0.0, mono=0.0).full
    assert not work.take(wall=0.0, mono=1.0).policies
    work.policies = True
    assert work.take(wall=0.0, mono=2.0).policies
    assert not work.take(wall=0.0, mono=3.0).policies
    work.forget_worker(("ns", "gone"))  # a deleted worker leaves its policy's status
    assert work.take(wall=0.0, mono=4.0).policies


def _full_fleet(sessions: int) -> Fleet:
    """A fleet of one Ready worker and ``sessions`` Bound to it, as the watches left it."""
    fleet = Fleet(config=OperatorConfig(), kube=None, http=None)  # type: ignore[arg-type]
    record = _worker("w1", capacity={"maxSessions": sessions})
    fleet.indexes.workers = {record.key: [record]}  # type: ignore[assignment]
    for i in range(sessions):
        state = replace(_session(f"s{i}", "w1"), epoch=1, bound_at=NOW)
        fleet.sessions.cache.put(state)
        fleet.sessions.worker_loads.update(state)
    return fleet


async def _ticks_during(work: Callable[[], Awaitable[object]]) -> tuple[int, object]:
    """Run ``work``; return how often another task ran meanwhile, and what it returned."""
    ticks = 0
    done = False

    async def ticker() -> None:
        nonlocal ticks
        while not done:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    start = ticks
    try:
        result = await work()
    finally:
        done = True
        await task
    return ticks - start, result


async def test_a_full_passs_repair_lets_events_in_and_puts_every_count_right() -> None:
    fleet = _full_fleet(5000)
    loads = fleet.sessions.worker_loads
    loads.remove(("ns", "s1"))  # its bind's event was missed
    loads.update(_session("gone", "w1"))  # its deletion's event was missed
    fleet.work.session_deadlines.schedule(("ns", "gone"), 1.0)
    ticks, _ = await _ticks_during(lambda: repair(fleet))
    assert ticks >= 5  # once per 1,000 sessions, at least: binds go in between
    assert loads.pinned[("ns", "w1")] == 5000 and loads.worker_of(("ns", "gone")) is None
    assert len(fleet.work.session_deadlines) == 5000  # each live session's next check


async def test_deciding_every_session_lets_events_in() -> None:
    fleet = _full_fleet(5000)
    stale = replace(_session("stale", "w1"), phase=SessionPhase.BOUND)  # no epoch yet
    fleet.sessions.cache.put(stale)
    ticks, due = await _ticks_during(
        lambda: due_sessions(fleet, fleet.sessions.all_sessions(), NOW)
    )
    assert ticks >= 5
    assert due == [stale]  # only the session with a step to take


def test_the_gauges_counts_follow_every_session_event() -> None:
    fleet = _full_fleet(3)
    cache = fleet.sessions.cache
    cache.put(_session("new", None))
    cache.put(replace(_session("s0", "w1"), recomputed_tokens=500))
    cache.put(replace(_session("s1", "w1"), phase=SessionPhase.FINISHED, recomputed_tokens=70))
    cache.drop(("ns", "s2"))
    counted = Counter(s.phase.value if s.phase else "New" for s in cache.all())
    assert +cache.phases == counted == Counter({"Bound": 1, "Finished": 1, "New": 1})
    assert cache.recomputed_pinned == 500  # a finished session is no longer pinned


class HeldWrites:
    """An API client whose writes wait until released, in the order they were sent."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.sent: list[tuple[str, str]] = []
        self.bodies: dict[str, Any] = {}
        self.version = 100

    async def patch(self, resource: object, name: str, body: Any, namespace: str, **_: object):
        self.sent.append(("patch", name))
        self.bodies[name] = body
        await self.release.wait()
        self.version += 1
        return {"metadata": {"name": name, "resourceVersion": str(self.version)}}

    async def delete(self, resource: object, name: str, namespace: str, **kw: object) -> None:
        self.sent.append(("delete", name))
        self.bodies[name] = kw
        await self.release.wait()


async def test_a_pass_starts_its_session_steps_and_does_not_wait_for_their_writes() -> None:
    fleet = _full_fleet(0)
    kube = HeldWrites()
    fleet.kube = kube  # type: ignore[assignment]
    fleet.sessions.writes = WriteTurns(1)
    recovering = _worker("w2", phase="Recovering")
    fleet.indexes.workers[recovering.key] = [recovering]  # type: ignore[index]
    new = [_session(f"new{i}", None) for i in range(3)]
    finishing = replace(_session("done", "w1"), epoch=1, finished=True)
    held = replace(_session("held", "w2"), epoch=1)  # its worker recovers: Restoring
    for state in (*new, finishing, held):
        fleet.sessions.cache.put(state)
    keys = frozenset(s.key for s in (*new, finishing, held))

    await asyncio.wait_for(reconcile_once(fleet, NOW, Batch(full=False, sessions=keys)), 1.0)
    await asyncio.sleep(0.01)
    assert len(kube.sent) == 1  # one turn: the rest wait for it, by urgency
    assert fleet.sessions.busy == set(keys)  # so the next pass starts none of them again
    await asyncio.wait_for(reconcile_once(fleet, NOW, Batch(full=False, sessions=keys)), 1.0)
    assert len(fleet.spawner.tasks) == len(keys)

    kube.release.set()
    while fleet.spawner.tasks:
        await asyncio.gather(*list(fleet.spawner.tasks))
    first, *rest = [name for _, name in kube.sent]
    # After the first write (whichever took the free turn): the restore, the binds, the finish.
    assert rest == [n for n in ("held", "new0", "new1", "new2", "done") if n != first]
    assert not fleet.sessions.busy


async def test_a_drain_marks_its_sessions_together_not_one_round_trip_after_another() -> None:
    fleet = _full_fleet(5)  # five sessions bound to w1, which drains
    target = _worker("w2", capacity={"maxSessions": 10})
    fleet.indexes.workers[target.key] = [target]  # type: ignore[index]
    kube = HeldWrites()
    fleet.kube = kube  # type: ignore[assignment]
    source = fleet.indexes.worker("ns", "w1")
    assert source is not None and source.worker is not None
    names = tuple(f"s{i}" for i in range(5))
    marking = asyncio.create_task(migrate_sessions(fleet, source, source.worker, names, False, NOW))
    for _ in range(50):
        await asyncio.sleep(0)
    assert sorted(name for _, name in kube.sent) == list(names)  # all sent, none answered
    kube.release.set()
    await asyncio.wait_for(marking, 1.0)


async def test_a_session_is_deleted_only_as_the_copy_the_decision_was_made_from() -> None:
    fleet = _full_fleet(0)
    kube = HeldWrites()
    kube.release.set()
    fleet.kube = kube  # type: ignore[assignment]
    expired = replace(
        _session("old", None),
        finished=True,
        phase=SessionPhase.FINISHED,
        finished_at=NOW - timedelta(hours=2),
        uid="u-1",
        resource_version=42,
    )
    fleet.sessions.cache.put(expired)
    await reconcile_session(fleet, expired, NOW)
    assert kube.sent == [("delete", "old")]
    # A deposed replica's late delete misses a session used or recreated since.
    assert kube.bodies["old"] == {"uid": "u-1", "resource_version": 42}


async def test_a_step_is_decided_again_when_its_turn_comes() -> None:
    fleet = _full_fleet(1)
    kube = HeldWrites()
    fleet.kube = kube  # type: ignore[assignment]
    fleet.sessions.writes = WriteTurns(1)
    gone, finished = _session("gone", None), _session("finished", None)
    for state in (gone, finished):
        fleet.sessions.cache.put(state)
    busy = asyncio.create_task(reconcile_session(fleet, _session("first", None), NOW))
    fleet.sessions.cache.put(_session("first", None))
    binds = [asyncio.create_task(reconcile_session(fleet, s, NOW)) for s in (gone, finished)]
    await asyncio.sleep(0.01)
    assert [name for _, name in kube.sent] == ["first"]  # the others wait for its turn
    fleet.sessions.cache.drop(gone.key)  # deleted while its bind waited
    fleet.sessions.cache.put(replace(finished, finished=True))  # finished while it waited
    kube.release.set()
    await asyncio.gather(busy, *binds)
    # No bind for the deleted session; the finished one is written Finished, not bound.
    assert [name for _, name in kube.sent] == ["first", "finished"]
    assert kube.bodies["finished"]["status"]["phase"] == "Finished"


async def test_a_drain_promotes_the_waiting_finish_of_a_session_on_its_worker() -> None:
    fleet = _full_fleet(1)  # s0 bound to w1
    kube = HeldWrites()
    fleet.kube = kube  # type: ignore[assignment]
    fleet.sessions.writes = WriteTurns(1)
    first = asyncio.create_task(reconcile_session(fleet, _session("first", None), NOW))
    fleet.sessions.cache.put(_session("first", None))
    await asyncio.sleep(0.01)
    new = [_session(f"new{i}", None) for i in range(3)]
    for state in new:
        fleet.sessions.cache.put(state)
    binds = [asyncio.create_task(reconcile_session(fleet, s, NOW)) for s in new]
    finishing = replace(fleet.sessions.session("ns", "s0"), finished=True)  # type: ignore[arg-type]
    fleet.sessions.cache.put(finishing)
    finish = asyncio.create_task(reconcile_session(fleet, finishing, NOW))
    await asyncio.sleep(0.01)
    source = fleet.indexes.worker("ns", "w1")
    assert source is not None and source.worker is not None
    await migrate_sessions(fleet, source, source.worker, ("s0",), False, NOW)
    kube.release.set()
    await asyncio.gather(first, finish, *binds)
    assert [name for _, name in kube.sent] == ["first", "s0", "new0", "new1", "new2"]
