"""Work started with ``Spawner.spawn``: failures counted, and cancelled before the Lease goes."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf
import pytest

from sessionfleet.controllers import handlers, metrics
from sessionfleet.controllers.config import OperatorConfig
from sessionfleet.controllers.fleet import Fleet
from sessionfleet.controllers.leadership import Solo
from sessionfleet.supervise import Supervisor


def make_fleet(**kw: Any) -> Fleet:
    return Fleet(config=OperatorConfig(), kube=None, http=None, **kw)  # type: ignore[arg-type]


async def test_a_spawned_failure_is_logged_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    fleet = make_fleet()
    before = metrics.SPAWNED_FAILURES._value.get()

    async def fail() -> None:
        raise RuntimeError("engine gone")

    fleet.spawner.spawn("checkpoint ns/w-1", fail())
    while fleet.spawner.tasks:
        await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert fleet.spawner.failures == 1
    assert metrics.SPAWNED_FAILURES._value.get() == before + 1
    assert any(
        r.levelno == logging.ERROR and "checkpoint ns/w-1 failed" in r.getMessage()
        for r in caplog.records
    )


async def test_spawned_work_is_cancelled_and_nothing_starts_after() -> None:
    fleet = make_fleet()
    ended: list[str] = []

    async def checkpoint() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            ended.append("checkpoint")

    fleet.spawner.spawn("checkpoint ns/w-1", checkpoint())
    await asyncio.sleep(0)
    await fleet.spawner.cancel_all()
    assert ended == ["checkpoint"] and not fleet.spawner.tasks
    fleet.spawner.spawn("migration", checkpoint())
    await asyncio.sleep(0)
    assert ended == ["checkpoint"] and not fleet.spawner.tasks
    assert fleet.spawner.failures == 0  # a cancellation is not a failure


class RecordingLeadership(Solo):
    """Records which spawned tasks were still running when the Lease was released."""

    def __init__(self, fleet: Fleet) -> None:
        super().__init__()
        self.fleet = fleet
        self.running_at_release: list[str] | None = None

    async def release(self) -> None:
        self.running_at_release = [t.get_name() for t in self.fleet.spawner.tasks if not t.done()]


class Closable:
    async def aclose(self) -> None:
        pass


async def test_the_operators_cleanup_cancels_spawned_work_before_releasing_the_lease() -> None:
    fleet = make_fleet()
    fleet.kube, fleet.http = Closable(), Closable()  # type: ignore[assignment]
    leadership = RecordingLeadership(fleet)
    fleet.leadership = leadership
    fleet.spawner.spawn("migration from ns/w-1", asyncio.sleep(3600))
    await asyncio.sleep(0)
    await handlers.stop(memo=kopf.Memo(fleet=fleet, supervisor=Supervisor()))
    assert leadership.running_at_release == []
