"""Leader election for the operator replicas, on a ``coordination.k8s.io`` Lease.

Every replica runs its watches and keeps its indexes warm; only the leader writes.
:class:`LeaderElector` tries for the Lease every retry period, and once it holds it,
renews it. :attr:`LeaderElector.leading` is the write gate the operator's API client
asks before every write: it closes ``renew_deadline`` after the last renewal that
succeeded (timed from when that request was sent), even if the event loop is stuck
and the elector never runs again, so a deposed leader stops writing before a standby
may take the Lease (``lease_duration`` after it last saw it change).

When a leader cannot renew in time, :meth:`LeaderElector.run` raises
:class:`LeadershipLost` and the process exits, to come back as a standby with a fresh
picture of the fleet (as Kubernetes' own controller managers do). A leader that is
stopped (SIGTERM) releases the Lease, so the standby takes over within one retry
period instead of a whole lease duration.

The decisions are pure, in :mod:`sessionfleet.policy.leadership`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import secrets
import socket
import time
from collections.abc import Callable

from sessionfleet.kube import LEASES, Conflict, Kube, KubeError, NotFound
from sessionfleet.policy.leadership import (
    JITTER_FACTOR,
    ElectionTiming,
    LeaseRecord,
    Observation,
    Step,
    lease_record,
    next_step,
    observe,
    still_leading,
)
from sessionfleet.resources.leases import leader_lease, leader_lease_claim, leader_lease_release

log = logging.getLogger(__name__)

DEFAULT_LEASE_NAME = "sessionfleet-operator"
SLOW_RENEWAL_SHARE = 4
"""A renewal that takes over 1/4 of the renew deadline is logged as a warning."""


class LeadershipLost(RuntimeError):
    """The leader could not renew its Lease before the renew deadline."""


def default_identity() -> str:
    """``$POD_NAME`` (or the host name) and a random suffix, unique to this process.

    The suffix keeps a restarted container from taking its previous life's Lease for
    its own (client-go appends a UUID for the same reason).
    """
    base = os.environ.get("POD_NAME") or socket.gethostname() or "sessionfleet"
    return f"{base}_{secrets.token_hex(4)}"


class LeaderElector:
    """Acquires and renews one Lease; answers whether this process may write now."""

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        name: str = DEFAULT_LEASE_NAME,
        *,
        identity: str | None = None,
        timing: ElectionTiming | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.name = name
        self.identity = identity or default_identity()
        self.timing = timing or ElectionTiming()
        self.clock = clock
        self.wall_clock = wall_clock
        self.acquired = asyncio.Event()
        """Set once this process first holds the Lease."""
        self._observation: Observation | None = None
        self._renewed_at: float | None = None
        self._reached_at: float | None = None
        self._missing = False

    @property
    def leading(self) -> bool:
        """Whether this process holds the Lease and may write (the write gate)."""
        return still_leading(self._renewed_at, self.clock(), self.timing)

    @property
    def holder(self) -> str | None:
        """The holder this process last saw (``None`` before it read the Lease)."""
        return self._observation.record.holder if self._observation is not None else None

    @property
    def in_touch(self) -> bool:
        """Whether the Lease was read or written within one lease duration.

        A standby that cannot reach it could not take over: it is then not ready.
        """
        reached = self._reached_at
        duration = self.timing.lease_duration.total_seconds()
        return reached is not None and self.clock() - reached < duration

    @property
    def lease(self) -> str:
        """``namespace/name`` of the Lease, for messages."""
        return f"{self.namespace}/{self.name}"

    @property
    def _duration_seconds(self) -> int:
        return int(self.timing.lease_duration.total_seconds())

    def _retry_delay(self) -> float:
        retry = self.timing.retry_period.total_seconds()
        return retry * random.uniform(1.0, JITTER_FACTOR)

    async def run(self) -> None:
        """Stand by until this process holds the Lease, then renew it until it cannot.

        Raises:
            LeadershipLost: the Lease could not be renewed within the renew deadline.

        """
        log.info("leader election: %s standing by for Lease %s", self.identity, self.lease)
        while not await self._attempt(self.timing.retry_period.total_seconds()):
            await asyncio.sleep(self._retry_delay())
        self.acquired.set()
        log.info("leader election: %s leads (Lease %s)", self.identity, self.lease)
        retry = self.timing.retry_period.total_seconds()
        while True:
            await asyncio.sleep(retry)
            while not await self._attempt(self._left_to_renew()):
                if not self.leading:
                    raise LeadershipLost(
                        f"{self.identity} could not renew Lease {self.lease} within "
                        f"{self.timing.renew_deadline.total_seconds():g} s"
                    )
                await asyncio.sleep(min(retry, max(self._left_to_renew(), 0.0)))

    def _left_to_renew(self) -> float:
        if self._renewed_at is None:
            return 0.0
        deadline = self._renewed_at + self.timing.renew_deadline.total_seconds()
        return max(deadline - self.clock(), 0.0)

    async def _attempt(self, timeout: float) -> bool:
        """One try at creating, renewing or taking the Lease; whether we hold it now."""
        sent_at = self.clock()
        try:
            async with asyncio.timeout(max(timeout, 0.1)):
                held = await self._try()
        except TimeoutError:
            log.warning("leader election: Lease %s: no answer in %.1f s", self.lease, timeout)
            return False
        except KubeError as error:
            log.warning("leader election: Lease %s: %s", self.lease, error)
            return False
        if held:
            self._renewed_at = sent_at
            took = self.clock() - sent_at
            if took > self.timing.renew_deadline.total_seconds() / SLOW_RENEWAL_SHARE:
                # A warning well before the deadline: a leader that later loses its Lease
                # leaves in its log how long its renewals had been taking, and so whether
                # the API server or its own event loop was slow.
                log.warning(
                    "leader election: Lease %s written after %.1f s (renew deadline %g s)",
                    self.lease,
                    took,
                    self.timing.renew_deadline.total_seconds(),
                )
        return held

    async def _try(self) -> bool:
        try:
            body = await self.kube.get(LEASES, self.name, self.namespace)
        except NotFound:
            body = None
        now = self.clock()
        self._reached_at = now
        if body is None:
            self._observation = None
        else:
            self._observation = observe(self._observation, lease_record(body), now)
        step = next_step(self._observation, self.identity, now)
        if step is Step.WAIT:
            return False
        try:
            if step is Step.CREATE:
                written = await self.kube.create(
                    LEASES,
                    leader_lease(
                        self.name,
                        self.identity,
                        duration_seconds=self._duration_seconds,
                        now=self.wall_clock(),
                    ),
                    self.namespace,
                )
            else:
                assert self._observation is not None
                claim = leader_lease_claim(
                    self._observation.record,
                    self.identity,
                    duration_seconds=self._duration_seconds,
                    now=self.wall_clock(),
                )
                written = await self.kube.patch(LEASES, self.name, claim, self.namespace)
        except (Conflict, NotFound):
            return False  # another candidate wrote it first; read it again next time
        if step is Step.TAKE:
            previous = self._observation.record.holder if self._observation else ""
            log.info(
                "leader election: %s takes over Lease %s from %s",
                self.identity,
                self.lease,
                previous or "nobody (released)",
            )
        self._observation = observe(self._observation, lease_record(written), self.clock())
        return True

    async def release(self) -> None:
        """Give the Lease up, if this process holds it, and stop writing at once.

        The Lease is read again first: the renewal that :meth:`run` was sending when it
        was cancelled may have reached the API server, and a release conditional on the
        version before it would be refused, leaving the standby to wait out the lease.
        """
        was_leading = self.leading
        self._renewed_at = None  # the gate closes before the release is even sent
        if not was_leading:
            return
        try:
            record: LeaseRecord = lease_record(
                await self.kube.get(LEASES, self.name, self.namespace)
            )
            if record.holder != self.identity:
                return  # taken over already: nothing of ours to give up
            await self.kube.patch(
                LEASES,
                self.name,
                leader_lease_release(record, now=self.wall_clock()),
                self.namespace,
            )
            log.info("leader election: %s released Lease %s", self.identity, self.lease)
        except KubeError as error:
            log.warning("leader election: cannot release Lease %s: %s", self.lease, error)


__all__ = [
    "DEFAULT_LEASE_NAME",
    "LeaderElector",
    "LeadershipLost",
    "default_identity",
]
