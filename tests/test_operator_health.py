"""The operator's probes: a dead task or a stalled leader loop fails liveness; readiness
needs the indexes and a part to play (leader, or a standby in touch with its Lease)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from sessionfleet.controllers.config import OperatorConfig
from sessionfleet.controllers.fleet import Fleet
from sessionfleet.controllers.health import assess, health_app, stall_after
from sessionfleet.operator.main import _stop_on_failure
from sessionfleet.supervise import Supervisor


@dataclass
class Role:
    """Stands for a LeaderElector: what the probes read of it."""

    leading: bool = False
    in_touch: bool = True
    holder: str | None = "other_1"
    identity: str = "me_1"
    lease: str = "ops/sessionfleet-operator"
    acquired: asyncio.Event = field(default_factory=asyncio.Event)


def fleet_with(role: Role, *, indexed: bool = True, resync: float = 2.0) -> Fleet:
    fleet = Fleet(config=OperatorConfig(resync_seconds=resync), kube=None, http=None)  # type: ignore[arg-type]
    fleet.leadership = role  # type: ignore[assignment]
    if indexed:
        fleet.indexed.set()
    return fleet


async def probe(fleet: Fleet, supervisor: Supervisor, path: str, now: float) -> tuple[int, Any]:
    async with TestClient(TestServer(health_app(fleet, supervisor, clock=lambda: now))) as client:
        response = await client.get(path)
        return response.status, await response.json()


async def test_a_dead_background_task_stops_the_operator_and_fails_both_probes() -> None:
    supervisor = Supervisor()
    stop = asyncio.Event()
    watchdog = asyncio.create_task(_stop_on_failure(supervisor, stop))
    fleet = fleet_with(Role(leading=True))
    assert (await probe(fleet, supervisor, "/healthz", 0.0))[0] == 200

    async def scraper() -> None:
        raise ValueError("cannot convert float NaN to integer")

    supervisor.start("engine scraper", scraper())
    await asyncio.wait_for(stop.wait(), 5)
    status, body = await probe(fleet, supervisor, "/healthz", 0.0)
    assert status == 500
    assert any("engine scraper" in problem for problem in body["problems"])
    assert (await probe(fleet, supervisor, "/readyz", 0.0))[0] == 503
    await watchdog
    await supervisor.stop()


async def test_a_synced_standby_in_touch_with_its_lease_is_ready_and_says_who_leads() -> None:
    status, body = await probe(fleet_with(Role()), Supervisor(), "/readyz", 0.0)
    assert status == 200
    assert body["role"] == "standby"
    assert body["holder"] == "other_1"
    assert body["lease"] == "ops/sessionfleet-operator"


async def test_a_standby_is_not_ready_before_its_indexes_are_or_out_of_touch() -> None:
    supervisor = Supervisor()
    status, body = await probe(fleet_with(Role(), indexed=False), supervisor, "/readyz", 0.0)
    assert status == 503 and "indexes" in body["problems"][0]
    status, body = await probe(fleet_with(Role(in_touch=False)), supervisor, "/readyz", 0.0)
    assert status == 503 and "not been reached" in body["problems"][0]
    # Neither is a reason to restart it.
    assert (await probe(fleet_with(Role(in_touch=False)), supervisor, "/healthz", 0.0))[0] == 200


def test_a_leader_whose_loop_stalls_fails_liveness_only_past_the_stall_bound() -> None:
    fleet = fleet_with(Role(leading=True, in_touch=False), resync=2.0)
    fleet.loop_marks.pass_at = 1000.0
    bound = stall_after(2.0)
    assert bound >= 120.0  # an API server restart or an etcd pause is no reason
    healthy = assess(fleet, Supervisor(), 1000.0 + bound - 1)
    assert healthy.live and healthy.ready and healthy.detail["role"] == "leader"
    stalled = assess(fleet, Supervisor(), 1000.0 + bound + 1)
    assert not stalled.live and not stalled.ready
    assert "has not finished a pass" in stalled.detail["problems"][0]
    # A standby's loop does not run: its last pass says nothing about it.
    fleet.leadership = Role(leading=False)  # type: ignore[assignment]
    assert assess(fleet, Supervisor(), 1000.0 + bound + 1).live


def test_gauges_of_workers_gone_or_no_longer_draining_are_pruned() -> None:
    from sessionfleet.controllers import metrics
    from sessionfleet.controllers.loop import _prune

    metrics.DRAIN_HELD.labels("ns", "kept").set(5)
    metrics.DRAIN_HELD.labels("ns", "gone").set(7)
    _prune(metrics.DRAIN_HELD, {("ns", "kept")})
    left = {s.labels["worker"] for f in metrics.DRAIN_HELD.collect() for s in f.samples}
    assert left == {"kept"}
    _prune(metrics.DRAIN_HELD, set())
