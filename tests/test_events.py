"""Events: which decisions become which Events, how repeats coalesce, the bodies."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from sessionfleet.api import InferenceWorkerStatus, Reason
from sessionfleet.controllers.config import OperatorConfig
from sessionfleet.controllers.fleet import EngineStats, Fleet
from sessionfleet.controllers.records import worker_record
from sessionfleet.controllers.workers import desired_status, metrics_notices
from sessionfleet.policy.drain import DEFAULT_POLICY, PinnedSession, PolicyChoice
from sessionfleet.policy.events import MAX_NOTE_CHARS, Coalescer, EventType, Notice
from sessionfleet.policy.observed import NodeState, PodState
from sessionfleet.policy.recovery import RecoveryBlock
from sessionfleet.policy.worker import WorkerObservation, WorkerPlan, plan_worker
from sessionfleet.resources.events import ObjectRef, event_body, event_name, series_patch

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
SPEC = {"model": "m", "engine": {"type": "sim"}, "gpus": 1}
POD = PodState("w-1", 1, "Running", scheduled=True, ready=True, node="n1", pod_ip="127.1.0.4")
FAILING = replace(POD, name="w-2", epoch=2, phase="Failed", ready=False, terminated=True)
NODE = NodeState("n1")
CORDONED = NodeState("n1", unschedulable=True)
NOT_READY = NodeState("n1", ready=False, not_ready_since=NOW - timedelta(minutes=5))
READY: dict[str, Any] = {"phase": "Ready", "epoch": 1, "pod": "w-1"}
DEFAULT = PolicyChoice(None, DEFAULT_POLICY)
MISSING = PolicyChoice(None, DEFAULT_POLICY, Reason.POLICY_NOT_FOUND, "no DrainPolicy nowhere")


def body(status: Mapping[str, Any], spec: Mapping[str, Any] = SPEC) -> dict[str, Any]:
    return {
        "apiVersion": "sessionfleet.dev/v1alpha1",
        "kind": "InferenceWorker",
        "metadata": {"name": "w", "namespace": "ns", "generation": 1, "resourceVersion": "1"},
        "spec": dict(spec),
        "status": dict(status),
    }


def plan(
    status: Mapping[str, Any],
    pods: tuple[PodState, ...] = (POD,),
    node: NodeState | None = NODE,
    pinned: int = 0,
    policy: PolicyChoice = DEFAULT,
    block: RecoveryBlock | None = None,
    now: datetime = NOW,
    spec: Mapping[str, Any] = SPEC,
) -> WorkerPlan:
    worker = worker_record(body(status, spec)).worker
    assert worker is not None
    return plan_worker(
        WorkerObservation(
            name="w",
            spec=worker.spec,
            status=InferenceWorkerStatus.model_validate(status),
            pods=pods,
            node=node,
            pinned=[PinnedSession(f"s{i}") for i in range(pinned)],
            policy=policy,
            now=now,
            recovery_block=block,
        )
    )


def written(
    status: Mapping[str, Any], decided: WorkerPlan, fleet: Fleet | None = None
) -> dict[str, Any]:
    """Return the status the operator writes for a plan (its own builder), as stored."""
    fleet = fleet or Fleet(config=OperatorConfig(), kube=None, http=None)  # type: ignore[arg-type]
    record = worker_record(body(status))
    assert record.worker is not None
    desired = desired_status(fleet, record, record.worker, decided, NOW)
    return {key: value for key, value in desired.items() if value is not None}


def reasons(notices: tuple[Notice, ...]) -> list[str]:
    return [n.reason for n in notices]


def test_a_drain_tells_its_story_once_started_held_at_its_deadline_completed() -> None:
    # Ready with sessions pinned: a hold outside a drain is no drain Event.
    held = plan(READY, pinned=3)
    assert held.notices == ()
    status = written(READY, held)

    started = plan(status, node=CORDONED, pinned=3)
    assert reasons(started.notices) == ["DrainStarted", "DrainHeld"]
    draining = next(c for c in started.conditions if c.type.value == "Draining")
    assert started.notices[0].note == draining.message
    assert "triggered by NodeCordoned (default policy)" in started.notices[0].note
    assert started.notices[1].note == (
        "3 session(s) pinned: sessions are pinned: eviction blocked by "
        "ClusterAutoscalerSafeToEvict, KarpenterDoNotDisrupt, PodDisruptionBudget"
    )
    status = written(status, started)
    # The next passes observe the Draining status: nothing new to say, though the drain
    # moves on to migrating its sessions after the grace period.
    assert plan(status, node=CORDONED, pinned=3).notices == ()
    migrating = plan(status, node=CORDONED, pinned=3, now=NOW + timedelta(minutes=3))
    assert migrating.migrate and migrating.notices == ()
    status = written(status, migrating)

    deadline = plan(status, node=CORDONED, pinned=2, now=NOW + timedelta(minutes=11))
    assert reasons(deadline.notices) == ["DrainDeadlineReached"]
    assert deadline.notices[0].note.startswith("deadline 10m passed with 2 session(s) pinned")
    status = written(status, deadline)
    assert plan(status, node=CORDONED, pinned=2, now=NOW + timedelta(minutes=12)).notices == ()

    completed = plan(status, node=CORDONED, now=NOW + timedelta(minutes=13))
    assert [(n.type, n.reason, n.action, n.note) for n in completed.notices] == [
        (EventType.NORMAL, "DrainCompleted", "Drain", "no session is pinned any more")
    ]
    status = written(status, completed)
    assert plan(status, node=CORDONED, now=NOW + timedelta(minutes=14)).notices == ()


def test_sessions_pinned_while_a_drain_runs_hold_it() -> None:
    unheld = {
        **READY,
        "phase": "Draining",
        "drainStartedAt": NOW.isoformat(),
        "conditions": [
            {
                "type": "DrainHeld",
                "status": "False",
                "reason": "Drained",
                "lastTransitionTime": NOW.isoformat(),
            }
        ],
    }
    held = plan(unheld, node=CORDONED, pinned=2)
    assert reasons(held.notices) == ["DrainHeld"]
    assert held.notices[0].note.startswith("2 session(s) pinned: ")


def test_a_new_epoch_says_what_it_replaces_and_why() -> None:
    lost = plan(READY, pods=())
    assert [(n.reason, n.note) for n in lost.notices] == [
        ("EpochReplaced", "epoch 2 replaces epoch 1: PodDeleted")
    ]
    failed = replace(POD, phase="Failed", ready=False, terminated=True)
    assert plan(READY, pods=(failed,)).notices[0].note.endswith(": PodFailed")
    moved = plan(READY, node=NOT_READY)
    assert moved.notices[0].note == "epoch 2 replaces epoch 1: NodeNotReady"
    # Back from a requested drain: a fresh epoch, no recovery.
    back = plan({"phase": "Drained", "epoch": 1}, pods=())
    assert [(n.reason, n.note) for n in back.notices] == [
        ("EpochReplaced", "epoch 2 replaces epoch 1: NewEpoch")
    ]
    # The very first epoch replaces nothing.
    assert plan({}, pods=()).notices == ()


def recovering() -> dict[str, Any]:
    """Return the status written when epoch 1 was lost at NOW and epoch 2's pod was made."""
    lost = written(READY, plan(READY, pods=()))
    starting = replace(FAILING, phase="Pending", terminated=False)
    return written(lost, plan(lost, pods=(starting,), now=NOW + timedelta(seconds=1)))


