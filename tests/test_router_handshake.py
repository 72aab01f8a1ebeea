"""The router's half of the handshake: a Lease per replica, acknowledgements at turn boundaries."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from router_fakes import FakeKube

from sessionfleet.kube import LEASES
from sessionfleet.router.bindings import BindingTable
from sessionfleet.router.handshake import ACKS_AT_ONCE, Acknowledger, LeaseKeeper

SINCE = "2026-11-29T12:00:00.123456Z"
ACK = "ack.sessionfleet.dev/r1"


def migrating(name: str = "s1") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "resourceVersion": "1"},
        "spec": {"sessionId": name, "model": "m"},
        "status": {"phase": "Migrating", "worker": "w", "migratingSince": SINCE},
    }


async def test_a_session_with_no_turn_in_flight_is_acknowledged_once() -> None:
    kube, table, turns = FakeKube(), BindingTable(), Counter[str]()
    kube.put("agentsessions", migrating())
    table.apply_session(kube.obj("agentsessions", "s1"))
    acknowledger = Acknowledger(kube, "ns", "r1", table, turns, asyncio.Event())  # type: ignore[arg-type]
    assert acknowledger.pending() == [("s1", SINCE)]
    await acknowledger.acknowledge("s1", SINCE)
    assert kube.obj("agentsessions", "s1")["metadata"]["annotations"][ACK] == SINCE
    assert acknowledger.pending() == []


async def test_a_turn_in_flight_delays_the_acknowledgement() -> None:
    kube, table, turns = FakeKube(), BindingTable(), Counter[str]()
    kube.put("agentsessions", migrating())
    table.apply_session(kube.obj("agentsessions", "s1"))
    ended = asyncio.Event()
    acknowledger = Acknowledger(kube, "ns", "r1", table, turns, ended)  # type: ignore[arg-type]
    turns["s1"] = 1
    task = asyncio.create_task(acknowledger.run())
    await asyncio.sleep(0.2)
    assert ACK not in kube.obj("agentsessions", "s1")["metadata"].get("annotations", {})
    del turns["s1"]
    ended.set()
    for _ in range(50):
        await asyncio.sleep(0.02)
        if ACK in kube.obj("agentsessions", "s1")["metadata"].get("annotations", {}):
            break
    task.cancel()
    assert kube.obj("agentsessions", "s1")["metadata"]["annotations"][ACK] == SINCE


async def test_bound_sessions_and_old_acknowledgements() -> None:
    kube, table = FakeKube(), BindingTable()
    bound = migrating("b")
    bound["status"]["phase"] = "Bound"
    table.apply_session(bound)
    done = migrating("d")
    done["metadata"]["annotations"] = {ACK: SINCE}
    table.apply_session(done)
    stale = migrating("o")
    stale["metadata"]["annotations"] = {ACK: "2026-11-29T10:00:00Z"}
    table.apply_session(stale)
    acknowledger = Acknowledger(kube, "ns", "r1", table, Counter(), asyncio.Event())  # type: ignore[arg-type]
    assert acknowledger.pending() == [("o", SINCE)]


async def test_the_lease_is_created_renewed_and_released() -> None:
    kube = FakeKube()
    keeper = LeaseKeeper(kube, "ns", "r1")  # type: ignore[arg-type]
    await keeper.renew()
    lease = kube.obj(LEASES.plural, "router-r1")
    assert lease["spec"]["holderIdentity"] == "r1"
    assert lease["metadata"]["labels"] == {"sessionfleet.dev/component": "router"}
    first = lease["spec"]["renewTime"]
    await asyncio.sleep(0.01)
    await keeper.renew()
    assert kube.obj(LEASES.plural, "router-r1")["spec"]["renewTime"] > first
    await keeper.release()
    assert "router-r1" not in kube.names(LEASES.plural)


def test_the_table_keeps_the_migrating_sessions_apart() -> None:
    table = BindingTable()
    table.apply_session(migrating("a"))
    table.apply_session(migrating("b"))
    bound = migrating("b")
    bound["status"] = {"phase": "Bound", "worker": "w"}
    table.apply_session(bound)  # bound again: no longer Migrating
    assert [s.name for s in table.migrating_sessions()] == ["a"]
    table.remove_session("a")
    assert list(table.migrating_sessions()) == []
    table.replace_sessions([migrating("c"), bound])
    assert [s.name for s in table.migrating_sessions()] == ["c"]


class SlowKube(FakeKube):
    """Answers each patch after a while, counting how many are open at once."""

    def __init__(self) -> None:
        super().__init__()
        self.open = self.most_open = 0

    async def patch(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            await asyncio.sleep(0.02)
            return await super().patch(*args, **kwargs)
        finally:
            self.open -= 1


async def test_a_drains_acknowledgements_go_out_together_a_bounded_number_at_once() -> None:
    kube, table = SlowKube(), BindingTable()
    names = [f"s{i}" for i in range(3 * ACKS_AT_ONCE)]
    for name in names:
        kube.put("agentsessions", migrating(name))
        table.apply_session(kube.obj("agentsessions", name))
    acknowledger = Acknowledger(kube, "ns", "r1", table, Counter(), asyncio.Event())  # type: ignore[arg-type]
    task = asyncio.create_task(acknowledger.run())
    while acknowledger.pending():
        await asyncio.sleep(0.01)
    task.cancel()
    assert all(kube.obj("agentsessions", n)["metadata"]["annotations"][ACK] == SINCE for n in names)
    assert kube.most_open == ACKS_AT_ONCE  # together, not one round trip after another
