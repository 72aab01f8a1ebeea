"""The router's half of the turn-boundary handshake (see :mod:`sessionfleet.policy.handshake`).

* :class:`LeaseKeeper` keeps this replica's Lease fresh, so the operator knows which
  replicas are alive and must acknowledge a migration;
* :class:`Acknowledger` watches the binding table: for every Migrating session that
  has no turn in flight through this replica, it writes the acknowledgement
  ``ack.sessionfleet.dev/<replica>: <migratingSince>``. The proxy holds the session's
  next turns meanwhile (Migrating is a held phase), so once acknowledged no new turn
  can start here until the operator has rebound the session.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any, Final

from sessionfleet.kube import LEASES, SESSIONS, Conflict, Kube, KubeError, NotFound
from sessionfleet.policy.handshake import ACK_PREFIX
from sessionfleet.resources.leases import lease_renewal, router_lease, router_lease_name
from sessionfleet.resources.sessions import acknowledgement_patch
from sessionfleet.router.bindings import BindingTable

logger = logging.getLogger("sessionfleet.router")

LEASE_DURATION_SECONDS: Final = 15
RENEW_EVERY_SECONDS: Final = 5.0
ACKS_AT_ONCE: Final = 16
"""Acknowledgements written concurrently by one replica."""


class LeaseKeeper:
    """Creates and renews ``router-<replica>``; deletes it on a clean shutdown."""

    def __init__(self, kube: Kube, namespace: str, replica: str) -> None:
        self.kube = kube
        self.namespace = namespace
        self.replica = replica
        self.name = router_lease_name(replica)

    def _body(self) -> dict[str, Any]:
        return router_lease(self.replica, duration_seconds=LEASE_DURATION_SECONDS, now=time.time())

    async def renew(self) -> None:
        """Create the Lease, or move its renewTime forward."""
        try:
            await self.kube.patch(
                LEASES, self.name, lease_renewal(self.replica, now=time.time()), self.namespace
            )
        except NotFound:
            try:
                await self.kube.create(LEASES, self._body(), self.namespace)
            except Conflict:
                pass

    async def run(self) -> None:
        """Renew forever; a failed renewal is retried at the next tick."""
        while True:
            try:
                await self.renew()
            except KubeError as error:
                logger.warning("cannot renew lease %s: %s", self.name, error)
            await asyncio.sleep(RENEW_EVERY_SECONDS)

    async def release(self) -> None:
        """Delete the Lease, so no migration waits for a replica that stopped."""
        try:
            await self.kube.delete(LEASES, self.name, self.namespace)
        except KubeError:
            pass


class Acknowledger:
    """Acknowledges Migrating sessions once none of their turns is in flight here."""

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        replica: str,
        table: BindingTable,
        in_flight: Counter[str],
        turn_ended: asyncio.Event,
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.key = f"{ACK_PREFIX}{replica}"
        self.table = table
        self.in_flight = in_flight
        self.turn_ended = turn_ended
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
            if self.in_flight[session.name] == 0:
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
            ended = asyncio.ensure_future(self.turn_ended.wait())
            await asyncio.wait({changed, ended}, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            for waiter in (changed, ended):
                waiter.cancel()
            self.turn_ended.clear()
