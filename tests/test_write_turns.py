"""Turns for session writes: a bounded number at once, the most urgent first."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from sessionfleet.api import Reason, SessionPhase, WorkerPhase
from sessionfleet.controllers.config import OperatorConfig
from sessionfleet.controllers.turns import WriteTurns
from sessionfleet.operator.main import add_parser
from sessionfleet.policy.sessions import (
    NOTHING,
    Action,
    SessionDecision,
    Urgency,
    WorkerBrief,
    urgency_of,
)


async def _writer(turns: WriteTurns, urgency: Urgency, name: str, order: list[str]) -> None:
    async with turns.turn(urgency):
        order.append(name)
        await asyncio.sleep(0)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def _one_turn_held(urgency: Urgency) -> tuple[WriteTurns, asyncio.Task[None], asyncio.Event]:
    """Turns for one write at a time, that one held by a task until the event is set."""
    turns, release = WriteTurns(1), asyncio.Event()

    async def holder() -> None:
        async with turns.turn(urgency):
            await release.wait()

    task = asyncio.create_task(holder())
    await _settle()
    return turns, task, release


async def test_no_more_writes_than_the_limit_hold_a_turn_at_once() -> None:
    turns = WriteTurns(3)
    most = 0

    async def write() -> None:
        nonlocal most
        async with turns.turn(Urgency.BIND):
            most = max(most, turns.writing)
            await asyncio.sleep(0.001)

    await asyncio.gather(*(write() for _ in range(40)))
    assert most == 3
    assert turns.writing == 0 and not turns.waiting


async def test_waiting_writes_go_most_urgent_first_and_in_order_within_one() -> None:
    turns, first, held = await _one_turn_held(Urgency.BIND)
    order: list[str] = []
    queued = [
        (Urgency.CLEANUP, "delete"),
        (Urgency.BIND, "bind-1"),
        (Urgency.FINISH, "finish"),
        (Urgency.BIND, "bind-2"),
        (Urgency.HOLDS_WORKER, "restore"),
    ]
    tasks = [asyncio.create_task(_writer(turns, u, name, order)) for u, name in queued]
    await _settle()
    assert turns.waiting == {
        Urgency.CLEANUP: 1,
        Urgency.BIND: 2,
        Urgency.FINISH: 1,
        Urgency.HOLDS_WORKER: 1,
    }
    held.set()
    await asyncio.gather(first, *tasks)
    assert order == ["restore", "bind-1", "bind-2", "finish", "delete"]
    assert turns.writing == 0 and not turns.waiting


async def test_a_write_cancelled_while_it_waits_gives_up_its_place_and_nothing_leaks() -> None:
    turns, first, held = await _one_turn_held(Urgency.CLEANUP)
    order: list[str] = []
    gone = asyncio.create_task(_writer(turns, Urgency.HOLDS_WORKER, "gone", order))
    kept = asyncio.create_task(_writer(turns, Urgency.BIND, "kept", order))
    await _settle()
    gone.cancel()
    await _settle()
    assert turns.waiting == {Urgency.BIND: 1}
    held.set()
    await asyncio.gather(first, kept)
    assert gone.cancelled() and order == ["kept"]
    assert turns.writing == 0 and not turns.waiting
    await _writer(turns, Urgency.FINISH, "after", order)  # the turn was freed, not lost
    assert order == ["kept", "after"]


async def test_a_write_cancelled_as_its_turn_comes_passes_the_turn_on() -> None:
    turns, first, held = await _one_turn_held(Urgency.BIND)
    order: list[str] = []
    unlucky = asyncio.create_task(_writer(turns, Urgency.HOLDS_WORKER, "unlucky", order))
    next_one = asyncio.create_task(_writer(turns, Urgency.BIND, "next", order))
    await _settle()
    held.set()
    while Urgency.HOLDS_WORKER in turns.waiting:  # the holder hands it the turn ...
        await asyncio.sleep(0)
    assert not order
    unlucky.cancel()  # ... and it is cancelled before it runs
    await asyncio.gather(first, next_one)
    assert unlucky.cancelled() and order == ["next"]
    assert turns.writing == 0 and not turns.waiting


def test_a_limit_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one write"):
        WriteTurns(0)


def _brief(phase: WorkerPhase) -> WorkerBrief:
    return WorkerBrief("w1", phase, 2, "w1-2")


def _update(phase: SessionPhase) -> SessionDecision:
    return SessionDecision(Action.UPDATE, phase, Reason.BOUND)


@pytest.mark.parametrize(
    ("decision", "worker", "expected"),
    [
        (SessionDecision(Action.PLACE), None, Urgency.BIND),
        (SessionDecision(Action.DELETE), _brief(WorkerPhase.DRAINING), Urgency.CLEANUP),
        (_update(SessionPhase.FINISHED), _brief(WorkerPhase.READY), Urgency.FINISH),
        (_update(SessionPhase.FINISHED), None, Urgency.FINISH),
        # Its worker's drain, or its recovery, waits for this session's finish.
        (_update(SessionPhase.FINISHED), _brief(WorkerPhase.DRAINING), Urgency.HOLDS_WORKER),
        (_update(SessionPhase.FINISHED), _brief(WorkerPhase.RECOVERING), Urgency.HOLDS_WORKER),
        (_update(SessionPhase.RESTORING), _brief(WorkerPhase.RECOVERING), Urgency.HOLDS_WORKER),
        (_update(SessionPhase.BOUND), _brief(WorkerPhase.READY), Urgency.HOLDS_WORKER),
        (_update(SessionPhase.LOST), None, Urgency.HOLDS_WORKER),
        (NOTHING, None, Urgency.HOLDS_WORKER),
    ],
)
def test_what_holds_a_worker_goes_first_and_cleanup_last(
    decision: SessionDecision, worker: WorkerBrief | None, expected: Urgency
) -> None:
    assert urgency_of(decision, worker) is expected


def _operator_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["operator", *argv])


def test_the_operator_takes_its_session_writes_from_the_command_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _operator_args().session_writes == OperatorConfig().session_writes == 16
    assert _operator_args("--session-writes=64").session_writes == 64
    with pytest.raises(SystemExit):
        _operator_args("--session-writes=0")
    assert "--session-writes: must be at least 1, not 0" in capsys.readouterr().err


async def test_a_promoted_write_goes_before_those_it_waited_behind() -> None:
    turns, first, held = await _one_turn_held(Urgency.BIND)
    order: list[str] = []

    async def keyed(urgency: Urgency, name: str) -> None:
        async with turns.turn(urgency, key=name):
            order.append(name)

    tasks = [asyncio.create_task(keyed(Urgency.BIND, f"bind-{i}")) for i in range(3)]
    tasks.append(asyncio.create_task(keyed(Urgency.FINISH, "finish")))
    await _settle()
    assert turns.promote("finish", Urgency.HOLDS_WORKER)
    assert not turns.promote("finish", Urgency.BIND)  # already more urgent than that
    assert not turns.promote("nobody", Urgency.HOLDS_WORKER)
    assert turns.waiting == {Urgency.BIND: 3, Urgency.HOLDS_WORKER: 1}
    held.set()
    await asyncio.gather(first, *tasks)
    assert order == ["finish", "bind-0", "bind-1", "bind-2"]  # granted once, not twice
    assert turns.writing == 0 and not turns.waiting and not turns._by_key