def test_recovery_warnings_backing_off_and_capped() -> None:
    # Epoch 2 fails 5 s into its first recovery: the next waits 10 s from it.
    backing_off = plan(recovering(), pods=(FAILING,), now=NOW + timedelta(seconds=5))
    assert [(n.type, n.reason) for n in backing_off.notices] == [
        (EventType.WARNING, "RecoveryBackingOff")
    ]
    assert backing_off.notices[0].note == (
        "1 epoch(s) in a row failed before Ready; epoch 3 starts in 5s"
    )
    block = RecoveryBlock(Reason.DISRUPTION_THRESHOLD, "3 of 4 nodes are NotReady")
    capped = plan(READY, node=NOT_READY, block=block)
    assert [(n.type, n.reason, n.note) for n in capped.notices] == [
        (
            EventType.WARNING,
            "RecoveriesCapped",
            "node n1 is NotReady, but 3 of 4 nodes are NotReady",
        )
    ]


@pytest.mark.parametrize(
    ("reason", "event"),
    [
        (Reason.POLICY_CONFLICT, "PolicyConflict"),
        (Reason.POLICY_NOT_FOUND, "PolicyNotFound"),
        (Reason.POLICY_INVALID, "PolicyInvalid"),
    ],
)
def test_a_policy_that_cannot_be_resolved_is_a_warning(reason: Reason, event: str) -> None:
    choice = PolicyChoice(None, DEFAULT_POLICY, reason, "what is wrong with it")
    (notice,) = plan(READY, policy=choice).notices
    assert (notice.type, notice.reason, notice.action, notice.note) == (
        EventType.WARNING,
        event,
        "ResolvePolicy",
        "what is wrong with it",
    )


