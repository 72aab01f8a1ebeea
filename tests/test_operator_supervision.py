"""The operator stops (and fails its liveness probe) when its fleet loop or scraper dies."""

from __future__ import annotations

import asyncio

import pytest

from sessionfleet.controllers.handlers import tasks_alive
from sessionfleet.controllers.run import _stop_on_failure
from sessionfleet.supervise import Supervisor


async def test_a_dead_background_task_stops_kopf_and_fails_the_probe() -> None:
    supervisor = Supervisor()
    stop = asyncio.Event()
    watchdog = asyncio.create_task(_stop_on_failure(supervisor, stop))
    memo = {"supervisor": supervisor}
    assert tasks_alive(memo=memo) == "ok"  # type: ignore[arg-type]

    async def scraper() -> None:
        raise ValueError("cannot convert float NaN to integer")

    supervisor.start("engine scraper", scraper())
    await asyncio.wait_for(stop.wait(), 5)
    with pytest.raises(RuntimeError, match="engine scraper"):
        tasks_alive(memo=memo)  # type: ignore[arg-type]
    await watchdog
    await supervisor.stop()
