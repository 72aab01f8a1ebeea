"""The router's half of the turn-boundary handshake (see :mod:`sessionfleet.policy.handshake`).

* :class:`LeaseKeeper` holds one of a fixed set of slot Leases for this replica and
  keeps it fresh, so the operator knows which replicas are alive and must acknowledge a
  migration (the slots' names are fixed so that RBAC can scope the replica's rights to
  them, see :mod:`sessionfleet.resources.leases`);
* :class:`Acknowledger` watches the binding table: for every Migrating session that
  has no turn in flight through this replica, it writes the acknowledgement
  ``ack.sessionfleet.dev/<replica>: <migratingSince>``. The front holds the session's
  next turns meanwhile (Migrating is a held phase), so once acknowledged no new turn
  can start here until the operator has rebound the session. Turns are counted and
  held by the front's :class:`~sessionfleet.fronts.turns.Turns`, the same in the router
  and the EPP.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime
from typing import Any, Final

from sessionfleet.fronts.bindings import BindingTable
from sessionfleet.fronts.turns import Turns
from sessionfleet.kube import LEASES, SESSIONS, Conflict, Kube, KubeError, NotFound
from sessionfleet.policy.handshake import ACK_PREFIX
from sessionfleet.resources.leases import (
    LeaseBody,
    LeaseSlots,
    lease_release,
    lease_renewal,
    router_lease,
    slot_claimable,
)
from sessionfleet.resources.sessions import acknowledgement_patch

logger = logging.getLogger("sessionfleet.router")

LEASE_DURATION_SECONDS: Final = 15
RENEW_EVERY_SECONDS: Final = 5.0
ACKS_AT_ONCE: Final = 16
"""Acknowledgements written concurrently by one replica."""


class LeaseKeeper:
    """Holds one slot Lease of ``slots`` for this replica; releases it on a clean shutdown.

    The replica claims a slot by creating it, or by taking over one whose holder let it
    expire (a merge patch conditioned on the resourceVersion it read, so two replicas
    never both win it); it renews the slot with the resourceVersion of its own last
    write, so a replica that stalled past its Lease's duration finds the slot taken
    (409) and claims another instead of overwriting the new holder.
    """

    def __init__(self, kube: Kube, namespace: str, replica: str, slots: LeaseSlots) -> None:
        self.kube = kube
        self.namespace = namespace
        self.replica = replica
        self.slots = slots
        self.slot: str | None = None
        """The Lease this replica holds; None while it holds none."""
        self._version: str | None = None

    def _body(self, name: str) -> LeaseBody:
        return router_lease(
            name, self.replica, duration_seconds=LEASE_DURATION_SECONDS, now=time.time()
        )

    def _hold(self, name: str, written: dict[str, Any]) -> None:
        self.slot = name
        self._version = resource_version(written) or None

    async def renew(self) -> None:
        """Renew the slot held, or claim one."""
        if self.slot is not None and await self._renew_held(self.slot):
            return
        if self.slot is not None:
            logger.warning("lease slot %s was taken over; claiming another", self.slot)
            self.slot = None
        if await self._claim() is None:
            logger.error(
                "no free Lease among the %d slots %s-*: the operator does not wait for "
                "this replica's acknowledgements until one is free (raise the slots)",
                self.slots.count,
                self.slots.prefix,
            )

    async def _renew_held(self, name: str) -> bool:
        patch = lease_renewal(self.replica, now=time.time())
        try:
            written = await self.kube.patch(
                LEASES, name, patch, self.namespace, resource_version=self._version
            )
        except NotFound:
            return False
        except Conflict:
            # Someone wrote the slot since our last write, or our last renewal landed and
            # its answer was lost: it is still ours only if it still names us.
            try:
                current = await self.kube.get(LEASES, name, self.namespace)
            except NotFound:
                return False
            if (current.get("spec") or {}).get("holderIdentity") != self.replica:
                return False
            written = await self.kube.patch(
                LEASES, name, patch, self.namespace, resource_version=resource_version(current)
            )
        self._hold(name, written)
        return True

    async def _claim(self) -> str | None:
        """Take the first free slot, in this replica's order; None when all are held."""
        for name in self.slots.order_for(self.replica):
            try:
                written = await self.kube.create(LEASES, self._body(name), self.namespace)
            except Conflict:
                try:
                    current = await self.kube.get(LEASES, name, self.namespace)
                except NotFound:
                    continue  # released in between: another replica may be creating it
                if not slot_claimable(current, self.replica, datetime.now(UTC)):
                    continue
                try:
                    written = await self.kube.patch(
                        LEASES,
                        name,
                        self._body(name),
                        self.namespace,
                        resource_version=resource_version(current),
                    )
                except (Conflict, NotFound):
                    continue  # another replica took it first
            self._hold(name, written)
            logger.info("replica %s holds the Lease %s", self.replica, name)
            return name
        return None

    async def run(self) -> None:
        """Renew forever; a failed renewal is retried at the next tick."""
        while True:
            try:
                await self.renew()
            except KubeError as error:
                logger.warning("cannot renew lease %s: %s", self.slot, error)
            await asyncio.sleep(RENEW_EVERY_SECONDS)

    async def release(self) -> None:
        """Give the slot up, so no migration waits for a replica that stopped.

        The holder and times are cleared rather than the Lease deleted (the Role then
        needs no ``delete``), and only in the version this replica wrote last: a slot
        another replica has taken over since (this one stalled past its duration) is
        left alone.
        """
        if self.slot is None:
            return
        try:
            await self.kube.patch(
                LEASES, self.slot, lease_release(), self.namespace, resource_version=self._version
            )
        except KubeError:
            pass
        self.slot = None


