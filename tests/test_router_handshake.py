"""The router's half of the handshake: a slot Lease per replica, acks at turn boundaries."""

from __future__ import annotations

import asyncio
from typing import Any

from router_fakes import FakeKube

from sessionfleet.fronts.bindings import BindingTable, WorkerView
from sessionfleet.fronts.handshake import ACKS_AT_ONCE, Acknowledger, LeaseKeeper
from sessionfleet.fronts.metrics import RouterMetrics
from sessionfleet.fronts.turns import Turns
from sessionfleet.kube import LEASES
from sessionfleet.resources.leases import LeaseSlots

SINCE = "2026-11-29T12:00:00.123456Z"
WORKER = WorkerView("w", "m", "Ready", "http://127.0.0.1:1", 8, 0, 0.0)
ACK = "ack.sessionfleet.dev/r1"


def turns_of(table: BindingTable) -> Turns:
    return Turns(table, RouterMetrics(table))


def migrating(name: str = "s1") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "resourceVersion": "1"},
        "spec": {"sessionId": name, "model": "m"},
        "status": {"phase": "Migrating", "worker": "w", "migratingSince": SINCE},
    }


async def test_a_session_with_no_turn_in_flight_is_acknowledged_once() -> None:
    kube, table = FakeKube(), BindingTable()
    kube.put("agentsessions", migrating())
    table.apply_session(kube.obj("agentsessions", "s1"))
    acknowledger = Acknowledger(kube, "ns", "r1", table, turns_of(table))  # type: ignore[arg-type]
    assert acknowledger.pending() == [("s1", SINCE)]
    await acknowledger.acknowledge("s1", SINCE)
    assert kube.obj("agentsessions", "s1")["metadata"]["annotations"][ACK] == SINCE
    assert acknowledger.pending() == []


async def test_a_turn_in_flight_delays_the_acknowledgement() -> None:
    kube, table = FakeKube(), BindingTable()
    kube.put("agentsessions", migrating())
    table.apply_session(kube.obj("agentsessions", "s1"))
    turns = turns_of(table)
    acknowledger = Acknowledger(kube, "ns", "r1", table, turns)  # type: ignore[arg-type]
    turns.started(WORKER, "s1")
    task = asyncio.create_task(acknowledger.run())
    await asyncio.sleep(0.2)
    assert ACK not in kube.obj("agentsessions", "s1")["metadata"].get("annotations", {})
    turns.ended(WORKER, "s1")  # the session's last turn here: the acknowledger wakes
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
    acknowledger = Acknowledger(kube, "ns", "r1", table, turns_of(table))  # type: ignore[arg-type]
    assert acknowledger.pending() == [("o", SINCE)]


SLOTS = LeaseSlots("sf-router", 3)


def holders(kube: FakeKube) -> dict[str, str | None]:
    return {
        name: kube.obj(LEASES.plural, name)["spec"].get("holderIdentity")
        for name in kube.names(LEASES.plural)
    }


async def test_a_replica_holds_one_named_slot_renews_and_releases_it() -> None:
    kube = FakeKube()
    keeper = LeaseKeeper(kube, "ns", "r1", SLOTS)  # type: ignore[arg-type]
    await keeper.renew()
    assert keeper.slot in SLOTS.names()
    assert holders(kube) == {keeper.slot: "r1"}  # one Lease, named by the slot
    lease = kube.obj(LEASES.plural, keeper.slot)
    assert lease["metadata"]["labels"] == {"sessionfleet.dev/component": "router"}
    first = lease["spec"]["renewTime"]
    await asyncio.sleep(0.01)
    await keeper.renew()
    assert kube.obj(LEASES.plural, keeper.slot)["spec"]["renewTime"] > first
    assert len(kube.names(LEASES.plural)) == 1  # renewed in place, no second slot
    slot = keeper.slot
    await keeper.release()
    assert holders(kube) == {slot: None} and keeper.slot is None
    # Released, the slot is free for the next replica at once.
    other = LeaseKeeper(kube, "ns", "r2", LeaseSlots("sf-router", 1))  # type: ignore[arg-type]
    await other.renew()
    assert holders(kube) == {"sf-router-0": "r2"}