def test_unreadable_metrics_are_the_scrapes_warning_once() -> None:
    fleet = Fleet(config=OperatorConfig(), kube=None, http=None)  # type: ignore[arg-type]
    fleet.engines.stats[("ns", "w")] = EngineStats(ignored=("kv_cache_usage_perc",))
    record = worker_record(body(READY))
    decided = plan(READY)
    (notice,) = metrics_notices(fleet, record, decided)
    assert (notice.type, notice.reason) == (EventType.WARNING, "MetricsUnreadable")
    assert notice.note.endswith("ignored: kv_cache_usage_perc")
    status = written(READY, decided, fleet)
    assert metrics_notices(fleet, worker_record(body(status)), plan(status)) == ()
    # A recovering worker's figures describe a pod that is gone: nothing said.
    assert metrics_notices(fleet, record, plan(READY, pods=())) == ()


STEADY = {
    "a drain held": {"node": CORDONED, "pinned": 3},
    "a drain past its deadline": {
        "node": CORDONED,
        "pinned": 2,
        "status": {
            "phase": "Draining",
            "drainStartedAt": (NOW - timedelta(minutes=11)).isoformat(),
        },
    },
    "a drain completed": {"node": CORDONED},
    "a lost pod": {"pods": ()},
    "a capped recovery": {
        "node": NOT_READY,
        "block": RecoveryBlock(Reason.RECOVERY_CAPPED, "two are moving"),
    },
    "a recovery backing off": {
        "pods": (FAILING,),
        "status": recovering(),
        "now": NOW + timedelta(seconds=5),
    },
    "a missing policy": {"policy": MISSING},
    "a drain on request": {"spec": {**SPEC, "drain": True}, "pinned": 1},
}


@pytest.mark.parametrize("case", STEADY.values(), ids=STEADY.keys())
def test_a_decision_the_status_already_shows_is_no_notice(case: dict[str, Any]) -> None:
    """Plan, write the status the operator writes, observe it: the plan says nothing new."""
    given = dict(case)
    status = {**READY, **given.pop("status", {})}
    now = given.pop("now", NOW)
    first = plan(status, now=now, **given)
    assert first.notices, "the case decides something"
    settled = written(status, first)
    assert plan(settled, now=now, **given).notices == ()
    # A pass later: messages that change with the clock (a back-off's wait) are no news.
    later = now + timedelta(seconds=1)
    assert plan(written(settled, first), now=later, **given).notices == ()


def test_a_burst_of_notices_is_one_event_and_its_series() -> None:
    coalescer = Coalescer(window=600, flush_every=30)
    key = ("ns", "InferenceWorker", "w", "uid", "Normal", "SessionsBound")
    created = [coalescer.observe(key, 1000.0 + i * 0.001) for i in range(1000)]
    assert created.count(True) == 1  # one Event for 1,000 binds
    assert coalescer.due(1001.0) == []  # not created yet: nothing to update
    coalescer.created(key, "w.abc")
    assert coalescer.due(1001.0) == []  # within flush_every of its creation
    (update,) = coalescer.due(1031.0)
    assert (update.name, update.count) == ("w.abc", 1000)
    assert coalescer.due(1032.0) == []  # written; nothing new
    coalescer.observe(key, 1040.0)
    assert coalescer.due(1050.0) == []  # within flush_every of the last update
    assert coalescer.due(1062.0)[0].count == 1001
    # After the window, the same notice is a new Event again.
    assert coalescer.observe(key, 1062.0 + 601) is True


