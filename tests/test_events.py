"""Events: which status changes become which Events, how repeats coalesce, the bodies."""

from __future__ import annotations

from typing import Any

from sessionfleet.api import Reason
from sessionfleet.policy.events import (
    MAX_NOTE_CHARS,
    Coalescer,
    EventType,
    Notice,
    merged,
    worker_notices,
)
from sessionfleet.resources.events import ObjectRef, event_body, event_name, series_patch


def condition(kind: str, status: str, reason: str, message: str = "") -> dict[str, str]:
    return {"type": kind, "status": status, "reason": reason, "message": message}


READY: dict[str, Any] = {
    "phase": "Ready",
    "epoch": 1,
    "conditions": [condition("DrainHeld", "True", "SessionsPinned", "eviction blocked by pdb")],
}


def reasons(notices: list[Notice]) -> list[str]:
    return [n.reason for n in notices]


def test_a_drain_that_starts_with_sessions_pinned_is_started_and_held_then_completed() -> None:
    draining = merged(
        READY,
        {
            "phase": "Draining",
            "conditions": [
                *READY["conditions"],
                condition("Draining", "True", "SessionsPinned", "node cordoned; waiting"),
            ],
        },
    )
    notices = worker_notices(READY, draining, pinned_sessions=3)
    assert reasons(notices) == ["DrainStarted", "DrainHeld"]
    assert notices[0].note == "node cordoned; waiting"
    assert notices[1].note.startswith("3 session(s) pinned")
    # The next pass writes the same phase and conditions: nothing new to say.
    assert worker_notices(draining, draining, pinned_sessions=3) == []
    drained = merged(draining, {"phase": "Drained"})
    assert reasons(worker_notices(draining, drained, 0)) == ["DrainCompleted"]


def test_a_hold_outside_a_drain_is_no_drain_event() -> None:
    bound = merged(READY, {"conditions": [condition("DrainHeld", "True", "SessionsPinned")]})
    assert worker_notices({"phase": "Ready", "epoch": 1}, bound, 1) == []


def test_the_deadline_a_new_epoch_and_the_warnings() -> None:
    old = {"phase": "Draining", "epoch": 1, "conditions": []}
    deadline = merged(
        old, {"conditions": [condition("Draining", "True", "DeadlineReached", "hold released")]}
    )
    assert reasons(worker_notices(old, deadline, 2)) == ["DrainDeadlineReached"]

    replaced = worker_notices(
        {"phase": "Ready", "epoch": 1}, {"phase": "Recovering", "epoch": 2}, 0, Reason.POD_FAILED
    )
    assert [(n.reason, n.note) for n in replaced] == [
        ("EpochReplaced", "epoch 2 replaces epoch 1: PodFailed")
    ]

    warned = worker_notices(
        {"phase": "Recovering", "epoch": 2},
        {
            "phase": "Recovering",
            "epoch": 2,
            "conditions": [
                condition("Recovering", "True", "RecoveryBackOff", "3 epochs failed"),
                condition("EngineMetrics", "False", "NonFiniteMetrics", "NaN"),
                condition("Conflict", "True", "PolicyNotFound", "no policy p"),
            ],
        },
        0,
    )
    assert reasons(warned) == ["RecoveryBackingOff", "MetricsUnreadable", "PolicyNotFound"]
    assert {n.type for n in warned} == {EventType.WARNING}
    capped = worker_notices(
        {"phase": "Ready"},
        {"phase": "Ready", "conditions": [condition("Recovering", "False", "RecoveryCapped")]},
        0,
    )
    assert reasons(capped) == ["RecoveriesCapped"]


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