async def test_replicas_take_different_slots_and_one_too_many_gets_none() -> None:
    kube = FakeKube()
    keepers = [LeaseKeeper(kube, "ns", f"r{n}", SLOTS) for n in range(4)]  # type: ignore[arg-type]
    for keeper in keepers:
        await keeper.renew()
    held = [k.slot for k in keepers[:3]]
    assert sorted(held) == SLOTS.names()  # type: ignore[type-var]
    assert keepers[3].slot is None
    assert sorted(h for h in holders(kube).values() if h) == ["r0", "r1", "r2"]
    await keepers[0].release()
    await keepers[3].renew()  # the next tick finds the freed slot
    assert keepers[3].slot == held[0]


async def test_an_expired_slot_is_taken_over_and_its_stalled_holder_moves_on() -> None:
    kube = FakeKube()
    two = LeaseSlots("sf-router", 2)
    stalled = LeaseKeeper(kube, "ns", "r1", two)  # type: ignore[arg-type]
    third = LeaseKeeper(kube, "ns", "r3", two)  # type: ignore[arg-type]
    await stalled.renew()
    await third.renew()
    slot = stalled.slot
    assert slot is not None and third.slot is not None
    expired = kube.obj(LEASES.plural, slot)
    expired["spec"]["renewTime"] = "2020-01-01T00:00:00.000000Z"
    kube.put(LEASES.plural, expired)  # r1 stalled past its duration
    taker = LeaseKeeper(kube, "ns", "r2", two)  # type: ignore[arg-type]
    await taker.renew()
    assert taker.slot == slot and holders(kube)[slot] == "r2"
    # r1 wakes: its renewal, conditioned on its own last write, is refused; it does not
    # overwrite r2, and finds no other free slot (r3 holds it).
    await stalled.renew()
    assert holders(kube) == {slot: "r2", third.slot: "r3"}
    assert stalled.slot is None
    # Its late release touches nothing of r2's.
    stalled.slot = slot
    await stalled.release()
    assert holders(kube)[slot] == "r2"
    # Once r3 stops, r1 takes the slot r3 gave up.
    freed = third.slot
    await third.release()
    await stalled.renew()
    assert stalled.slot == freed and holders(kube) == {slot: "r2", freed: "r1"}


async def test_a_live_slot_of_another_replica_is_never_taken() -> None:
    kube = FakeKube()
    owner = LeaseKeeper(kube, "ns", "r1", LeaseSlots("sf-router", 1))  # type: ignore[arg-type]
    await owner.renew()
    other = LeaseKeeper(kube, "ns", "r2", LeaseSlots("sf-router", 1))  # type: ignore[arg-type]
    await other.renew()
    assert other.slot is None and holders(kube) == {"sf-router-0": "r1"}


async def test_a_renewal_whose_answer_was_lost_keeps_the_slot() -> None:
    kube = FakeKube()
    keeper = LeaseKeeper(kube, "ns", "r1", SLOTS)  # type: ignore[arg-type]
    await keeper.renew()
    slot = keeper.slot
    assert slot is not None
    # Our renewal landed but its answer never came: the slot moved on under our name.
    kube.put(LEASES.plural, kube.obj(LEASES.plural, slot))
    await keeper.renew()
    assert keeper.slot == slot and len(kube.names(LEASES.plural)) == 1


def test_the_table_keeps_the_migrating_sessions_apart() -> None:
    table = BindingTable()
    table.apply_session(migrating("a"))
    table.apply_session(migrating("b"))
    bound = migrating("b")
    bound["metadata"]["resourceVersion"] = "2"
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
    acknowledger = Acknowledger(kube, "ns", "r1", table, turns_of(table))  # type: ignore[arg-type]
    task = asyncio.create_task(acknowledger.run())
    while acknowledger.pending():
        await asyncio.sleep(0.01)
    task.cancel()
    assert all(kube.obj("agentsessions", n)["metadata"]["annotations"][ACK] == SINCE for n in names)
    assert kube.most_open == ACKS_AT_ONCE  # together, not one round trip after another
