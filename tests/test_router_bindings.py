"""The binding table: what the watches put in, what routing reads out."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from sessionfleet.fronts.bindings import BindingTable
from sessionfleet.policy.placement import PlacementRequest, place


def worker(
    name: str,
    *,
    model: str = "m",
    phase: str = "Ready",
    port: int = 8000,
    max_sessions: int = 4,
    kv: int | None = None,
) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase, "endpoint": f"http://127.1.0.9:{port}"}
    if kv is not None:
        status["kvCacheUsagePercent"] = kv
    return {
        "metadata": {"name": name},
        "spec": {"model": model, "capacity": {"maxSessions": max_sessions}},
        "status": status,
    }


VERSIONS = itertools.count(1)


def session(
    name: str,
    sid: str,
    *,
    hint: str | None = None,
    bound: str | None = None,
    phase: str | None = None,
    rv: str | None = None,
) -> dict[str, Any]:
    """An AgentSession as the API server returns it: each one a new resourceVersion."""
    spec: dict[str, Any] = {"sessionId": sid, "model": "m"}
    if hint:
        spec["workerHint"] = hint
    status: dict[str, Any] = {}
    if bound:
        status["worker"] = bound
    if phase:
        status["phase"] = phase
    version = rv if rv is not None else str(next(VERSIONS))
    return {"metadata": {"name": name, "resourceVersion": version}, "spec": spec, "status": status}


def test_a_session_routes_by_hint_until_bound() -> None:
    table = BindingTable()
    table.apply_session(session("n1", "s1", hint="w1"))
    view = table.session_named("n1")
    assert view is not None and view.worker == "w1"
    table.apply_session(session("n1", "s1", hint="w1", bound="w2", phase="Bound"))
    view = table.session_named("n1")
    assert view is not None and view.worker == "w2" and view.phase == "Bound"
    assert table.pinned_sessions("w2") == 1 and table.pinned_sessions("w1") == 0


def test_pinned_counts_follow_updates_and_deletes() -> None:
    table = BindingTable()
    table.replace_workers([worker("w1"), worker("w2")])
    table.replace_sessions([session("a", "a", hint="w1"), session("b", "b", hint="w1")])
    assert table.pinned_sessions("w1") == 2
    table.apply_session(session("a", "a", bound="w1", phase="Finished"))
    assert table.pinned_sessions("w1") == 1
    table.remove_session("b")
    assert table.pinned_sessions("w1") == 0
    assert table.session_named("b") is None


def test_placement_sees_the_sessions_the_router_created() -> None:
    table = BindingTable()
    table.replace_workers([worker("w1", max_sessions=2), worker("w2", max_sessions=2)])
    table.replace_sessions([])
    chosen = []
    for n in range(4):
        decision = place(PlacementRequest(model="m"), table.loads())
        assert decision.worker is not None
        chosen.append(decision.worker)
        table.apply_session(session(f"n{n}", f"s{n}", hint=decision.worker))
    assert sorted(chosen) == ["w1", "w1", "w2", "w2"]
    assert not place(PlacementRequest(model="m"), table.loads()).placed


def test_worker_views() -> None:
    table = BindingTable()
    table.replace_workers(
        [
            worker("w1", kv=40),
            worker("w2", phase="Draining"),
            worker("w3", phase="Starting"),
            worker("w4", model="other"),
        ]
    )
    w1, w2, w3 = (table.workers[n] for n in ("w1", "w2", "w3"))
    assert w1.ready and w1.serving and w1.kv_usage == 0.4
    assert not w2.ready and w2.serving
    assert not w3.ready and not w3.serving
    assert table.has_model("other") and not table.has_model("nope")
    table.remove_worker("w4")
    assert not table.has_model("other")


def test_least_loaded_prefers_idle_and_rotates() -> None:
    table = BindingTable()
    table.replace_workers([worker("w1"), worker("w2"), worker("w3", phase="Draining")])
    picks = {table.least_loaded("m").name for _ in range(4)}  # type: ignore[union-attr]
    assert picks == {"w1", "w2"}
    table.workers["w1"].in_flight = 3
    assert {table.least_loaded("m").name for _ in range(4)} == {"w2"}  # type: ignore[union-attr]
    assert table.least_loaded("other") is None


def test_in_flight_survives_a_worker_update() -> None:
    table = BindingTable()
    table.replace_workers([worker("w1")])
    table.workers["w1"].in_flight = 2
    table.apply_worker(worker("w1", kv=10))
    assert table.workers["w1"].in_flight == 2
    table.replace_workers([worker("w1")])
    assert table.workers["w1"].in_flight == 2


async def test_changes_wake_waiters() -> None:
    table = BindingTable()
    assert not table.synced
    waiter = asyncio.ensure_future(table.changed().wait())
    await asyncio.sleep(0)
    assert not waiter.done()
    table.replace_workers([])
    await asyncio.wait_for(waiter, 1)
    table.replace_sessions([])
    assert table.synced


async def test_a_version_already_held_changes_nothing_and_wakes_nobody() -> None:
    """The watch brings back the router's own usage write, applied from its answer."""
    table = BindingTable()
    written = session("n1", "s1", bound="w1", phase="Bound", rv="7")
    held = table.apply_session(written)
    waiter = asyncio.ensure_future(table.changed().wait())
    await asyncio.sleep(0)
    assert table.apply_session(written) is held
    await asyncio.sleep(0)
    assert not waiter.done() and table.pinned_sessions("w1") == 1
    table.apply_session(session("n1", "s1", bound="w2", phase="Bound", rv="8"))
    await asyncio.wait_for(waiter, 1)
    assert table.pinned_sessions("w2") == 1 and table.pinned_sessions("w1") == 0


def test_rendezvous_is_stable_and_moves_little() -> None:
    names = [f"w{n}" for n in range(5)]
    table = BindingTable()
    table.replace_workers([worker(n) for n in names])
    other = BindingTable()
    other.replace_workers([worker(n) for n in reversed(names)])
    keys = [f"session-{n}" for n in range(200)]
    first = {k: table.rendezvous("m", k).name for k in keys}  # type: ignore[union-attr]
    assert first == {k: other.rendezvous("m", k).name for k in keys}  # type: ignore[union-attr]
    assert len(set(first.values())) == 5
    table.apply_worker(worker("w0", phase="Draining"))
    after = {k: table.rendezvous("m", k).name for k in keys}  # type: ignore[union-attr]
    moved = {k for k in keys if after[k] != first[k]}
    assert moved == {k for k in keys if first[k] == "w0"}
    assert table.rendezvous("other", "x") is None


def test_a_drain_asked_for_closes_a_worker_to_new_sessions_before_its_status_says_so() -> None:
    table = BindingTable()
    asked = worker("w1")
    asked["spec"]["drain"] = True  # the operator has not written Draining yet
    table.replace_workers([asked, worker("w2")])
    w1 = table.workers["w1"]
    assert not w1.ready and w1.serving  # bound sessions still reach it, new ones do not
    picked = place(PlacementRequest(model="m"), table.loads())
    assert picked.worker == "w2"
    table.replace_workers([asked])
    assert place(PlacementRequest(model="m"), table.loads()).worker is None
