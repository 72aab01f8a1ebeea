"""The router's half of the handshake: a Lease per replica, acknowledgements at turn boundaries."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from router_fakes import FakeKube

from sessionfleet.kube import LEASES
from sessionfleet.router.bindings import BindingTable
from sessionfleet.router.handshake import Acknowledger, LeaseKeeper

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
