"""The operator admits the worker a front placed a session on, or places it and says why.

The front (router or EPP) places a session's first turn and records the worker as
``spec.workerHint``; the operator binds it there while that worker takes new sessions and
has room under the operator's own count, which every front replica's sessions pass
through (sessionfleet.policy.placement.admit_or_place).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from sessionfleet.api import SessionPhase
from sessionfleet.controllers.config import OperatorConfig
from sessionfleet.controllers.fleet import Fleet
from sessionfleet.controllers.records import WorkerRecord, session_record, worker_record
from sessionfleet.controllers.sessions import reconcile_session
from sessionfleet.fronts.bindings import BindingTable
from sessionfleet.policy.placement import WorkerLoad
from sessionfleet.policy.sessions import SessionState

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


class Writes:
    """An API client that records each status write and answers it at once."""

    def __init__(self) -> None:
        self.status: dict[str, dict[str, Any]] = {}
        self.version = 100

    async def patch(self, resource: object, name: str, body: Any, namespace: str, **_: object):
        self.status[name] = body["status"]
        self.version += 1
        return {"metadata": {"name": name, "resourceVersion": str(self.version)}}


def api_worker(
    name: str, capacity: dict[str, int], *, phase: str = "Ready", **spec: object
) -> dict[str, Any]:
    return {
        "apiVersion": "sessionfleet.dev/v1alpha1",
        "kind": "InferenceWorker",
        "metadata": {"name": name, "namespace": "ns", "resourceVersion": "1"},
        "spec": {"model": "m", "engine": {"type": "sim"}, "gpus": 1, "capacity": capacity, **spec},
        "status": {"phase": phase, "epoch": 1, "pod": f"{name}-1", "endpoint": "http://127.0.0.1"},
    }


def worker(name: str, max_sessions: int, **spec: object) -> WorkerRecord:
    return worker_record(api_worker(name, {"maxSessions": max_sessions}, **spec))


def fleet_of(*records: WorkerRecord, bound: dict[str, str]) -> tuple[Fleet, Writes]:
    fleet = Fleet(config=OperatorConfig(), kube=None, http=None)  # type: ignore[arg-type]
    fleet.indexes.workers = {record.key: [record] for record in records}  # type: ignore[assignment]
    for name, on in bound.items():
        state = SessionState("ns", name, name, "m", worker=on, phase=SessionPhase.BOUND, epoch=1)
        fleet.sessions.cache.put(state)
        fleet.sessions.worker_loads.update(state)
    writes = Writes()
    fleet.kube = writes  # type: ignore[assignment]
    return fleet, writes


def new(name: str, hint: str | None) -> SessionState:
    return SessionState("ns", name, name, "m", hint=hint)


async def bind(fleet: Fleet, *sessions: SessionState) -> None:
    for session in sessions:
        fleet.sessions.cache.put(session)
    await asyncio.gather(*(reconcile_session(fleet, s, NOW) for s in sessions))


def bound_to(writes: Writes, name: str) -> tuple[str | None, str]:
    status = writes.status[name]
    return status.get("worker"), status["conditions"][0]["message"]


async def test_a_hint_with_room_is_bound_there_though_another_worker_is_less_loaded() -> None:
    fleet, writes = fleet_of(worker("w1", 4), worker("w2", 4), bound={"s0": "w1", "s1": "w1"})
    await bind(fleet, new("hinted", "w1"))
    assert bound_to(writes, "hinted") == (
        "w1",
        "admitted to the hinted worker w1, where its first turn went",
    )


async def test_hints_of_two_front_replicas_for_the_last_place_bind_one_there() -> None:
    """Each replica saw one place left on w1; the operator's count sees both sessions."""
    fleet, writes = fleet_of(worker("w1", 2), worker("w2", 4), bound={"s0": "w1"})
    await bind(fleet, new("from-r1", "w1"))
    await bind(fleet, new("from-r2", "w1"))  # its bind counted before the watch shows it
    assert bound_to(writes, "from-r1")[0] == "w1"
    assert bound_to(writes, "from-r2") == (
        "w2",
        "placed on the least-loaded worker w2; "
        "the hinted worker w1 was not admitted: it is full (2 of 2 sessions)",
    )


async def test_a_hint_on_a_worker_asked_to_drain_is_refused_with_the_reason() -> None:
    fleet, writes = fleet_of(worker("w1", 4, drain=True), worker("w2", 4), bound={})
    await bind(fleet, new("late", "w1"))
    assert bound_to(writes, "late") == (
        "w2",
        "placed on the least-loaded worker w2; the hinted worker w1 was not admitted: "
        "it takes no new sessions (not Ready, or asked to drain)",
    )


async def test_a_session_without_a_hint_is_placed_by_the_operator() -> None:
    fleet, writes = fleet_of(worker("w1", 4), worker("w2", 4), bound={"s0": "w1"})
    await bind(fleet, new("kubectl", None), replace(new("pinned", "w2"), pin="w1"))
    assert bound_to(writes, "kubectl") == ("w2", "placed on the least-loaded worker w2")
    assert bound_to(writes, "pinned") == ("w1", "pinned to worker w1")


def api_session(name: str, worker: str, phase: str, prompt: int, turns: int) -> dict[str, Any]:
    return {
        "apiVersion": "sessionfleet.dev/v1alpha1",
        "kind": "AgentSession",
        "metadata": {"name": name, "namespace": "ns", "resourceVersion": "1"},
        "spec": {"sessionId": name, "model": "m", "workerHint": worker},
        "status": {
            "phase": phase,
            "worker": worker,
            "epoch": 1,
            "promptTokens": prompt,
            "turns": turns,
        },
    }


def test_the_front_and_the_operator_weigh_bound_workers_by_one_load_rule() -> None:
    """A worker the front finds full, the operator refuses as a hint, and the reverse.

    From the same objects, the router's table and the operator's count give placement the
    same pinned sessions, prefix tokens, capacities and "takes new sessions".
    """
    capacity = {"maxSessions": 3, "kvTokens": 5000}
    workers = [
        api_worker("w1", capacity),
        api_worker("w2", capacity, drain=True),
        api_worker("w3", capacity, phase="Recovering"),
    ]
    sessions = [
        api_session("a", "w1", "Bound", 6000, 3),
        api_session("b", "w1", "Migrating", 900, 1),
        api_session("c", "w1", "Finished", 4000, 1),  # lets its worker go
        api_session("d", "w2", "Bound", 3000, 2),
        api_session("e", "w3", "Restoring", 800, 4),
        api_session("f", "w3", "Lost", 800, 4),  # its worker was gone
    ]
    table = BindingTable()
    table.replace_workers(workers)
    table.replace_sessions(sessions)
    fleet = Fleet(config=OperatorConfig(), kube=None, http=None)  # type: ignore[arg-type]
    records = [worker_record(w) for w in workers]
    fleet.indexes.workers = {record.key: [record] for record in records}  # type: ignore[assignment]
    for body in sessions:
        fleet.sessions.worker_loads.update(session_record(body))

    def weighed(loads: list[WorkerLoad]) -> dict[str, tuple[object, ...]]:
        return {
            w.name: (w.ready, w.pinned_sessions, w.kv_tokens_pinned, w.has_room(), w.load)
            for w in loads
        }

    front, operator = weighed(table.loads()), weighed(fleet.loads("ns"))
    assert front == operator
    assert front["w1"] == (True, 2, 2900, True, 2 / 3)
    assert front["w2"][:3] == (False, 1, 1500)