def test_series_updates_beyond_the_limit_wait_and_the_longest_unwritten_go_first() -> None:
    coalescer = Coalescer(window=600, flush_every=30)
    keys = [("ns", "InferenceWorker", f"w{i}", "uid", "Normal", "SessionsBound") for i in range(5)]
    for i, key in enumerate(keys):
        coalescer.observe(key, 1000.0)
        coalescer.created(key, f"w{i}.e")
        coalescer.observe(key, 1001.0)  # a repeat: a series to write
    first = coalescer.due(1031.0, limit=2)
    assert len(first) == 2
    for key in keys:
        coalescer.observe(key, 1040.0)  # every series grows again
    # The three left out are written next, before the two just written come round again.
    second = coalescer.due(1062.0, limit=3)
    assert {u.key for u in second} == set(keys) - {u.key for u in first}
    assert {u.key for u in coalescer.due(1063.0, limit=10)} == {u.key for u in first}
    assert sum(u.count for u in second) == 3 * 3  # each counts what it saw
    for key in keys:
        coalescer.observe(key, 1070.0)
    assert coalescer.due(1100.0, limit=0) == []
    assert len(coalescer.due(1100.0)) == 5  # no limit: every series due


def test_the_coalescer_forgets_the_least_recently_seen_beyond_its_bound() -> None:
    coalescer = Coalescer(max_keys=3)
    for i in range(5):
        assert coalescer.observe((str(i),), float(i)) is True
    assert len(coalescer) == 3
    assert coalescer.observe(("4",), 5.0) is False
    assert coalescer.observe(("0",), 5.0) is True  # forgotten


def test_the_event_body_names_its_object_by_uid_and_bounds_its_note() -> None:
    worker = ObjectRef("sessionfleet.dev/v1alpha1", "InferenceWorker", "ns", "w" * 300, "u-1")
    notice = Notice(EventType.WARNING, "CheckpointFailed", "Checkpoint", "x" * 5000)
    name = event_name(worker, "18f0a1b2c3d4")
    assert len(name) <= 253 and name.endswith(".18f0a1b2c3d4")
    body = event_body(worker, notice, name=name, instance="op-1", now=0.0)
    assert body["regarding"]["uid"] == "u-1"
    assert body["type"] == "Warning" and body["reportingController"] == "sessionfleet.dev/operator"
    assert len(body["note"]) == MAX_NOTE_CHARS
    assert body["eventTime"] == "1970-01-01T00:00:00.000000Z"
    assert series_patch(3, 1.5)["series"] == {
        "count": 3,
        "lastObservedTime": "1970-01-01T00:00:01.500000Z",
    }


class WrittenEvents:
    """Stands in for the API client: keeps what the recorder writes (no cluster here)."""

    def __init__(self) -> None:
        self.created: list[str] = []
        self.patched: list[str] = []

    async def create(self, _resource: Any, body: dict[str, Any], _namespace: str) -> None:
        self.created.append(body["metadata"]["name"])

    async def patch(self, _resource: Any, name: str, *_: Any, **__: Any) -> None:
        self.patched.append(name)


async def test_the_recorder_writes_series_updates_within_its_budget_of_events() -> None:
    import asyncio

    from sessionfleet.controllers.events import EventRecorder

    kube = WrittenEvents()
    coalescer = Coalescer(window=600, flush_every=0)
    # Fifty series already created and repeated: each has a count to write back.
    for i in range(50):
        key = ("ns", "InferenceWorker", f"w{i}", "uid", "Normal", "SessionsBound")
        coalescer.observe(key, 1000.0)
        coalescer.created(key, f"w{i}.e")
        coalescer.observe(key, 1001.0)
    recorder = EventRecorder(
        kube,  # type: ignore[arg-type]
        "op-1",
        coalescer=coalescer,
        rate=0.001,  # no token earned while the test runs: the burst is the whole budget
        burst=5,
        clock=lambda: 1002.0,
    )
    worker = ObjectRef("sessionfleet.dev/v1alpha1", "InferenceWorker", "ns", "new", "u-2")
    recorder.record(worker, Notice(EventType.NORMAL, "DrainStarted", "Drain", "a new Event"))
    task = asyncio.create_task(recorder.run())
    try:
        for _ in range(100):
            if kube.patched:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
    finally:
        task.cancel()
    assert len(kube.created) == 1
    assert len(kube.patched) == 4  # the budget's other four tokens; 46 series wait
