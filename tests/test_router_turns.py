"""One turn counter and one turn hold for both fronts, router and EPP (fronts/turns.py)."""

from __future__ import annotations

import asyncio

import pytest
from epp_fakes import fleet, session, worker

from sessionfleet.fronts.bindings import BindingTable, WorkerView
from sessionfleet.fronts.identity import session_object_name
from sessionfleet.fronts.metrics import RouterMetrics
from sessionfleet.fronts.turns import Turns

NAME = session_object_name("task-42", None)


def turns_over(table: BindingTable) -> tuple[Turns, RouterMetrics, WorkerView]:
    metrics = RouterMetrics(table)
    return Turns(table, metrics), metrics, table.workers["w-2"]


def holds(metrics: RouterMetrics, outcome: str) -> float:
    return (
        metrics.registry.get_sample_value("sessionfleet_router_holds_total", {"outcome": outcome})
        or 0.0
    )


def held(metrics: RouterMetrics) -> float:
    return metrics.registry.get_sample_value("sessionfleet_router_held_turns") or 0.0


def test_the_first_of_two_overlapping_turns_ending_is_no_turn_boundary() -> None:
    """The handshake may acknowledge a migration only once the session's last turn ended.

    The EPP used to signal "turn ended" at every end of a turn; a listener that reads it
    as a boundary would acknowledge while the second turn still runs.
    """
    turns, _, w2 = turns_over(fleet())
    turns.started(w2, NAME)
    turns.started(w2, NAME)
    assert turns.sessions == {NAME: 2} and w2.in_flight == 2
    turns.ended(w2, NAME)
    assert turns.sessions == {NAME: 1} and w2.in_flight == 1
    assert not turns.ended_event.is_set()
    turns.ended(w2, NAME)
    assert NAME not in turns.sessions and w2.in_flight == 0
    assert turns.ended_event.is_set()


def test_a_stateless_turn_counts_on_its_worker_only() -> None:
    turns, _, w2 = turns_over(fleet())
    turns.started(w2, None)
    assert w2.in_flight == 1 and not turns.sessions
    turns.ended(w2, None)
    assert w2.in_flight == 0 and not turns.ended_event.is_set()


def test_turns_of_two_sessions_are_counted_apart() -> None:
    turns, _, w2 = turns_over(fleet())
    turns.started(w2, "a")
    turns.started(w2, "b")
    turns.ended(w2, "a")
    assert turns.sessions == {"b": 1} and turns.ended_event.is_set()  # a's last turn


async def test_a_held_turn_is_released_by_the_change_that_makes_it_routable() -> None:
    table = fleet([session("task-42", "w-2", phase="Migrating")])
    turns, metrics, _ = turns_over(table)
    decisions: list[str | None] = []

    def retry() -> str | None:
        current = table.session_named(NAME)
        assert current is not None
        decisions.append(current.phase)
        return current.worker if current.phase == "Bound" else None

    hold = asyncio.ensure_future(turns.hold(retry, 5.0))
    await asyncio.sleep(0)
    assert held(metrics) == 1
    table.apply_worker(worker("w-4", "10.0.0.4"))  # a change that does not release it
    await asyncio.sleep(0.01)
    assert not hold.done() and decisions == ["Migrating"]
    table.apply_session(session("task-42", "w-3"))
    assert await asyncio.wait_for(hold, 5) == "w-3"
    assert decisions == ["Migrating", "Bound"]
    assert (holds(metrics, "released"), holds(metrics, "timeout"), held(metrics)) == (1, 0, 0)


@pytest.mark.parametrize("timeout", [0.0, 0.05])
async def test_a_held_turn_that_is_never_released_times_out(timeout: float) -> None:
    turns, metrics, _ = turns_over(fleet())
    tries: list[int] = []

    def retry() -> str | None:
        tries.append(1)
        return None

    assert await turns.hold(retry, timeout) is None
    assert (holds(metrics, "released"), holds(metrics, "timeout"), held(metrics)) == (0, 1, 0)
    if timeout == 0:
        assert not tries  # no wait at all: the EPP's default answers 503 at once


async def test_a_retry_that_raises_ends_the_hold_with_its_answer() -> None:
    table = fleet([session("task-42", "w-2", phase="Restoring")])
    turns, metrics, _ = turns_over(table)

    def retry() -> str | None:
        raise LookupError("the session was deleted while its turn waited")

    hold = asyncio.ensure_future(turns.hold(retry, 5.0))
    await asyncio.sleep(0)
    table.remove_session(NAME)
    with pytest.raises(LookupError):
        await asyncio.wait_for(hold, 5)
    assert (holds(metrics, "released"), holds(metrics, "timeout"), held(metrics)) == (0, 0, 0)