def resource_version(body: dict[str, Any]) -> str:
    """Return an object's resourceVersion."""
    return str((body.get("metadata") or {}).get("resourceVersion", ""))


class Acknowledger:
    """Acknowledges Migrating sessions once none of their turns is in flight here."""

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        replica: str,
        table: BindingTable,
        turns: Turns,
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.key = f"{ACK_PREFIX}{replica}"
        self.table = table
        self.turns = turns
        self._acknowledged: set[tuple[str, str]] = set()

    def pending(self) -> list[tuple[str, str]]:
        """Sessions (name, migratingSince) this replica may acknowledge now."""
        due = []
        for session in self.table.migrating_sessions():
            since = session.migrating_since
            if since is None:
                continue
            if session.acks.get(self.key) == since or (session.name, since) in self._acknowledged:
                continue
            if not self.turns.sessions.get(session.name):
                due.append((session.name, since))
        return due

    async def acknowledge(self, name: str, since: str) -> None:
        """Write this replica's acknowledgement on the session."""
        try:
            await self.kube.patch(
                SESSIONS, name, acknowledgement_patch(self.key, since), self.namespace
            )
        except NotFound:
            return
        self._acknowledged.add((name, since))

    async def run(self) -> None:
        """Acknowledge whatever is due, on every table change and every finished turn.

        Up to :data:`ACKS_AT_ONCE` at a time: one after another, a drain of 400 sessions
        waited 400 round trips to a busy API server for each router's acknowledgements,
        over a minute at 20,000 live sessions (``make bench-scale``).
        """
        limit = asyncio.Semaphore(ACKS_AT_ONCE)

        async def one(name: str, since: str) -> None:
            async with limit:
                try:
                    await self.acknowledge(name, since)
                except KubeError as error:
                    logger.warning("cannot acknowledge the migration of %s: %s", name, error)

        while True:
            await asyncio.gather(*(one(name, since) for name, since in self.pending()))
            changed = asyncio.ensure_future(self.table.changed().wait())
            ended = asyncio.ensure_future(self.turns.ended_event.wait())
            await asyncio.wait({changed, ended}, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            for waiter in (changed, ended):
                waiter.cancel()
            self.turns.ended_event.clear()
